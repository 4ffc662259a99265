"""Issue 4: each metric on a hand-built batch with padding, compared with numbers worked by hand; and a run writes
its run folder (metrics.jsonl, samples.jsonl, TensorBoard events) and shows a progress bar."""

import json
import math

import pytest
import torch

from trl_ext import PPOConfig, PPOTrainer, Rollout
from trl_ext.core import explained_variance
from trl_ext.core.types import TOKEN_STATS, UpdateStats
from trl_ext.monitoring.diagnostics import rollout_metrics, update_metrics
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

EOS = 1
G = 9.0  # garbage in padding: must not change any metric


def hand_batch(garbage=G) -> Rollout:
    """Row 0 stops at EOS after 2 tokens; row 1 runs to the length cap (4) without a stop token."""
    m = torch.tensor([[True, True, False, False], [True, True, True, True]])
    pad = ~m

    def t(rows):
        return torch.tensor(rows, dtype=torch.float32).masked_fill(pad, garbage)

    logprobs = t([[-1.0, -2.0, 0, 0], [-1.0, -1.0, -1.0, -1.0]])
    ref_logprobs = t([[-1.5, -2.0, 0, 0], [-1.0, -1.0, -1.0, -2.0]])
    kl = (logprobs - ref_logprobs).masked_fill(pad, 0.0)  # k1, as the trainer stores it: 0 outside the mask
    return Rollout(
        queries=torch.tensor([[0, 5], [5, 6]]), query_mask=torch.tensor([[False, True], [True, True]]),
        responses=torch.tensor([[5, EOS, 0, 0], [5, 6, 7, 8]]), response_mask=m,
        logprobs=logprobs, ref_logprobs=ref_logprobs,
        values=t([[0.5, 1.0, 0, 0], [0.0, 0.0, 0.0, 0.0]]), returns=t([[1.0, 1.0, 0, 0], [1.0, 2.0, 3.0, 4.0]]),
        scores=torch.tensor([1.0, 3.0]), kl=kl, rewards=torch.zeros(2, 4), advantages=torch.zeros(2, 4),
    )


def test_rollout_metrics_by_hand():
    got = rollout_metrics(hand_batch(), kl_coef=0.1, stop_token_id=EOS)
    expected = {
        # scores [1, 3]
        "objective/scores": 2.0, "objective/scores_std": 1.0, "objective/scores_min": 1.0,
        "objective/scores_max": 3.0,
        # per-sequence k1 KL: row 0 (−1)−(−1.5) + 0 = 0.5; row 1 0+0+0+((−1)−(−2)) = 1 -> mean 0.75
        "objective/kl": 0.75, "objective/kl_k1": 0.75,
        # k3 = e^{log ρ} − 1 − log ρ, log ρ = ref − logprob: row 0 (e^{−0.5} − 0.5) = 0.1065307, row 1 e^{−1} =
        # 0.3678794 -> mean 0.2372050
        "objective/kl_k3": 0.2372050,
        "objective/kl_coef": 0.1,
        # sampled-token entropy: row 0: 1 + 2 = 3, row 1: 4 -> 3.5
        "objective/entropy": 3.5,
        "objective/non_score_reward": -0.075, "objective/rlhf_reward": 1.925,
        # real tokens: R = [1,1,1,2,3,4], V = [0.5,1,0,0,0,0], d = R − V = [0.5,0,1,2,3,4]
        # Var R = 32/6 − 2² = 1.333333; Var d = 30.25/6 − 1.75² = 1.979167; EV = 1 − 1.979167/1.333333
        "val/explained_variance": -0.484375, "val/value_error": 30.25 / 6,
        "val/num_eos_tokens": 1.0,
        "rollout/response_length_mean": 3.0,  # (2 + 4) / 2
        "rollout/truncation_rate": 0.5,  # row 1 hit the cap without EOS
        # real tokens: row 0: 1 prompt + 2 response, row 1: 2 + 4 -> 9 of the 2 x (2 + 4) = 12 padded positions
        "rollout/tokens": 9.0, "perf/padding_fraction": 0.25,
    }
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_padding_never_changes_a_metric():
    assert rollout_metrics(hand_batch(9.0), 0.1, EOS) == pytest.approx(rollout_metrics(hand_batch(-123.0), 0.1, EOS))


def test_a_full_length_response_ending_in_eos_is_not_truncated():
    r = hand_batch()
    r.responses[1, 3] = EOS
    assert rollout_metrics(r, 0.1, EOS)["rollout/truncation_rate"] == 0.0
    assert rollout_metrics(r, 0.1, None)["rollout/truncation_rate"] == 0.5  # no stop token: the cap cuts row 1


@pytest.mark.parametrize("seed", range(5))
def test_explained_variance_matches_the_core_function_on_ragged_batches(seed):
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 7
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None] < lengths[:, None]
    values, returns = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    r = hand_batch()
    r = Rollout(queries=torch.zeros(B, 1, dtype=torch.long), query_mask=torch.ones(B, 1, dtype=torch.bool),
                responses=torch.full((B, T), 5), response_mask=mask, logprobs=torch.zeros(B, T),
                ref_logprobs=torch.zeros(B, T), values=values, returns=returns, scores=torch.zeros(B),
                kl=torch.zeros(B, T), rewards=torch.zeros(B, T), advantages=torch.zeros(B, T))
    got = rollout_metrics(r, 0.1, EOS)
    assert got["val/explained_variance"] == pytest.approx(explained_variance(values, returns, mask).item(), abs=1e-5)
    assert got["val/value_error"] == pytest.approx(((returns - values)[mask] ** 2).mean().item(), rel=1e-5)


def test_update_metrics_by_hand():
    """Two micro-batches of 1 and 3 real tokens: token statistics are token means over both (not the mean of the two
    means); the first-minibatch ratio is the first micro-batch's; the ratio variance is over micro-batch means."""
    u = UpdateStats()
    means = {key: torch.tensor(0.0) for key in TOKEN_STATS}
    u.add(torch.tensor(1), first_minibatch=True, **{**means, "val/ratio": torch.tensor(1.0),
                                                     "policy/clipfrac_avg": torch.tensor(0.1)})
    u.add(torch.tensor(3), first_minibatch=False, **{**means, "val/ratio": torch.tensor(1.2),
                                                      "policy/clipfrac_avg": torch.tensor(0.3)})
    u.add_step("policy/grad_norm", 2.0)
    u.add_step("policy/grad_norm", 4.0)
    got = update_metrics(u)
    assert got["val/ratio"] == pytest.approx((1.0 + 3 * 1.2) / 4)
    assert got["policy/clipfrac_avg"] == pytest.approx((0.1 + 3 * 0.3) / 4)
    assert got["policy/ratio_first_minibatch"] == pytest.approx(1.0)
    assert got["val/ratio_var"] == pytest.approx(0.02)  # unbiased variance of [1.0, 1.2]
    assert got["policy/grad_norm"] == pytest.approx(3.0)
    one = UpdateStats()
    one.add(torch.tensor(2), first_minibatch=True, **{**means, "val/ratio": torch.tensor(1.05)})
    assert update_metrics(one)["val/ratio_var"] == 0.0  # one micro-batch: 0, not NaN


def test_a_run_writes_its_run_folder_and_a_progress_bar(tmp_path, capsys):
    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     total_episodes=12, response_length=5, num_ppo_epochs=2, num_mini_batches=2,
                     report_to=["tensorboard"], save_strategy="no", num_sample_generations=3, bf16=False,
                     logging_steps=1)
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, 8),
                   value_model=tiny_scalar_model(tok))
    t.train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "objective/scores" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    # one line per PPO step: the end-of-training entry (log_history's last, train_loss) is not one
    assert "train_loss" in t.state.log_history[-1] and not any("train_loss" in line for line in lines)
    for key in ("val/explained_variance", "val/value_error", "rollout/response_length_mean",
                "rollout/truncation_rate", "policy/ratio_first_minibatch", "policy/grad_norm", "val/grad_norm",
                "objective/kl_coef", "objective/scores_min", "objective/scores_max", "objective/scores_std"):
        assert all(key in line and (line[key] is None or math.isfinite(line[key])) for line in steps), key
    # generator and trainer agree: the first minibatch's ratio is 1 before any optimizer step
    assert all(line["policy/ratio_first_minibatch"] == pytest.approx(1.0, abs=1e-5) for line in steps)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "score"} <= set(samples[0])
    assert list(tmp_path.rglob("events.out.tfevents.*")), "report_to=['tensorboard'] wrote no events"
    err = capsys.readouterr().err
    assert "PPO [" in err and "score=" in err and "kl=" in err


def test_alarms_are_warned_and_written_to_the_run_folder_and_the_report(tmp_path):
    """A threshold no real run meets (approx KL above 1e-12) raises kl_blowup on the first step that updates twice:
    a PPOAlarmWarning, an alarm/kl_blowup key in metrics.jsonl, the alarm in `trl-ext report`'s summary and PNG."""
    from trl_ext.monitoring.alarms import PPOAlarmWarning
    from trl_ext.monitoring.report import report

    tok = tiny_tokenizer()
    args = PPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, total_episodes=8, response_length=5,
                     num_ppo_epochs=2, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                     disable_tqdm=True, learning_rate=1e-2, alarm_thresholds={"approxkl_max": 1e-12})
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=tiny_scalar_model(tok, seed=2), train_dataset=tiny_prompt_dataset(tok, 8),
                   value_model=tiny_scalar_model(tok))
    with pytest.warns(PPOAlarmWarning, match="kl_blowup"):
        t.train()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0].get("alarm/kl_blowup") == 1.0 and "alarm/kl_blowup" not in lines[1]  # once per episode
    summary = report(str(tmp_path))
    assert "kl_blowup" in summary
    assert (tmp_path / "dashboard.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_alarm_thresholds_are_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown alarm threshold"):
        PPOConfig(output_dir=str(tmp_path), bf16=False, alarm_thresholds={"clip_max": 0.4})
    with pytest.raises(ValueError, match="is not valid JSON"):
        PPOConfig(output_dir=str(tmp_path), bf16=False, alarm_thresholds="{clipfrac_max: 0.4}")
