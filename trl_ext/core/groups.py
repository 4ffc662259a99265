"""Groups of completions of one prompt (`num_generations` consecutive rows): GRPO's group-relative advantage and
DAPO's test for a group that carries no signal.

Shapes: B = rows (a multiple of G = num_generations), S = reward sources.
"""

from collections.abc import Callable

import torch

SCALE_REWARDS = ("group", "batch", "none")  # the group advantage's divisor (TRL's GRPO values)
MULTI_OBJECTIVE_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")  # TRL's GRPO values
STD_EPS = 1e-4  # TRL's: (r − mean) / (std + 1e-4)


def _grouped(x: torch.Tensor, num_generations: int) -> torch.Tensor:
    if x.shape[0] % num_generations:
        raise ValueError(f"{x.shape[0]} rows do not split into groups of num_generations={num_generations}")
    return x.reshape(x.shape[0] // num_generations, num_generations, *x.shape[1:])


def group_advantages(
    scores: torch.Tensor,
    num_generations: int,
    scale_rewards: str = "group",
    aggregation: str = "sum_then_normalize",
    source_scores: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """One advantage per completion from its group's scores, as TRL 1.16's GRPOTrainer computes them (Shao et al.
    2024, https://arxiv.org/abs/2402.03300, §4.1.2; GDPO for normalize_then_sum).

    sum_then_normalize: A_i = (r_i − mean_group(r)) / (std + 1e-4), std the group's ('group'), the whole batch's
    ('batch'), or no division ('none'); r = `scores`.
    normalize_then_sum: each source k normalised within its group, (r_ik − mean_k) / (std_k + 1e-4), summed with
    `weights`, then the sum normalised over the batch: (s_i − mean(s)) / (std(s) + 1e-4).
    Every std is unbiased (Bessel's correction, TRL's nanstd).

    Args:
        scores: (B,) each completion's score (the weighted sum of its sources').
        num_generations: G, rows per group; groups are G consecutive rows.
        scale_rewards: one of SCALE_REWARDS (sum_then_normalize only).
        aggregation: one of MULTI_OBJECTIVE_AGGREGATIONS.
        source_scores: (B, S) each source's raw score (normalize_then_sum).
        weights: (S,) the sources' weights (normalize_then_sum).
        gather: the batch statistics' rows: this process's (B,) -> every process's (N·B,); None: this process's.

    Returns:
        (B,) float32 advantages.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards={scale_rewards!r} is not one of {SCALE_REWARDS}")
    gather = gather or (lambda x: x)
    if aggregation == "sum_then_normalize":
        r = scores.float()
        grouped = _grouped(r, num_generations)
        advantages = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
        if scale_rewards == "group":
            std = grouped.std(1, keepdim=True).expand_as(grouped).reshape(-1)
        elif scale_rewards == "batch":
            std = gather(r).std()
        else:
            return advantages
        return advantages / (std + STD_EPS)
    if aggregation != "normalize_then_sum":
        raise ValueError(f"aggregation={aggregation!r} is not one of {MULTI_OBJECTIVE_AGGREGATIONS}")
    if source_scores is None or weights is None:
        raise ValueError("normalize_then_sum needs each source's scores and the sources' weights")
    grouped = _grouped(source_scores.float(), num_generations)  # (B/G, G, S)
    normalised = (grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + STD_EPS)
    summed = (normalised.reshape(-1, source_scores.shape[1]) * weights.to(normalised)).sum(1)
    everyone = gather(summed)
    return (summed - everyone.mean()) / (everyone.std() + STD_EPS)


def constant_groups(scores: torch.Tensor, num_generations: int) -> torch.Tensor:
    """(B,) scores -> (B / G,) bool: True where every completion of the group got the same score (DAPO: such a group
    has no group-relative signal; TRL logs their share as frac_reward_zero_std)."""
    grouped = _grouped(scores, num_generations)
    return torch.isclose(grouped.amax(1), grouped.amin(1))
