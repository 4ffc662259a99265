"""Padding-free forwards (`PPOConfig.padding_free`): the real tokens of a batch of rows as packed sequences.

`Packing` takes the padded layout every other part of the trainer uses ((B, L) ids with an attention mask, the last T
columns the response) and gives the model the N real tokens, row after row, in k packed sequences of C positions
each ((k, C) ids), with position ids that restart at 0 in each row and no attention mask: transformers then builds
attention within each row from the position ids alone (FlashAttention varlen on GPUs; sdpa and eager take a
block-diagonal mask per sequence). Rows go into the sequences first-fit, longest first, each sequence at most twice
the longest row (all rows in one sequence where they fit): sdpa's block mask costs C² per sequence, so one sequence
of many rows would make the attention quadratic in the whole batch. A sequence's unused tail holds id 0 as a row of
its own, computed and never read. The outputs come back into the padded layout (`unpack`, zeros at padding) or, for
the positions that predict response tokens (`keep`: R of them, one per real response token), straight to (B, T)
(`responses`), so no (B, T, V) logits are built: `models.forward.lm_logits` hands the output layer the hidden states
of the `keep` positions alone. `check_padding_free` runs a model both ways once and refuses one whose attention
ignores the position ids.

Shapes: B = rows, L = Q + T, N = real tokens of the rows, k × C = the packed sequences, R = real response tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from ..core import token_logprobs
from .forward import LOGPROB_CHUNK, _underlying, position_ids_from_mask
from .value import probe_batch


def pack_rows(lengths: list[int]) -> tuple[list[list[int]], int]:
    """Rows of `lengths` real tokens into packed sequences: (the rows of each sequence, in their order, the length C
    of every sequence: the fullest one's). Each holds at most twice the longest row (all the rows where they fit in
    that); first fit, longest row first."""
    capacity = min(2 * max(lengths), sum(lengths))
    sequences: list[list[int]] = []
    used: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = next((k for k in range(len(sequences)) if used[k] + lengths[row] <= capacity), len(sequences))
        if k == len(sequences):
            sequences.append([])
            used.append(0)
        sequences[k].append(row)
        used[k] += lengths[row]
    return [sorted(rows) for rows in sequences], max(used)


class Packing:
    """The real tokens of (B, L) rows as (k, C) packed sequences, and the way back. `response_mask`: (B, T) of the
    last T columns (a prefix of each row's response: real up to and including the stop token); None for passes that
    read no response positions (a reward model's last token)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 response_mask: torch.Tensor | None = None):
        self.real = attention_mask.bool()  # (B, L)
        self.response_mask = None if response_mask is None else response_mask.bool()
        self.lengths = self.real.sum(1)  # (B,)
        lengths = self.lengths.tolist()
        sequences, capacity = pack_rows(lengths)
        # where each row starts in the flattened (k·C) layout; the real tokens, row after row, go there in order
        starts = [0] * len(lengths)
        tails = []  # (start, length) of each sequence's unused tail
        for k, rows in enumerate(sequences):
            at = k * capacity
            for row in rows:
                starts[row] = at
                at += lengths[row]
            tails.append((at, (k + 1) * capacity - at))
        device = input_ids.device
        positions = position_ids_from_mask(self.real)[self.real]  # (N,) 0.. in each row
        row_of = torch.arange(len(lengths), device=device)[:, None].expand_as(self.real)[self.real]  # (N,)
        self.flat = torch.tensor(starts, device=device)[row_of] + positions  # (N,) each real token's packed place
        self.shape = (len(sequences), capacity)
        ids = input_ids.new_zeros(len(sequences) * capacity)
        ids[self.flat] = input_ids[self.real]
        position_ids = torch.zeros(len(sequences) * capacity, dtype=torch.long, device=device)
        position_ids[self.flat] = positions
        for start, length in tails:  # a tail is a row of its own: positions restart there too
            position_ids[start : start + length] = torch.arange(length, device=device)
        self.inputs = {"input_ids": ids.view(self.shape), "attention_mask": None,
                       "position_ids": position_ids.view(self.shape)}
        if self.response_mask is not None:
            B, L = self.real.shape
            T = self.response_mask.shape[1]
            # the position before each real response token predicts it: columns L-T-1 .. L-2 of the padded row
            predicts = torch.zeros_like(self.real)
            predicts[:, L - T - 1 : L - 1] = self.response_mask
            self.keep = self.flat[predicts[self.real]]  # (R,) indices into the flattened packed sequences
            self.targets = ids[self.keep + 1]  # (R,) the response tokens they predict (the next place in the row)

    @staticmethod
    def of(inputs: dict, response_mask: torch.Tensor | None = None) -> Packing:
        """The packing of `sequence_inputs`' padded inputs (or any ids + attention mask)."""
        return Packing(inputs["input_ids"], inputs["attention_mask"], response_mask)

    @property
    def num_tokens(self) -> int:
        """N: the real tokens packed."""
        return self.flat.shape[0]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (k, C, ...): a padded-layout tensor's real positions in their packed places (zeros in the
        tails)."""
        out = x.new_zeros(self.shape[0] * self.shape[1], *x.shape[2:])
        out[self.flat] = x[self.real]
        return out.view(*self.shape, *x.shape[2:])

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(k, C, ...) -> (B, L, ...) in the padded layout, zeros at padding."""
        out = x.new_zeros(*self.real.shape, *x.shape[2:])
        out[self.real] = x.reshape(-1, *x.shape[2:])[self.flat]
        return out

    def responses(self, x: torch.Tensor) -> torch.Tensor:
        """(R, ...) values at the `keep` positions -> (B, T, ...), zeros after each row's stop token."""
        out = x.new_zeros(*self.response_mask.shape, *x.shape[1:])
        out[self.response_mask] = x
        return out

    def logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(1, R, V) logits at the `keep` positions -> (B, T) fp32 log-probs of the response tokens."""
        return self.responses(token_logprobs(logits, self.targets[None], temperature, LOGPROB_CHUNK)[0])

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """(k, C) per-position outputs (a value head's) -> (B, T): at the position before each response token."""
        return self.responses(x.reshape(-1)[self.keep])

    def last_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(k, C, ...) -> (B, ...): each row's last real token."""
        return x.reshape(-1, *x.shape[2:])[self.flat[self.lengths.cumsum(0) - 1]]


def check_padding_free(model: nn.Module, role: str, forward) -> None:
    """Refuse a model whose padded and packed forwards differ (its attention does not read packed position ids):
    `forward(model, inputs) -> (B or 1, L or N, ...)` runs it on a 2-row probe, left-padded as the trainer's rows."""
    config = getattr(_underlying(model), "config", None)
    vocab = getattr(config, "vocab_size", None) or 16
    device = next(model.parameters()).device
    inputs, _ = probe_batch(vocab, device)
    packing = Packing.of(inputs)
    params = list(model.parameters())
    gathered = nullcontext()
    if any(hasattr(p, "ds_id") for p in params):  # partitioned by ZeRO-3 as it loaded: whole for the probe
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(params)
    with torch.no_grad(), gathered:
        out = forward(model, inputs)
        padded, packed = out.float(), packing.unpack(forward(model, packing.inputs)).float()
    mask = packing.real.reshape(*packing.real.shape, *[1] * (padded.dim() - 2))
    # rounding differs between the two layouts (SmolLM2-135M's fp32 logits: 2e-4 of a largest 36); a row that sees
    # the row before it differs by a fraction of the outputs' scale
    scale = (padded * mask).abs().max().item()
    tolerance = max(1e-3, 8 * torch.finfo(out.dtype).eps) * scale + 1e-5
    if padded.shape != packed.shape or (padded * mask - packed * mask).abs().max().item() > tolerance:
        impl = getattr(config, "_attn_implementation", None)
        raise ValueError(
            f"padding_free=True: the {role} ({type(_underlying(model)).__name__}, attn_implementation={impl!r}) "
            "gives different outputs on packed rows than on padded ones: its attention does not separate sequences "
            "by their position ids (transformers does it for models that build their masks with "
            "`create_causal_mask`: sdpa, eager, flash_attention_2). Use such a model, or set padding_free=False.")
