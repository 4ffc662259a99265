"""The order in which prompts are used: deterministic from the seed and the iteration number, so a resumed run
draws exactly the batches the uninterrupted run would have."""

from __future__ import annotations

import torch
from torch.utils.data import Sampler


class PromptBatches(Sampler[list[int]]):
    """Yields, forever, this process's share of each rollout batch: dataset indices, each prompt `num_generations`
    times in a row (its group).

    Each data epoch e is a permutation of the dataset drawn from `seed + e`; it is cut into global batches of
    `local_batch_size x world_size / num_generations` prompts (a ragged tail is dropped), and process `rank` takes its
    slice of each. `start_batch` skips the batches a resumed run has already used (iteration k uses global batch k).
    """

    def __init__(self, num_prompts: int, local_batch_size: int, world_size: int = 1, rank: int = 0, seed: int = 0,
                 shuffle: bool = True, start_batch: int = 0, num_generations: int = 1):
        if local_batch_size % num_generations:
            raise ValueError(f"The per-process rollout batch of {local_batch_size} completions (per_device_train_"
                             f"batch_size x gradient_accumulation_steps) does not split into groups of num_generations="
                             f"{num_generations}: each prompt's group stays on one process. Make it a multiple.")
        self.local_prompts = local_batch_size // num_generations
        self.global_batch_size = self.local_prompts * world_size
        if num_prompts < self.global_batch_size:
            raise ValueError(f"The dataset has {num_prompts} prompts, fewer than one rollout batch's "
                             f"{self.global_batch_size} (per_device_train_batch_size x gradient_accumulation_steps "
                             "x processes / num_generations); lower the batch size or add prompts.")
        self.num_prompts, self.local_batch_size, self.rank = num_prompts, local_batch_size, rank
        self.seed, self.shuffle, self.start_batch = seed, shuffle, start_batch
        self.num_generations = num_generations
        self.batches_per_epoch = num_prompts // self.global_batch_size

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_prompts)
        return torch.randperm(self.num_prompts, generator=torch.Generator().manual_seed(self.seed + epoch))

    def _share(self, order: torch.Tensor, start: int) -> list[int]:
        """This process's prompts of the global batch at `start` in `order`, each repeated num_generations times."""
        start += self.rank * self.local_prompts
        return order[start : start + self.local_prompts].repeat_interleave(self.num_generations).tolist()

    def __iter__(self):
        batch, epoch, order = self.start_batch, None, None
        while True:
            e, i = divmod(batch, self.batches_per_epoch)
            if e != epoch:
                epoch, order = e, self._order(e)
            yield self._share(order, i * self.global_batch_size)
            batch += 1

    def extra(self, seed: int) -> list[int]:
        """A further draw of prompts (dynamic sampling's refills): this process's share of a batch from a permutation
        of its own, seeded by `seed` alone (`trainer.seeds.extra_draw_seed`: from the iteration and the draw), so the
        main order, and a resumed run's refills, are the uninterrupted run's."""
        generator = torch.Generator().manual_seed(seed)
        return self._share(torch.randperm(self.num_prompts, generator=generator), 0)


def token_budget_groups(lengths: list[int], budget: int, groups: int | None = None) -> list[list[int]]:
    """Consecutive rows in groups of at most `budget` tokens (`lengths`: each row's real tokens): a micro-batch or
    scoring chunk per group (`PPOConfig.max_tokens_per_micro_batch`). `groups`: exactly this many (the largest count
    over processes, so every process runs the same number of forwards and backwards): the groups with the most tokens
    are halved until there are that many (each half is still within the budget). Raises for a row over the budget."""
    over = [i for i, n in enumerate(lengths) if n > budget]
    if over:
        raise ValueError(f"max_tokens_per_micro_batch={budget} is smaller than row {over[0]}'s {lengths[over[0]]} "
                         "tokens (prompt + response): raise it to at least max prompt length + response_length.")
    out: list[list[int]] = []
    used = budget + 1
    for i, n in enumerate(lengths):
        if used + n > budget:
            out.append([])
            used = 0
        out[-1].append(i)
        used += n
    if groups is not None:
        if not len(out) <= groups <= len(lengths):
            raise ValueError(f"{groups} groups of {len(lengths)} rows that need {len(out)}")
        while len(out) < groups:
            k = max((k for k in range(len(out)) if len(out[k]) > 1), key=lambda k: sum(lengths[i] for i in out[k]))
            half = len(out[k]) // 2
            out[k : k + 1] = [out[k][:half], out[k][half:]]
    return out


def balanced_partition(lengths: list[int], parts: int) -> list[list[int]]:
    """Rows into `parts` parts of equal row count whose token sums are as even as a greedy pass makes them: the
    longest row first, each to the part with the fewest tokens that still has room (`len(lengths)` must divide by
    `parts`). The consecutive split (the processes' own rows, for a minibatch gathered process after process) is kept
    where its busiest part holds no more tokens than the greedy one's. Each part lists its rows in their original
    order. Equal row counts keep a fixed micro-batch size giving the same number of micro-batches on every process."""
    if len(lengths) % parts:
        raise ValueError(f"{len(lengths)} rows do not split into {parts} parts of equal size")
    size = len(lengths) // parts
    dealt: list[list[int]] = [[] for _ in range(parts)]
    tokens = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        k = min((k for k in range(parts) if len(dealt[k]) < size), key=lambda k: (tokens[k], k))
        dealt[k].append(i)
        tokens[k] += lengths[i]
    consecutive = [list(range(k * size, (k + 1) * size)) for k in range(parts)]
    busiest = lambda split: max(sum(lengths[i] for i in part) for part in split)  # noqa: E731
    return consecutive if busiest(consecutive) <= busiest(dealt) else [sorted(part) for part in dealt]
