"""The PPO variants (docs/ppo-variants.md): clip-higher, dual-clip, the loss aggregation modes, decoupled and
length-adaptive GAE λ, the MSE / Huber value loss and the vf_coef schedule. Each against hand-computed numbers and a
plain reference loop; the trainer's update with them against a plain-PyTorch reference for gradient accumulation 1,
2 and 4 (and 2 processes: slow); a short PPO run with each trains. Unset, each is TRL 1.12's PPO (the TRL parity
tests and tests/core/test_token_mean.py cover that path)."""

import json
import math
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trl_ext import PPOConfig, PPOTrainer, Rollout
from trl_ext.core import (
    LOSS_AGG_MODES,
    aggregate_loss,
    cispo_loss,
    clipped_policy_loss,
    compute_gae,
    length_adaptive_lam,
    loss_denominator,
    masked_whiten,
    top_entropy_mask,
    value_loss,
)
from trl_ext.monitoring.diagnostics import update_metrics
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "scripts"))

import token_mean_runs as runs  # noqa: E402

B = 8


# ------------------------------------------------------------------------------------------ hand-computed numbers
def _one_token_rows(ratios, advantages):
    ratio = torch.tensor(ratios, dtype=torch.float64)[:, None]
    logp = torch.log(ratio).requires_grad_()
    return (logp, torch.zeros_like(ratio), torch.tensor(advantages, dtype=torch.float64)[:, None],
            torch.ones_like(ratio, dtype=torch.bool))


def test_clip_higher_by_hand():
    """(A, ρ) = (1, 1.25), (1, 1.3), (−1, 0.7), (−1, 1.5) with ε_low 0.2, ε_high 0.28 (DAPO), token-sum:
    −1.25 (inside 1.28: not clipped, where ε 0.2 would clip it to −1.2), −1.28 (clipped high), 0.8 (clipped low:
    max(0.7, 0.8)), 1.5; the clipped tokens get no gradient, the others −A·ρ."""
    logp, old, adv, mask = _one_token_rows([1.25, 1.3, 0.7, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, cliprange_high=0.28, loss_agg_mode="token-sum")
    assert loss.item() == pytest.approx(-1.25 - 1.28 + 0.8 + 1.5)
    loss.backward()
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([-1.25, 0.0, 0.0, 1.5], dtype=torch.float64))
    assert stats["clipfrac_high"].item() == 0.25 and stats["clipfrac_low"].item() == 0.25
    assert stats["clipfrac"].item() == 0.5 and stats["clipfrac_dual"].item() == 0.0
    symmetric, _ = clipped_policy_loss(logp, old, adv, mask, 0.2, loss_agg_mode="token-sum")
    assert symmetric.item() == pytest.approx(-1.2 - 1.2 + 0.8 + 1.5)


def test_dual_clip_by_hand():
    """The same rows with c = 1.4: the fourth token (A = −1, ρ = 1.5 > c) costs −A·c = 1.4, not 1.5, and gets no
    gradient; A > 0 and ρ < c are untouched."""
    logp, old, adv, mask = _one_token_rows([1.25, 1.3, 0.7, 1.5], [1.0, 1.0, -1.0, -1.0])
    loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, cliprange_high=0.28, clip_ratio_c=1.4,
                                      loss_agg_mode="token-sum")
    assert loss.item() == pytest.approx(-1.25 - 1.28 + 0.8 + 1.4)
    loss.backward()
    torch.testing.assert_close(logp.grad[:, 0], torch.tensor([-1.25, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert stats["clipfrac_dual"].item() == 0.25 and stats["clipfrac"].item() == 0.5
    # a huge ratio on a bad token: without the dual clip the loss grows with ρ, with it it is capped at −A·c
    logp, old, adv, mask = _one_token_rows([50.0], [-2.0])
    assert clipped_policy_loss(logp, old, adv, mask, 0.2)[0].item() == pytest.approx(100.0)
    assert clipped_policy_loss(logp, old, adv, mask, 0.2, clip_ratio_c=3.0)[0].item() == pytest.approx(6.0)


def test_top_entropy_mask_by_hand():
    """Real entropies 0.1, 0.5, 0.9, 0.3, 0.7; quantile 0.4 keeps the top 40 %: the 0.6 quantile is 0.5 + 0.4·0.2 =
    0.58 (linear interpolation), so 0.9 and 0.7 stay; the padding (9.0) never does."""
    entropy = torch.tensor([[0.1, 0.5, 0.9], [0.3, 0.7, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    assert top_entropy_mask(entropy, mask, 0.4).tolist() == [[False, False, True], [False, True, False]]
    assert top_entropy_mask(entropy, mask, 1.0).tolist() == mask.tolist()
    # the population of every process: here another's entropies 0.95 and 1.0 raise the threshold past 0.7
    population = torch.tensor([0.1, 0.5, 0.9, 0.3, 0.7, 0.95, 1.0])
    assert top_entropy_mask(entropy, mask, 0.3, population).tolist() == [[False, False, False], [False, False, False]]
    assert top_entropy_mask(entropy, mask, 0.45, population).tolist() == [[False, False, True], [False, False, False]]


def test_cispo_by_hand():
    """CISPO, cap 1 + 0.28: ratios 2.0 (A = +1: weight 1.28), 0.5 (A = +1: 0.5), 2.0 (A = −1: 1.28, A < 0 is never
    capped above... the cap is on the ratio alone, as in MiniMax-M1 and TRL). Loss −Σ sg(w)·A·log π / 3, gradient
    −w·A / 3 per token (PPO's clip would give the first token no gradient)."""
    logp, old, adv, mask = _one_token_rows([2.0, 0.5, 2.0], [1.0, 1.0, -1.0])
    loss, stats = cispo_loss(logp, old, adv, mask, 0.28)
    w = torch.tensor([1.28, 0.5, 1.28], dtype=torch.float64)
    expected = -(w * torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64) * torch.log(torch.tensor([2.0, 0.5, 2.0],
                                                                                              dtype=torch.float64)))
    torch.testing.assert_close(loss, expected.sum() / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    torch.testing.assert_close(grad[:, 0], -w * torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64) / 3)
    assert stats["clipfrac"].item() == pytest.approx(1 / 3) == stats["clipfrac_high"].item()  # only A > 0, ρ > cap
    with pytest.raises(ValueError, match="loss_type='cispo' has none: drop it"):
        PPOConfig(output_dir="unused", loss_type="cispo", clip_ratio_high=4.0, clip_ratio_c=3.0, bf16=False)


def test_sequence_level_ratio_by_hand():
    """GSPO: row 0's log-ratios ln 1.5 and ln 0.5 give one ratio, exp(mean) = √0.75 = 0.866, on both its tokens
    (A = 1, 1: inside the clip, −0.866 each, and each token's gradient −(A₀ + A₁)·ρ/2 = −0.866); row 1's one token
    ρ = 1.5 with A = −1: 1.5. Token level would clip the first token (−1.2) and not the second (−0.5). A row whose
    mean ratio leaves the clip range is clipped whole: no gradient to any of its tokens."""
    logp = torch.tensor([[math.log(1.5), math.log(0.5)], [math.log(1.5), 0.0]], dtype=torch.float64,
                        requires_grad=True)
    old, adv = torch.zeros(2, 2, dtype=torch.float64), torch.tensor([[1.0, 1.0], [-1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True], [True, False]])
    loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, loss_agg_mode="token-sum",
                                      importance_sampling_level="sequence")
    rho = math.sqrt(0.75)
    assert loss.item() == pytest.approx(-2 * rho + 1.5)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-rho, -rho], [1.5, 0.0]], dtype=torch.float64))
    assert stats["ratio_max"].item() == pytest.approx(1.5) and stats["ratio_min"].item() == pytest.approx(rho)
    token, _ = clipped_policy_loss(logp, old, adv, mask, 0.2, loss_agg_mode="token-sum")
    assert token.item() == pytest.approx(-1.2 - 0.5 + 1.5)
    high = torch.tensor([[math.log(1.5), math.log(1.3)]], dtype=torch.float64, requires_grad=True)
    clipped, stats = clipped_policy_loss(high, torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2),
                                         torch.ones(1, 2, dtype=torch.bool), 0.2, loss_agg_mode="token-sum",
                                         importance_sampling_level="sequence")
    clipped.backward()
    assert clipped.item() == pytest.approx(-2.4) and high.grad.abs().sum() == 0 and stats["clipfrac"].item() == 1.0
    with pytest.raises(ValueError, match="importance_sampling_level='row' is not one of"):
        clipped_policy_loss(logp, old, adv, mask, 0.2, importance_sampling_level="row")


X = torch.tensor([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]])
XMASK = torch.tensor([[True, True, False], [True, True, True]])


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 15 / 5),  # (1 + 2 + 3 + 4 + 5) / 5 tokens
    ("token-sum", 15.0),
    ("seq-mean-token-sum", (3 + 12) / 2),
    ("seq-mean-token-mean", (3 / 2 + 12 / 3) / 2),
    ("seq-mean-token-sum-norm", 15 / (2 * 3)),  # 2 sequences × T = 3
])
def test_loss_aggregation_by_hand(mode, expected):
    assert aggregate_loss(X, XMASK, mode).item() == pytest.approx(expected)
    # split into two micro-batches, each with the whole batch's denominator: the shares add up to the whole
    # (token-sum's denominator is 1 for any batch; the others add over micro-batches and processes)
    total = (torch.ones(()) if mode == "token-sum"
             else loss_denominator(XMASK[:1], mode) + loss_denominator(XMASK[1:], mode))
    parts = aggregate_loss(X[:1], XMASK[:1], mode, total) + aggregate_loss(X[1:], XMASK[1:], mode, total)
    assert parts.item() == pytest.approx(expected)


def test_seq_mean_token_sum_norm_divides_by_the_configured_length():
    assert aggregate_loss(X, XMASK, "seq-mean-token-sum-norm", max_length=4).item() == pytest.approx(15 / 8)


def test_value_loss_types_by_hand():
    """V = (0.5, 2.0, 0.1), R = (1, 1, −1), V_old = 0: mse ½(0.25, 1, 1.21); Huber δ = 0.5: |x| = 0.5 → ½·0.25,
    1 → 0.5·(1 − 0.25), 1.1 → 0.5·(1.1 − 0.25); the clipped loss (c = 0.2) as tests/core/test_core_math.py."""
    values = torch.tensor([[0.5, 2.0, 0.1]], requires_grad=True)
    old, returns, mask = torch.zeros(1, 3), torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool)
    mse, stats = value_loss(values, old, returns, mask, "mse")
    assert mse.item() == pytest.approx(0.5 * (0.25 + 1 + 1.21) / 3) and stats["clipfrac"].item() == 0.0
    huber, _ = value_loss(values, old, returns, mask, "huber", huber_delta=0.5)
    assert huber.item() == pytest.approx((0.125 + 0.375 + 0.425) / 3)
    huber.backward()  # the gradient is x inside δ, δ·sign(x) outside
    torch.testing.assert_close(values.grad, torch.tensor([[-0.5, 0.5, 0.5]]) / 3)
    clipped, _ = value_loss(values, old, returns, mask, "clipped", cliprange_value=0.2)
    assert clipped.item() == pytest.approx(0.475)


def test_length_adaptive_lam_by_hand():
    """λ = 1 − 1/(α·l), α = 0.05: l = 10 → −1, floored at 0; 40 → 0.5; 200 → 0.9."""
    mask = torch.zeros(3, 200, dtype=torch.bool)
    for row, length in enumerate((10, 40, 200)):
        mask[row, :length] = True
    torch.testing.assert_close(length_adaptive_lam(mask, 0.05), torch.tensor([0.0, 0.5, 0.9]))


def test_decoupled_lambda_by_hand():
    """One row, rewards (0, 0, 1), V = 0.5 everywhere, γ = 1: λ = 1 gives Monte-Carlo targets (1, 1, 1); λ = 0 gives
    the one-step targets r + V_next = (0.5, 0.5, 1)."""
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5)
    mask = torch.ones(1, 3, dtype=torch.bool)
    torch.testing.assert_close(compute_gae(rewards, values, mask, 1.0, 1.0)[1], torch.tensor([[1.0, 1.0, 1.0]]))
    torch.testing.assert_close(compute_gae(rewards, values, mask, 1.0, 0.0)[1], torch.tensor([[0.5, 0.5, 1.0]]))


def test_bad_variant_settings_name_the_value_and_the_fix(tmp_path):
    cases = [
        (dict(clip_ratio_high=0.0), "clip_ratio_high=0.0 must be > 0"),
        (dict(clip_ratio_c=1.0), "clip_ratio_c=1.0 must be > 1"),
        (dict(loss_agg_mode="seq-mean"), "loss_agg_mode='seq-mean' is not one of"),
        (dict(lam_value=1.5), "lam_value=1.5 must be in \\[0, 1\\]"),
        (dict(length_adaptive_alpha=0.05, lam_policy=0.9), "both set the policy's λ: set one"),
        (dict(vf_loss_type="l1"), "vf_loss_type='l1' is not one of"),
        (dict(vf_huber_delta=0), "vf_huber_delta=0 must be > 0"),
        (dict(vf_coef_end=-1.0), "vf_coef_end=-1.0 must be >= 0"),
        (dict(importance_sampling_level="row"), "importance_sampling_level='row' is not one of"),
        (dict(entropy_coef=-0.01), "entropy_coef=-0.01 must be >= 0"),
        (dict(beta=-0.1), "beta=-0.1 must be >= 0"),
        (dict(kl_loss_estimator="k4"), "kl_loss_estimator='k4' is not one of"),
        (dict(loss_type="bnpo"), "'dapo' is its accumulation-invariant form"),
        (dict(top_entropy_quantile=0.0), "top_entropy_quantile=0.0 must be in \\(0, 1\\]"),
        (dict(top_entropy_quantile=0.2, rollout_logprobs="sampler"), "set rollout_logprobs='trainer'"),
        (dict(loss_type="cispo"), "set it \\(MiniMax-M1 / ScaleRL: 4.0"),
        (dict(loss_type="cispo", clip_ratio_high=4.0, clip_ratio_c=3.0), "clip_ratio_c=3.0 .* drop it"),
        (dict(loss_type="grpo", loss_agg_mode="token-sum"), "aggregates as 'seq-mean-token-mean' but loss_agg_mode"),
    ]
    for overrides, match in cases:
        with pytest.raises(ValueError, match=match):
            PPOConfig(output_dir=str(tmp_path), **overrides)
    with pytest.raises(ValueError, match="length_adaptive_alpha=0 must be > 0"):
        length_adaptive_lam(XMASK, 0)
    for loss_type, mode in (("dapo", "token-mean"), ("grpo", "seq-mean-token-mean"),
                            ("dr_grpo", "seq-mean-token-sum-norm"), ("cispo", "token-mean")):
        config = PPOConfig(output_dir=str(tmp_path), bf16=False, loss_type=loss_type, clip_ratio_high=4.0)
        assert config.loss_agg_mode == mode


# --------------------------------------------------------------------------------------------- reference loops
def per_token_rows(mask, loss):
    """[[loss(b, t) for each real token t of row b] for each row b]: a plain loop over the tokens."""
    return [[loss(b, t) for t in range(mask.shape[1]) if mask[b, t]] for b in range(mask.shape[0])]


def reference_policy_loss(logp, old, adv, mask, eps_low, eps_high, c, mode, T, level="token", objective="ppo"):
    """Token by token in Python: max(−Aρ, −A·clip(ρ, 1 − ε_low, 1 + ε_high)), then min(·, −A·c) where A < 0; at
    sequence level ρ is the row's exp(mean log-ratio)."""
    def log_ratio(b, t):
        if level == "token":
            return logp[b, t] - old[b, t]
        real = [s for s in range(mask.shape[1]) if mask[b, s]]
        return sum(logp[b, s] - old[b, s] for s in real) / len(real)

    def loss(b, t):
        ratio, a = torch.exp(log_ratio(b, t)), float(adv[b, t])
        if objective == "cispo":
            return -a * torch.clamp(ratio, max=1 + eps_high).detach() * logp[b, t]
        value = torch.max(-a * ratio, -a * torch.clamp(ratio, 1 - eps_low, 1 + eps_high))
        return torch.min(value, torch.tensor(-a * c)) if c is not None and a < 0 else value

    return reference_aggregate(per_token_rows(mask, loss), mode, T)


def reference_value_loss(v, old, ret, mask, kind, c, delta, mode, T):
    def loss(b, t):
        x = v[b, t] - ret[b, t]
        if kind == "clipped":
            clipped = old[b, t] + torch.clamp(v[b, t] - old[b, t], -c, c)
            return 0.5 * torch.max(x**2, (clipped - ret[b, t]) ** 2)
        if kind == "mse":
            return 0.5 * x**2
        return 0.5 * x**2 if abs(float(x)) <= delta else delta * (x.abs() - 0.5 * delta)

    return reference_aggregate(per_token_rows(mask, loss), mode, T)


def reference_aggregate(rows, mode, T):
    tokens = [x for row in rows for x in row]
    sequences = [row for row in rows if row]
    if mode == "token-mean":
        return sum(tokens) / len(tokens)
    if mode == "token-sum":
        return sum(tokens)
    if mode == "seq-mean-token-sum":
        return sum(sum(row) for row in sequences) / len(sequences)
    if mode == "seq-mean-token-mean":
        return sum(sum(row) / len(row) for row in sequences) / len(sequences)
    return sum(tokens) / (len(sequences) * T)  # seq-mean-token-sum-norm


def _ragged(seed):
    g = torch.Generator().manual_seed(seed)
    mask = torch.arange(6)[None] < torch.tensor([6, 1, 4, 0, 3])[:, None]  # an empty row counts as no sequence
    logp = (-1 + 0.8 * torch.randn(5, 6, generator=g)).requires_grad_()
    old = -1 + 0.8 * torch.randn(5, 6, generator=g)
    adv = torch.randn(5, 6, generator=g)
    return logp, old, adv, mask


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("eps_high, c, level", [(None, None, "token"), (0.28, None, "token"), (None, 1.5, "token"),
                                                (0.28, 1.5, "token"), (None, None, "sequence"),
                                                (0.28, 1.5, "sequence")])
def test_policy_loss_equals_the_reference_loop(mode, eps_high, c, level):
    logp, old, adv, mask = _ragged(0)
    loss, stats = clipped_policy_loss(logp, old, adv, mask, 0.2, cliprange_high=eps_high, clip_ratio_c=c,
                                      loss_agg_mode=mode, importance_sampling_level=level)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = reference_policy_loss(logp, old, adv, mask, 0.2, eps_high or 0.2, c, mode, 6, level)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert stats["clipfrac"].item() == pytest.approx(stats["clipfrac_low"].item() + stats["clipfrac_high"].item())
    assert stats["clipfrac"].item() > 0
    if level == "token":  # (no row's mean ratio reaches c = 1.5 in these rows)
        assert (c is None) == (stats["clipfrac_dual"].item() == 0)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_equals_the_reference_loop(mode, level):
    logp, old, adv, mask = _ragged(0)
    loss, stats = cispo_loss(logp, old, adv, mask, 0.05, loss_agg_mode=mode, importance_sampling_level=level)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = reference_policy_loss(logp, old, adv, mask, 0.2, 0.05, None, mode, 6, level, objective="cispo")
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(grad, expected_grad)
    assert (level == "sequence" or stats["clipfrac"].item() > 0) and stats["clipfrac_low"].item() == 0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("kind", ["clipped", "mse", "huber"])
def test_value_loss_equals_the_reference_loop(mode, kind):
    g = torch.Generator().manual_seed(1)
    _, _, _, mask = _ragged(0)
    values = torch.randn(5, 6, generator=g).requires_grad_()
    old, returns = torch.randn(5, 6, generator=g), 2 * torch.randn(5, 6, generator=g)
    loss, _ = value_loss(values, old, returns, mask, kind, 0.2, 0.7, loss_agg_mode=mode)
    expected = reference_value_loss(values, old, returns, mask, kind, 0.2, 0.7, mode, 6)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(torch.autograd.grad(loss, values)[0], torch.autograd.grad(expected, values)[0])


def test_per_row_lambda_is_gae_row_by_row():
    g = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(4, 7, generator=g), torch.randn(4, 7, generator=g)
    mask = torch.arange(7)[None] < torch.tensor([7, 2, 5, 1])[:, None]
    lam = torch.tensor([0.0, 0.3, 0.9, 1.0])
    advantages, returns = compute_gae(rewards, values, mask, 0.97, lam)
    for b in range(4):
        a, r = compute_gae(rewards[b : b + 1], values[b : b + 1], mask[b : b + 1], 0.97, float(lam[b]))
        torch.testing.assert_close(advantages[b : b + 1], a)
        torch.testing.assert_close(returns[b : b + 1], r)
    with pytest.raises(ValueError, match="a per-row λ must be \\(4,\\)"):
        compute_gae(rewards, values, mask, 0.97, lam[:2])


# ------------------------------------------------------------------------------------------- the trainer's update
@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    return runs.ragged_rollout(str(tmp_path_factory.mktemp("rollout")), B)


# tight clip ranges so that the clips bind on the second minibatch (after the first SGD step)
VARIANTS = {
    "clip-higher, token-sum": dict(cliprange=0.02, clip_ratio_high=0.05, loss_agg_mode="token-sum"),
    "dual-clip, seq-mean-token-mean": dict(cliprange=0.02, clip_ratio_c=1.01, loss_agg_mode="seq-mean-token-mean"),
    "huber, seq-mean-token-sum-norm": dict(vf_loss_type="huber", vf_huber_delta=0.3,
                                           loss_agg_mode="seq-mean-token-sum-norm"),
    "mse, seq-mean-token-sum": dict(vf_loss_type="mse", loss_agg_mode="seq-mean-token-sum"),
    "sequence ratio (GSPO)": dict(cliprange=0.01, importance_sampling_level="sequence"),
    "entropy bonus, seq-mean-token-mean": dict(entropy_coef=0.5, loss_agg_mode="seq-mean-token-mean"),
    "KL loss k3, bias-corrected": dict(beta=2.0),
    "KL loss k2, sequence ratio": dict(beta=2.0, kl_loss_estimator="k2", importance_sampling_level="sequence",
                                       cliprange=0.01),
    "KL loss k1, no correction": dict(beta=2.0, kl_loss_estimator="k1", use_bias_correction_kl=False),
    "CISPO": dict(loss_type="cispo", clip_ratio_high=0.01),
}


def reference_update(rollout, minibatches, cliprange=0.2, clip_ratio_high=None, clip_ratio_c=None,
                     loss_agg_mode="token-mean", vf_loss_type="clipped", vf_huber_delta=1.0,
                     importance_sampling_level="token", entropy_coef=0.0, beta=0.0, kl_loss_estimator="k3",
                     use_bias_correction_kl=True, loss_type=None):
    """Plain PyTorch on fresh models: one SGD step per minibatch on the whole minibatch at once, the losses written
    out (no trl_ext loss function)."""
    tok = tiny_tokenizer()
    policy, value = runs.models(tok)
    sgd = torch.optim.SGD(list(policy.parameters()) + list(value.parameters()), lr=runs.LR)
    high = cliprange if clip_ratio_high is None else clip_ratio_high
    for rows in minibatches:
        r = rollout[torch.tensor(rows)]
        mask, T = r.response_mask, r.responses.shape[1]
        attention = torch.cat([r.query_mask, mask], 1).long()
        ids = torch.cat([r.queries, r.responses], 1).masked_fill(attention == 0, 0)
        position = (attention.cumsum(1) - 1).clamp(min=0)
        logits = policy(input_ids=ids, attention_mask=attention, position_ids=position).logits[:, -T - 1 : -1]
        logp = torch.log_softmax(logits.float() / runs.TEMPERATURE, -1).gather(
            -1, r.responses.masked_fill(~mask, 0)[..., None])[..., 0]
        log_ratio, adv = torch.where(mask, logp - r.logprobs, 0.0), r.advantages
        if importance_sampling_level == "sequence":  # the row's mean log-ratio on each of its tokens
            log_ratio = (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(logp)
        ratio = torch.exp(log_ratio)
        pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - cliprange, 1 + high))
        if loss_type == "cispo":
            pg = -adv * ratio.clamp(max=1 + high).detach() * logp
        if clip_ratio_c is not None:
            pg = torch.where(adv < 0, torch.min(pg, -adv * clip_ratio_c), pg)
        if r.entropy_mask is not None:  # top_entropy_quantile: the policy-gradient term of the other tokens weighs 0
            pg = pg * r.entropy_mask  # (TRL: before the KL term is added; the denominator unchanged)
        log_p = torch.log_softmax(logits.float() / runs.TEMPERATURE, -1)
        pg = pg + entropy_coef * (log_p.exp() * log_p).sum(-1)  # − c·H per token, H = −Σ p log p
        to_ref = r.ref_logprobs - logp  # log π_ref / π_θ
        kl = {"k1": -to_ref, "k2": 0.5 * to_ref**2, "k3": torch.exp(to_ref) - to_ref - 1}[kl_loss_estimator]
        pg = pg + beta * kl * (ratio if use_bias_correction_kl else 1.0)
        hidden = value.model(input_ids=ids, attention_mask=attention, position_ids=position).last_hidden_state
        v = value.score(hidden).squeeze(-1)[:, -T - 1 : -1]
        if vf_loss_type == "clipped":
            v_clip = torch.max(torch.min(v, r.values + 0.2), r.values - 0.2)
            vf = 0.5 * torch.max((v - r.returns) ** 2, (v_clip - r.returns) ** 2)
        elif vf_loss_type == "mse":
            vf = 0.5 * (v - r.returns) ** 2
        else:
            vf = F.huber_loss(v, r.returns, reduction="none", delta=vf_huber_delta)
        def weights(mask):
            lengths, n_seq = mask.sum(1, keepdim=True), (mask.sum(1) > 0).sum()
            return {"token-mean": mask / mask.sum(), "token-sum": mask * 1.0, "seq-mean-token-sum": mask / n_seq,
                    "seq-mean-token-mean": mask / lengths.clamp(min=1) / n_seq,
                    "seq-mean-token-sum-norm": mask / (n_seq * 6)}[loss_agg_mode]  # response_length 6

        policy_mask = mask if r.policy_mask is None else r.policy_mask  # mask_truncated_completions
        sgd.zero_grad()
        ((pg * weights(policy_mask))[policy_mask].sum() + (runs.VF_COEF * vf * weights(mask))[mask].sum()).backward()
        sgd.step()
    return runs.flat(policy, value)


def minibatch_order(seed, minibatches):
    return runs.minibatch_order(seed, B, minibatches)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_the_update_with_a_variant_is_the_reference_for_any_accumulation(tmp_path, rollout, name):
    overrides = VARIANTS[name]
    expected = reference_update(rollout, minibatch_order(7, 2), **overrides)
    baseline = reference_update(rollout, minibatch_order(7, 2))
    assert (expected - baseline).abs().max() > 1e-4, "the variant does not change this update: no teeth"
    # 1e-4 of the update's size: token-sum's step (a sum over ~40 tokens at lr 0.05) moves weights by ~300, and
    # float32 rounding of other micro-batch shapes grows with it (up to 1.3e-5 of it on an AMD EPYC, 3 of 44,297
    # weights, against < 1e-5 on an Intel Xeon); a wrong denominator is off by the step itself
    step = (expected - runs.flat(*runs.models(tiny_tokenizer()))).abs().max().item()
    for ga in (1, 2, 4):
        tok = tiny_tokenizer()
        policy, value = runs.models(tok)
        t = runs.trainer(str(tmp_path / str(ga)), tok, policy, value, rows=B, ga=ga, minibatches=2, **overrides)
        torch.manual_seed(7)
        metrics = update_metrics(t.ppo_update(rollout))
        torch.testing.assert_close(runs.flat(policy, value), expected, rtol=0, atol=1e-4 * max(step, 1.0),
                                   msg=lambda m, ga=ga: f"{name}, ga={ga}: {m}")
    if "clip_ratio_high" in overrides:  # (CISPO caps the weight above only)
        assert metrics["policy/clipfrac_high_avg"] > 0
        assert (metrics["policy/clipfrac_low_avg"] > 0) == (overrides.get("loss_type") != "cispo")
    if "clip_ratio_c" in overrides:
        assert metrics["policy/clipfrac_dual_avg"] > 0
    else:
        assert "policy/clipfrac_dual_avg" not in metrics
    assert metrics["policy/clipfrac_avg"] == pytest.approx(
        metrics["policy/clipfrac_low_avg"] + metrics["policy/clipfrac_high_avg"], abs=1e-6)


@pytest.mark.parametrize("overrides", [dict(), dict(loss_agg_mode="seq-mean-token-mean", entropy_coef=0.5, beta=2.0)])
def test_rows_out_of_the_policy_loss_leave_its_terms_and_denominator(tmp_path, rollout, overrides):
    """mask_truncated_completions: rows 1 and 5 (their policy mask all False) give the policy loss, its entropy bonus
    and KL term nothing and are not counted in their denominators; the value loss keeps every row."""
    keep = torch.ones(B, dtype=torch.bool)
    keep[[1, 5]] = False
    masked = Rollout(**{**vars(rollout), "policy_mask": rollout.response_mask & keep[:, None]})
    _masked_update_is_the_reference(tmp_path, rollout, masked, dict(mask_truncated_completions=True), overrides)


def test_the_top_entropy_mask_weighs_the_other_tokens_zero_for_any_accumulation(tmp_path, rollout):
    """A rollout whose entropy mask keeps every other real token: the policy loss of the others is 0, the
    denominators are the response mask's (TRL's rule), the KL term and the value loss untouched."""
    keep = (torch.arange(rollout.response_mask.shape[1])[None] % 2 == 0) & rollout.response_mask
    masked = Rollout(**{**vars(rollout), "entropy_mask": keep})
    _masked_update_is_the_reference(tmp_path, rollout, masked, dict(top_entropy_quantile=0.5), dict(beta=2.0))


def _masked_update_is_the_reference(tmp_path, rollout, masked, flag, overrides):
    """The trainer's update on `masked` (a rollout with a policy or entropy mask; `flag`: the config field that
    makes one) equals the reference update for gradient accumulation 1, 2 and 4, and differs from the unmasked one."""
    expected = reference_update(masked, minibatch_order(7, 2), **overrides)
    assert (expected - reference_update(rollout, minibatch_order(7, 2), **overrides)).abs().max() > 1e-4
    for ga in (1, 2, 4):
        tok = tiny_tokenizer()
        policy, value = runs.models(tok)
        t = runs.trainer(str(tmp_path / str(ga)), tok, policy, value, rows=B, ga=ga, minibatches=2, **flag,
                         **overrides)
        torch.manual_seed(7)
        t.ppo_update(masked)
        torch.testing.assert_close(runs.flat(policy, value), expected, rtol=0, atol=1e-5,
                                   msg=lambda m, ga=ga: f"ga={ga}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["token-sum", "seq-mean-token-mean"])
def test_two_processes_aggregate_like_one(tmp_path, rollout, mode):
    """Process 0 holds the 4 rows with the most response tokens, process 1 the other 4; token-sum's denominator is
    1 for the whole minibatch (not 1 per process), a sequence mode's the sequences of both processes."""
    lengths = rollout.response_mask.sum(1)
    by_length = torch.argsort(lengths, descending=True, stable=True).tolist()
    path = tmp_path / "rollout.pt"
    torch.save({"rollout": dict(asdict(rollout)), "split": [sorted(by_length[:4]), sorted(by_length[4:])]}, path)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29533",
           str(ROOT / "tests" / "scripts" / "token_mean_runs.py"), "--rollout", str(path), "--out", str(tmp_path),
           "--ga", "2", "--config", json.dumps({"loss_agg_mode": mode})]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    expected = reference_update(rollout, [list(range(B))], loss_agg_mode=mode)
    torch.testing.assert_close(torch.load(tmp_path / "weights.pt")["weights"], expected, rtol=0, atol=1e-5)


def test_decoupled_lambdas_in_the_rollout(tmp_path):
    """lam_value = 1 and lam_policy = 0: the value targets are GAE(λ = 1) of the rollout's rewards and values, the
    advantages whitened GAE(λ = 0); length_adaptive_alpha gives each row its own λ, logged as policy/lam_*."""
    tok = tiny_tokenizer()
    policy, value = runs.models(tok)
    for overrides in (dict(lam_policy=0.0, lam_value=1.0), dict(length_adaptive_alpha=0.4, lam_value=1.0)):
        t = runs.trainer(str(tmp_path), tok, policy, value, rows=B, ga=1, **overrides)
        batch = next(iter(t.dataloader))
        torch.manual_seed(3)
        r = t.rollout(batch["input_ids"], batch["attention_mask"])
        mask = r.response_mask
        lam = overrides.get("lam_policy", None)
        if lam is None:  # 1 − 1/(0.4·l), at least 0
            lam = (1 - 1 / (0.4 * mask.sum(1).float())).clamp(min=0)
            torch.testing.assert_close(r.advantage_lam, lam)
            assert lam.min() < 0.2 and lam.max() > 0.5  # lengths 3 to 6 (λ 0.17 to 0.58)
        else:
            assert r.advantage_lam is None
        torch.testing.assert_close(r.returns, compute_gae(r.rewards, r.values, mask, 1.0, 1.0)[1])
        advantages = compute_gae(r.rewards, r.values, mask, 1.0, lam)[0]
        torch.testing.assert_close(r.advantages, masked_whiten(advantages, mask) * mask)
        assert not torch.allclose(r.advantages, masked_whiten(compute_gae(r.rewards, r.values, mask, 1.0, 1.0)[0],
                                                              mask) * mask)


def test_vf_coef_schedule_moves_linearly(tmp_path):
    tok = tiny_tokenizer()
    policy, value = runs.models(tok)
    t = runs.trainer(str(tmp_path), tok, policy, value, rows=B, ga=1, vf_coef_end=0.1)
    t.args.total_episodes = 5 * B  # 5 iterations: 0.7 → 0.1 in steps of 0.15
    t.args.num_total_batches = 5
    seen = []
    for step in range(5):
        t.state.global_step = step
        seen.append(t.vf_coef)
    assert seen == pytest.approx([0.7, 0.55, 0.4, 0.25, 0.1])


# --------------------------------------------------------------------------------------------- short PPO runs
TARGETS = {f"w{i}" for i in range(8)}  # 8 of 73 tokens: about 0.1 of a random response


def target_share(prompts, completions):
    return [sum(w in TARGETS for w in c.split()) / max(len(c.split()), 1) for c in completions]


def train(tmp_path, steps=30, **overrides):
    tok = tiny_tokenizer()
    args = PPOConfig(**{**dict(output_dir=str(tmp_path), per_device_train_batch_size=8, total_episodes=8 * steps,
                               learning_rate=1e-2, num_ppo_epochs=2, kl_coef=0.01, response_length=4,
                               logging_steps=1, report_to=[], save_strategy="no", num_sample_generations=0,
                               bf16=False, disable_tqdm=True, seed=0), **overrides})
    t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok), ref_model=None,
                   reward_model=target_share, train_dataset=tiny_prompt_dataset(tok, 16),
                   value_model=tiny_scalar_model(tok))
    t.train()
    return [h for h in t.state.log_history if "objective/scores" in h]


def _learned(logs):
    scores = [log["objective/scores"] for log in logs]
    assert all(math.isfinite(s) for s in scores)
    return sum(scores[:3]) / 3, sum(scores[-5:]) / 5


ALL_ON = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode="seq-mean-token-mean",
              length_adaptive_alpha=0.5, lam_value=1.0, vf_loss_type="huber", vf_coef_end=0.05)


def test_a_run_with_every_variant_on_trains_and_logs_them(tmp_path):
    logs = train(tmp_path, **ALL_ON)
    first, last = _learned(logs)
    assert first < 0.3 and last > 0.6, (first, last)
    for log in logs:
        assert log["policy/clipfrac_avg"] == pytest.approx(
            log["policy/clipfrac_low_avg"] + log["policy/clipfrac_high_avg"], abs=1e-6)
        assert 0 <= log["policy/lam_min"] <= log["policy/lam_mean"] <= log["policy/lam_max"] < 1
        assert "policy/clipfrac_dual_avg" in log
    assert logs[0]["val/vf_coef"] == pytest.approx(0.1) and logs[-1]["val/vf_coef"] == pytest.approx(0.05)
    assert len({round(log["policy/lam_mean"], 6) for log in logs}) > 1  # λ follows the response lengths


@pytest.mark.slow
@pytest.mark.parametrize("name, overrides", [
    ("clip-higher", dict(clip_ratio_high=0.28)),
    ("dual-clip", dict(clip_ratio_c=3.0)),
    *[(mode, dict(loss_agg_mode=mode)) for mode in LOSS_AGG_MODES if mode != "token-mean"],
    ("decoupled λ", dict(lam_policy=0.9, lam_value=1.0)),
    ("length-adaptive λ", dict(length_adaptive_alpha=0.5)),
    ("mse value loss", dict(vf_loss_type="mse")),
    ("sequence ratio (GSPO)", dict(importance_sampling_level="sequence")),
    ("entropy bonus", dict(entropy_coef=0.01)),
    ("KL loss", dict(beta=0.04)),
    ("CISPO", dict(loss_type="cispo", clip_ratio_high=4.0)),
    # (the top half: on 4-token responses of a near-uniform policy the top fifth trains too few tokens in 30 steps;
    # mask_truncated_completions is not here: most of these responses run to the cap and leave the loss)
    ("top-entropy tokens", dict(top_entropy_quantile=0.5)),
])
def test_each_variant_trains(tmp_path, name, overrides):
    first, last = _learned(train(tmp_path, **overrides))
    assert first < 0.3 and last > 0.6, (name, first, last)


def test_defaults_log_no_variant_metric(tmp_path):
    logs = train(tmp_path, steps=1)
    assert not any(k in logs[0] for k in ("policy/clipfrac_dual_avg", "policy/lam_mean", "val/vf_coef",
                                          "policy/kl_loss_avg"))
    assert logs[0]["policy/clipfrac_avg"] == logs[0]["policy/clipfrac_low_avg"] + logs[0]["policy/clipfrac_high_avg"]


def test_the_kl_loss_term_is_logged_and_grows_as_the_policy_leaves_the_reference(tmp_path):
    """k3 of the first minibatch is 0 (the policy is the reference), then positive; the reward penalty is off."""
    logs = train(tmp_path, steps=4, beta=0.04, kl_coef=0.0)
    kl = [log["policy/kl_loss_avg"] for log in logs]
    assert kl[0] >= 0 and all(k > 0 for k in kl[1:]) and kl[-1] > kl[0], kl
    assert all(log["objective/non_score_reward"] == 0 for log in logs)


def test_the_variants_are_command_line_flags(tmp_path):
    """The recipes parse PPOConfig with TRL's TrlParser: each variant is a flag with its type."""
    from trl import TrlParser

    (args,) = TrlParser((PPOConfig,)).parse_args_and_config([
        "--output_dir", str(tmp_path), "--bf16", "False", "--clip_ratio_high", "0.28", "--clip_ratio_c", "3",
        "--loss_agg_mode", "seq-mean-token-mean", "--lam_value", "1.0", "--length_adaptive_alpha", "0.05",
        "--vf_loss_type", "huber", "--vf_huber_delta", "0.5", "--vf_coef_end", "0.01",
        "--importance_sampling_level", "sequence", "--entropy_coef", "0.001", "--beta", "0.04",
        "--kl_loss_estimator", "k2", "--use_bias_correction_kl", "false"])
    assert (args.clip_ratio_high, args.clip_ratio_c, args.loss_agg_mode, args.lam_value, args.length_adaptive_alpha,
            args.vf_loss_type, args.vf_huber_delta, args.vf_coef_end, args.importance_sampling_level,
            args.entropy_coef, args.beta, args.kl_loss_estimator, args.use_bias_correction_kl) == (
        0.28, 3.0, "seq-mean-token-mean", 1.0, 0.05, "huber", 0.5, 0.01, "sequence", 0.001, 0.04, "k2", False)
    assert args.clip_ratio_low is None and args.lam_policy is None  # unset: cliprange and lam
    (args,) = TrlParser((PPOConfig,)).parse_args_and_config([
        "--output_dir", str(tmp_path), "--bf16", "False", "--loss_type", "cispo", "--clip_ratio_high", "4.0",
        "--mask_truncated_completions", "true", "--top_entropy_quantile", "0.2", "--cast_lm_head_to_fp32", "true"])
    assert (args.loss_type, args.clip_ratio_high, args.mask_truncated_completions, args.top_entropy_quantile,
            args.cast_lm_head_to_fp32) == ("cispo", 4.0, True, 0.2, True)
