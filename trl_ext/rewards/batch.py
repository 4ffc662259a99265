"""`RewardBatch`: one batch of query + response as every kind of reward reads it, with the policy tokenizer's
decodings made once and shared."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core import real_rows
from ..models import sequence_inputs


@dataclass
class RewardBatch:
    queries: torch.Tensor  # (B, Q) left-padded prompt ids
    query_mask: torch.Tensor  # (B, Q) bool
    responses: torch.Tensor  # (B, T) response ids
    response_mask: torch.Tensor  # (B, T) bool, True up to and including the stop token
    policy_tokenizer: Any
    extra_columns: dict[str, list] = field(default_factory=dict)  # {column: B values}, for reward functions
    trainer_state: Any = None
    padding_free: bool = False  # models in TRL's layout read packed rows (`read_last_token`)
    conversations: list | None = None  # multi-turn: each row's assistant, tool and feedback messages
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def inputs(self) -> dict[str, torch.Tensor]:
        """The policy's ids of query + response, with their attention mask and position ids."""
        if "inputs" not in self._cache:
            self._cache["inputs"] = sequence_inputs(self.queries, self.query_mask, self.responses, self.response_mask)
        return self._cache["inputs"]

    def token_ids(self) -> tuple[list[list[int]], list[list[int]]]:
        """(prompt ids, completion ids) without padding, the completion cut after the stop token: read to the host
        once for the batch."""
        if "ids" not in self._cache:
            self._cache["ids"] = (real_rows(self.queries, self.query_mask), real_rows(self.responses,
                                                                                      self.response_mask))
        return self._cache["ids"]

    def texts(self) -> tuple[list[str], list[str]]:
        """(prompts, completions) decoded from the policy's tokens: no padding, no special tokens, completion cut
        after the stop token."""
        if "texts" not in self._cache:
            tok, (prompt_ids, completion_ids) = self.policy_tokenizer, self.token_ids()
            self._cache["texts"] = (tok.batch_decode(prompt_ids, skip_special_tokens=True),
                                    tok.batch_decode(completion_ids, skip_special_tokens=True))
        return self._cache["texts"]

    def joined_texts(self) -> list[str]:
        """Prompt and completion tokens decoded together: prompt + completion with the seam's spacing kept (decoding
        them apart drops a leading space with SentencePiece and word-level tokenizers)."""
        if "joined" not in self._cache:
            prompt_ids, completion_ids = self.token_ids()
            self._cache["joined"] = self.policy_tokenizer.batch_decode(
                [q + r for q, r in zip(prompt_ids, completion_ids)], skip_special_tokens=True)
        return self._cache["joined"]
