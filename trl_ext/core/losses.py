"""PPO clipped surrogate losses and per-token log-prob / entropy from logits.

Shapes: B = batch, T = response length, V = vocab, C = chunk of positions.

Losses are aggregated by `loss_agg_mode` (veRL's names; `aggregate_loss`), token means by default (TRL's rule):
Σ over real tokens / the number of real tokens. By default the denominator is this batch's own; `denominator` gives
that of a whole minibatch spread over micro-batches and processes instead (`loss_denominator`, summed), so each
micro-batch's loss is its share of the minibatch's loss and the shares add up to it whatever the gradient
accumulation and the process count.

Memory: `token_logprobs` and `entropy_from_logits(chunk_size=...)` never hold a full-vocabulary fp32 tensor of
shape (B, T, V): they work on C positions at a time, and `token_logprobs`' backward recomputes the softmax of each
chunk from the (model-dtype) logits instead of keeping an fp32 log-softmax alive until backward.
"""

import torch
import torch.nn.functional as F

from .masks import masked_mean


def token_mean(x: torch.Tensor, mask: torch.Tensor, num_tokens=None) -> torch.Tensor:
    """Σ x over real tokens / `num_tokens` (a number or 0-dim tensor: the real tokens of the whole minibatch); None:
    / this batch's own real tokens (= masked_mean)."""
    return aggregate_loss(x, mask, "token-mean", num_tokens)


LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")  # one ratio per token (PPO) or per sequence (GSPO)


def loss_denominator(response_mask: torch.Tensor, mode: str = "token-mean",
                     max_length: int | None = None) -> torch.Tensor:
    """The denominator D of `aggregate_loss` for this batch (0-dim float): its real tokens ("token-mean"), 1
    ("token-sum"), its sequences ("seq-mean-token-sum", "seq-mean-token-mean") or sequences × `max_length`
    ("seq-mean-token-sum-norm"; default the mask's width). Sum it over the micro-batches and processes of a minibatch
    for the minibatch's D. Sequences: rows with at least one real token."""
    _check_agg_mode(mode)
    mask = response_mask.bool()
    if mode == "token-mean":
        count = mask.sum()
    elif mode == "token-sum":
        count = torch.ones((), device=mask.device)
    else:
        count = mask.any(dim=1).sum()
        if mode == "seq-mean-token-sum-norm":
            count = count * (mask.shape[1] if max_length is None else max_length)
    return count.float()


def aggregate_loss(per_token: torch.Tensor, response_mask: torch.Tensor, mode: str = "token-mean",
                   denominator=None, max_length: int | None = None) -> torch.Tensor:
    """Per-token losses -> one loss, Σ_b Σ_t w_bt · x_bt / D over real tokens:

    # token-mean (TRL, OpenRLHF token level): w = 1, D = real tokens; token-sum: w = 1, D = 1;
    # seq-mean-token-sum: w = 1, D = sequences; seq-mean-token-mean (GRPO's 1/|o_i|; OpenRLHF sample level):
    # w = 1 / (the row's real tokens), D = sequences; seq-mean-token-sum-norm (Dr. GRPO, Liu et al. 2025):
    # w = 1, D = sequences × max_length. veRL's names (verl/trainer/ppo/core_algos.py, agg_loss).

    Args:
        per_token: (B, T).
        response_mask: (B, T) bool.
        mode: one of LOSS_AGG_MODES.
        denominator: D of the whole minibatch (`loss_denominator` summed over micro-batches and processes); None:
            this batch's own.
        max_length: T of seq-mean-token-sum-norm (default the mask's width: the response length).

    Returns:
        0-dim, differentiable.
    """
    if denominator is None:
        denominator = loss_denominator(response_mask, mode, max_length)
    mask = response_mask.bool()
    x = torch.where(mask, per_token, 0)
    if mode == "seq-mean-token-mean":
        x = x / mask.sum(dim=1, keepdim=True).clamp(min=1)
    return x.sum() / denominator


def _check_agg_mode(mode: str) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {LOSS_AGG_MODES}")


def _check_same_shape(response_mask: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, x in tensors.items():
        if x.shape != response_mask.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but response_mask has "
                             f"{tuple(response_mask.shape)}; they must match")


SAMPLER_CORRECTION_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def sampler_correction_weights(
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor:
    """Importance weights for tokens drawn by a sampler that is not exactly the trainer's policy (vLLM, or generate
    under bf16): w = π_old / π_sampler, truncated or masked (TRL's `vllm_importance_sampling_*`; Yao et al. 2025,
    "Your efficient RL framework secretly brings you off-policy RL training": truncated importance sampling).

    # token_*: w_t = exp(log π_old(y_t) − log π_sampler(y_t)); sequence_*: w = exp(Σ_t over real tokens of the same),
    # one weight for the whole row. *_truncate: clamp(w, clip_min, clip_max); *_mask: w outside [clip_min, clip_max]
    # set to 0 (the token or the sequence leaves the loss).

    Args:
        logprobs: (B, T) log π_old of the sampled tokens (the trainer's, from rollout time).
        sampler_logprobs: (B, T) the sampler's log-probs of the same tokens.
        response_mask: (B, T) bool.
        mode: one of SAMPLER_CORRECTION_MODES.
        clip_min, clip_max: bounds (None: unbounded on that side; at least one must be set).

    Returns:
        (B, T) detached weights, 0 outside the mask.
    """
    if mode not in SAMPLER_CORRECTION_MODES:
        raise ValueError(f"mode={mode!r} is not one of {SAMPLER_CORRECTION_MODES}")
    if clip_min is None and clip_max is None:
        raise ValueError("clip_min and clip_max are both None: set clip_max (typical: 3.0) and/or clip_min")
    _check_same_shape(response_mask, logprobs=logprobs, sampler_logprobs=sampler_logprobs)
    with torch.no_grad():
        log_w = torch.where(response_mask, logprobs.double() - sampler_logprobs.double(), 0)
        if mode.startswith("sequence"):
            log_w = log_w.sum(dim=1, keepdim=True).expand_as(log_w)
        w = torch.exp(log_w)
        low = -float("inf") if clip_min is None else clip_min
        high = float("inf") if clip_max is None else clip_max
        if mode.endswith("truncate"):
            w = w.clamp(min=low, max=high)
        else:
            w = torch.where((w < low) | (w > high), 0.0, w)
        return torch.where(response_mask, w, 0.0).to(logprobs.dtype)


def off_policy_sequence_mask(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    threshold: float,
) -> torch.Tensor:
    """Off-policy sequence masking (DeepSeek-V3.2, https://arxiv.org/abs/2512.02556, eq. 9; TRL's GRPO
    `off_policy_mask_threshold`), per token for PPO's per-token advantages: a token leaves the policy loss when its
    advantage is negative and its sequence has drifted: the mean over real tokens of log π_sampler − log π_θ exceeds
    `threshold`. A sample the policy already moves away from is not pushed further.

    # keep_t = (A_t >= 0) or ((1/|o|) Σ_t∈o (log π_sampler(y_t) − log π_θ(y_t)) <= δ)
    # (GRPO's advantage is one per sequence; PPO's GAE advantage is per token, so its sign is taken per token)

    Args:
        advantages: (B, T).
        logprobs: (B, T) log π_θ of the sampled tokens (the current policy; detached here).
        sampler_logprobs: (B, T) log-probs of the policy that sampled them.
        response_mask: (B, T) bool.
        threshold: δ >= 0.

    Returns:
        (B, T) float: 1 keep, 0 masked (0 outside the mask too).
    """
    _check_same_shape(response_mask, advantages=advantages, logprobs=logprobs, sampler_logprobs=sampler_logprobs)
    with torch.no_grad():
        drift = torch.where(response_mask, sampler_logprobs.float() - logprobs.detach().float(), 0)
        mean_drift = drift.sum(1, keepdim=True) / response_mask.sum(1, keepdim=True).clamp(min=1)
        keep = (advantages >= 0) | (mean_drift <= threshold)
        return (keep & response_mask).to(logprobs.dtype)


def _importance_ratio(logprobs, old_logprobs, advantages, response_mask, importance_sampling_level):
    """-> (token log-ratio, the ratio the loss uses, advantages), each 0 on padding, so garbage there cannot reach the
    loss or its gradient. Level "sequence" (GSPO): each row's mean log-ratio on each of its real tokens."""
    if importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
        raise ValueError(f"importance_sampling_level={importance_sampling_level!r} is not one of "
                         f"{IMPORTANCE_SAMPLING_LEVELS}")
    _check_same_shape(response_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    token_log_ratio = torch.where(response_mask, logprobs - old_logprobs, 0)
    log_ratio = token_log_ratio
    if importance_sampling_level == "sequence":
        row_mean = log_ratio.sum(1, keepdim=True) / response_mask.sum(1, keepdim=True).clamp(min=1)
        log_ratio = torch.where(response_mask, row_mean.expand_as(log_ratio), 0)
    return token_log_ratio, torch.exp(log_ratio), torch.where(response_mask, advantages, 0)


def _policy_objective(per_token, clipped, dual, token_log_ratio, ratio, advantages, response_mask, weights,
                      loss_agg_mode, denominator) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The per-token losses weighed and aggregated, and the statistics both objectives report."""
    _check_agg_mode(loss_agg_mode)
    if weights is not None:
        _check_same_shape(response_mask, weights=weights)
        per_token = per_token * weights.detach()
    loss = aggregate_loss(per_token, response_mask, loss_agg_mode, denominator)
    with torch.no_grad():
        ratio_d = ratio.detach()

        def mean(tensor):  # the mask always selects a token: no emptiness check (a host read)
            return masked_mean(tensor, response_mask, strict=False)

        stats = {
            "loss": mean(per_token.detach()),
            "clipfrac": mean(clipped.float()),
            "clipfrac_low": mean((clipped & (advantages < 0)).float()),
            "clipfrac_high": mean((clipped & (advantages > 0)).float()),
            "clipfrac_dual": mean(dual.float()),
            "approxkl": mean(torch.expm1(token_log_ratio) - token_log_ratio),
            "ratio_mean": mean(ratio_d),
            "ratio_max": ratio_d.masked_fill(~response_mask, float("-inf")).max(),
            "ratio_min": ratio_d.masked_fill(~response_mask, float("inf")).min(),
        }
    return loss, stats


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange: float,
    denominator=None,
    weights: torch.Tensor | None = None,
    cliprange_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip policy loss: aggregate of max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)), ρ = π_θ / π_old; with dual-clip,
    min(that, −A·c) where A < 0.

    # Schulman et al. 2017, https://arxiv.org/abs/1707.06347, eq. 7 (negated: a loss to minimise)
    # clip-higher: ε_high > ε_low (DAPO, Yu et al. 2025, https://arxiv.org/abs/2503.14476): low-probability tokens
    #   with A > 0 can grow further before the clip stops them
    # dual-clip (Ye et al. 2020, https://arxiv.org/abs/1912.09729): for A < 0 the loss −A·ρ is bounded by −A·c,
    #   so a huge ratio on a bad token cannot give an unbounded step (veRL clip_ratio_c)
    # sequence level (GSPO, Zheng et al. 2025, https://arxiv.org/abs/2507.18071; TRL's importance_sampling_level):
    #   one ratio per sequence, ρ_b = exp((1/|o_b|) Σ_t log(π_θ/π_old)), for every token of the row, clipped alike

    Args:
        logprobs: (B, T) log π_θ of the sampled tokens (with grad).
        old_logprobs: (B, T) log π_old of the same tokens, from rollout time.
        advantages: (B, T).
        response_mask: (B, T) bool.
        cliprange: ε_low > 0 (and ε_high unless `cliprange_high` is given).
        denominator: the denominator of the aggregation (`aggregate_loss`); None: this batch's own.
        weights: (B, T) per-token weights of the loss (`sampler_correction_weights`); None: all 1.
        cliprange_high: ε_high > 0; None: ε_low.
        clip_ratio_c: dual-clip bound c > 1; None: off.
        loss_agg_mode: one of LOSS_AGG_MODES.
        importance_sampling_level: "token" (PPO) or "sequence" (GSPO: the row's geometric-mean ratio).

    Returns:
        loss: 0-dim, differentiable.
        stats: detached 0-dim tensors: "loss" (this batch's own token mean of the per-token losses, whatever the
            aggregation); "clipfrac" (fraction of real tokens where the clipped term is the active one), split into
            "clipfrac_low" (A < 0, ρ < 1 − ε_low) and "clipfrac_high" (A > 0, ρ > 1 + ε_high); "clipfrac_dual" (A < 0,
            ρ > c: the dual clip active); "approxkl" (k3 estimate of KL(π_old ‖ π_θ) from samples of π_old: with
            log ρ = logprobs − old_logprobs, (ρ − 1) − log ρ, http://joschu.net/blog/kl-approx.html; per token at
            either level); "ratio_mean", "ratio_max", "ratio_min" over real tokens (of the ratio the loss uses).
    """
    if not cliprange > 0:
        raise ValueError(f"cliprange={cliprange} must be > 0 (typical: 0.2)")
    high = cliprange if cliprange_high is None else _clip_high(cliprange_high)
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(f"clip_ratio_c={clip_ratio_c} must be > 1 (typical: 3.0), or None for no dual clip")
    token_log_ratio, ratio, advantages = _importance_ratio(logprobs, old_logprobs, advantages, response_mask,
                                                           importance_sampling_level)
    pg_losses = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + high)
    per_token = torch.max(pg_losses, pg_losses2)
    clipped = (pg_losses2 > pg_losses).detach()  # the clipped term is the active one
    dual = torch.zeros_like(response_mask)
    if clip_ratio_c is not None:
        pg_losses3 = -advantages * clip_ratio_c
        dual = (advantages < 0) & (per_token > pg_losses3)
        per_token = torch.where(advantages < 0, torch.min(per_token, pg_losses3), per_token)
    return _policy_objective(per_token, clipped, dual, token_log_ratio, ratio, advantages, response_mask, weights,
                             loss_agg_mode, denominator)


def cispo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_high: float,
    denominator=None,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO policy loss: aggregate of −sg(min(ρ, 1+ε_high))·A·log π_θ, ρ = π_θ / π_old.

    # MiniMax-M1, Chen et al. 2025, https://arxiv.org/abs/2506.13585, eq. 4; TRL's loss_type="cispo": the ratio,
    #   clipped above and detached, weighs the REINFORCE term: every token keeps its gradient A·∇log π_θ (scaled by
    #   the weight), where PPO's clip zeroes it

    Arguments and statistics as `clipped_policy_loss`'s, with no ε_low and no dual clip: "clipfrac" and
    "clipfrac_high" count the tokens with A > 0 whose weight the cap lowered, "clipfrac_low" and "clipfrac_dual"
    are 0."""
    high = _clip_high(cliprange_high)
    token_log_ratio, ratio, advantages = _importance_ratio(logprobs, old_logprobs, advantages, response_mask,
                                                           importance_sampling_level)
    per_token = -advantages * torch.clamp(ratio, max=1.0 + high).detach() * torch.where(response_mask, logprobs, 0)
    clipped = (ratio.detach() > 1.0 + high) & (advantages > 0)  # the cap lowered the weight
    return _policy_objective(per_token, clipped, torch.zeros_like(response_mask), token_log_ratio, ratio,
                             advantages, response_mask, weights, loss_agg_mode, denominator)


def _clip_high(cliprange_high: float) -> float:
    if not cliprange_high > 0:
        raise ValueError(f"cliprange_high={cliprange_high} must be > 0 (DAPO: 0.28), or None for cliprange")
    return cliprange_high


VALUE_LOSS_TYPES = ("clipped", "mse", "huber")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    loss_type: str = "clipped",
    cliprange_value: float = 0.2,
    huber_delta: float = 1.0,
    denominator=None,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The value loss, aggregated as `aggregate_loss`:

    # "clipped" (TRL, OpenAI baselines ppo2 vpredclipped): ½ · max((V − R)², (V_clip − R)²),
    #   V_clip = V_old + clip(V − V_old, −c, c)
    # "mse": ½ · (V − R)² (OpenRLHF with value_clip unset)
    # "huber": δ-Huber of V − R: ½x² for |x| ≤ δ, δ(|x| − ½δ) beyond (robust to outlier returns)

    Args:
        values: (B, T) current value predictions (with grad).
        old_values: (B, T) value predictions from rollout time (used by "clipped").
        returns: (B, T) value targets.
        response_mask: (B, T) bool.
        loss_type: one of VALUE_LOSS_TYPES.
        cliprange_value: c > 0 ("clipped").
        huber_delta: δ > 0 ("huber").
        denominator: the denominator of the aggregation (`aggregate_loss`); None: this batch's own.
        loss_agg_mode: one of LOSS_AGG_MODES.

    Returns:
        loss: 0-dim, differentiable.
        stats: detached 0-dim tensors "loss" (this batch's own token mean), "clipfrac" (fraction of real tokens
            where the clipped error is larger, i.e. active; 0 for "mse" and "huber", which do not clip),
            "values_mean".
    """
    if loss_type not in VALUE_LOSS_TYPES:
        raise ValueError(f"vf_loss_type={loss_type!r} is not one of {VALUE_LOSS_TYPES}")
    if not cliprange_value > 0:
        raise ValueError(f"cliprange_value={cliprange_value} must be > 0 (typical: 0.2)")
    if not huber_delta > 0:
        raise ValueError(f"vf_huber_delta={huber_delta} must be > 0 (typical: 1.0)")
    _check_agg_mode(loss_agg_mode)
    _check_same_shape(response_mask, values=values, old_values=old_values, returns=returns)
    clipped = torch.zeros_like(response_mask)
    if loss_type == "clipped":
        # clamp(V, V_old ± c) is V_old + clip(V − V_old, ±c) written so that it is V itself inside the range (no
        # subtract-then-add rounding that clipfrac could count as a clip)
        values_clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
        vf_losses1 = (values - returns).square()
        vf_losses2 = (values_clipped - returns).square()
        per_token = 0.5 * torch.max(vf_losses1, vf_losses2)
        clipped = vf_losses2 > vf_losses1
    elif loss_type == "mse":
        per_token = 0.5 * (values - returns).square()
    else:
        per_token = F.huber_loss(values, returns, reduction="none", delta=huber_delta)
    loss = aggregate_loss(per_token, response_mask, loss_agg_mode, denominator)
    with torch.no_grad():
        def mean(tensor):  # the mask always selects a token: no emptiness check (a host read)
            return masked_mean(tensor, response_mask, strict=False)

        stats = {"loss": mean(per_token.detach()), "clipfrac": mean(clipped.float()),
                 "values_mean": mean(values.detach())}
    return loss, stats


def clipped_value_loss(values, old_values, returns, response_mask, cliprange_value: float, denominator=None,
                       loss_agg_mode: str = "token-mean"):
    """`value_loss` with loss_type="clipped" (TRL's value loss)."""
    return value_loss(values, old_values, returns, response_mask, "clipped", cliprange_value,
                      denominator=denominator, loss_agg_mode=loss_agg_mode)


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


def _entropy_rows(x: torch.Tensor) -> torch.Tensor:
    """(..., V) -> (...): logsumexp(x) − Σ_v softmax(x)_v · x_v."""
    p = F.softmax(x, dim=-1)
    # p = 0 where l = −inf: zero those logits first so 0 · (−inf) gives 0, not NaN (in backward too)
    return torch.logsumexp(x, dim=-1) - (p * x.masked_fill(p == 0, 0)).sum(-1)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0,
                        chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) at each position: logsumexp(l) − Σ_v softmax(l)_v · l_v.

    Args:
        logits: (B, T, V); −inf entries (masked vocabulary) are allowed and contribute 0.
        temperature: > 0; the logits are divided by it (chunk by chunk, never as a full copy).
        chunk_size: None: one row of the batch at a time, in the logits' dtype (differentiable). An int C: C
            positions at a time, each chunk upcast to fp32 (fp64 stays fp64), so the peak extra memory is one
            (C, V) fp32 tensor; returns fp32 (call it under `torch.no_grad()` for a logged statistic).

    Returns:
        (B, T).
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be (B, T, V), got shape {tuple(logits.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if chunk_size is None:
        # one row at a time keeps the peak extra memory at (T, V)
        return torch.stack([_entropy_rows(row / temperature if temperature != 1.0 else row) for row in logits])
    _check_chunk_size(chunk_size)
    B, T, _ = logits.shape
    out = torch.empty(B, T, dtype=_upcast(logits.dtype), device=logits.device)
    for b, s in _position_chunks(B, T, chunk_size):
        out[b, s] = _entropy_rows(logits[b, s].to(out.dtype) / temperature)
    return out


# ---------------------------------------------------------------- chunked log-probs of the sampled tokens


def _upcast(dtype: torch.dtype) -> torch.dtype:
    """fp16/bf16 -> fp32; fp32/fp64 unchanged."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int (positions per chunk, e.g. 64)")


def _position_chunks(B: int, T: int, chunk_size: int):
    """(row, slice of positions) pairs covering (B, T), C positions at a time, row by row: slicing one row keeps
    a view of a non-contiguous (B, T, V) slice (e.g. logits[:, Q − 1 : −1]) without copying it."""
    for b in range(B):
        for t0 in range(0, T, chunk_size):
            yield b, slice(t0, min(t0 + chunk_size, T))


class _TokenLogprobs(torch.autograd.Function):
    """log softmax(logits / τ)[token], chunk by chunk; backward recomputes each chunk's softmax.

    d log p_y / d l_v = (1[v = y] − softmax(l / τ)_v) / τ, so backward needs only the logits and the tokens."""

    @staticmethod
    def forward(ctx, logits, tokens, temperature, chunk_size):
        B, T, _ = logits.shape
        out = torch.empty(B, T, dtype=_upcast(logits.dtype), device=logits.device)
        for b, s in _position_chunks(B, T, chunk_size):
            x = logits[b, s].to(out.dtype) / temperature  # (C, V)
            out[b, s] = x.gather(-1, tokens[b, s, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, tokens)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        logits, tokens = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        B, T, _ = logits.shape
        for b, s in _position_chunks(B, T, ctx.chunk_size):
            g = grad_out[b, s, None].to(_upcast(logits.dtype))  # (C, 1)
            x = logits[b, s].to(g.dtype) / ctx.temperature
            chunk = -F.softmax(x, dim=-1) * g
            chunk.scatter_add_(-1, tokens[b, s, None], g)
            grad[b, s] = (chunk / ctx.temperature).to(grad.dtype)
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int = 64) -> torch.Tensor:
    """log softmax(logits / temperature)[token] at each position, C = `chunk_size` positions at a time.

    # gather − logsumexp, after TRL's selective_log_softmax (trl/trainer/utils.py), with a backward that
    # recomputes the softmax chunk by chunk

    Neither pass materialises a (B, T, V) fp32 tensor: the forward upcasts one (C, V) chunk at a time, and autograd
    keeps only the logits themselves (in their dtype) and the tokens, not an fp32 log-softmax. The logits' gradient
    is (B, T, V) in their dtype, as for any consumer of them.

    Args:
        logits: (B, T, V) raw logits (any float dtype; a non-contiguous slice is fine and is not copied).
        tokens: (B, T) integer ids in [0, V).
        temperature: > 0; the sampling temperature the logits are divided by.
        chunk_size: positions per chunk (C).

    Returns:
        (B, T) log-probs in fp32 (fp64 for fp64 logits), differentiable with respect to the logits.
    """
    if logits.dim() != 3 or tokens.shape != logits.shape[:2]:
        raise ValueError(f"logits must be (B, T, V) and tokens (B, T) with the same B, T; got logits "
                         f"{tuple(logits.shape)} and tokens {tuple(tokens.shape)}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    _check_chunk_size(chunk_size)
    return _TokenLogprobs.apply(logits, tokens.long(), float(temperature), chunk_size)
