"""Pure PPO math for trl_ext: torch only (no trl, transformers or numpy), so it is testable in isolation.

Shapes: B = batch, T = response length, V = vocab. `response_mask` is bool (B, T), True = a real response
token, left-aligned (real tokens are a prefix of each row).
"""
from .advantages import compute_gae, explained_variance, length_adaptive_lam
from .groups import MULTI_OBJECTIVE_AGGREGATIONS, SCALE_REWARDS, constant_groups, group_advantages
from .kl import KL_ESTIMATORS, estimate_kl
from .kl_control import KL_CONTROLLERS, AdaptiveKLController, FixedKLController, make_kl_controller
from .losses import (
    IMPORTANCE_SAMPLING_LEVELS,
    LOSS_AGG_MODES,
    SAMPLER_CORRECTION_MODES,
    VALUE_LOSS_TYPES,
    aggregate_loss,
    cispo_loss,
    clipped_policy_loss,
    clipped_value_loss,
    entropy_from_logits,
    logprobs_from_logits,
    loss_denominator,
    off_policy_sequence_mask,
    sampler_correction_weights,
    token_logprobs,
    token_mean,
    value_loss,
)
from .masks import (
    check_response_mask,
    last_true_index,
    masked_mean,
    masked_var,
    masked_whiten,
    real_rows,
    response_mask_from_stop,
    top_entropy_mask,
)
from .rewards import shape_rewards
from .turns import compact, compaction, expand, place_turn_rewards, turn_ends

__all__ = [
    "compact",
    "compaction",
    "expand",
    "place_turn_rewards",
    "turn_ends",
    "IMPORTANCE_SAMPLING_LEVELS",
    "MULTI_OBJECTIVE_AGGREGATIONS",
    "SCALE_REWARDS",
    "LOSS_AGG_MODES",
    "SAMPLER_CORRECTION_MODES",
    "VALUE_LOSS_TYPES",
    "aggregate_loss",
    "AdaptiveKLController",
    "FixedKLController",
    "KL_CONTROLLERS",
    "KL_ESTIMATORS",
    "check_response_mask",
    "cispo_loss",
    "clipped_policy_loss",
    "clipped_value_loss",
    "compute_gae",
    "constant_groups",
    "entropy_from_logits",
    "estimate_kl",
    "explained_variance",
    "group_advantages",
    "last_true_index",
    "length_adaptive_lam",
    "logprobs_from_logits",
    "loss_denominator",
    "off_policy_sequence_mask",
    "sampler_correction_weights",
    "make_kl_controller",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "real_rows",
    "response_mask_from_stop",
    "shape_rewards",
    "token_logprobs",
    "top_entropy_mask",
    "token_mean",
    "value_loss",
]
