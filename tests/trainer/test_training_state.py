"""Issue 3: adaptive β, k1/k3 logging, critic warmup, value-model initialisation, critic learning rate, and resume
from checkpoint (bit-identical to an uninterrupted run; atomic saves that survive SIGKILL)."""

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from transformers import TrainerCallback

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.monitoring.diagnostics import WALL_CLOCK_KEYS
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=16, response_length=6,
                num_ppo_epochs=2, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                disable_tqdm=True, learning_rate=1e-3, logging_steps=1, seed=3)
    base.update(kw)
    return PPOConfig(**base)


def make_trainer(args, value="given", peft=False, **kw):
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok, seed=0)
    value_model = tiny_scalar_model(tok, seed=1) if value == "given" else None
    return PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=None,
                      reward_model=kw.pop("reward_model", tiny_scalar_model(tok, seed=2)),
                      train_dataset=tiny_prompt_dataset(tok, 8), value_model=value_model,
                      peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             task_type="CAUSAL_LM") if peft else None, **kw)


def flat(module):
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


class StopAt(TrainerCallback):
    """Stop training after `step` iterations (as a user interrupting a run would)."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


def step_logs(trainer):
    return [h for h in trainer.state.log_history if "objective/scores" in h]


# --- KL control ---------------------------------------------------------------------------------------------------
def test_adaptive_beta_follows_the_controller_from_one_step_to_the_next(tmp_path):
    """β used at step k+1 = β_k (1 + clip((KL_k − target)/target, ±0.2) n/horizon), KL_k the logged per-sequence KL."""
    args = config(tmp_path, kl_controller="adaptive", kl_coef=0.1, kl_target=0.01, kl_horizon=8)
    t = make_trainer(args)
    t.train()
    logs = step_logs(t)
    assert logs[0]["objective/kl_coef"] == pytest.approx(0.1)
    for prev, cur in zip(logs, logs[1:]):
        e = min(max((prev["objective/kl"] - 0.01) / 0.01, -0.2), 0.2)
        assert cur["objective/kl_coef"] == pytest.approx(prev["objective/kl_coef"] * (1 + e * 4 / 8), rel=1e-6)
    assert logs[-1]["objective/kl_coef"] != pytest.approx(0.1)


def test_fixed_beta_and_k1_k3_logged_side_by_side(tmp_path):
    t = make_trainer(config(tmp_path, kl_coef=0.07, kl_estimator="k2"))
    t.train()
    for log in step_logs(t):
        assert log["objective/kl_coef"] == pytest.approx(0.07)
        assert math.isfinite(log["objective/kl_k1"]) and log["objective/kl_k3"] >= 0


def test_adaptive_horizon_smaller_than_a_batch_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="kl_horizon=2 is smaller than one rollout batch"):
        make_trainer(config(tmp_path, kl_controller="adaptive", kl_horizon=2))


@pytest.mark.parametrize("field, value, message", [
    ("kl_target", 0.0, "kl_target=0.0 must be a positive number"),
    ("kl_horizon", 0, "kl_horizon=0 must be > 0"),
    ("kl_controller", "pid", "kl_controller='pid' is not one of"),
    ("critic_warmup_steps", -1, "critic_warmup_steps=-1 must be >= 0"),
    ("value_model_init", "sft", "value_model_init='sft' is not one of"),
    ("value_head_init", "random", "value_head_init='random' is not one of"),
    ("critic_learning_rate", 0.0, "critic_learning_rate=0.0 must be > 0"),
])
def test_bad_settings_are_clear_errors(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **{field: value})


def test_adaptive_from_zero_beta_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="stay 0 forever"):
        config(tmp_path, kl_controller="adaptive", kl_coef=0.0)


# --- critic warmup ------------------------------------------------------------------------------------------------
def test_critic_warmup_freezes_the_policy_and_still_saves(tmp_path):
    t = make_trainer(config(tmp_path, critic_warmup_steps=2, save_strategy="steps", save_steps=1),
                     callbacks=[StopAt(2)])
    policy, value = t.unwrapped.policy, t.unwrapped.value_model
    p0, v0 = flat(policy), flat(value)
    t.train()
    assert t.state.global_step == 2
    assert torch.equal(flat(policy), p0), "the policy moved during critic warmup"
    assert not torch.equal(flat(value), v0), "the value model did not train during warmup"
    optimizer_state = t.optimizer.optimizer.state if hasattr(t.optimizer, "optimizer") else t.optimizer.state
    assert all(p not in optimizer_state for p in policy.parameters()), "policy optimizer state changed in warmup"
    assert [log["val/warmup"] for log in step_logs(t)] == [1.0, 1.0]
    assert (tmp_path / "checkpoint-1" / "value_model").is_dir() and (tmp_path / "checkpoint-2").is_dir()


def test_critic_warmup_on_one_process_runs_no_policy_backward_and_trains_the_critic_the_same(tmp_path):
    """On one plain process the warmup's policy pass runs without a graph (its gradients would be dropped); under
    DDP/DeepSpeed/FSDP it keeps the weight-0 policy term. Both give the same critic and the same logged stats."""
    def run(joint):
        t = make_trainer(config(tmp_path / str(joint), critic_warmup_steps=2), callbacks=[StopAt(2)])
        # joint: the distributed path, the policy term at weight 0 and one backward of the summed loss
        t.backend.plain = not joint
        policy_grads = []
        for p in t.unwrapped.policy.parameters():
            p.register_hook(lambda g: policy_grads.append(1))
        t.train()
        return t, len(policy_grads)

    alone, alone_grads = run(joint=False)
    joint, joint_grads = run(joint=True)
    assert alone_grads == 0 and joint_grads > 0
    assert torch.allclose(flat(alone.unwrapped.value_model), flat(joint.unwrapped.value_model), atol=1e-6)
    fresh = make_trainer(config(tmp_path)).unwrapped.value_model
    assert not torch.equal(flat(alone.unwrapped.value_model), flat(fresh))
    for a, b in zip(step_logs(alone), step_logs(joint)):
        for key in ("policy/entropy_avg", "policy/approxkl_avg", "loss/value_avg", "val/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def test_after_warmup_the_policy_moves(tmp_path):
    t = make_trainer(config(tmp_path, critic_warmup_steps=2))
    policy = t.unwrapped.policy
    snapshots = []

    class Snap(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots.append(flat(policy))

    t.add_callback(Snap())
    p0 = flat(policy)
    t.train()
    assert torch.equal(snapshots[0], p0) and torch.equal(snapshots[1], p0)
    assert not torch.equal(snapshots[2], p0) and not torch.equal(snapshots[3], snapshots[2])
    assert [log["val/warmup"] for log in step_logs(t)] == [1.0, 1.0, 0.0, 0.0]


# --- value-model initialisation -----------------------------------------------------------------------------------
def test_value_model_from_the_policy_backbone_with_a_zero_head(tmp_path):
    t = make_trainer(config(tmp_path, value_model_init="policy"), value=None)
    policy, value = t.unwrapped.policy, t.unwrapped.value_model
    for (name, p), (_, q) in zip(policy.model.state_dict().items(), value.model.state_dict().items()):
        assert torch.equal(p, q), name
    assert (value.score.weight == 0).all()
    batch = next(iter(t.dataloader))
    assert (t.rollout(batch["input_ids"], batch["attention_mask"]).values == 0).all()  # V = 0 at step 0


@pytest.mark.parametrize("head, zero", [(None, True), ("zero", True), ("keep", False)])
def test_value_model_from_the_reward_model(tmp_path, head, zero):
    tok = tiny_tokenizer()
    reward = tiny_scalar_model(tok, seed=2)
    t = make_trainer(config(tmp_path, value_model_init="reward_model", value_head_init=head), value=None,
                     reward_model=reward)
    value = t.unwrapped.value_model
    assert value is not reward
    assert torch.equal(flat(value.model), flat(reward.model))
    assert bool((value.score.weight == 0).all()) is zero
    if not zero:
        assert torch.equal(value.score.weight, reward.score.weight)


def test_given_value_model_keeps_its_head_unless_asked(tmp_path):
    assert (make_trainer(config(tmp_path)).unwrapped.value_model.score.weight != 0).any()
    assert (make_trainer(config(tmp_path, value_head_init="zero")).unwrapped.value_model.score.weight == 0).all()


def test_without_a_value_model_a_critic_is_made_from_the_policy_and_printed(tmp_path, capsys):
    """value_model_init unset and no value_model: the policy's backbone with a zeroed 1-output head, said once."""
    t = make_trainer(config(tmp_path), value=None)
    critic, policy = t.unwrapped.value_model, t.unwrapped.policy
    backbone = getattr(critic, critic.base_model_prefix)
    assert all(torch.equal(a, b) for a, b in zip(backbone.state_dict().values(),
                                                   policy.model.state_dict().values()))
    assert (critic.score.weight == 0).all()
    out = capsys.readouterr().out
    trainable = sum(p.numel() for p in critic.parameters() if p.requires_grad)
    assert out.count("trl_ext: critic: LlamaForSequenceClassification, the policy") == 1
    assert f"{trainable:,} trainable parameters" in out and "reference: a frozen copy of the policy" in out


def trainable_names(model) -> set[str]:
    return {n for n, p in model.named_parameters() if p.requires_grad}


def test_a_made_critic_trains_its_top_layers_norm_and_head(tmp_path, capsys):
    """value_trainable_layers unset: a made critic trains its top 2 decoder layers (all the tiny model has), its
    final norm and its head, never its embeddings; 1 trains the top layer alone, and its lower layer is then the
    reference's (the frozen trunk, computed by the reference pass); -1 trains all of it; a given critic is left
    as given unless value_trainable_layers is set."""
    made = make_trainer(config(tmp_path), value=None).unwrapped.value_model
    assert trainable_names(made) == {n for n, _ in made.named_parameters() if "embed_tokens" not in n}
    assert "its top 2 of 2 decoder layers, final norm and head trained" in capsys.readouterr().out
    t = make_trainer(config(tmp_path, value_trainable_layers=1), value=None)
    top = trainable_names(t.unwrapped.value_model)
    assert top and all(n.startswith(("model.layers.1.", "model.norm.", "score.")) for n in top)
    assert t.trunk_from_reference is not None  # the frozen layer 0 runs once per rollout, in the reference's pass
    every = make_trainer(config(tmp_path, value_trainable_layers=-1), value=None).unwrapped.value_model
    assert trainable_names(every) == {n for n, _ in every.named_parameters()}
    given = make_trainer(config(tmp_path)).unwrapped.value_model
    assert trainable_names(given) == {n for n, _ in given.named_parameters()}
    given_top = make_trainer(config(tmp_path, value_trainable_layers=0)).unwrapped.value_model
    assert trainable_names(given_top) == {"model.norm.weight", "score.weight"}
    with pytest.raises(ValueError, match="value_trainable_layers=-2 must be >= 0 decoder layers, -1"):
        config(tmp_path, value_trainable_layers=-2)


def test_value_model_init_errors(tmp_path):
    with pytest.raises(ValueError, match="No value model"):
        make_trainer(config(tmp_path, value_model_init="given"), value=None)
    with pytest.raises(ValueError, match="a `value_model` was passed too"):
        make_trainer(config(tmp_path, value_model_init="policy"))
    with pytest.raises(ValueError, match="needs a reward \\*model\\*"):
        make_trainer(config(tmp_path, value_model_init="reward_model"), value=None,
                     reward_model=lambda p, c: [0.0] * len(c))


def test_critic_learning_rate(tmp_path):
    t = make_trainer(config(tmp_path, learning_rate=1e-3, critic_learning_rate=5e-2, lr_scheduler_type="constant"))
    value_ids = {id(p) for p in t.unwrapped.value_model.parameters()}
    groups = t.optimizer.param_groups
    for g in groups:
        kinds = {id(p) in value_ids for p in g["params"]}
        assert len(kinds) == 1, "a param group mixes policy and value parameters"
        assert g["lr"] == (5e-2 if kinds.pop() else 1e-3)
    n = sum(len(g["params"]) for g in groups)
    assert n == len(list(t.model.parameters()))


# --- resume -------------------------------------------------------------------------------------------------------

def comparable(logs):
    return [{k: v for k, v in log.items() if k not in WALL_CLOCK_KEYS} for log in logs]


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_resume_gives_the_same_run(tmp_path, peft):
    kw = dict(kl_controller="adaptive", kl_coef=0.1, kl_target=0.01, kl_horizon=8, critic_warmup_steps=1,
              num_mini_batches=2, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    straight = make_trainer(config(tmp_path / "a", **kw), peft=peft)
    straight.train()

    first = make_trainer(config(tmp_path / "b", save_strategy="steps", save_steps=1, **kw), peft=peft,
                         callbacks=[StopAt(2)])
    first.train()
    assert first.state.global_step == 2
    resumed = make_trainer(config(tmp_path / "b", save_strategy="steps", save_steps=1, **kw), peft=peft)
    resumed.train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))

    assert resumed.state.global_step == straight.state.global_step == 4
    assert torch.equal(flat(resumed.unwrapped.policy), flat(straight.unwrapped.policy))
    assert torch.equal(flat(resumed.unwrapped.value_model), flat(straight.unwrapped.value_model))
    assert resumed.kl_ctl.value == straight.kl_ctl.value
    assert comparable(step_logs(resumed)) == comparable(step_logs(straight))


def test_resume_true_takes_the_latest_checkpoint_and_refuses_other_settings(tmp_path):
    t = make_trainer(config(tmp_path, save_strategy="steps", save_steps=1), callbacks=[StopAt(3)])
    t.train()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-1", "checkpoint-2", "checkpoint-3"]
    resumed = make_trainer(config(tmp_path, save_strategy="no"))
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 4 and len(step_logs(resumed)) == 4

    other = make_trainer(config(tmp_path, response_length=7))
    with pytest.raises(ValueError, match="response_length: checkpoint 6, now 7"):
        other.train(resume_from_checkpoint=True)
    with pytest.raises(ValueError, match="no checkpoint-N folder"):
        make_trainer(config(tmp_path / "empty")).train(resume_from_checkpoint=True)


KILL_SCRIPT = '''
import os, sys, time
sys.path.insert(0, {tests!r})
from test_training_state import config, make_trainer
from trl_ext import PPOTrainer

original = PPOTrainer._save_optimizer_and_scheduler
def slow_save(self, output_dir):
    original(self, output_dir)
    if self.state.global_step == 2:  # mid-save of checkpoint-2: tell the test, then wait to be killed
        open(os.path.join(self.args.output_dir, "SAVING"), "w").close()
        time.sleep(120)
PPOTrainer._save_optimizer_and_scheduler = slow_save
make_trainer(config({out!r}, save_strategy="steps", save_steps=1)).train()
'''


@pytest.mark.slow
def test_sigkill_during_a_save_leaves_the_previous_checkpoint_and_resume_works(tmp_path):
    out = tmp_path / "run"
    script = tmp_path / "kill_me.py"
    script.write_text(KILL_SCRIPT.format(tests=str(ROOT / "tests" / "trainer"), out=str(out)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while not (out / "SAVING").exists():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() < deadline, "the run never reached the second save"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-1", "checkpoint-2.partial"], names  # checkpoint-2 never became visible

    resumed = make_trainer(config(out, save_strategy="steps", save_steps=1))
    resumed.train(resume_from_checkpoint=True)  # picks checkpoint-1
    straight = make_trainer(config(tmp_path / "straight"))
    straight.train()
    assert torch.equal(flat(resumed.unwrapped.policy), flat(straight.unwrapped.policy))
    assert comparable(step_logs(resumed)) == comparable(step_logs(straight))
    assert not (out / "checkpoint-2.partial").exists() and (out / "checkpoint-4").exists()


def test_critic_copied_from_reward_model_keeps_its_pad_id_zero():
    """A reward model whose pad id is 0 keeps it in the critic copied from it (0 is not 'unset')."""
    from trl_ext.models import build_value_model
    from trl_ext.testing import tiny_causal_lm, tiny_scalar_model, tiny_tokenizer

    tok = tiny_tokenizer()
    policy, reward = tiny_causal_lm(tok), tiny_scalar_model(tok)
    policy.config.pad_token_id, reward.config.pad_token_id = 3, 0
    critic = build_value_model("reward_model", None, None, policy, reward)
    assert critic.config.pad_token_id == 0
    reward.config.pad_token_id = None
    assert build_value_model("reward_model", None, None, policy, reward).config.pad_token_id == \
        policy.config.pad_token_id
