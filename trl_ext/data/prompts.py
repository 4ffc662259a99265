"""Prompt datasets in TRL's standard forms, tokenized for PPO, and a collator that left-pads them.

TRL 1.12's PPOTrainer only takes a dataset of pre-tokenized `input_ids`. `prepare_prompts` accepts the three prompt
forms TRL's trainers use and returns a dataset of `input_ids` (python int lists):

- text: a `prompt` column of strings. Tokenized with the tokenizer's default special tokens (`tokenizer(text)`), as
  TRL's trainers do for plain-text prompts.
- conversational: a `prompt` column of message lists (`[{"role": "user", "content": "..."}, ...]`). Rendered with
  `tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)` and tokenized with
  `add_special_tokens=False` (the template already holds the special tokens; this is what TRL does).
- tokenized: an `input_ids` column of int lists (TRL's PPO form), used as is. It wins when `prompt` is also present.

Every other column is kept (e.g. `answer`, for a reward function). The text and conversational forms also get a
`prompt_text` column: the text that was tokenized (the prompt string, or the rendered chat template), before any
truncation. The `prompt` column itself is kept as given: reward functions in TRL's convention receive it as `prompts`
(message lists for conversational prompts, as GRPOTrainer passes them).

    prepared = prepare_prompts(dataset, tokenizer, max_prompt_length=256)
    collator = LeftPaddingCollator(tokenizer, extra_columns=["answer"])
    trainer = PPOTrainer(..., train_dataset=prepared.dataset, data_collator=collator)

`LeftPaddingCollator` always pads on the left, whatever `tokenizer.padding_side` says, and builds the attention mask
from the prompt lengths, never from `== pad_token_id`: a prompt that contains the pad token (pad == EOS, and chat
templates put EOS inside prompts) keeps attention 1 on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any, Literal

import torch

__all__ = ["PreparedPrompts", "LeftPaddingCollator", "prepare_prompts"]

FORMS_HELP = (
    "Accepted forms: a `prompt` column of strings (text), a `prompt` column of message lists "
    "[{'role': ..., 'content': ...}, ...] (conversational), or an `input_ids` column of token-id lists (tokenized)."
)
_OVER = "__trl_ext_over_max_prompt_length__"  # temporary column: the row was longer than max_prompt_length


@dataclass
class PreparedPrompts:
    """What `prepare_prompts` returns.

    dataset: a `datasets.Dataset` with an `input_ids` column (python int lists, unpadded) and every extra column of
        the input; for the text and conversational forms also `prompt_text` (the text that was tokenized, before
        truncation).
    form: the form of the input: "text", "conversational" or "tokenized".
    num_truncated: prompts cut to their last `max_prompt_length` tokens (truncation="left").
    num_dropped: prompts removed for being longer than `max_prompt_length` (truncation="drop").
    """

    dataset: Any
    form: Literal["text", "conversational", "tokenized"]
    num_truncated: int = 0
    num_dropped: int = 0

    @property
    def extra_columns(self) -> list[str]:
        """Every column but `input_ids` (for `LeftPaddingCollator(tokenizer, extra_columns=...)`)."""
        return [c for c in self.dataset.column_names if c != "input_ids"]


def _describe(value) -> str:
    if isinstance(value, list):
        inner = f" of {type(value[0]).__name__}" if value else ""
        return f"a list{inner}"
    return f"of type {type(value).__name__}"


def _prompt_kind(value) -> str:
    """'text', 'conversational', 'missing', 'empty' or 'invalid' for one value of the `prompt` column."""
    if value is None:
        return "missing"
    if isinstance(value, str):
        return "text" if value else "empty"
    if isinstance(value, list):
        if not value:
            return "empty"
        if all(isinstance(m, Mapping) and isinstance(m.get("role"), str) and m.get("role") and "content" in m
               for m in value):
            return "conversational"
    return "invalid"


def _row_error(index: int, column: str, kind: str, value, form: str | None) -> ValueError:
    where = f"Row {index} of the dataset"
    if kind == "missing":
        return ValueError(f"{where} has no {column!r} (it is None): every prompt must be given; remove the row.")
    if kind == "empty":
        return ValueError(f"{where} has an empty {column!r} ({value!r}): every prompt needs at least one token; "
                          "remove the row.")
    if kind in ("text", "conversational") and form is not None:
        return ValueError(f"Mixed prompts: row {index} is a {kind} prompt but the dataset's first row is a {form} "
                          f"prompt. Use one form for the whole dataset (render conversations to text, or text to "
                          f"messages).")
    if kind == "messages":
        return ValueError(f"{where}: {column!r} holds a message without a string 'role' and a 'content' "
                          f"({value!r}). Each message must be {{'role': ..., 'content': ...}}. {FORMS_HELP}")
    return ValueError(f"{where}: {column!r} is {_describe(value)}, which is not a prompt. {FORMS_HELP}")


def _check_ids(index: int, ids) -> list[int]:
    if ids is None:
        raise _row_error(index, "input_ids", "missing", ids, None)
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise ValueError(f"Row {index} of the dataset: 'input_ids' is {_describe(ids)}; it must be a list of token "
                         "ids (ints).")
    if not ids:
        raise _row_error(index, "input_ids", "empty", ids, None)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, Integral) or t < 0:
            raise ValueError(f"Row {index} of the dataset: 'input_ids' holds {t!r}; it must be a flat list of "
                             "non-negative token ids (ints), one prompt per row, unpadded.")
    return [int(t) for t in ids]


def _check_max_prompt_length(max_prompt_length, truncation) -> None:
    if max_prompt_length is not None:
        if isinstance(max_prompt_length, bool) or not isinstance(max_prompt_length, Integral):
            raise TypeError(f"max_prompt_length must be an int or None, got {max_prompt_length!r}.")
        if max_prompt_length <= 0:
            raise ValueError(f"max_prompt_length={max_prompt_length}: it must be a positive number of tokens, or "
                             "None for no limit.")
    if truncation not in ("left", "drop"):
        raise ValueError(f"truncation={truncation!r}: use 'left' (keep each long prompt's last max_prompt_length "
                         "tokens) or 'drop' (remove long prompts).")


def _header_length(tokenizer, text: str, messages) -> int | None:
    """Tokens of the rendered chat `text` before the first message's content (BOS, role headers, a default system
    prompt the template adds), which left truncation keeps; None if the content is not found verbatim."""
    content = messages[0].get("content")
    start = text.find(content) if isinstance(content, str) and content else -1
    if start < 0:
        return None
    if getattr(tokenizer, "is_fast", False):
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        return sum(1 for _, end in offsets if end <= start)
    return len(tokenizer(text[:start], add_special_tokens=False)["input_ids"])


def _check_dataset(dataset) -> None:
    """One map-style `datasets.Dataset` split."""
    from datasets import Dataset, DatasetDict, IterableDataset, IterableDatasetDict

    if isinstance(dataset, (DatasetDict, IterableDatasetDict)):
        raise TypeError(f"prepare_prompts takes one split, got a {type(dataset).__name__} with splits "
                        f"{list(dataset.keys())}: pass e.g. dataset['train'].")
    if isinstance(dataset, IterableDataset):
        raise TypeError("prepare_prompts needs a map-style datasets.Dataset (PPO samples prompts by index), got an "
                        "IterableDataset: materialise it, e.g. Dataset.from_generator or Dataset.from_list.")
    if not isinstance(dataset, Dataset):
        raise TypeError(f"prepare_prompts takes a datasets.Dataset, got {type(dataset).__name__}: wrap it, e.g. "
                        "Dataset.from_list(rows) or Dataset.from_dict(columns).")


def _prompt_form(dataset, tokenizer) -> str:
    """"tokenized" (an `input_ids` column), or "text" / "conversational" (a `prompt` column, by its first row)."""
    columns = dataset.column_names
    if "input_ids" in columns:
        form = "tokenized"
    elif "prompt" in columns:
        form = None  # text or conversational: decided by the first row
    else:
        raise ValueError(f"The dataset has neither a 'prompt' nor an 'input_ids' column (columns found: {columns}). "
                         f"{FORMS_HELP}")
    if len(dataset) == 0:
        raise ValueError("The prompt dataset is empty: PPO needs at least one prompt.")
    if form is None:
        first = dataset[0]["prompt"]
        kind = _prompt_kind(first)
        if kind not in ("text", "conversational"):
            if isinstance(first, list) and first and all(isinstance(m, Mapping) for m in first):
                kind = "messages"
            raise _row_error(0, "prompt", kind, first, None)
        form = kind
        if "prompt_text" in columns:
            raise ValueError("The dataset already has a 'prompt_text' column, where prepare_prompts puts the text of "
                             "each prompt: rename that column.")
    if form == "conversational" and not getattr(tokenizer, "chat_template", None):
        raise ValueError("The prompts are conversational (message lists) but the tokenizer has no chat template. "
                         "Set one: `tokenizer.chat_template = ...` (e.g. the instruct model's tokenizer's template), "
                         "or pass text prompts or tokenized `input_ids` instead.")
    return form


class _Cut:
    """A prompt longer than `limit` tokens: flagged (truncation "drop"), or cut from the left after its head."""

    def __init__(self, limit: int | None, drop: bool, special_ids: set[int]):
        self.limit, self.drop, self.special_ids = limit, drop, special_ids

    def __call__(self, ids: list[int], index: int, keep: int | None = None) -> tuple[list[int], bool]:
        """(ids, over the limit). Left truncation keeps the prompt's head (`keep` tokens: the chat template's header;
        default its leading special tokens, e.g. BOS) and cuts the oldest tokens after it."""
        limit = self.limit
        if limit is None or len(ids) <= limit:
            return ids, False
        if self.drop:
            return ids, True
        if keep is None:
            keep = next((i for i, t in enumerate(ids) if t not in self.special_ids), len(ids))
        if keep >= limit:
            raise ValueError(f"Row {index} of the dataset: max_prompt_length={limit} leaves no room for the prompt "
                             f"after its first {keep} tokens (leading special tokens / the chat template's header, "
                             "which truncation keeps): raise max_prompt_length, or use prompt_truncation='drop'.")
        return ids[:keep] + ids[len(ids) - (limit - keep):], True


def _tokenize_rows(tokenizer, form: str, cut: _Cut, tools=None, template_kwargs: dict | None = None):
    """The `Dataset.map` function of the text and conversational forms: rendered, tokenized, cut."""
    def tokenize_batch(batch, indices):
        out_ids, out_text, over = [], [], []
        environments = batch.get("environment") or [None] * len(indices)
        for value, index, environment in zip(batch["prompt"], indices, environments):
            kind = _prompt_kind(value)
            if kind != form:
                if kind == "invalid" and isinstance(value, list) and all(isinstance(m, Mapping) for m in value):
                    kind = "messages"
                raise _row_error(index, "prompt", kind, value, form)
            keep = None
            if form == "text":
                text = value
                ids = tokenizer(text)["input_ids"]  # the tokenizer's default special tokens, as TRL does
            else:
                listed = tools(environment) if callable(tools) else tools  # the tools the template lists
                text = tokenizer.apply_chat_template(value, tools=listed, add_generation_prompt=True, tokenize=False,
                                                     **(template_kwargs or {}))
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template holds them
                if cut.limit is not None and len(ids) > cut.limit:
                    keep = _header_length(tokenizer, text, value)
            if not ids:
                raise ValueError(f"Row {index} of the dataset: the prompt {value!r} tokenizes to no tokens; every "
                                 "prompt needs at least one token. Remove the row.")
            ids, is_over = cut(list(ids), index, keep)
            out_ids.append(ids)
            out_text.append(text)
            over.append(is_over)
        return {"input_ids": out_ids, "prompt_text": out_text, _OVER: over}
    return tokenize_batch


def _check_token_rows(cut: _Cut):
    """The `Dataset.map` function of the tokenized form: ids checked, pre-padded rows unpadded by their own mask,
    cut."""
    def check_batch(batch, indices):
        masks = batch.get("attention_mask")
        out_ids, over = [], []
        for j, (ids, index) in enumerate(zip(batch["input_ids"], indices)):
            ids = _check_ids(index, ids)
            if masks is not None:  # pre-padded rows: keep the positions their own mask marks as real
                mask = masks[j]
                if mask is None or len(mask) != len(ids):
                    raise ValueError(f"Row {index} of the dataset: 'attention_mask' does not match 'input_ids' "
                                     f"({None if mask is None else len(mask)} vs {len(ids)} positions).")
                ids = [t for t, m in zip(ids, mask) if m]
                if not ids:
                    raise _row_error(index, "input_ids", "empty", ids, None)
            ids, is_over = cut(ids, index)
            out_ids.append(ids)
            over.append(is_over)
        return {"input_ids": out_ids, _OVER: over}
    return check_batch


def _drop_long(dataset, limit: int, num_proc: int | None):
    """The dataset without its prompts over the limit (truncation "drop"), and how many went."""
    num_over = sum(bool(x) for x in dataset[_OVER])
    if num_over == len(dataset):
        shortest = min(len(ids) for ids in dataset["input_ids"])
        raise ValueError(f"All {num_over} prompts are longer than max_prompt_length={limit} (the shortest has "
                         f"{shortest} tokens), so truncation='drop' leaves no prompt: raise max_prompt_length "
                         "or use truncation='left'.")
    if num_over:
        dataset = dataset.filter(lambda flags: [not f for f in flags], input_columns=[_OVER], batched=True,
                                 num_proc=num_proc, desc="Dropping long prompts")
    return dataset, num_over


def prepare_prompts(
    dataset,
    tokenizer,
    max_prompt_length: int | None = None,
    truncation: Literal["left", "drop"] = "left",
    num_proc: int | None = None,
    tools=None,
    chat_template_kwargs: dict | None = None,
) -> PreparedPrompts:
    """Tokenize a prompt dataset in any of TRL's prompt forms (see the module docstring) for PPO.

    dataset: a `datasets.Dataset` with a `prompt` column (strings or message lists) or an `input_ids` column.
    tokenizer: the policy's tokenizer. The conversational form needs its `chat_template`.
    max_prompt_length: longest prompt in tokens (None: no limit). Longer prompts are handled per `truncation`:
        "left" keeps their head (the leading special tokens, e.g. BOS; for conversational prompts the chat template's
        header up to the first message's content) and as many of their last tokens as fit, cutting the oldest tokens
        after the head (counted in `num_truncated`; the end of a prompt, next to
        the response, is what PPO generates from), "drop" removes them (counted in `num_dropped`).
    num_proc: processes for `Dataset.map`.
    tools: the tools conversational prompts are rendered with (the chat template lists them for the model): a list
        of functions, or a function of the row's `environment` (None without that column) returning one.
    chat_template_kwargs: further keyword arguments of `apply_chat_template` (GRPO's field, e.g. enable_thinking).

    Raises ValueError for: neither a `prompt` nor an `input_ids` column, a conversational prompt with a tokenizer
    without a chat template, mixed forms, missing or empty prompts, an empty dataset (also after dropping),
    `max_prompt_length <= 0` or an unknown `truncation`.
    """
    _check_dataset(dataset)
    _check_max_prompt_length(max_prompt_length, truncation)
    form = _prompt_form(dataset, tokenizer)
    dataset = dataset.with_format(None)  # python values, whatever format the caller set
    drop = truncation == "drop"
    cut = _Cut(max_prompt_length, drop, set(getattr(tokenizer, "all_special_ids", None) or ()))
    if form == "tokenized":
        remove = ["attention_mask"] if "attention_mask" in dataset.column_names else []
        dataset = dataset.map(_check_token_rows(cut), batched=True, with_indices=True, num_proc=num_proc,
                              remove_columns=remove, desc="Checking prompts")
    else:
        dataset = dataset.map(_tokenize_rows(tokenizer, form, cut, tools, chat_template_kwargs), batched=True,
                              with_indices=True, num_proc=num_proc, desc="Tokenizing prompts")
    num_truncated = num_dropped = 0
    if drop:
        dataset, num_dropped = _drop_long(dataset, max_prompt_length, num_proc)
    else:
        num_truncated = sum(bool(x) for x in dataset[_OVER])
    dataset = dataset.remove_columns([_OVER])
    return PreparedPrompts(dataset=dataset, form=form, num_truncated=num_truncated, num_dropped=num_dropped)


def left_padding_tokenizer(name: str, trust_remote_code: bool = False, revision: str | None = None):
    """A model's tokenizer as PPO (and GRPOTrainer) loads it: left-padding, with a pad token, its EOS token if it had
    none (Pythia, Llama). trl_ext masks by position, never by `== pad_token_id`, so pad == EOS is safe."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, padding_side="left", trust_remote_code=trust_remote_code,
                                              revision=revision)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class LeftPaddingCollator:
    """Collate prompt rows into a left-padded batch for PPO.

    Called on a list of rows (dicts with `input_ids`, e.g. rows of `prepare_prompts(...).dataset`), returns
    `{"input_ids": (B, Q) long, "attention_mask": (B, Q) long, **{name: [row[name] for row in rows]}}` where Q is the
    longest prompt in the batch, shorter prompts are padded on the left with `tokenizer.pad_token_id`, and the
    attention mask is 1 exactly on each prompt's own tokens (from the prompt lengths, never from `== pad_token_id`).
    A row's own `attention_mask`, if it has one, marks which of its positions are real; the others are dropped.

    Padding is always on the left, whatever `tokenizer.padding_side` is. `extra_columns`: names of columns to pass
    through as python lists (e.g. ["answer"] for a reward function); other columns are ignored.
    """

    def __init__(self, tokenizer, extra_columns: Iterable[str] | str | None = None):
        pad_token_id = getattr(tokenizer, "pad_token_id", None)
        if pad_token_id is None:
            raise ValueError("The tokenizer has no pad token, which left padding needs: set `tokenizer.pad_token` "
                             "(e.g. `tokenizer.pad_token = tokenizer.eos_token`).")
        self.tokenizer = tokenizer
        self.pad_token_id = int(pad_token_id)
        if extra_columns is None:
            extra_columns = ()
        elif isinstance(extra_columns, str):
            extra_columns = (extra_columns,)
        self.extra_columns = tuple(extra_columns)
        reserved = [c for c in self.extra_columns if c in ("input_ids", "attention_mask")]
        if reserved:
            raise ValueError(f"extra_columns cannot include {reserved}: the collator builds those itself.")

    def __repr__(self) -> str:
        return f"LeftPaddingCollator(pad_token_id={self.pad_token_id}, extra_columns={list(self.extra_columns)})"

    def __call__(self, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        if isinstance(rows, Mapping):
            raise TypeError("LeftPaddingCollator takes a list of rows (dicts), got a dict of columns.")
        rows = list(rows)
        if not rows:
            raise ValueError("LeftPaddingCollator got an empty batch.")
        prompts = []
        for i, row in enumerate(rows):
            if "input_ids" not in row:
                raise ValueError(f"Batch row {i} has no 'input_ids' (its columns: {list(row)}): tokenize the prompts "
                                 "first, with trl_ext.data.prompts.prepare_prompts(dataset, tokenizer).")
            ids = row["input_ids"]
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            mask = row.get("attention_mask")
            if mask is not None:
                mask = mask.tolist() if hasattr(mask, "tolist") else list(mask)
                if len(mask) != len(ids):
                    raise ValueError(f"Batch row {i}: 'attention_mask' has {len(mask)} positions, 'input_ids' "
                                     f"{len(ids)}.")
                ids = [t for t, m in zip(ids, mask) if m]
            if not ids:
                raise ValueError(f"Batch row {i} has an empty prompt: every prompt needs at least one token.")
            prompts.append(ids)
        width = max(len(ids) for ids in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, ids in enumerate(prompts):
            input_ids[i, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids):] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
        for name in self.extra_columns:
            missing = [i for i, row in enumerate(rows) if name not in row]
            if missing:
                raise ValueError(f"extra column {name!r} is missing from batch row {missing[0]} (its columns: "
                                 f"{list(rows[missing[0]])}).")
            batch[name] = [row[name] for row in rows]
        return batch
