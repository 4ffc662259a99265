"""Per-token PPO rewards: a KL penalty on every real response token plus the scalar score at the end.

Shapes: B = batch, T = response length.
"""

import torch

from .kl import estimate_kl
from .masks import check_response_mask, last_true_index


def shape_rewards(
    scores: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """r_t = −kl_coef · KL_t on real tokens, plus scores[b] on the last real token of row b.

    # Ziegler et al. 2019 (https://arxiv.org/abs/1909.08593), eq. 2; Ouyang et al. 2022 (InstructGPT), eq. 2

    Args:
        scores: (B,) reward-model score of each full response.
        logprobs: (B, T) log π_θ of the sampled response tokens (the sampling policy).
        ref_logprobs: (B, T) log π_ref of the same tokens.
        response_mask: (B, T) bool, left-aligned, at least one True per row.
        kl_coef: β >= 0, weight of the per-token KL penalty.
        estimator: KL estimator name, see kl.KL_ESTIMATORS.

    Returns:
        rewards: (B, T), 0 outside the mask.
        kl: (B, T) per-token KL estimate, 0 outside the mask.
    """
    check_response_mask(response_mask, logprobs.shape)
    if scores.shape != (logprobs.shape[0],):
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected ({logprobs.shape[0]},): one score per row")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef} is negative, which would reward divergence from the reference; "
                         "use kl_coef >= 0")
    kl = torch.where(response_mask, estimate_kl(logprobs, ref_logprobs, estimator), 0)
    rewards = -kl_coef * kl
    last = last_true_index(response_mask)
    rows = torch.arange(rewards.shape[0], device=rewards.device)
    # the terminal reward: on the last real response token (the stop token if the response stopped,
    # the last sampled token if it was cut at the length cap)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, kl
