"""Padding-free forwards (`PPOConfig.padding_free`): the real tokens of a batch of rows as one sequence.

`Packing` takes the padded layout every other part of the trainer uses ((B, L) ids with an attention mask, the last T
columns the response) and gives the model one (1, N) sequence of the N real tokens, row after row, with position ids
that restart at 0 in each row and no attention mask: transformers then builds attention within each row from the
position ids alone (FlashAttention varlen on GPUs; sdpa and eager take a block-diagonal mask). The outputs come back
into the padded layout (`unpack`, zeros at padding) or, for the positions that predict response tokens
(`keep`: R of them, one per real response token), straight to (B, T) (`responses`), so no (B, T, V) logits are
built. `Padded` answers the same calls for rows left padded (each a no-op or a slice), so the rollout and the
update pick one of the two once (`row_layout`) and never branch on `padding_free`. `check_padding_free` runs a model
both ways once and refuses one whose attention ignores the position ids.

Shapes: B = rows, L = Q + T, N = real tokens of the rows, R = real response tokens.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn as nn

from ..core import token_logprobs
from .forward import LOGPROB_CHUNK, _underlying, lm_logits, position_ids_from_mask
from .value import probe_batch


class Packing:
    """The real tokens of (B, L) rows as one (1, N) sequence, and the way back. `response_mask`: (B, T) of the last T
    columns (a prefix of each row's response: real up to and including the stop token); None for passes that read
    no response positions (a reward model's last token)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 response_mask: torch.Tensor | None = None):
        self.real = attention_mask.bool()  # (B, L)
        self.response_mask = None if response_mask is None else response_mask.bool()
        self.lengths = self.real.sum(1)  # (B,)
        self.inputs = {"input_ids": input_ids[self.real][None], "attention_mask": None,
                       "position_ids": position_ids_from_mask(self.real)[self.real][None]}
        if self.response_mask is not None:
            B, L = self.real.shape
            T = self.response_mask.shape[1]
            # the position before each real response token predicts it: columns L-T-1 .. L-2 of the padded row
            predicts = torch.zeros_like(self.real)
            predicts[:, L - T - 1 : L - 1] = self.response_mask
            self.keep = predicts[self.real].nonzero().squeeze(1)  # (R,) indices into the packed sequence
            self.targets = self.inputs["input_ids"][0, self.keep + 1]  # (R,) the response tokens they predict

    @staticmethod
    def of(inputs: dict, response_mask: torch.Tensor | None = None) -> Packing:
        """The packing of `sequence_inputs`' padded inputs (or any ids + attention mask)."""
        return Packing(inputs["input_ids"], inputs["attention_mask"], response_mask)

    @property
    def num_tokens(self) -> int:
        return self.inputs["input_ids"].shape[1]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L, ...) -> (1, N, ...): the real positions of a padded-layout tensor."""
        return x[self.real][None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) -> (B, L, ...) in the padded layout, zeros at padding."""
        out = x.new_zeros(*self.real.shape, *x.shape[2:])
        out[self.real] = x[0]
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
        """(1, N) per-position outputs (a value head's) -> (B, T): at the position before each response token."""
        return self.responses(x[0, self.keep])

    def last_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) -> (B, ...): each row's last real token."""
        return x[0, self.lengths.cumsum(0) - 1]

    # the calls `Padded` answers too
    @property
    def token_ids(self) -> torch.Tensor:
        """(1, R): the response tokens the `keep` positions predict."""
        return self.targets[None]

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The logits a forward with logits_to_keep=`keep` returned: (1, R, V), already those of the responses."""
        return logits

    def per_response(self, x: torch.Tensor) -> torch.Tensor:
        """(1, R) per-token values of `response_logits` -> (B, T), zeros after each row's stop token."""
        return self.responses(x[0])

    def model_logprobs(self, model: nn.Module, temperature: float) -> torch.Tensor:
        """(B, T) fp32 log-probs of the response tokens under `model`, from one packed forward."""
        return self.logprobs(lm_logits(model, self.inputs, self.keep), temperature)


class Padded:
    """Rows left as they are, (B, L) with the last T columns the response (`padding_free=False`): `Packing`'s calls,
    each a no-op or a slice. `inputs`: `sequence_inputs`' (None where only the losses run: `of_rollout`); `token_ids`
    the (B, T) response ids the model reads (id 0 after the stop token)."""

    def __init__(self, inputs: dict | None, token_ids: torch.Tensor):
        self.inputs, self.token_ids = inputs, token_ids
        self.T = token_ids.shape[1]
        self.keep = self.T + 1  # logits_to_keep: the T positions that predict response tokens, and the last

    @staticmethod
    def of(inputs: dict, response_mask: torch.Tensor | None = None) -> Padded:
        """`Packing.of`'s counterpart: the rows of `sequence_inputs`' inputs, the last T columns the response."""
        return Padded(inputs, inputs["input_ids"][:, -response_mask.shape[1]:])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def response_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """(B, T+1 or L, V) -> (B, T, V): the positions that predict the response tokens."""
        return logits[:, -self.T - 1 : -1]

    def per_response(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def logprobs(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(B, T+1 or L, V) logits -> (B, T) fp32 log-probs of the response tokens."""
        return token_logprobs(self.response_logits(logits), self.token_ids, temperature, LOGPROB_CHUNK)

    def values(self, x: torch.Tensor) -> torch.Tensor:
        """(B, L) per-position outputs -> (B, T): at the position before each response token."""
        return x[:, -self.T - 1 : -1]

    def model_logprobs(self, model: nn.Module, temperature: float) -> torch.Tensor:
        return self.logprobs(lm_logits(model, self.inputs, self.keep), temperature)


def row_layout(padding_free: bool):
    """How the rollout and the update lay rows out for the models, chosen once: `Packing.of` or `Padded.of`."""
    return Packing.of if padding_free else Padded.of


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
