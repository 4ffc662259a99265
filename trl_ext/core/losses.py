"""PPO clipped surrogate losses and per-token log-prob / entropy from logits.

Shapes: B = batch, T = response length, V = vocab.

Losses average over real tokens of the whole minibatch (masked_mean over B × T), as in TRL.
"""
from typing import Dict, Tuple

import torch
import torch.nn.functional as F

from .masks import masked_mean


def _check_same_shape(response_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if x.shape != response_mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but response_mask has "
                             f"{tuple(response_mask.shape)}; they must match")


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """PPO-clip policy loss: masked_mean(max(−A·ρ, −A·clip(ρ, 1−ε, 1+ε))), ρ = π_θ / π_old.

    # Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 7 (negated: a loss to minimise)

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens (with grad).
        old_logprobs: (B, T) log π_old of the same tokens, from rollout time.
        advantages: (B, T).
        response_mask: (B, T) bool.
        cliprange: ε > 0.

    Returns:
        loss: 0-dim, differentiable.
        stats: detached 0-dim tensors: "loss"; "clipfrac" (fraction of real tokens where the clipped term is the
            active one); "approxkl" (k3 estimate of KL(π_old ‖ π_θ) from samples of π_old: with
            log ρ = logprobs − old_logprobs, (ρ − 1) − log ρ, http://joschu.net/blog/kl-approx.html);
            "ratio_mean", "ratio_max", "ratio_min" over real tokens.
    """
    if not cliprange > 0:
        raise ValueError(f"cliprange={cliprange} must be > 0 (typical: 0.2)")
    _check_same_shape(response_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    # padding gets log ρ = 0 and A = 0, so garbage there cannot reach the loss or its gradient
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0)
    advantages = torch.where(response_mask, advantages, 0)
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    loss = masked_mean(torch.max(pg_losses, pg_losses2), response_mask)
    with torch.no_grad():
        ratio_d = ratio.detach()
        stats = {
            "loss": loss.detach(),
            "clipfrac": masked_mean((pg_losses2 > pg_losses).float(), response_mask),
            "approxkl": masked_mean(torch.expm1(log_ratio) - log_ratio, response_mask),
            "ratio_mean": masked_mean(ratio_d, response_mask),
            "ratio_max": ratio_d.masked_fill(~response_mask, float("-inf")).max(),
            "ratio_min": ratio_d.masked_fill(~response_mask, float("inf")).min(),
        }
    return loss, stats


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """Clipped value loss: ½ · masked_mean(max((V − R)², (V_clip − R)²)),
    with V_clip = V_old + clip(V − V_old, −c, c).

    # https://github.com/openai/baselines/blob/master/baselines/ppo2/model.py (vpredclipped)

    Args:
        values: (B, T) current value predictions (with grad).
        old_values: (B, T) value predictions from rollout time.
        returns: (B, T) value targets.
        response_mask: (B, T) bool.
        cliprange_value: c > 0.

    Returns:
        loss: 0-dim, differentiable.
        stats: detached 0-dim tensors "loss", "clipfrac" (fraction of real tokens where the clipped error is
            larger, i.e. active), "values_mean".
    """
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value={cliprange_value} must be > 0 (typical: 0.2)")
    _check_same_shape(response_mask, values=values, old_values=old_values, returns=returns)
    values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
    vf_losses1 = (values - returns).square()
    vf_losses2 = (values_clipped - returns).square()
    loss = 0.5 * masked_mean(torch.max(vf_losses1, vf_losses2), response_mask)
    with torch.no_grad():
        stats = {
            "loss": loss.detach(),
            "clipfrac": masked_mean((vf_losses2 > vf_losses1).float(), response_mask),
            "values_mean": masked_mean(values.detach(), response_mask),
        }
    return loss, stats


def logprobs_from_logits(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] for each position, without materialising a (B, T, V) log-softmax.

    # after TRL's selective_log_softmax (trl/trainer/utils.py)

    Args:
        logits: (B, T, V).
        tokens: (B, T) integer ids in [0, V).

    Returns:
        (B, T) log-probs, in the logits' dtype.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits must be (B, T, V) and tokens (B, T) with the same B, T; got logits "
                         f"{tuple(logits.shape)} and tokens {tuple(tokens.shape)}")
    tokens = tokens.long()
    if logits.dtype in (torch.float32, torch.float64):
        selected = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        # one row at a time keeps the peak extra memory at (T, V)
        return selected - torch.stack([torch.logsumexp(row, dim=-1) for row in logits])
    # low precision (bf16/fp16): logsumexp loses too much; take log_softmax row by row instead
    return torch.stack(
        [F.log_softmax(row, dim=-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1) for row, tok in zip(logits, tokens)]
    )


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) at each position: logsumexp(l) − Σ_v softmax(l)_v · l_v.

    Args:
        logits: (B, T, V); −inf entries (masked vocabulary) are allowed and contribute 0.

    Returns:
        (B, T).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    out = []
    for row in logits:  # one row at a time keeps the peak extra memory at (T, V)
        p = F.softmax(row, dim=-1)
        # p = 0 where l = −inf: zero those logits first so 0 · (−inf) gives 0, not NaN (in backward too)
        out.append(torch.logsumexp(row, dim=-1) - (p * row.masked_fill(p == 0, 0)).sum(-1))
    return torch.stack(out)
