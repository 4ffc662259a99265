"""Multi-turn rollouts: the model's tokens among tool and environment tokens.

A multi-turn response is the conversation after the prompt: the model's turns and, between them, tokens the model did
not generate (tool results, environment feedback, the chat template's headers). `model_mask` (B, T) bool marks the
model's tokens; they need not be contiguous. PPO's recursions run over the model's tokens only: `compaction` moves
each row's model tokens to the front, in order (a left-aligned mask, what `shape_rewards` and `compute_gae` take),
and `expand` puts the results back, so the GAE's discount γλ applies once per model token and never across a tool
result's tokens.
"""

from __future__ import annotations

import torch


def compaction(model_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) bool model mask -> (B, T) long gather index that brings each row's model tokens to its front in order,
    and the (B, T) bool left-aligned mask of the compacted rows (True on the first n_b positions)."""
    B, T = model_mask.shape
    positions = torch.arange(T, device=model_mask.device).expand(B, T)
    # model tokens keep their position as sort key, the others go after all of them (stable: order kept)
    key = torch.where(model_mask, positions, positions + T)
    index = key.argsort(dim=1, stable=True)
    compact_mask = positions < model_mask.sum(1, keepdim=True)
    return index, compact_mask


def compact(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """(B, T) tensor -> its values at `index` (`compaction`): the model tokens' values first."""
    return x.gather(1, index)


def expand(y: torch.Tensor, index: torch.Tensor, compact_mask: torch.Tensor) -> torch.Tensor:
    """The inverse of `compact`: (B, T) compacted values -> the original layout, 0 at the positions that are not the
    model's."""
    out = torch.zeros_like(y)
    return out.scatter(1, index, torch.where(compact_mask, y, torch.zeros_like(y)))


def turn_ends(model_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the last token of each model turn (a model token not followed by another model token)."""
    following = torch.nn.functional.pad(model_mask[:, 1:], (0, 1), value=False)
    return model_mask & ~following


def place_turn_rewards(turn_rewards: list[list[float]], model_mask: torch.Tensor) -> torch.Tensor:
    """Per-turn rewards -> (B, T) float32 with turn k's reward on the last token of model turn k of its row.

    Args:
        turn_rewards: one list per row, one float per model turn (0.0 for a turn that earned nothing).
        model_mask: (B, T) bool.
    """
    ends = turn_ends(model_mask)
    out = torch.zeros(model_mask.shape, dtype=torch.float32, device=model_mask.device)
    for b, rewards in enumerate(turn_rewards):
        positions = ends[b].nonzero().flatten()
        if len(positions) != len(rewards):
            raise ValueError(f"row {b} has {len(positions)} model turns but {len(rewards)} turn rewards: give one "
                             "reward per model turn.")
        if rewards:
            out[b, positions] = torch.tensor(rewards, dtype=torch.float32, device=out.device)
    return out
