"""Issue 5, evaluation: policy vs reference on held-out prompts, scored by the training reward and a gold scorer."""

import copy
import math

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

TARGETS = {f"w{i}" for i in range(8)}


def share_of_targets(prompts, completions):
    return [sum(w in TARGETS for w in c.split()) / max(len(c.split()), 1) for c in completions]


def distinct_words(prompts, completions):  # a "gold" scorer the policy never trains on
    return [float(len(set(c.split()))) for c in completions]


def make(tmp_path, *, iterations, lr, eval_reward=distinct_words, eval_strategy="steps", ref_model=None, **kw):
    tok = tiny_tokenizer()
    policy = tiny_causal_lm(tok)
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=8, total_episodes=8 * iterations,
                     response_length=4, num_ppo_epochs=2, kl_coef=0.01, learning_rate=lr, report_to=[],
                     save_strategy="no", num_sample_generations=0, bf16=False, disable_tqdm=True,
                     eval_strategy=eval_strategy, eval_steps=10, per_device_eval_batch_size=6, **kw)
    return PPOTrainer(args=args, processing_class=tok, model=policy,
                      ref_model=copy.deepcopy(policy) if ref_model == "copy" else None,
                      reward_model=share_of_targets, train_dataset=tiny_prompt_dataset(tok, 16),
                      value_model=tiny_scalar_model(tok), eval_dataset=tiny_prompt_dataset(tok, 12, seed=5),
                      eval_reward=eval_reward)


def eval_logs(trainer):
    return [h for h in trainer.state.log_history if "eval/score" in h]


def test_same_model_gives_win_rate_one_half_and_zero_kl(tmp_path):
    """Policy == reference (learning_rate 0, a separate frozen copy) and a deterministic scorer: the paired samples
    are identical, every prompt is a tie, so the win rate is exactly 0.5 and the KL exactly 0."""
    t = make(tmp_path, iterations=1, lr=0.0, ref_model="copy")
    out = t.evaluate_policy()
    assert out["eval/win_rate_vs_ref"] == 0.5 and out["eval/gold_win_rate_vs_ref"] == 0.5
    assert out["eval/kl"] == 0.0
    assert out["eval/score"] == out["eval/score_ref"] and out["eval/gold_score"] == out["eval/gold_score_ref"]


def test_evaluation_on_a_tiny_run(tmp_path):
    """40 iterations on the share-of-target-words reward: evaluated every 10 steps, the policy beats the reference
    on held-out prompts by the training reward, moves away from it in KL, and the gold scorer is reported too."""
    t = make(tmp_path, iterations=40, lr=1e-2)
    t.train()
    logs = eval_logs(t)
    assert [h["step"] for h in logs] == [10, 20, 30, 40]
    last = logs[-1]
    for key in ("eval/score", "eval/score_ref", "eval/win_rate_vs_ref", "eval/kl", "eval/gold_score",
                "eval/gold_score_ref", "eval/gold_win_rate_vs_ref"):
        assert math.isfinite(last[key]), key
    assert last["eval/score"] > last["eval/score_ref"] + 0.3
    assert last["eval/win_rate_vs_ref"] > 0.8
    assert last["eval/kl"] > 0.1
    assert 0.0 <= last["eval/gold_win_rate_vs_ref"] <= 1.0


def test_evaluation_does_not_change_training(tmp_path):
    """Evaluation draws from its own RNG streams: the trained weights are the same with and without it."""
    weights = []
    for strategy in ("steps", "no"):
        t = make(tmp_path / strategy, iterations=12, lr=1e-2, eval_strategy=strategy)
        t.train()
        assert bool(eval_logs(t)) is (strategy == "steps")
        weights.append(torch.cat([p.detach().flatten() for p in t.unwrapped.policy.parameters()]))
    assert torch.equal(weights[0], weights[1])


def test_eval_reward_without_eval_dataset_is_an_error(tmp_path):
    tok = tiny_tokenizer()
    with pytest.raises(ValueError, match="eval_reward is set but there is no eval_dataset"):
        PPOTrainer(args=PPOConfig(output_dir=str(tmp_path), bf16=False, per_device_train_batch_size=4),
                   processing_class=tok, model=tiny_causal_lm(tok), ref_model=None, reward_model=share_of_targets,
                   train_dataset=tiny_prompt_dataset(tok, 8), value_model=tiny_scalar_model(tok),
                   eval_reward=distinct_words)


def test_the_dashboard_plots_win_rate_against_kl_when_evaluated(tmp_path):
    from trl_ext.monitoring.report import EVAL_PANEL_TITLES, load_metrics, make_dashboard

    t = make(tmp_path, iterations=20, lr=1e-2)
    t.train()
    fig = make_dashboard(load_metrics(tmp_path), tmp_path / "dashboard.png")
    titles = [ax.get_title() for ax in fig.axes]
    assert all(title in titles for title in EVAL_PANEL_TITLES)
    win_ax = fig.axes[titles.index(EVAL_PANEL_TITLES[0])]
    kl = [h["eval/kl"] for h in eval_logs(t)]
    assert any(list(line.get_xdata()) == pytest.approx(kl) for line in win_ax.get_lines())
