"""Rewards behind one interface: a TRL sequence-classification reward model, or a plain Python function
`(prompts: list[str], completions: list[str]) -> list[float]`.

`score_responses` returns the (B,) scalar score of each query+response. A reward model reads its output at the last
real token (found from the attention mask, positionally), so with pad == EOS it still reads the EOS token, never the
token before it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn as nn

from .core import last_true_index
from .models import scalar_head_outputs, sequence_inputs

RewardFunction = Callable[[list[str], list[str]], list[float]]


def is_reward_function(reward) -> bool:
    """A plain callable, not a torch module."""
    return callable(reward) and not isinstance(reward, nn.Module)


def check_reward_function_output(values, n: int, name: str = "reward function") -> torch.Tensor:
    """Validate what a reward function returned: a list of n finite numbers."""
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError) as e:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.") from e
    if len(values) != n:
        raise ValueError(f"The {name} returned {len(values)} scores for {n} completions; return exactly one score "
                         "per completion, in order.")
    bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        raise ValueError(f"The {name} returned non-finite scores {bad[:5]} (index, value); return finite floats "
                         "(e.g. clip or replace NaN/inf before returning).")
    return torch.tensor(values, dtype=torch.float32)


@torch.no_grad()
def score_responses(reward, tokenizer, queries, query_mask, responses, response_mask) -> torch.Tensor:
    """(B,) float32 score of each query+response (the response cut after its stop token)."""
    if is_reward_function(reward):
        prompts = tokenizer.batch_decode([q[m] for q, m in zip(queries, query_mask)], skip_special_tokens=True)
        completions = tokenizer.batch_decode([r[m] for r, m in zip(responses, response_mask)],
                                             skip_special_tokens=True)
        return check_reward_function_output(reward(prompts, completions), len(prompts)).to(queries.device)
    inputs = sequence_inputs(queries, query_mask, responses, response_mask)
    per_position = scalar_head_outputs(reward, inputs)  # (B, Q+T)
    last = last_true_index(inputs["attention_mask"].bool())  # (B,) the last real token of query+response
    return per_position.gather(1, last[:, None]).squeeze(1).float()
