"""GRPOTrainer scripts run on trl_ext's PPO with only the class and config names changed (README, "From GRPO to PPO"),
on offline stand-ins: a tiny model saved to a folder stands for the hub id, a local dataset for the hub dataset.

Each checks what a GRPO user relies on: the policy and the critic (made for the script) moved, the run logged what
a GRPO user reads, and what the trainer reads back (`processing_class`, `state.log_history`)."""

import textwrap

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_tokenizer

# TRL's GRPO docs quickstart (docs/source/quickstart.md, GRPO), word for word but for the class name and the two
# offline stand-ins: the hub id is MODEL, the dataset is DATASET
QUICKSTART = """
from trl_ext import PPOTrainer

dataset = DATASET
trainer = PPOTrainer(model=MODEL, reward_funcs=accuracy_reward, train_dataset=dataset)
trainer.train()
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny causal LM and its tokenizer in a folder, as a hub id resolves to one."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tokenizer = tiny_tokenizer(padding_side="right")  # GRPOTrainer pads prompts on the left whatever it is saved with
    tiny_causal_lm(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts(n: int = 16) -> Dataset:
    """GRPO's standard text form: a `prompt` column, and the `solution` column accuracy_reward reads."""
    g = torch.Generator().manual_seed(0)
    rows = [" ".join(f"w{i}" for i in torch.randint(0, 60, (3,), generator=g).tolist()) for _ in range(n)]
    return Dataset.from_dict({"prompt": rows, "solution": [row.split()[0] for row in rows]})


def accuracy_reward(completions, solution, **kwargs):
    """Stands in for trl.rewards.accuracy_reward (math_verify is not installed here): TRL's reward-function
    signature, 1.0 where the completion contains the solution."""
    return [float(answer in completion) for completion, answer in zip(completions, solution)]


@pytest.mark.slow
def test_trls_grpo_quickstart_runs_with_only_the_class_name_changed(model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    scope = {"MODEL": str(model_dir), "DATASET": prompts(), "accuracy_reward": accuracy_reward}
    exec(textwrap.dedent(QUICKSTART), scope)
    trainer = scope["trainer"]
    # args=None: a default config named after the model, as GRPOTrainer's "<name>-GRPO"
    assert trainer.args.output_dir == f"{model_dir.name}-PPO" and (tmp_path / f"{model_dir.name}-PPO").is_dir()
    assert trainer.processing_class.padding_side == "left"
    start = load_file(model_dir / "model.safetensors")
    policy = trainer.unwrapped.policy.state_dict()
    assert any(not torch.equal(policy[name], start[name]) for name in start)  # the policy moved
    critic = trainer.unwrapped.value_model
    assert (critic.score.weight != 0).any()  # the critic made for the script learned (its head starts at zero)
    out = capsys.readouterr().out
    assert "trl_ext: critic: LlamaForSequenceClassification, the policy" in out
    steps = [log for log in trainer.state.log_history if "objective/scores" in log]
    assert len(steps) == trainer.args.num_total_batches == 6  # 3 epochs x 16 prompts / 8 per batch
    for log in steps:  # GRPO's keys beside TRL 1.12 PPO's
        assert log["reward"] == pytest.approx(log["objective/scores"])
        assert log["rewards/accuracy_reward/mean"] == pytest.approx(log["objective/scores"])
        assert log["reward_std"] == log["objective/scores_std"] and log["entropy"] == log["policy/entropy_avg"]
        assert log["completions/mean_length"] == log["rollout/response_length_mean"]


def test_ppos_own_call_and_grpos_call_build_the_same_trainer(model_dir, tmp_path):
    """TRL 1.12 PPO's call (objects) and GRPOTrainer's (a path, reward_funcs, no tokenizer, no value or reference
    model) give the same first-step weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def config(out):
        return PPOConfig(output_dir=str(out), per_device_train_batch_size=4, total_episodes=8, response_length=5,
                         num_ppo_epochs=1, report_to=[], save_strategy="no", seed=1, learning_rate=1e-3)

    grpo = PPOTrainer(model=str(model_dir), reward_funcs=accuracy_reward, args=config(tmp_path / "grpo"),
                      train_dataset=prompts(8))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ppo = PPOTrainer(args=config(tmp_path / "ppo"), processing_class=tokenizer, model=policy, ref_model=None,
                     reward_model=accuracy_reward, train_dataset=prompts(8), value_model=None)
    outputs = [trainer.train() for trainer in (grpo, ppo)]
    # what Trainer.train returns, as GRPO scripts log it: train_loss = the mean of policy + vf_coef x value loss
    logs = [h for h in grpo.state.log_history if "loss/policy_avg" in h]
    want = sum(h["loss/policy_avg"] + 0.1 * h["loss/value_avg"] for h in logs) / 2
    assert len(logs) == 2 and outputs[0].metrics["train_loss"] == pytest.approx(want, rel=1e-12)
    assert outputs[0].global_step == 2 and outputs[0].training_loss == outputs[1].training_loss
    for role in ("policy", "value_model"):
        a, b = getattr(grpo.unwrapped, role).state_dict(), getattr(ppo.unwrapped, role).state_dict()
        assert all(torch.equal(a[name], b[name]) for name in a), role


def test_grpo_positional_order_model_reward_funcs_args(model_dir, tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=3,
                     report_to=[], save_strategy="no")
    trainer = PPOTrainer(str(model_dir), accuracy_reward, args, train_dataset=prompts(4))
    assert trainer.args is args and trainer.reward_scorer.names == ["accuracy_reward"]


@pytest.mark.parametrize("call, message", [
    (dict(reward_funcs=accuracy_reward, reward_model=accuracy_reward), "reward_funcs (GRPO's name) and reward_model"),
    (dict(reward_funcs=accuracy_reward, model_init_kwargs=True), "model_init_kwargs / quantization_config load"),
])
def test_bad_grpo_calls_are_refused_by_name(model_dir, tmp_path, call, message):
    from transformers import AutoModelForCausalLM

    args = PPOConfig(output_dir=str(tmp_path), report_to=[],
                     model_init_kwargs={"dtype": "float32"} if call.pop("model_init_kwargs", False) else None)
    model = AutoModelForCausalLM.from_pretrained(model_dir) if args.model_init_kwargs else str(model_dir)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PPOTrainer(model=model, args=args, train_dataset=prompts(4), **call)
