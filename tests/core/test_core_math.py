"""Tests for trl_ext.core: hand-worked numbers, plain-python reference loops, edge cases and bad input."""
import ast
import math
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from trl_ext.core import (
    KL_ESTIMATORS,
    clipped_policy_loss,
    clipped_value_loss,
    compute_gae,
    entropy_from_logits,
    estimate_kl,
    explained_variance,
    last_true_index,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    response_mask_from_stop,
    shape_rewards,
    token_logprobs,
    token_mean,
)

CORE_DIR = pathlib.Path(__file__).resolve().parents[2] / "trl_ext" / "core"
SEEDS = [0, 1, 2, 3, 4]


def ragged_batch(seed, B=6, T=7):
    """Random (B, T) tensors and a left-aligned mask whose lengths include 1 and T."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0], lengths[1] = 1, T
    mask = torch.arange(T)[None, :] < lengths[:, None]
    rand = lambda: torch.randn(B, T, generator=g, dtype=torch.float64)  # noqa: E731
    return mask, lengths.tolist(), rand, g


# ---------------------------------------------------------------- KL estimators


def test_kl_hand_computed():
    logprobs = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-2.0, -1.5]])
    # token 0: log ρ = ref − logp = −2 − (−1) = −1
    #          k1 = 1,    k2 = ½·1 = 0.5,     k3 = e^−1 − 1 + 1 = 0.36787944
    # token 1: log ρ = −1.5 − (−2) = 0.5
    #          k1 = −0.5, k2 = ½·0.25 = 0.125, k3 = e^0.5 − 1 − 0.5 = 0.14872127
    torch.testing.assert_close(estimate_kl(logprobs, ref, "k1"), torch.tensor([[1.0, -0.5]]))
    torch.testing.assert_close(estimate_kl(logprobs, ref, "k2"), torch.tensor([[0.5, 0.125]]))
    torch.testing.assert_close(estimate_kl(logprobs, ref, "k3"), torch.tensor([[0.36787944, 0.14872127]]))


def test_k3_never_negative_k1_can_be():
    g = torch.Generator().manual_seed(0)
    logprobs, ref = torch.randn(64, 50, generator=g) * 3, torch.randn(64, 50, generator=g) * 3
    assert (estimate_kl(logprobs, ref, "k3") >= 0).all()
    assert (estimate_kl(logprobs, ref, "k2") >= 0).all()
    assert (estimate_kl(logprobs, ref, "k1") < 0).any()
    # tiny differences: expm1 keeps k3 >= 0 where exp(x) − 1 would round below x
    tiny = torch.full((1, 8), -1.0) + torch.linspace(-1e-7, 1e-7, 8)
    assert (estimate_kl(torch.full((1, 8), -1.0), tiny, "k3") >= 0).all()


def test_kl_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'.*'k1', 'k2', 'k3'"):
        estimate_kl(x, x, "k4")
    with pytest.raises(ValueError, match=r"ref_logprobs has shape \(2, 4\)"):
        estimate_kl(x, torch.zeros(2, 4), "k1")
    assert KL_ESTIMATORS == ("k1", "k2", "k3")


# ---------------------------------------------------------------- masks


def test_masked_mean_var_whiten_match_reference():
    for seed in SEEDS:
        mask, lengths, rand, _ = ragged_batch(seed)
        x = rand()
        x[~mask] = float("nan")  # padding garbage must not leak
        real = [x[b, t].item() for b in range(len(lengths)) for t in range(lengths[b])]
        n = len(real)
        mean = sum(real) / n
        var = sum((v - mean) ** 2 for v in real) / (n - 1)
        assert math.isclose(masked_mean(x, mask).item(), mean, rel_tol=1e-12)
        assert math.isclose(masked_var(x, mask).item(), var, rel_tol=1e-12)
        assert math.isclose(masked_var(x, mask, unbiased=False).item(), var * (n - 1) / n, rel_tol=1e-12)
        row_means = [sum(x[b, :L].tolist()) / L for b, L in enumerate(lengths)]
        assert torch.allclose(masked_mean(x, mask, dim=1), torch.tensor(row_means, dtype=torch.float64))
        for shift_mean in (True, False):
            ref = torch.zeros_like(x)
            for b, L in enumerate(lengths):
                for t in range(L):
                    ref[b, t] = (x[b, t] - mean) / math.sqrt(var + 1e-8) + (0 if shift_mean else mean)
            assert torch.allclose(masked_whiten(x, mask, shift_mean=shift_mean), ref)


def test_masked_whiten_single_element_is_finite():
    x = torch.tensor([[3.0, 7.0, 9.0]])
    mask = torch.tensor([[True, False, False]])
    # one element: variance taken as 0 -> (3 − 3)·rsqrt(1e-8) = 0; padding is 0
    torch.testing.assert_close(masked_whiten(x, mask), torch.zeros(1, 3))
    torch.testing.assert_close(masked_whiten(x, mask, shift_mean=False), torch.tensor([[3.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="unbiased=False"):
        masked_var(x, mask)
    assert masked_var(x, mask, unbiased=False).item() == 0.0


def test_mask_bad_input():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="selects no entries"):
        masked_mean(x, torch.zeros(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="dim=1"):
        masked_mean(x, torch.tensor([[True, False, False], [False, False, False]]), dim=1)
    with pytest.raises(ValueError, match=r"must be a bool tensor.*\.bool\(\)"):
        masked_mean(x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"mask has shape \(2, 2\)"):
        masked_mean(x, torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"rows \[1\].*no True"):
        last_true_index(torch.tensor([[True, False], [False, False]]))


def test_last_true_index():
    mask = torch.tensor([[True, False, False], [True, True, True], [True, True, False]])
    assert last_true_index(mask).tolist() == [0, 2, 1]
    assert last_true_index(mask).dtype == torch.long


def test_response_mask_from_stop():
    EOS, PAD = 2, 0
    responses = torch.tensor([
        [5, 6, EOS, 7],      # stops at 2: keeps the EOS, drops what follows
        [5, 6, 7, 8],        # no EOS: cut at the cap, all real
        [EOS, EOS, EOS, 9],  # just one EOS: only position 0
        [5, PAD, 6, EOS],    # a sampled pad id that is not the stop token is a real token
    ])
    expected = [[1, 1, 1, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 1]]
    assert response_mask_from_stop(responses, EOS).tolist() == [[bool(v) for v in r] for r in expected]
    assert response_mask_from_stop(responses, None).all()
    with pytest.raises(ValueError, match="stop_token_id must be an int or None"):
        response_mask_from_stop(responses, 2.0)
    with pytest.raises(ValueError, match="integer tensor"):
        response_mask_from_stop(responses.float(), EOS)


# ---------------------------------------------------------------- rewards


def reference_shape_rewards(scores, logprobs, ref_logprobs, lengths, kl_coef, estimator):
    rewards, kls = torch.zeros_like(logprobs), torch.zeros_like(logprobs)
    for b, L in enumerate(lengths):
        for t in range(L):
            log_rho = ref_logprobs[b, t].item() - logprobs[b, t].item()
            kl = {"k1": -log_rho, "k2": 0.5 * log_rho**2, "k3": math.exp(log_rho) - 1 - log_rho}[estimator]
            kls[b, t] = kl
            rewards[b, t] = -kl_coef * kl + (scores[b].item() if t == L - 1 else 0.0)
    return rewards, kls


def test_shape_rewards_matches_reference():
    for seed in SEEDS:
        mask, lengths, rand, g = ragged_batch(seed)
        scores = torch.randn(len(lengths), generator=g, dtype=torch.float64)
        logprobs, ref = -rand().abs(), -rand().abs()
        logprobs[~mask] = 1.0  # TRL's INVALID_LOGPROB in padding: must be ignored
        for estimator in KL_ESTIMATORS:
            rewards, kl = shape_rewards(scores, logprobs, ref, mask, 0.05, estimator)
            ref_rewards, ref_kl = reference_shape_rewards(scores, logprobs, ref, lengths, 0.05, estimator)
            assert torch.allclose(rewards, ref_rewards) and torch.allclose(kl, ref_kl)


def test_shape_rewards_score_placement():
    EOS = 2
    responses = torch.tensor([
        [5, 6, EOS, EOS],  # stopped: score on the EOS at index 2
        [5, 6, 7, 8],      # cut at the cap: score on index 3
        [EOS, 9, 9, 9],    # just one EOS: score on index 0
        [5, EOS, EOS, EOS],  # pad == eos: score on index 1, not on the padding EOS tokens
    ])
    mask = response_mask_from_stop(responses, EOS)
    scores = torch.tensor([10.0, 20.0, 30.0, 40.0])
    zeros = torch.zeros(4, 4)
    rewards, kl = shape_rewards(scores, zeros, zeros, mask, 0.1, "k3")  # identical policies: KL = 0
    expected = torch.zeros(4, 4)
    expected[0, 2], expected[1, 3], expected[2, 0], expected[3, 1] = 10.0, 20.0, 30.0, 40.0
    torch.testing.assert_close(rewards, expected)
    assert (kl == 0).all()


def test_shape_rewards_bad_input():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"scores has shape \(3,\), expected \(2,\)"):
        shape_rewards(torch.zeros(3), z, z, m, 0.1, "k1")
    with pytest.raises(ValueError, match="kl_coef=-0.1"):
        shape_rewards(torch.zeros(2), z, z, m, -0.1, "k1")
    with pytest.raises(ValueError, match="unknown KL estimator 'kl'"):
        shape_rewards(torch.zeros(2), z, z, m, 0.1, "kl")
    with pytest.raises(ValueError, match=r"rows \[0\] are not left-aligned"):
        shape_rewards(torch.zeros(2), z, z, torch.tensor([[True, False, True], [True, True, True]]), 0.1, "k1")


# ---------------------------------------------------------------- GAE


def test_gae_hand_computed():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    # γ = 1, λ = 0.95, V_3 = 0 (episode ends after the last token)
    # δ2 = 1 + 0 − 0.7 = 0.3      A2 = 0.3
    # δ1 = 0 + 0.7 − 0.6 = 0.1    A1 = 0.1 + 0.95·0.3 = 0.385
    # δ0 = 0 + 0.6 − 0.5 = 0.1    A0 = 0.1 + 0.95·0.385 = 0.46575
    # returns = A + V = [0.96575, 0.985, 1.0]
    adv, ret = compute_gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.46575, 0.385, 0.3]]))
    torch.testing.assert_close(ret, torch.tensor([[0.96575, 0.985, 1.0]]))


def test_gae_ignores_padding():
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    adv, ret = compute_gae(rewards, values, mask, 0.9, 0.8)
    r2, v2 = rewards.clone(), values.clone()
    r2[0, 2:], v2[0, 2:] = torch.tensor([5.0, -3.0]), torch.tensor([100.0, 7.0])  # padding garbage
    adv2, ret2 = compute_gae(r2, v2, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, adv2)
    torch.testing.assert_close(ret, ret2)
    # row 0 by hand: A1 = 1 + 0.9·0 − 0.4 = 0.6 (V after the last token is 0, not 100);
    # A0 = (0 + 0.9·0.4 − 0.2) + 0.9·0.8·0.6 = 0.16 + 0.432 = 0.592
    torch.testing.assert_close(adv[0], torch.tensor([0.592, 0.6, 0.0, 0.0]))
    torch.testing.assert_close(ret[0], torch.tensor([0.792, 1.0, 0.0, 0.0]))


def reference_gae(rewards, values, lengths, gamma, lam):
    adv, ret = torch.zeros_like(values), torch.zeros_like(values)
    for b, L in enumerate(lengths):
        last = 0.0
        for t in reversed(range(L)):
            next_v = values[b, t + 1].item() if t + 1 < L else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[b, t], ret[b, t] = last, last + values[b, t].item()
    return adv, ret


def test_gae_matches_reference():
    for seed in SEEDS:
        mask, lengths, rand, _ = ragged_batch(seed)
        rewards, values = rand(), rand()
        for gamma, lam in [(1.0, 0.95), (0.99, 0.9), (0.5, 0.0), (1.0, 1.0)]:
            adv, ret = compute_gae(rewards, values, mask, gamma, lam)
            ref_adv, ref_ret = reference_gae(rewards, values, lengths, gamma, lam)
            assert torch.allclose(adv, ref_adv) and torch.allclose(ret, ref_ret)


def test_gae_bad_input():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"gamma=1.5 is outside \[0, 1\]"):
        compute_gae(z, z, m, 1.5, 0.95)
    with pytest.raises(ValueError, match=r"rewards has shape \(2, 4\)"):
        compute_gae(torch.zeros(2, 4), z, m, 1.0, 0.95)


def test_explained_variance():
    mask = torch.tensor([[True, True, True, False]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 99.0]])
    assert explained_variance(returns.clone(), returns, mask).item() == pytest.approx(1.0)
    # constant prediction at the mean: Var(R − V) = Var(R) -> 0
    assert explained_variance(torch.full((1, 4), 2.0), returns, mask).item() == pytest.approx(0.0)
    # V = [1, 1, 1]: R − V = [0, 1, 2], same variance as R -> 0; V = [0, 2, 4]: R − V = [1, 0, −1] -> 0
    assert explained_variance(torch.tensor([[0.0, 2.0, 4.0, 0.0]]), returns, mask).item() == pytest.approx(0.0)
    # Var(returns) == 0 (single real token, or constant targets): documented to return 0.0, not NaN
    one_token = torch.tensor([[True, False, False, False]])
    assert explained_variance(torch.zeros(1, 4), returns, one_token).item() == 0.0
    assert explained_variance(torch.zeros(1, 4), torch.ones(1, 4), mask).item() == 0.0


# ---------------------------------------------------------------- PPO losses


def policy_case(log_ratio, advantage, eps=0.2):
    old = torch.tensor([[-1.0]])
    logprobs = (old + log_ratio).requires_grad_()
    mask = torch.ones(1, 1, dtype=torch.bool)
    loss, stats = clipped_policy_loss(logprobs, old, torch.tensor([[advantage]]), mask, eps)
    loss.backward()
    return loss.item(), logprobs.grad.item(), stats


def test_policy_loss_clip_cases():
    # A > 0, ratio 1.5 > 1 + ε: the clipped term −2·1.2 = −2.4 is the max; no gradient
    loss, grad, stats = policy_case(math.log(1.5), 2.0)
    assert loss == pytest.approx(-2.4) and grad == 0.0 and stats["clipfrac"].item() == 1.0
    # A < 0, ratio 0.5 < 1 − ε: −(−2)·0.8 = 1.6 > 1.0; no gradient
    loss, grad, stats = policy_case(math.log(0.5), -2.0)
    assert loss == pytest.approx(1.6) and grad == 0.0 and stats["clipfrac"].item() == 1.0
    # inside the range, ratio 1.1: loss −2·1.1 = −2.2, d/dlogp (−A·e^(logp − old)) = −A·ratio = −2.2
    loss, grad, stats = policy_case(math.log(1.1), 2.0)
    assert loss == pytest.approx(-2.2) and grad == pytest.approx(-2.2) and stats["clipfrac"].item() == 0.0
    # A > 0 with ratio below 1 − ε is NOT clipped (the pessimistic bound keeps the gradient): −2·0.5 = −1.0
    loss, grad, stats = policy_case(math.log(0.5), 2.0)
    assert loss == pytest.approx(-1.0) and grad == pytest.approx(-1.0) and stats["clipfrac"].item() == 0.0
    # A < 0 with ratio above 1 + ε is NOT clipped: 2·1.5 = 3.0, grad = −A·ratio = 3.0
    loss, grad, stats = policy_case(math.log(1.5), -2.0)
    assert loss == pytest.approx(3.0) and grad == pytest.approx(3.0) and stats["clipfrac"].item() == 0.0


def test_policy_loss_masked_stats():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    log_ratio = torch.tensor([[math.log(1.5), 0.0, 50.0], [math.log(0.9), 0.0, 0.0]])
    logprobs = (old + log_ratio).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, float("nan")], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    loss, stats = clipped_policy_loss(logprobs, old, adv, mask, 0.2)
    loss.backward()
    # per token: −1.2 (clipped), −1, −0.9, −1, −1 -> mean −5.1 / 5 = −1.02
    assert loss.item() == pytest.approx(-1.02)
    assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 2] == 0 and logprobs.grad[0, 0] == 0
    assert stats["clipfrac"].item() == pytest.approx(0.2)
    assert stats["ratio_max"].item() == pytest.approx(1.5) and stats["ratio_min"].item() == pytest.approx(0.9)
    assert stats["ratio_mean"].item() == pytest.approx((1.5 + 1 + 0.9 + 1 + 1) / 5)
    # approxkl = k3 of KL(π_old ‖ π_θ), log ρ = new − old: ((1.5 − 1 − ln 1.5) + (0.9 − 1 − ln 0.9)) / 5 tokens
    k3 = (0.5 - math.log(1.5)) + (-0.1 - math.log(0.9))
    assert stats["approxkl"].item() == pytest.approx(k3 / 5)
    assert stats["loss"].item() == pytest.approx(-1.02)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_token_mean_with_a_minibatch_count():
    """num_tokens: each micro-batch's loss is its share of the minibatch's token mean, and the shares add up to it.
    Minibatch of 5 real tokens split 2 + 3: per-token losses (−1.2, −1) and (−0.9, −1, −1)."""
    x = torch.tensor([[-1.2, -1.0, 7.0], [-0.9, -1.0, -1.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert token_mean(x, mask).item() == pytest.approx(-5.1 / 5)
    first, second = token_mean(x[:1], mask[:1], 5), token_mean(x[1:], mask[1:], 5)
    assert first.item() == pytest.approx(-2.2 / 5) and second.item() == pytest.approx(-2.9 / 5)
    assert (first + second).item() == pytest.approx(-5.1 / 5)
    # the mean of the two micro-batch means is another number: −(1.1 + 0.9667) / 2 = −1.0333, not −1.02
    assert ((token_mean(x[:1], mask[:1]) + token_mean(x[1:], mask[1:])) / 2).item() == pytest.approx(-31 / 30)
    # the losses take it: the same rows as test_policy_loss_masked_stats, counted over a minibatch of 10 tokens
    old = torch.full((2, 3), -1.0)
    log_ratio = torch.tensor([[math.log(1.5), 0.0, 50.0], [math.log(0.9), 0.0, 0.0]])
    adv = torch.tensor([[1.0, 1.0, float("nan")], [1.0, 1.0, 1.0]])
    loss, stats = clipped_policy_loss(old + log_ratio, old, adv, mask, 0.2, denominator=10)
    assert loss.item() == pytest.approx(-5.1 / 10)
    assert stats["loss"].item() == pytest.approx(-1.02)  # the logged value stays this batch's own token mean
    vloss, vstats = clipped_value_loss(torch.tensor([[0.5, 2.0, 0.1]]), torch.zeros(1, 3),
                                       torch.tensor([[1.0, 1.0, -1.0]]), torch.ones(1, 3, dtype=torch.bool), 0.2,
                                       denominator=6)
    assert vloss.item() == pytest.approx(0.5 * 2.85 / 6) and vstats["loss"].item() == pytest.approx(0.475)


def test_value_loss_clip_cases():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.tensor([[0.0, 0.0, 0.0]])
    returns = torch.tensor([[1.0, 1.0, -1.0]])
    values = torch.tensor([[0.5, 2.0, 0.1]], requires_grad=True)
    loss, stats = clipped_value_loss(values, old, returns, mask, 0.2)
    loss.backward()
    # token 0: v = 0.5 -> vclip = 0.2; (0.5−1)² = 0.25 < (0.2−1)² = 0.64 -> clipped term active, no gradient
    # token 1: v = 2.0 -> vclip = 0.2; (2−1)² = 1 > 0.64 -> unclipped, grad ½·2·(2−1)/3 = 1/3
    # token 2: v = 0.1 inside the range -> vclip = v, equal terms, grad ½·2·(0.1+1)/3 = 1.1/3
    # loss = ½·(0.64 + 1 + 1.21)/3 = 0.475
    assert loss.item() == pytest.approx(0.475)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 1 / 3, 1.1 / 3]]))
    assert stats["clipfrac"].item() == pytest.approx(1 / 3)
    assert stats["values_mean"].item() == pytest.approx(2.6 / 3)
    assert stats["loss"].item() == pytest.approx(0.475) and not stats["loss"].requires_grad


def test_loss_bad_input():
    z, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="cliprange=0 must be > 0"):
        clipped_policy_loss(z, z, z, m, 0)
    with pytest.raises(ValueError, match="cliprange_value=-0.2 must be > 0"):
        clipped_value_loss(z, z, z, m, -0.2)
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\)"):
        clipped_policy_loss(z, z, torch.zeros(2, 4), m, 0.2)
    with pytest.raises(ValueError, match=r"logits must be \(B, T, V\)"):
        logprobs_from_logits(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_logprobs_and_entropy_from_logits():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 11, generator=g)
    tokens = torch.randint(0, 11, (3, 4), generator=g)
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, tokens), ref)
    bf16 = logprobs_from_logits(logits.bfloat16(), tokens)
    assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.float(), ref, atol=0.05)
    p = torch.softmax(logits, -1)
    torch.testing.assert_close(entropy_from_logits(logits), -(p * p.log()).sum(-1))
    # uniform over 2 of 4 entries (others −inf): entropy ln 2, finite gradient
    masked = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    ent = entropy_from_logits(masked)
    ent.sum().backward()
    assert ent.item() == pytest.approx(math.log(2)) and not masked.grad.isnan().any()


# ---------------------------------------------------------------- chunked log-probs and entropy


def _reference_logprobs(logits, tokens, temperature=1.0):
    return torch.log_softmax(logits / temperature, -1).gather(-1, tokens[..., None]).squeeze(-1)


@pytest.mark.parametrize("chunk_size", [1, 3, 5, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_chunked_equals_unchunked_values_and_gradients(chunk_size, temperature):
    g = torch.Generator().manual_seed(chunk_size)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, 11, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g, dtype=torch.float64)  # an arbitrary upstream gradient
    out = token_logprobs(logits, tokens, temperature, chunk_size)
    ref = _reference_logprobs(logits, tokens, temperature)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref)
    (grad,) = torch.autograd.grad((out * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(grad, ref_grad)
    # and against finite differences
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, tokens, temperature, chunk_size), (logits,))


def test_token_logprobs_hand_computed():
    # logits (0, ln 3) over 2 tokens: softmax = (1/4, 3/4); at τ = 1, log p(1) = ln 0.75;
    # d log p(1) / d l = (0 − 1/4, 1 − 3/4) = (−0.25, 0.25)
    logits = torch.tensor([[[0.0, math.log(3.0)]]], requires_grad=True)
    out = token_logprobs(logits, torch.tensor([[1]]))
    assert out.item() == pytest.approx(math.log(0.75))
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.tensor([[[-0.25, 0.25]]]))


def test_token_logprobs_of_a_non_contiguous_slice():
    """The trainer passes logits[:, Q − 1 : −1] (a non-contiguous view): same values, gradient lands in place."""
    g = torch.Generator().manual_seed(0)
    full = torch.randn(2, 9, 7, generator=g, requires_grad=True)
    tokens = torch.randint(0, 7, (2, 5), generator=g)
    sliced = full[:, 3:-1]
    assert not sliced.is_contiguous()
    out = token_logprobs(sliced, tokens, chunk_size=2)
    torch.testing.assert_close(out, _reference_logprobs(sliced, tokens))
    out.sum().backward()
    ref_full = full.detach().clone().requires_grad_(True)
    _reference_logprobs(ref_full[:, 3:-1], tokens).sum().backward()
    torch.testing.assert_close(full.grad, ref_full.grad)
    assert (full.grad[:, :3] == 0).all() and (full.grad[:, -1] == 0).all()


def test_token_logprobs_keeps_no_fp32_vocabulary_tensor_for_backward():
    """bf16 logits: autograd keeps only the bf16 logits and the ids; the plain `.float()` + log_softmax path keeps a
    (B, T, V) fp32 tensor. Values are computed in fp32 (more precise than bf16 log_softmax)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 2, 6, 50
    logits = torch.randn(B, T, V, generator=g).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, V, (B, T), generator=g)

    def saved(fn):
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append((t.dtype, t.numel())) or t,
                                                      lambda t: t):
            out = fn()
        return out, packed

    out, packed = saved(lambda: token_logprobs(logits, tokens, chunk_size=4))
    assert out.dtype == torch.float32
    assert (torch.float32, B * T * V) not in packed and (torch.bfloat16, B * T * V) in packed
    _, plain = saved(lambda: _reference_logprobs(logits.float(), tokens))
    assert (torch.float32, B * T * V) in plain  # what the chunked function avoids
    torch.testing.assert_close(out, _reference_logprobs(logits.float(), tokens))
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("chunk_size", [1, 4, 100])
def test_entropy_chunked_equals_unchunked(chunk_size):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 7, 13, generator=g, dtype=torch.float64)
    logits[0, 0, :5] = float("-inf")
    for temperature in (1.0, 0.5):
        torch.testing.assert_close(entropy_from_logits(logits, temperature, chunk_size),
                                   entropy_from_logits(logits / temperature))
    p = torch.softmax(logits[1:] / 0.5, -1)
    torch.testing.assert_close(entropy_from_logits(logits, 0.5, chunk_size)[1:], -(p * p.log()).sum(-1))
    # bf16 in, fp32 out, computed on the upcast chunk
    bf16 = logits.bfloat16()
    chunked = entropy_from_logits(bf16, 1.0, chunk_size)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, entropy_from_logits(bf16.float()))


def test_chunked_math_bad_input():
    z, t = torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_size=0 must be a positive int"):
        token_logprobs(z, t, chunk_size=0)
    with pytest.raises(ValueError, match="temperature=0 must be > 0"):
        token_logprobs(z, t, temperature=0)
    with pytest.raises(ValueError, match=r"tokens \(1, 3\)"):
        token_logprobs(z, torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size=2.5 must be a positive int"):
        entropy_from_logits(z, chunk_size=2.5)


# ---------------------------------------------------------------- import hygiene


def test_core_imports_torch_only():
    # torch and the standard library's typing and record helpers (`core/types.py` holds dataclasses)
    allowed = {"torch", "typing", "collections", "dataclasses", "__future__"}
    for path in sorted(CORE_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in allowed, f"{path.name} imports {name}; core must import torch only"
        # belt and braces: also catches imports hidden in strings / importlib calls
        bad = re.findall(r"(?:^\s*(?:import|from)\s+|import_module\(\s*['\"])(trl|transformers|numpy)\b",
                         path.read_text(), flags=re.M)
        assert not bad, f"{path.name} imports {bad}"


def test_core_import_does_not_load_trl():
    # load the core package's files directly (bypassing trl_ext/__init__.py, which may import trl)
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('core', {str(CORE_DIR / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(CORE_DIR)!r}])\n"
        "m = importlib.util.module_from_spec(spec); sys.modules['core'] = m; spec.loader.exec_module(m)\n"
        "bad = [k for k in sys.modules if k.split('.')[0] in ('trl', 'transformers')]\n"
        "assert not bad, bad\n"
        "assert m.compute_gae\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_masked_whiten_over_processes_equals_whitening_the_whole_batch():
    """With all_reduce_sum, each process's share is whitened with the statistics of all shares together."""
    torch.manual_seed(0)
    a, b = torch.randn(3, 5), torch.randn(2, 5) * 3 + 1
    ma, mb = torch.rand(3, 5) > 0.3, torch.rand(2, 5) > 0.3
    for shift_mean in (True, False):
        whole = masked_whiten(torch.cat([a, b]), torch.cat([ma, mb]), shift_mean=shift_mean)
        # process A's view: the reducer adds process B's contribution to each of the two sums A asks for
        mean = torch.cat([a, b])[torch.cat([ma, mb])].mean()
        other = iter([torch.stack([b[mb].sum(), mb.sum().float()]), ((b - mean)[mb] ** 2).sum()])
        share = masked_whiten(a, ma, shift_mean=shift_mean, all_reduce_sum=lambda t, other=other: t + next(other))
        torch.testing.assert_close(share, whole[:3], rtol=1e-5, atol=1e-6)
        # and it is not what whitening A alone gives (TRL's per-process whitening)
        assert not torch.allclose(masked_whiten(a, ma, shift_mean=shift_mean), whole[:3], atol=1e-3)
    # hand-computed: entries 1, 3 here and 5, 7 elsewhere -> mean 4, unbiased var 20/3
    x, m = torch.tensor([1.0, 3.0]), torch.tensor([True, True])
    other = iter([torch.tensor([12.0, 2.0]), torch.tensor(10.0)])
    out = masked_whiten(x, m, all_reduce_sum=lambda t: t + next(other))
    torch.testing.assert_close(out, (x - 4) / torch.sqrt(torch.tensor(20 / 3 + 1e-8)))
