"""trl_ext.PPOTrainer as a drop-in for TRL's: same script with one import changed, rewards as functions, the
decomposed step (`rollout` -> `Rollout`), errors for bad input."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer, Rollout
from trl_ext._trl import PPOTrainerBase
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
TRL_SCRIPT = ROOT / "tests" / "scripts" / "trl_ppo_script.py"
TRL_IMPORT = "from trl.experimental.ppo import PPOConfig, PPOTrainer"


def with_import(line: str, dest: Path) -> Path:
    """The TRL user's script with only its import line replaced."""
    source = TRL_SCRIPT.read_text()
    assert source.count(TRL_IMPORT) == 1
    dest.write_text(source.replace(TRL_IMPORT, line))
    return dest


def run_script(argv, env_extra=None, timeout=300):
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", **(env_extra or {})}
    return subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=4, response_length=6,
                num_ppo_epochs=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                disable_tqdm=True, learning_rate=1e-3)
    base.update(kw)
    return PPOConfig(**base)


def test_subclasses_its_base():
    assert issubclass(PPOTrainer, PPOTrainerBase)


def test_import_prints_no_experimental_warning():
    out = run_script([sys.executable, "-W", "always", "-c", "from trl_ext import PPOConfig, PPOTrainer"])
    assert out.returncode == 0, out.stderr
    assert "trl.experimental" not in out.stderr + out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_trl_script_runs_with_only_its_import_changed(tmp_path, lora):
    script = with_import("from trl_ext import PPOConfig, PPOTrainer", tmp_path / "script.py")
    out = run_script([sys.executable, str(script), "--output_dir", str(tmp_path / "out")] + ["--lora"] * lora)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "TRAINING DONE" in out.stdout
    saved = "adapter_model.safetensors" if lora else "model.safetensors"
    assert (tmp_path / "out" / saved).exists()


def test_reward_function(tmp_path):
    """A plain function is a reward model: it sees decoded prompts and completions cut after the stop token."""
    tok = tiny_tokenizer()
    seen = []

    def reward(prompts, completions):
        seen.append((prompts, completions))
        return [float(len(c.split())) for c in completions]

    t = PPOTrainer(args=args(tmp_path), processing_class=tok, model=tiny_causal_lm(tok, token_bias={1: 2.0}),
                   ref_model=None, reward_model=reward, train_dataset=tiny_prompt_dataset(tok, 4),
                   value_model=tiny_scalar_model(tok))
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    prompts, completions = seen[-1]
    assert len(prompts) == len(completions) == 4
    assert all("<eos>" not in c and "<pad>" not in c for c in completions)
    expected = [len(tok.decode(row[m], skip_special_tokens=True).split()) for row, m in
                zip(r.responses, r.response_mask)]
    assert r.scores.tolist() == expected
    assert prompts[0] == tok.decode(batch["input_ids"][0], skip_special_tokens=True)


@pytest.mark.parametrize(
    "bad, message",
    [
        (lambda p, c: [0.0] * (len(c) - 1), r"returned 3 scores for 4 completions"),
        (lambda p, c: [float("nan")] + [0.0] * (len(c) - 1), r"non-finite scores \[\(0, nan\)\]"),
        (lambda p, c: ["high"] * len(c), r"must return a list of floats"),
    ],
    ids=["wrong-length", "nan", "not-numbers"],
)
def test_bad_reward_function_output_is_a_clear_error(tmp_path, bad, message):
    tok = tiny_tokenizer()
    t = PPOTrainer(args=args(tmp_path), processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=bad, train_dataset=tiny_prompt_dataset(tok, 4), value_model=tiny_scalar_model(tok))
    with pytest.raises(ValueError, match=message):
        t.train()


def test_rollout_is_a_dataclass_of_named_tensors(tmp_path):
    tok = tiny_tokenizer()
    t = PPOTrainer(args=args(tmp_path, kl_coef=0.1), processing_class=tok, model=tiny_causal_lm(tok),
                   ref_model=None, reward_model=tiny_scalar_model(tok, seed=2),
                   train_dataset=tiny_prompt_dataset(tok, 4), value_model=tiny_scalar_model(tok))
    batch = next(iter(t.dataloader))
    r = t.rollout(batch["input_ids"], batch["attention_mask"])
    assert isinstance(r, Rollout)
    B, T = 4, 6
    for name in ("responses", "response_mask", "logprobs", "ref_logprobs", "values", "rewards", "advantages",
                 "returns", "kl"):
        assert getattr(r, name).shape == (B, T), name
    assert r.scores.shape == (B,)
    m = r.response_mask
    # outside the mask everything the loss reads is zero
    for name in ("values", "rewards", "advantages", "returns", "kl"):
        assert (getattr(r, name)[~m] == 0).all(), name
    # rewards = -beta * kl, plus the score on the last real token
    last = T - 1 - m.long().fliplr().argmax(1)
    expected = -0.1 * r.kl
    expected[torch.arange(B), last] += r.scores
    assert torch.allclose(r.rewards, expected)
    # a minibatch is a Rollout too
    assert len(r[torch.tensor([0, 2])]) == 2


def test_errors_for_bad_setups(tmp_path):
    tok = tiny_tokenizer()
    common = dict(processing_class=tok, ref_model=None, reward_model=tiny_scalar_model(tok, seed=2),
                  value_model=tiny_scalar_model(tok))
    with pytest.raises(ValueError, match="The dataset has 2 prompts, fewer than one rollout batch"):
        PPOTrainer(args=args(tmp_path), model=tiny_causal_lm(tok), train_dataset=tiny_prompt_dataset(tok, 2),
                   **common)
    with pytest.raises(ValueError, match="not divisible"):
        PPOTrainer(args=args(tmp_path, num_mini_batches=3), model=tiny_causal_lm(tok),
                   train_dataset=tiny_prompt_dataset(tok, 4), **common)
    with pytest.raises(TypeError, match="trl_ext.PPOConfig"):
        from trl_ext._trl import PPOConfigBase

        PPOTrainer(args=PPOConfigBase(output_dir=str(tmp_path), bf16=False), model=tiny_causal_lm(tok),
                   train_dataset=tiny_prompt_dataset(tok, 4), **common)
    with pytest.raises(ValueError, match="missing_eos_penalty=1.0 is set but there is no stop token"):
        PPOTrainer(args=args(tmp_path, stop_token="none", missing_eos_penalty=1.0), model=tiny_causal_lm(tok),
                   train_dataset=tiny_prompt_dataset(tok, 4), **common)


def test_training_moves_the_score_up(tmp_path):
    """A reward function that pays for the share of words from a small set: PPO drives that share up."""
    tok = tiny_tokenizer()
    targets = {f"w{i}" for i in range(8)}  # 8 of 73 tokens: about 0.1 of a random response

    def reward(prompts, completions):
        return [sum(w in targets for w in c.split()) / max(len(c.split()), 1) for c in completions]

    t = PPOTrainer(args=args(tmp_path, per_device_train_batch_size=8, total_episodes=8 * 40, learning_rate=1e-2,
                             num_ppo_epochs=2, kl_coef=0.01, response_length=4, logging_steps=1),
                   processing_class=tok, model=tiny_causal_lm(tok), ref_model=None, reward_model=reward,
                   train_dataset=tiny_prompt_dataset(tok, 16), value_model=tiny_scalar_model(tok))
    t.train()
    scores = [h["objective/scores"] for h in t.state.log_history if "objective/scores" in h]
    assert len(scores) == 40 and all(math.isfinite(s) for s in scores)
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert first < 0.3 and last > 0.7, (first, last)
