"""Masked reductions and response-mask helpers.

Shapes: B = batch, T = response length.

`response_mask` is always bool (B, T), True = a real response token. Responses are left-aligned: the real tokens
of a row are a prefix, padding comes after. Reductions here use `torch.where`, so NaN/inf sitting in padding never
leaks into a result.
"""
from collections.abc import Callable

import torch


def _check_mask(values: torch.Tensor, mask: torch.Tensor, name: str = "mask") -> None:
    if mask.dtype != torch.bool:
        raise ValueError(f"{name} must be a bool tensor, got dtype {mask.dtype}; pass `{name}.bool()`")
    if mask.shape != values.shape:
        raise ValueError(
            f"{name} has shape {tuple(mask.shape)} but values have shape {tuple(values.shape)}; they must match"
        )


def check_response_mask(response_mask: torch.Tensor, shape: torch.Size | None = None) -> None:
    """Raise ValueError unless `response_mask` is a bool (B, T) tensor whose True entries are a prefix of each row.

    Args:
        response_mask: (B, T) bool.
        shape: the (B, T) shape it must have, if given.
    """
    if response_mask.dtype != torch.bool:
        raise ValueError(f"response_mask must be bool, got dtype {response_mask.dtype}; pass `response_mask.bool()`")
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be 2-D (B, T), got shape {tuple(response_mask.shape)}")
    if shape is not None and response_mask.shape != shape:
        raise ValueError(f"response_mask has shape {tuple(response_mask.shape)}, expected {tuple(shape)}")
    # left-aligned: no True may follow a False in the same row
    gaps = response_mask[:, 1:] & ~response_mask[:, :-1]
    if gaps.any():
        rows = gaps.any(1).nonzero().flatten().tolist()
        raise ValueError(
            f"response_mask rows {rows} are not left-aligned (a True follows a False); real tokens must be a "
            "prefix of each row, padding after"
        )


def real_rows(ids: torch.Tensor, mask: torch.Tensor) -> list[list[int]]:
    """(B, L) ids and bool mask -> the ids where the mask is True, one list per row: two device-to-host copies for
    the whole batch (tokenizers and engines take lists), not one per row."""
    return [[i for i, keep in zip(row, keep_row) if keep] for row, keep_row in zip(ids.tolist(), mask.tolist())]


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None,
                strict: bool = True) -> torch.Tensor:
    """Mean of `values` over entries where `mask` is True.

    Args:
        values: any shape, e.g. (B, T).
        mask: bool, same shape as values.
        dim: reduce only along this dim (e.g. 1 -> (B,) per-row means); None -> 0-dim mean over everything.
        strict: check that every reduced slice selects an entry. The check reads a device value on the host (a GPU
            stall); the training step's statistics pass False (their masks always select a token), where an empty
            slice gives nan.

    Raises ValueError (strict) if the mask (or, with `dim`, any slice of it) has no True entry: that mean is undefined.
    """
    _check_mask(values, mask)
    count = mask.sum() if dim is None else mask.sum(dim)
    if strict and (count == 0).any():
        where = "" if dim is None else f" in some slice along dim={dim}"
        raise ValueError(f"masked_mean: the mask selects no entries{where}; every reduced slice needs a True")
    masked = torch.where(mask, values, 0)
    return (masked.sum() if dim is None else masked.sum(dim)) / count


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over entries where `mask` is True (0-dim).

    Args:
        values: any shape, e.g. (B, T).
        mask: bool, same shape as values.
        unbiased: apply Bessel's correction n / (n − 1). Needs n >= 2; with n == 1 it raises ValueError (pass
            unbiased=False, which gives 0).
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean).square(), mask)
    if unbiased:
        n = int(mask.sum())
        if n == 1:
            raise ValueError("masked_var(unbiased=True) needs at least 2 selected entries, the mask has 1; "
                             "pass unbiased=False (variance 0)")
        variance = variance * (n / (n - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  all_reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """(x − mean) · rsqrt(var + 1e-8) over the masked entries, as in TRL; the mean is added back if not shift_mean.

    Args:
        values: any shape, e.g. (B, T).
        mask: bool, same shape as values.
        shift_mean: if False, the result keeps the original mean (only the scale is normalised).
        all_reduce_sum: with several processes, a function returning the sum of a tensor over all of them (e.g.
            `lambda t: accelerator.reduce(t, "sum")`): the mean and variance are then those of every process's
            masked entries together, so N processes whiten like one process holding the whole batch (TRL whitens
            each process's share on its own).

    Returns:
        same shape as values; 0 outside the mask (TRL leaves whitened padding there; callers zero it anyway).
        The variance is unbiased when the mask has >= 2 entries. With exactly one entry the variance is taken
        as 0 (biased), so that entry becomes 0 (or its own value if not shift_mean): no NaN.
    """
    # https://github.com/huggingface/trl/blob/v0.11.0/trl/core.py (masked_whiten)
    _check_mask(values, mask)
    if all_reduce_sum is None:
        n = int(mask.sum())
        mean, var = masked_mean(values, mask), masked_var(values, mask, unbiased=n > 1)
    else:
        totals = all_reduce_sum(torch.stack([torch.where(mask, values, 0).sum(), mask.sum().to(values.dtype)]))
        n = totals[1]
        if not n > 0:
            raise ValueError("masked_whiten: the mask selects no entries on any process")
        mean = totals[0] / n
        squares = all_reduce_sum(torch.where(mask, (values - mean).square(), 0).sum())
        var = squares / (n - 1) if n > 1 else squares / n
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0)


def last_true_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the rightmost True in each row, found positionally.

    Args:
        mask: (B, T) bool.

    Returns:
        (B,) long. Raises ValueError if a row has no True.
    """
    if mask.dtype != torch.bool or mask.dim() != 2:
        raise ValueError(f"mask must be a 2-D bool tensor, got dtype {mask.dtype} shape {tuple(mask.shape)}")
    empty = ~mask.any(1)
    if empty.any():
        raise ValueError(f"rows {empty.nonzero().flatten().tolist()} of the mask have no True entry; "
                         "every response needs at least one real token")
    T = mask.shape[1]
    # argmax returns the first maximum, so on the flipped row it finds the last True
    return T - 1 - mask.long().fliplr().argmax(1)


def response_mask_from_stop(responses: torch.Tensor, stop_token_id: int | None) -> torch.Tensor:
    """Mark real response tokens: everything up to AND INCLUDING the first `stop_token_id` in each row.

    Pad tokens are never consulted. If pad == EOS, padding after the EOS is excluded only because the first EOS
    ends the response; a pad id that differs from the stop token and is sampled mid-response stays a real token.

    Args:
        responses: (B, T) integer token ids.
        stop_token_id: the stop (EOS) token id, or None (no stop token: every position is real).

    Returns:
        (B, T) bool; all True in a row where the stop token never occurs (cut at the length cap).
    """
    if responses.dim() != 2 or responses.dtype.is_floating_point or responses.dtype == torch.bool:
        raise ValueError(f"responses must be a 2-D integer tensor of token ids, got dtype {responses.dtype} "
                         f"shape {tuple(responses.shape)}")
    if stop_token_id is None:
        return torch.ones_like(responses, dtype=torch.bool)
    if isinstance(stop_token_id, bool) or not isinstance(stop_token_id, int):
        raise ValueError(f"stop_token_id must be an int or None, got {stop_token_id!r}")
    is_stop = responses == stop_token_id
    # stops strictly before position t; t is real iff there are none
    stops_before = is_stop.long().cumsum(1) - is_stop.long()
    return stops_before == 0


def top_entropy_mask(entropy: torch.Tensor, response_mask: torch.Tensor, quantile: float,
                     population: torch.Tensor | None = None) -> torch.Tensor:
    """The high-entropy "forking" tokens (Wang et al. 2025, https://arxiv.org/abs/2506.01939; TRL's
    top_entropy_quantile): True on the real tokens whose entropy is at least the (1 − quantile) quantile of
    `population`, so about `quantile` of the tokens are kept.

    Args:
        entropy: (B, T) per-token entropy.
        response_mask: (B, T) bool.
        quantile: in (0, 1]; 1 keeps every real token.
        population: 1-D entropies the threshold is taken over (every process's real tokens); None: this batch's.

    Returns:
        (B, T) bool.
    """
    if not 0 < quantile <= 1:
        raise ValueError(f"top_entropy_quantile={quantile} must be in (0, 1] (the 80/20 paper: 0.2)")
    population = entropy[response_mask] if population is None else population
    threshold = torch.quantile(population.float(), 1 - quantile)
    return (entropy >= threshold) & response_mask
