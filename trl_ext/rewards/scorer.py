"""`RewardScorer`: one reward or a weighted sum of several, each reward one object of its kind behind one interface
(`score(batch)`: `FunctionReward`, `ModelReward`, `ModuleReward`, `TextModelReward`)."""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .batch import RewardBatch
from .functions import FunctionReward, _await_all, check_reward_function_output
from .modules import (
    ModelReward,
    ModuleReward,
    TextModelReward,
    _is_tokenizer,
    check_model_scores,
    has_score_head,
    load_reward_model,
)


@dataclass
class _Entry:
    """A reward while the scorer is built: its kind so far ("function" or "model"; a model with a tokenizer of its
    own becomes "text_model"), the object, its own tokenizer and its name."""
    kind: str
    obj: Any
    tokenizer: Any = None
    name: str = ""


def _reward(entry: _Entry):
    """The reward object of an entry."""
    if entry.kind == "function":
        return FunctionReward(entry.obj, entry.name)
    if entry.kind == "text_model":
        return TextModelReward(entry.obj, entry.name, entry.tokenizer)
    if has_score_head(entry.obj):
        return ModelReward(entry.obj, entry.name)
    return ModuleReward(entry.obj, entry.name)  # no TRL layout to read at the last token: it scores whole rows


def _base_vocab(tokenizer) -> dict:
    """The tokenizer's own vocabulary, without the tokens added after training (a pad token a script added)."""
    added = tokenizer.get_added_vocab()
    return {token: i for token, i in tokenizer.get_vocab().items() if token not in added}


def _saved_tokenizer(path: str):
    """The tokenizer saved beside a model in a local folder (None if there is none)."""
    if not path or not os.path.isdir(path) or not any(
            os.path.isfile(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


class RewardScorer:
    """Scores query+response batches with one reward or a weighted sum of several.

    Args:
        reward_model: one reward, or a list of them. A reward is
            - a sequence-classification `nn.Module` in TRL's layout (backbone under `base_model_prefix`, a 1-output
              `score` head). With no tokenizer of its own it reads the policy's token ids and is read at the last
              real token (positionally, from the attention mask; see `score_responses`).
            - such a model with its own tokenizer: a `(model, tokenizer)` tuple, or an entry in `reward_tokenizers`.
              Its text is decoded from the policy's tokens: the prompt's real tokens and the completion cut after
              the stop token, both without special tokens. If the reward tokenizer has a `chat_template`, the text
              is `apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant",
              "content": completion}], tokenize=False)`, tokenized with `add_special_tokens=False` (the template
              renders them); otherwise it is the prompt and completion tokens decoded together (prompt + completion,
              spacing at the seam kept), tokenized with `add_special_tokens=True`. The batch is padded on the reward
              tokenizer's padding side (right-padded by hand if it has no pad token), sent to the model's device,
              and each row's score is read at its last real token, found positionally from the attention mask
              (position ids come from the mask too, so left padding is safe). A model with its own tokenizer but
              no `score` head (an encoder such as DeBERTa/BERT, which pools its own way) is called as
              `model(input_ids=..., attention_mask=...).logits[:, 0]`.
              Keep it simple: the prompt is decoded as plain text. A prompt the policy's own chat template already
              rendered arrives with its role markers as text (their special tokens dropped), inside the user turn.
            - a module without a `score` head that reads the policy's ids (a rule-based `PreTrainedModel` whose
              `forward(input_ids, attention_mask)` decodes them, or any `nn.Module`): called on the policy's ids,
              it returns `logits` (B, 1) or a tensor (B,) / (B, 1), one score per row (`module_scores`).
            - a Python callable `(prompts: list[str], completions: list[str], **columns) -> list[float]`.
              `prompts`/`completions` are decoded as above and passed positionally. Extra dataset columns
              (`extra_columns` at call time) are passed by keyword: only the ones its signature names, or all of
              them if it takes `**kwargs`.
        policy_tokenizer: the policy's tokenizer (decodes the policy's tokens).
        reward_weights: one float per reward (default all 1.0); the combined score is Σ w_i·s_i.
        reward_tokenizers: the reward models' own tokenizers: a dict {name: tokenizer} (names as in `names`) or a
            list aligned with `reward_model`; a None entry means "shares the policy tokenizer".

    Each reward has a name (`names`): a function's `__name__`, a model's `config._name_or_path` or else its class
    name, made unique with suffixes `_2`, `_3`, ...

    Calling the scorer returns `(combined, per_source)`: the (B,) float32 combined score and {name: (B,) float32 raw,
    unweighted score}, all on the queries' device. A reward function that raises is a `RuntimeError` naming it;
    a wrong number of scores, a non-number or a non-finite score (from a function or a model) is a `ValueError`
    naming the reward. Nothing is ever silently scored zero.
    """

    def __init__(self, reward_model, policy_tokenizer, reward_weights=None, reward_tokenizers=None,
                 padding_free: bool = False):
        if policy_tokenizer is None:
            raise ValueError("RewardScorer needs the policy's tokenizer (`policy_tokenizer`) to decode responses.")
        self.policy_tokenizer = policy_tokenizer
        self.padding_free = padding_free  # reward models in TRL's layout run on packed rows (`models.Packing`)
        rewards = self._as_list(reward_model)
        if not rewards:
            raise ValueError("RewardScorer needs at least one reward (`reward_model`).")

        sources: list[_Entry] = []
        tuple_tokenizers: list[Any] = []
        for i, reward in enumerate(rewards):
            tokenizer = None
            if isinstance(reward, (str, os.PathLike)):  # a folder or hub id: loaded as GRPOTrainer loads it
                reward = load_reward_model(reward)
            if isinstance(reward, tuple):
                if len(reward) != 2 or not isinstance(reward[0], nn.Module) or not _is_tokenizer(reward[1]):
                    raise TypeError(f"reward {i} is a tuple; a tuple reward must be (model, tokenizer), got "
                                    f"{tuple(type(x).__name__ for x in reward)}.")
                reward, tokenizer = reward
            if isinstance(reward, nn.Module):
                sources.append(_Entry("model", reward))
            elif _is_tokenizer(reward):
                raise TypeError(f"reward {i} is a tokenizer ({type(reward).__name__}), not a reward; pass a model's "
                                "own tokenizer as (model, tokenizer) or in `reward_tokenizers`.")
            elif callable(reward):
                sources.append(_Entry("function", reward))
            else:
                raise TypeError(f"reward {i} ({type(reward).__name__}) is neither a reward model (torch nn.Module) "
                                "nor a callable reward function (prompts, completions, **columns) -> list[float].")
            tuple_tokenizers.append(tokenizer)

        self._sources = sources
        self._assign_names()
        self._assign_tokenizers(tuple_tokenizers, reward_tokenizers)
        self.weights = self._check_weights(reward_weights, len(sources))
        self._sources = [_reward(src) for src in sources]  # one object per reward, each with `score(batch)`

    # ----------------------------------------------------------------------------------------------- construction
    @staticmethod
    def _as_list(reward_model) -> list:
        if isinstance(reward_model, tuple) and len(reward_model) == 2 and isinstance(reward_model[0], nn.Module) \
                and _is_tokenizer(reward_model[1]):
            return [reward_model]  # one (model, tokenizer) reward
        if isinstance(reward_model, (list, tuple)):
            return list(reward_model)
        return [reward_model]

    def _assign_names(self) -> None:
        seen: set[str] = set()
        for src in self._sources:
            if src.kind == "function":
                base = getattr(src.obj, "__name__", None) or type(src.obj).__name__
            else:
                base = getattr(getattr(src.obj, "config", None), "_name_or_path", None) or type(src.obj).__name__
            base = str(base)
            name, k = base, 1
            while name in seen:
                k += 1
                name = f"{base}_{k}"
            seen.add(name)
            src.name = name

    def _assign_tokenizers(self, tuple_tokenizers: list, reward_tokenizers) -> None:
        n = len(self._sources)
        if reward_tokenizers is None:
            given = [None] * n
        elif isinstance(reward_tokenizers, Mapping):
            unknown = sorted(set(reward_tokenizers) - set(self.names))
            if unknown:
                raise ValueError(f"reward_tokenizers names {unknown} match no reward; the rewards are {self.names}.")
            given = [reward_tokenizers.get(name) for name in self.names]
        elif isinstance(reward_tokenizers, (list, tuple)):
            if len(reward_tokenizers) != n:
                raise ValueError(f"reward_tokenizers has {len(reward_tokenizers)} entries for {n} rewards; give one "
                                 "per reward (None: shares the policy tokenizer), or a dict {name: tokenizer}.")
            given = list(reward_tokenizers)
        else:
            raise TypeError("reward_tokenizers must be a dict {name: tokenizer} or a list aligned with reward_model, "
                            f"got {type(reward_tokenizers).__name__}.")
        for src, from_tuple, from_arg in zip(self._sources, tuple_tokenizers, given):
            if from_tuple is not None and from_arg is not None and from_arg is not from_tuple:
                raise ValueError(f"reward {src.name!r} got two tokenizers: one in its (model, tokenizer) tuple and "
                                 "one in reward_tokenizers; give one.")
            tokenizer = from_tuple if from_tuple is not None else from_arg
            if tokenizer is None:
                if src.kind == "model":
                    self._check_reads_policy_ids(src)
                continue
            if src.kind == "function":
                raise ValueError(f"reward {src.name!r} is a function; only reward models take a tokenizer.")
            if not _is_tokenizer(tokenizer):
                raise TypeError(f"the tokenizer given for reward {src.name!r} is a {type(tokenizer).__name__}, "
                                "not a tokenizer.")
            if tokenizer is not self.policy_tokenizer:  # the policy's own tokenizer: score the ids directly
                src.kind, src.tokenizer = "text_model", tokenizer

    def _check_reads_policy_ids(self, src) -> None:
        """A reward model without a tokenizer of its own reads the policy's token ids: refuse one made for another
        tokenizer (fewer embeddings than the policy's vocabulary, or its saved tokenizer's vocabulary differs)."""
        model, tokenizer = src.obj, self.policy_tokenizer
        fix = ("pass its tokenizer in reward_processing_classes (or the reward as (model, tokenizer)): it then "
               "reads the decoded text")
        try:  # (a rule-based module has no embeddings)
            rows = model.get_input_embeddings().num_embeddings
        except (AttributeError, NotImplementedError):
            rows = None
        if rows is not None and tokenizer.vocab_size > rows:  # (tokens added after, e.g. a pad, need no row)
            raise ValueError(f"reward model {src.name!r} has {rows} token embeddings, fewer than the policy "
                             f"tokenizer's {tokenizer.vocab_size} tokens: it was made for another tokenizer; {fix}.")
        own = _saved_tokenizer(getattr(getattr(model, "config", None), "_name_or_path", ""))
        if own is not None and _base_vocab(own) != _base_vocab(tokenizer):
            raise ValueError(f"reward model {src.name!r} was saved with a tokenizer whose vocabulary differs from the "
                             f"policy's: it would read the policy's ids as other tokens; {fix}.")

    @staticmethod
    def _check_weights(reward_weights, n: int) -> list[float]:
        if reward_weights is None:
            return [1.0] * n
        if isinstance(reward_weights, torch.Tensor):
            reward_weights = reward_weights.reshape(-1).tolist()
        elif hasattr(reward_weights, "tolist") and not isinstance(reward_weights, (list, tuple)):  # numpy
            reward_weights = reward_weights.tolist()
        if isinstance(reward_weights, (str, bytes)) or not isinstance(reward_weights, Sequence):
            raise ValueError(f"reward_weights must be a list of floats, one per reward; got {reward_weights!r}.")
        if len(reward_weights) != n:
            raise ValueError(f"reward_weights has {len(reward_weights)} entries for {n} rewards; give one weight per "
                             "reward, in the same order.")
        weights = []
        for i, w in enumerate(reward_weights):
            if isinstance(w, (bool, str, bytes)) or not isinstance(w, numbers.Real):
                raise ValueError(f"reward_weights[{i}] = {w!r} is not a number.")
            if not math.isfinite(float(w)):
                raise ValueError(f"reward_weights[{i}] = {w!r} is not finite.")
            weights.append(float(w))
        return weights

    # --------------------------------------------------------------------------------------------- introspection
    def check_columns(self, columns: tuple[str, ...]) -> None:
        """Refuse, before any generation, a reward function whose required arguments neither the trainer nor the
        dataset's columns (`columns`) provide."""
        for src in self._sources:
            if src.kind != "function":
                continue
            provided = {"completion_ids", "trainer_state", *columns}
            if src.convention == "keyword":
                provided |= {"prompts", "completions"}
            missing = sorted(src.required_keywords - provided)
            if missing:
                raise ValueError(f"reward function {src.name!r} needs the argument(s) {missing}, but the dataset's "
                                 f"columns are {sorted(columns)}: add those columns to the dataset, or give the "
                                 "arguments defaults.")

    @property
    def names(self) -> list[str]:
        """The rewards' unique names, in order (the keys of `per_source`)."""
        return [src.name for src in self._sources]

    @property
    def models(self) -> dict[str, nn.Module]:
        """{name: module} of the reward models (to move them to a device, prepare them, set eval mode)."""
        return {src.name: src.obj for src in self._sources if src.kind != "function"}

    def tokenizer_of(self, name: str):
        """The reward model's own tokenizer, or None if it reads the policy's token ids."""
        for src in self._sources:
            if src.name == name:
                return src.tokenizer
        raise KeyError(f"no reward named {name!r}; the rewards are {self.names}.")

    def replace_model(self, name: str, module: nn.Module) -> None:
        """Swap a reward model for its prepared/wrapped version (e.g. after `prepare_deepspeed`)."""
        for src in self._sources:
            if src.name == name and src.kind != "function":
                src.obj = module
                return
        raise KeyError(f"no reward model named {name!r}; the reward models are {list(self.models)}.")

    # ------------------------------------------------------------------------------------------------- scoring
    @torch.no_grad()
    def __call__(self, queries: torch.Tensor, query_mask: torch.Tensor, responses: torch.Tensor,
                 response_mask: torch.Tensor, extra_columns: dict[str, list] | None = None,
                 trainer_state=None, conversations: list | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score a batch: (B, Q) left-padded queries and bool mask, (B, T) responses and bool mask (True up to and
        including the stop token). `extra_columns`: {column: list of B values} for reward functions;
        `trainer_state`: passed to reward functions that take it (TRL's convention); `conversations`: multi-turn
        rollouts' message lists, TRL's conversational completions.

        Returns (combined (B,) float32, {name: (B,) float32 raw score}), on the queries' device. A function's None
        (not applicable) is NaN in its raw scores and left out of the combined score; a row that no reward scores
        is an error."""
        B = queries.shape[0]
        batch = RewardBatch(queries, query_mask.bool(), responses, response_mask.bool(), self.policy_tokenizer,
                            self._check_columns(extra_columns, B), trainer_state, self.padding_free,
                            conversations=conversations)
        device = queries.device
        per_source: dict[str, torch.Tensor] = {}
        pending: dict[str, Any] = {}  # async reward functions, awaited together below
        for src in self._sources:
            scores = src.score(batch)
            if src.kind == "function":
                if src.is_async:
                    pending[src.name] = scores
                    continue
                scores = check_reward_function_output(scores, B, name=f"reward function {src.name!r}",
                                                      allow_none=True)
            scores = scores.float().to(device)
            if src.kind != "function":
                check_model_scores(src.name, scores, B)
            per_source[src.name] = scores
        for name, result in _await_all(pending).items():
            per_source[name] = check_reward_function_output(result, B, name=f"reward function {name!r}",
                                                            allow_none=True).to(device)
        per_source = {src.name: per_source[src.name] for src in self._sources}  # in the rewards' order

        combined = torch.zeros(B, dtype=torch.float32, device=device)
        scored = torch.zeros(B, dtype=torch.bool, device=device)
        for w, src in zip(self.weights, self._sources):
            s = per_source[src.name]
            combined = combined + torch.where(torch.isnan(s), 0.0, w * s)
            scored |= ~torch.isnan(s)
        if not scored.all():
            rows = (~scored).nonzero().flatten().tolist()
            raise ValueError(f"every reward returned None for rows {rows[:5]} of the batch, so they have no score: "
                             f"let at least one reward score every completion (rewards: {self.names}).")
        return combined, per_source

    @staticmethod
    def _check_columns(extra_columns, B: int) -> dict[str, list]:
        if extra_columns is None:
            return {}
        if not isinstance(extra_columns, Mapping):
            raise TypeError(f"extra_columns must be a dict {{column: list}}, got {type(extra_columns).__name__}.")
        for key, column in extra_columns.items():
            if isinstance(column, (str, bytes)) or not hasattr(column, "__len__"):
                raise ValueError(f"extra column {key!r} must be a list with one value per completion, got "
                                 f"{type(column).__name__}.")
            if len(column) != B:
                raise ValueError(f"extra column {key!r} has {len(column)} values for a batch of {B}.")
        return dict(extra_columns)
