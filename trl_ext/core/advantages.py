"""Generalised advantage estimation and the explained-variance diagnostic.

Shapes: B = batch, T = response length.
"""

import torch

from .masks import check_response_mask, masked_var


def compute_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (not whitened) GAE advantages and value targets.

    # Schulman et al. 2015, https://arxiv.org/abs/1506.02438, eq. 16
    δ_t = r_t + γ V_{t+1} − V_t,   A_t = δ_t + γλ A_{t+1},
    with V_{t+1} = 0 and A_{t+1} = 0 beyond the last real token (the episode ends there): values and rewards
    in padding are ignored.

    Args:
        rewards: (B, T) per-token rewards.
        values: (B, T) value estimates V_t.
        response_mask: (B, T) bool, left-aligned.
        gamma: discount γ in [0, 1].
        lam: GAE λ in [0, 1], one for all rows or a (B,) tensor of one per row (`length_adaptive_lam`).

    Returns:
        advantages: (B, T), 0 outside the mask.
        returns: (B, T) = advantages + values, 0 outside the mask.
    """
    check_response_mask(response_mask, values.shape)
    if rewards.shape != values.shape:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)} but values has {tuple(values.shape)}; "
                         "they must match")
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} is outside [0, 1]; pick a value in [0, 1]")
    if isinstance(lam, torch.Tensor):
        if lam.shape != values.shape[:1]:
            raise ValueError(f"lam has shape {tuple(lam.shape)}; a per-row λ must be ({values.shape[0]},)")
        if not ((lam >= 0) & (lam <= 1)).all():
            raise ValueError(f"lam has values outside [0, 1]: min {lam.min().item()}, max {lam.max().item()}")
        lam = lam.to(values.dtype)
    elif not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam={lam} is outside [0, 1]; pick a value in [0, 1]")
    values = torch.where(response_mask, values, 0)
    rewards = torch.where(response_mask, rewards, 0)
    T = values.shape[1]
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        next_adv = torch.where(response_mask[:, t], delta + gamma * lam * next_adv, 0)
        advantages[:, t] = next_adv
        next_value = values[:, t]
    returns = advantages + values
    return advantages, returns


def length_adaptive_lam(response_mask: torch.Tensor, alpha: float) -> torch.Tensor:
    """λ_policy of each row from its length l (real tokens): 1 − 1/(α·l), at least 0 (VAPO, Yue et al. 2025,
    https://arxiv.org/abs/2504.05118, eq. 8; α = 0.05 there): short responses get a small λ (low variance), long
    ones a λ near 1 (the reward at the end reaches the early tokens, little bias).

    Args:
        response_mask: (B, T) bool.
        alpha: α > 0.

    Returns:
        (B,) float32 λ in [0, 1).
    """
    if not alpha > 0:
        raise ValueError(f"length_adaptive_alpha={alpha} must be > 0 (VAPO: 0.05)")
    lengths = response_mask.sum(dim=1).float().clamp(min=1)
    return (1 - 1 / (alpha * lengths)).clamp(min=0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """1 − Var(returns − values) / Var(returns) over real tokens: 1 = perfect, 0 = no better than a constant.

    # https://github.com/vwxyzjn/cleanrl/blob/master/cleanrl/ppo.py (explained_var)

    Args:
        values: (B, T) value predictions.
        returns: (B, T) value targets.
        response_mask: (B, T) bool.

    Returns:
        detached 0-dim float tensor. If Var(returns) == 0 (e.g. a single real token, or all targets equal)
        the ratio is undefined and 0.0 is returned instead of NaN (CleanRL/SB3 return NaN there).
    """
    values, returns = values.detach().float(), returns.detach().float()
    var_y = masked_var(returns, response_mask, unbiased=False)
    var_diff = masked_var(returns - values, response_mask, unbiased=False)
    # torch.where avoids a host sync; the 0/0 in the unused branch is discarded
    return torch.where(var_y > 0, 1 - var_diff / var_y, torch.zeros_like(var_y))
