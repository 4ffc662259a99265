"""One regression test per defect of TRL 1.12's PPOTrainer (issue 2). Each passes on trl_ext and fails on TRL:
run `TRL_EXT_TEST_UPSTREAM=1 pytest tests/trl/test_regressions.py` to see them fail there (test_upstream_fails.py does).
"""

import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
from harness import UPSTREAM, config, first_index, run, trainer
from transformers.modeling_outputs import BaseModelOutput

from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer


def build(tokenizer, token_bias=None, n=4):
    policy = tiny_causal_lm(tokenizer, seed=0, token_bias=token_bias)
    value = tiny_scalar_model(tokenizer, seed=1)
    reward = tiny_scalar_model(tokenizer, seed=2)
    return policy, value, reward, tiny_prompt_dataset(tokenizer, n=n)


def params(*models):
    return torch.cat([p.detach().flatten().clone() for m in models for p in m.parameters()])


# --- max_grad_norm ------------------------------------------------------------------------------------------------
def test_max_grad_norm_clips_the_update(tmp_path):
    """With SGD(lr=1) one optimizer step moves the weights by lr x the (clipped) gradient, so the policy's step and
    the critic's step are each at most max_grad_norm (each is clipped on its own). TRL never clipped: the step is the
    full gradient."""
    tok = tiny_tokenizer()
    policy, value, reward, ds = build(tok)
    before_policy, before_value = params(policy), params(value)
    sgd = torch.optim.SGD(list(policy.parameters()) + list(value.parameters()), lr=1.0)
    args = config(tmp_path, max_grad_norm=1e-3)
    out = run(trainer(args, tok, policy, reward, value, train_dataset=ds, optimizers=(sgd, None)))
    for before, model in ((before_policy, policy), (before_value, value)):
        step = (params(model) - before).norm().item()
        assert 0 < step <= 1e-3 * (1 + 1e-4)
    pre_clip = out["logs"][0]["policy/grad_norm"]
    assert pre_clip > 1e-3  # the logged norm is the pre-clip one


def test_one_optimizer_step_per_minibatch(tmp_path):
    """PPO takes one optimizer step per minibatch: 2 epochs x 4 minibatches = 8 steps. TRL accumulated gradients
    over gradient_accumulation_steps micro-batches, so one step straddled several minibatches (2 steps here), except
    on the dataloader's last batch, where accelerate synced every micro-batch."""
    tok = tiny_tokenizer()
    policy, value, reward, ds = build(tok, n=16)  # two batches: the first is not the dataloader's last
    adam = torch.optim.Adam(list(policy.parameters()) + list(value.parameters()), lr=1e-3)
    steps = []
    adam.register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    args = config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=4,
                  num_ppo_epochs=2, total_episodes=8)
    run(trainer(args, tok, policy, reward, value, train_dataset=ds, optimizers=(adam, None)))
    assert len(steps) == 8


# --- precision, checkpointing, seeds ------------------------------------------------------------------------------
def test_bf16_runs_the_training_forward_in_bf16(tmp_path):
    tok = tiny_tokenizer()
    policy, value, reward, ds = build(tok)
    seen = []
    policy.model.layers[0].register_forward_hook(
        lambda module, inputs, output: seen.append(torch.is_autocast_enabled("cpu")
                                                   and torch.get_autocast_dtype("cpu") == torch.bfloat16))
    args = config(tmp_path, bf16=True, use_cpu=True)
    run(trainer(args, tok, policy, reward, value, train_dataset=ds))
    assert any(seen), "no forward pass of the policy ran under bf16 autocast"


def test_gradient_checkpointing_is_enabled(tmp_path):
    tok = tiny_tokenizer()
    policy, value, reward, ds = build(tok)
    args = config(tmp_path, gradient_checkpointing=True)
    trainer(args, tok, policy, reward, value, train_dataset=ds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert policy.is_gradient_checkpointing and value.is_gradient_checkpointing


def test_same_seed_gives_identical_weights(tmp_path):
    """Minibatch order must come from the seeded generators, whatever the global numpy state."""
    weights = []
    for numpy_state in (1, 2):
        np.random.seed(numpy_state)
        tok = tiny_tokenizer()
        policy, value, reward, ds = build(tok, n=8)
        args = config(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=4, num_mini_batches=4,
                      num_ppo_epochs=2, total_episodes=8, seed=7)
        run(trainer(args, tok, policy, reward, value, train_dataset=ds))
        weights.append(params(policy, value))
    assert torch.equal(weights[0], weights[1])


# --- stop token and score placement -------------------------------------------------------------------------------
def test_score_lands_on_the_stop_token(tmp_path):
    """pad != eos: a response that stops gets its score on its EOS token, not on the first pad after it."""
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    policy, value, reward, ds = build(tok, token_bias={eos: 3.0})
    out = run(trainer(config(tmp_path, stop_token="eos", kl_coef=0.0), tok, policy, reward, value,
                      train_dataset=ds))
    stopped = 0
    for b in range(len(out["scores"])):
        i = first_index(out["responses"][b], eos)
        if i is None:
            continue
        stopped += 1
        expected = torch.zeros_like(out["rewards"][b])
        expected[i] = out["scores"][b]
        assert torch.allclose(out["rewards"][b], expected), f"row {b}: score not on the EOS at {i}"
    assert stopped > 0


def test_missing_eos_penalty_tests_the_configured_stop_token(tmp_path):
    """stop_token_id = a word: a response that ends with that word is not penalised, whether or not it has EOS."""
    tok = tiny_tokenizer()
    stop = tok.convert_tokens_to_ids("ok")
    policy, value, reward, ds = build(tok, token_bias={stop: 2.5})
    nn.init.zeros_(reward.score.weight)  # every raw score is 0: what remains is the penalty
    args = config(tmp_path, stop_token_id=stop, missing_eos_penalty=1.0)
    out = run(trainer(args, tok, policy, reward, value, train_dataset=ds))
    has_stop = ((out["responses"] == stop) & out["response_mask"]).any(1)
    assert has_stop.any()
    assert torch.equal(out["scores"], torch.where(has_stop, 0.0, -1.0))


def test_default_config_stops_at_eos(tmp_path):
    """With no stop_token set, nothing after the first EOS is a response token (nor scored)."""
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    policy, value, reward, ds = build(tok, token_bias={eos: 2.0})
    out = run(trainer(config(tmp_path), tok, policy, reward, value, train_dataset=ds))
    rows_with_eos = 0
    for b in range(len(out["responses"])):
        i = first_index(out["responses"][b], eos)
        if i is not None and i < out["responses"].shape[1] - 1:
            rows_with_eos += 1
            assert not out["response_mask"][b, i + 1 :].any(), f"row {b}: tokens after EOS count as response"
    assert rows_with_eos > 0


# --- pad token == EOS token ---------------------------------------------------------------------------------------
class EOSProbe(nn.Module):
    """A 'reward model' in TRL's layout (backbone under base_model_prefix + `score`) whose score at a position is
    1.0 if the token there is EOS: it tells which token the trainer reads the score from."""

    base_model_prefix = "backbone"

    def __init__(self, eos_id: int):
        super().__init__()
        self.eos_id = eos_id
        self.backbone = nn.Module()
        self.backbone.forward = self._backbone
        self.score = nn.Identity()

    def _backbone(self, input_ids, attention_mask=None, **kwargs):
        hidden = ((input_ids == self.eos_id) & attention_mask.bool()).float()[..., None]  # (B, L, 1)
        return BaseModelOutput(last_hidden_state=hidden, hidden_states=(hidden,))


def test_pad_equals_eos_keeps_eos_in_the_response(tmp_path):
    tok = tiny_tokenizer(pad_is_eos=True)
    eos = tok.eos_token_id
    policy, value, _, ds = build(tok, token_bias={eos: 2.5})
    out = run(trainer(config(tmp_path, stop_token="eos"), tok, policy, EOSProbe(eos), value, train_dataset=ds))
    stopped = 0
    for b in range(len(out["responses"])):
        i = first_index(out["responses"][b], eos)
        if i is None:
            continue
        stopped += 1
        assert out["response_mask"][b, : i + 1].all(), f"row {b}: EOS at {i} is masked out of the loss"
        assert not out["response_mask"][b, i + 1 :].any()
        assert out["scores"][b] == 1.0, f"row {b}: the reward model did not read the EOS token"
    assert stopped > 0


def test_response_that_starts_with_eos_has_length_one(tmp_path):
    tok = tiny_tokenizer(pad_is_eos=True)
    eos = tok.eos_token_id
    policy, value, reward, ds = build(tok, token_bias={eos: 6.0})
    out = run(trainer(config(tmp_path, stop_token="eos", kl_coef=0.0), tok, policy, reward, value,
                      train_dataset=ds))
    starts = (out["responses"][:, 0] == eos).nonzero().flatten()
    assert len(starts) > 0
    for b in starts:
        assert out["response_mask"][b].tolist() == [True] + [False] * (out["response_mask"].shape[1] - 1)
        assert out["rewards"][b, 0] == out["scores"][b]


def test_pad_token_sampled_mid_response_does_not_end_it(tmp_path):
    """pad != eos and the policy samples the pad id: it is an ordinary token, the response goes on."""
    tok = tiny_tokenizer()
    pad = tok.pad_token_id
    policy, value, reward, ds = build(tok, token_bias={pad: 2.0})
    out = run(trainer(config(tmp_path, stop_token="eos"), tok, policy, reward, value, train_dataset=ds))
    T = out["responses"].shape[1]
    checked = 0
    for b in range(len(out["responses"])):
        i = first_index(out["responses"][b], pad)
        if i is not None and i < T - 1 and first_index(out["responses"][b], tok.eos_token_id) is None:
            checked += 1
            assert out["response_mask"][b].all(), f"row {b}: response cut at the pad token sampled at {i}"
    assert checked > 0


def test_prompt_tokens_equal_to_pad_are_real(tmp_path):
    """pad == eos and a prompt contains EOS (chat templates end turns with it): the prompt mask is the collator's
    attention mask, not `ids != pad`."""
    tok = tiny_tokenizer(pad_is_eos=True)
    policy, value, reward, _ = build(tok)
    from datasets import Dataset

    ids = tok("w1 w2 <eos> w3 w4")["input_ids"]
    ds = Dataset.from_dict({"input_ids": [ids] * 4})
    out = run(trainer(config(tmp_path, stop_token="eos"), tok, policy, reward, value, train_dataset=ds))
    assert out["query_mask"].all()


# --- behaviour policy ---------------------------------------------------------------------------------------------
def test_rollout_logprobs_are_the_policy_logprobs(tmp_path):
    """The model's own generation_config (repetition_penalty) must not alter the behaviour log-probs: at step 1,
    with policy == reference, log π_old == log π_ref on every real token and the KL is 0."""
    tok = tiny_tokenizer()
    policy, value, reward, ds = build(tok)
    policy.generation_config.repetition_penalty = 5.0
    ref = tiny_causal_lm(tok, seed=0)
    ref.generation_config.repetition_penalty = 5.0
    out = run(trainer(config(tmp_path, stop_token="eos"), tok, policy, reward, value, train_dataset=ds,
                      ref_model=ref))
    m = out["response_mask"]
    assert torch.allclose(out["logprobs"][m], out["ref_logprobs"][m], atol=1e-5)
    assert abs(out["logs"][0]["objective/kl"]) < 1e-4
    assert out["logs"][0]["val/ratio"] == pytest.approx(1.0, abs=1e-5)  # one minibatch: measured before any step


# --- statistics over real tokens ----------------------------------------------------------------------------------
def test_statistics_average_over_real_tokens_only(tmp_path):
    """learning_rate=0 keeps the policy fixed, so policy/entropy_avg must equal the entropy of the policy averaged
    over real response tokens, computed here independently. val/ratio_var is finite with one minibatch."""
    tok = tiny_tokenizer()
    eos = tok.eos_token_id
    policy, value, reward, ds = build(tok, token_bias={eos: 2.0})
    out = run(trainer(config(tmp_path, stop_token="eos", learning_rate=0.0, temperature=1.0), tok, policy, reward,
                      value, train_dataset=ds))
    q, qm, r, rm = out["queries"], out["query_mask"], out["responses"], out["response_mask"]
    assert (~rm).any(), "need ragged responses"
    ids = torch.cat([q, r], 1)
    att = torch.cat([qm, torch.ones_like(rm)], 1).long()
    with torch.no_grad():
        logits = policy(input_ids=ids, attention_mask=att, position_ids=(att.cumsum(1) - 1).clamp(min=0)).logits
    logits = logits[:, q.shape[1] - 1 : -1].float()
    entropy = torch.logsumexp(logits, -1) - (logits.softmax(-1) * logits).sum(-1)
    expected = entropy[rm].mean().item()
    log = out["logs"][0]
    assert log["policy/entropy_avg"] == pytest.approx(expected, rel=1e-4)
    assert np.isfinite(log["val/ratio_var"])


# --- prompts ------------------------------------------------------------------------------------------------------
def test_right_padded_prompts_are_an_error(tmp_path):
    """A collator that pads prompts on the right would make PPO generate after padding: a clear error, not a run.
    (trl_ext's own collator always pads on the left, whatever the tokenizer's padding side.)"""
    from transformers import DataCollatorWithPadding

    tok = tiny_tokenizer(padding_side="right")
    policy, value, reward, ds = build(tok)
    with pytest.raises(ValueError, match="left"):
        run(trainer(config(tmp_path), tok, policy, reward, value, train_dataset=ds,
                    data_collator=DataCollatorWithPadding(tok)))


# --- LoRA and saving under more than one process ------------------------------------------------------------------
@pytest.mark.slow
def test_lora_under_two_processes_trains_and_saves(tmp_path):
    """A TRL user's LoRA script under DDP (2 CPU processes): TRL 1.12 crashed on `.policy` of the DDP-wrapped model
    and could not save. Checkpoints and the final adapter must be written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    source = (root / "tests" / "scripts" / "trl_ppo_script.py").read_text()
    script = tmp_path / "script.py"
    trl_import = "from trl.experimental.ppo import PPOConfig, PPOTrainer"
    script.write_text(source if UPSTREAM else source.replace(trl_import, "from trl_ext import PPOConfig, PPOTrainer"))
    out_dir = tmp_path / "out"
    # `accelerate launch --cpu` starts a single process; multi-process CPU DDP is --multi_gpu with ACCELERATE_USE_CPU
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "PYTHONPATH": f"{root}:{root / 'tests'}",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
           str(script), "--output_dir", str(out_dir), "--lora", "--save_steps", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TRAINING DONE" in proc.stdout
    assert (out_dir / "adapter_model.safetensors").exists()
    assert (out_dir / "checkpoint-1" / "adapter_model.safetensors").exists()
