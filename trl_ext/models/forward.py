"""Forward passes with real attention masks: the inputs of prompt + response, the logits of the positions that
predict response tokens only (`logits_to_keep`, where the model takes it), and the log-probs of the response
tokens (`trl_ext.core.token_logprobs`: chunks of positions, no (B, T, V) fp32 tensor). Nothing compares ids with the
pad id.

Shapes: B = batch, Q = query (prompt) length, T = response length, V = vocabulary.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn as nn

from ..core import token_logprobs

LOGPROB_CHUNK = 64  # positions per chunk in log-prob / entropy computations: one (64, V) fp32 tensor at a time


def _underlying(model: nn.Module) -> nn.Module:
    """The transformers model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def output_device(model: nn.Module) -> torch.device:
    """Where the model's final hidden states come out: its output layer's device (lm_head; the last parameter's
    for a model without one). With `device_map="auto"` over several GPUs that is the last one, not the device of the
    first parameter (the embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        return head.weight.device
    return list(model.parameters())[-1].device


def accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the causal LM computes logits for the last k positions only when given `logits_to_keep=k`."""
    return _forward_accepts_logits_to_keep(type(_underlying(model)))


@functools.cache
def _forward_accepts_logits_to_keep(model_class: type) -> bool:  # inspect.signature is slow: once per class
    try:
        return "logits_to_keep" in inspect.signature(model_class.forward).parameters
    except (TypeError, ValueError):
        return False


def lm_logits(model: nn.Module, inputs: dict, logits_to_keep: int | torch.Tensor = 0) -> torch.Tensor:
    """(B, L', V) logits: the last `logits_to_keep` positions where the model supports it (0: all L positions), or
    the positions a 1-D index tensor names (a packed sequence's, `Packing.keep`: (1, R, V), on any model)."""
    indexed = isinstance(logits_to_keep, torch.Tensor)
    if not (indexed or logits_to_keep) or not accepts_logits_to_keep(model):
        logits = model(**inputs, use_cache=False).logits
        return logits[:, logits_to_keep] if indexed else logits
    return model(**inputs, use_cache=False, logits_to_keep=logits_to_keep).logits


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool/long -> (B, L) long: 0 at the first real token, counting real tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def model_input_ids(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Token ids a model may read: masked-out positions (padding, anything after the stop token) hold id 0, so a pad id
    outside the embedding table (a `[PAD]` added to the tokenizer but not to the model, as TRL's scripts do) never
    reaches the model. TRL does the same (`masked_fill(~attention_mask, 0)` before every forward)."""
    return input_ids.masked_fill(~attention_mask.bool(), 0)


def sequence_inputs(queries, query_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """Model inputs for query+response: (B, Q+T) ids, attention mask and position ids. Tokens after the stop token
    (response_mask False) are masked out, so nothing reads them; masked positions hold id 0 (`model_input_ids`)."""
    attention_mask = torch.cat([query_mask, response_mask], dim=1).long()
    input_ids = model_input_ids(torch.cat([queries, responses], dim=1), attention_mask)  # (B, Q+T)
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask)}


def response_logprobs(model: nn.Module, inputs: dict, responses: torch.Tensor, temperature: float) -> torch.Tensor:
    """(B, T) fp32 log π(response token) under softmax(logits / temperature), without a (B, T, V) fp32 tensor.
    `inputs` from `sequence_inputs`; the tokens are its last T ids (positions after the stop token hold id 0 there,
    where `responses` may hold a pad id the model does not have). Padding-free: `Packing.model_logprobs`."""
    T = responses.shape[1]
    logits = lm_logits(model, inputs, T + 1)  # (B, T+1, V) or (B, Q+T, V)
    return token_logprobs(logits[:, -T - 1 : -1], inputs["input_ids"][:, -T:], temperature, LOGPROB_CHUNK)
