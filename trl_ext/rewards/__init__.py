"""Rewards behind one interface.

`RewardScorer` scores query+response batches with any mix of

(a) a sequence-classification reward model that shares the policy's tokenizer: it reads the policy's token ids
    directly and its score is read at the last real token (found from the attention mask, positionally), so with
    pad == EOS it still reads the EOS token, never the token before it; a module without a `score` head (a
    rule-based `PreTrainedModel`, any `nn.Module`) is called on the policy's ids and returns one score per row
    (`module_scores`);
(b) a sequence-classification reward model with its OWN tokenizer (`reward_tokenizers`, or a `(model, tokenizer)`
    tuple): the text is decoded from the policy's tokens, re-rendered and re-tokenized for it (see `RewardScorer`);
(c) a Python function `(prompts: list[str], completions: list[str], **columns) -> list[float]`;
(d) a list of these, combined as Σ w_i·s_i with `reward_weights`.

`RewardNormalizer` normalises the combined score ("none", "fixed" or "running" mean/std, optional clip). The trainer
normalises the score BEFORE it applies `missing_eos_penalty`, so the penalty keeps its configured size in normalised
units and is never scaled or clipped away.

`score_responses` scores with one reward on the policy's tokenizer (kind (a) or (c)); the trainer uses `RewardScorer`.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn as nn

from ..core import last_true_index
from ..models import position_ids_from_mask, scalar_head_outputs, sequence_inputs

RewardFunction = Callable[..., list[float]]

__all__ = [
    "RewardFunction",
    "RewardNormalizer",
    "RewardScorer",
    "check_reward_function_output",
    "has_score_head",
    "is_reward_function",
    "load_reward_model",
    "module_scores",
    "score_responses",
]


def load_reward_model(path: str | os.PathLike) -> tuple[nn.Module, Any]:
    """A reward model given by path (a local folder or a hub id), loaded as TRL's GRPOTrainer loads one:
    `AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)` and its own tokenizer (pad token = EOS
    if it has none). Returns (model, tokenizer): it reads text through that tokenizer."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = str(path)
    try:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"reward_model={path!r} is a string, so it is loaded as a reward model from that folder or "
                         f"hub id, and that failed: {e}. Pass a path to a sequence-classification model (with its "
                         "tokenizer), or the model itself.") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def is_reward_function(reward) -> bool:
    """A plain callable, not a torch module."""
    return callable(reward) and not isinstance(reward, nn.Module)


def check_reward_function_output(values, n: int, name: str = "reward function",
                                 allow_none: bool = False) -> torch.Tensor:
    """Validate what a reward function returned: a list of n finite numbers -> (n,) float32 tensor. allow_none: a
    None means "not applicable to this completion" (TRL's convention) and becomes NaN."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist()
    if isinstance(values, (str, bytes, Mapping)):
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.")
    try:
        values = list(values)
    except TypeError as e:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.") from e
    if allow_none:
        none = {i for i, v in enumerate(values) if v is None}
        values = [math.nan if v is None else v for v in values]
    bad_type = [(i, v) for i, v in enumerate(values)
                if isinstance(v, (str, bytes)) or v is None
                or not isinstance(v, (numbers.Real, torch.Tensor)) and not hasattr(v, "__float__")]
    if bad_type:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got non-numbers "
                         f"{bad_type[:5]} (index, value).")
    try:
        values = [float(v) for v in values]
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"The {name} must return a list of floats, one per completion; got {values!r}.") from e
    if len(values) != n:
        raise ValueError(f"The {name} returned {len(values)} scores for {n} completions; return exactly one score "
                         "per completion, in order.")
    bad = [(i, v) for i, v in enumerate(values) if not math.isfinite(v) and not (allow_none and i in none)]
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
    if not has_score_head(reward):
        return module_scores(reward, inputs, tokenizer.pad_token_id).float()
    per_position = scalar_head_outputs(reward, inputs)  # (B, Q+T)
    last = last_true_index(inputs["attention_mask"].bool())  # (B,) the last real token of query+response
    return per_position.gather(1, last[:, None]).squeeze(1).float()


def module_scores(model: nn.Module, inputs: dict, pad_token_id: int | None, name: str | None = None) -> torch.Tensor:
    """(B,) scores of a reward module without a `score` head, on the policy's ids: `model(input_ids=...,
    attention_mask=...)` (attention_mask only if its forward takes it), with the policy tokenizer's pad id at the
    masked positions, as TRL's query_responses hold it (decoding with skip_special_tokens=True reads the real text
    alone). It may return `logits` of shape (B, 1) (a SequenceClassifierOutput), a (B,) or (B, 1) tensor, or a tuple
    whose first element is one."""
    name = name or type(model).__name__
    mask = inputs["attention_mask"].bool()
    input_ids = inputs["input_ids"].masked_fill(~mask, 0 if pad_token_id is None else pad_token_id)
    device = _model_device(model)
    kwargs = {"input_ids": input_ids.to(device)}
    try:
        params = inspect.signature(model.forward).parameters
        takes_mask = "attention_mask" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
    except (TypeError, ValueError):
        takes_mask = True
    if takes_mask:
        kwargs["attention_mask"] = inputs["attention_mask"].to(device)
    out = model(**kwargs)
    what = "its output"
    if isinstance(out, Mapping) and "logits" in out or hasattr(out, "logits"):
        out, what = out["logits"] if isinstance(out, Mapping) else out.logits, "`logits`"
    elif isinstance(out, tuple) and out:  # a ModelOutput with return_dict=False
        out, what = out[0], "the first element of its output"
    B = input_ids.shape[0]
    if isinstance(out, torch.Tensor) and out.shape in ((B,), (B, 1)):
        return out.reshape(B)
    got = f"has shape {tuple(out.shape)} for a batch of {B}" if isinstance(out, torch.Tensor) else \
        f"is a {type(out).__name__}, not a tensor"
    raise ValueError(f"reward model {name!r} ({type(model).__name__}) has no `score` head, so it is called as "
                     f"model(input_ids, attention_mask) on the policy's ids; {what} {got}: return `logits` of shape "
                     "(B, 1) (e.g. SequenceClassifierOutput(logits=scores[:, None])) or a tensor of shape (B,), one "
                     "score per row.")


# ---------------------------------------------------------------------------------------------------- RewardScorer

def _is_tokenizer(obj) -> bool:
    """A Hugging Face tokenizer (or anything that decodes and tokenizes like one)."""
    return callable(obj) and hasattr(obj, "batch_decode") and hasattr(obj, "convert_tokens_to_ids")


def has_score_head(model: nn.Module) -> bool:
    """TRL's reward/value model layout: a backbone under `base_model_prefix` and a `score` head."""
    prefix = getattr(model, "base_model_prefix", None)
    return bool(prefix) and hasattr(model, prefix) and hasattr(model, "score")


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    for b in model.buffers():
        return b.device
    return torch.device("cpu")


class _Source:
    """One reward: kind "function", "model" (shares the policy tokenizer, read at the last token), "module" (shares
    it, no `score` head: scores whole rows) or "text_model" (its own tokenizer)."""

    def __init__(self, kind: str, obj, tokenizer=None):
        self.kind, self.obj, self.tokenizer = kind, obj, tokenizer
        self.name = ""
        # functions: how they are called ("positional": trl_ext's (prompts, completions, **columns) with text;
        # "keyword": TRL's GRPO convention) and which keyword arguments they take
        self.convention = "positional"
        self.is_async = False
        self.accepts_var_kwargs = False
        self.keyword_params: set[str] = set()
        self.required_keywords: set[str] = set()
        self.positional_names: tuple[str, ...] = ()


TRL_FIRST_PARAMETERS = ("completions", "completion_ids")  # how TRL's reward functions start (trl.rewards, GRPO docs)


def _inspect_function(src: _Source) -> None:
    """Read a reward function's signature and choose how to call it.

    - TRL's convention (GRPOTrainer's): the first parameter is `completions` or `completion_ids`, or the function
      takes keywords only. Everything goes by keyword: prompts, completions, completion_ids, trainer_state and the
      dataset's columns; only those it names, or all of them with **kwargs. Conversational prompts give
      conversational completions ([{"role": "assistant", "content": ...}]).
    - trl_ext's (prompts, completions, **columns): any other function with two positional parameters. prompts and
      completions go positionally, as text; the other arguments by keyword, as above.
    """
    call = type(src.obj).__call__ if callable(src.obj) else None  # an object with an async __call__
    src.is_async = inspect.iscoroutinefunction(src.obj) or inspect.iscoroutinefunction(call)
    try:
        sig = inspect.signature(src.obj)
    except (TypeError, ValueError):  # builtins without a signature: prompts and completions only
        return
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not positional or positional[0].name in TRL_FIRST_PARAMETERS:
        src.convention = "keyword"
        if any(p.kind in (p.POSITIONAL_ONLY, p.VAR_POSITIONAL) for p in params):
            raise TypeError(f"reward function {src.name!r} follows TRL's convention (first parameter "
                            f"{positional[0].name if positional else None!r}) but takes positional-only arguments; "
                            f"TRL calls reward functions by keyword. Its signature is {sig}.")
    else:
        try:
            sig.bind_partial(None, None)
        except TypeError as e:
            raise TypeError(f"reward function {src.name!r} must take (prompts, completions, ...) as its first two "
                            f"positional arguments, or follow TRL's convention (keyword arguments, starting with "
                            f"`completions`); its signature is {sig}.") from e
        src.positional_names = tuple(p.name for p in positional[:2])
    bound_positionally = set(src.positional_names)
    for p in params:
        if p.kind == p.VAR_KEYWORD:
            src.accepts_var_kwargs = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in bound_positionally:
            src.keyword_params.add(p.name)
            if p.default is p.empty:
                src.required_keywords.add(p.name)


def _is_conversation(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(m, Mapping) and "role" in m for m in value)


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

    def __init__(self, reward_model, policy_tokenizer, reward_weights=None, reward_tokenizers=None):
        if policy_tokenizer is None:
            raise ValueError("RewardScorer needs the policy's tokenizer (`policy_tokenizer`) to decode responses.")
        self.policy_tokenizer = policy_tokenizer
        rewards = self._as_list(reward_model)
        if not rewards:
            raise ValueError("RewardScorer needs at least one reward (`reward_model`).")

        sources: list[_Source] = []
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
                sources.append(_Source("model", reward))
            elif _is_tokenizer(reward):
                raise TypeError(f"reward {i} is a tokenizer ({type(reward).__name__}), not a reward; pass a model's "
                                "own tokenizer as (model, tokenizer) or in `reward_tokenizers`.")
            elif callable(reward):
                sources.append(_Source("function", reward))
            else:
                raise TypeError(f"reward {i} ({type(reward).__name__}) is neither a reward model (torch nn.Module) "
                                "nor a callable reward function (prompts, completions, **columns) -> list[float].")
            tuple_tokenizers.append(tokenizer)

        self._sources = sources
        self._assign_names()
        self._assign_tokenizers(tuple_tokenizers, reward_tokenizers)
        self.weights = self._check_weights(reward_weights, len(sources))

        for src in sources:
            if src.kind == "function":
                _inspect_function(src)
            elif src.kind == "model" and not has_score_head(src.obj):
                src.kind = "module"  # no TRL layout to read at the last token: the module scores whole rows

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
                continue
            if src.kind == "function":
                raise ValueError(f"reward {src.name!r} is a function; only reward models take a tokenizer.")
            if not _is_tokenizer(tokenizer):
                raise TypeError(f"the tokenizer given for reward {src.name!r} is a {type(tokenizer).__name__}, "
                                "not a tokenizer.")
            if tokenizer is not self.policy_tokenizer:  # the policy's own tokenizer: score the ids directly
                src.kind, src.tokenizer = "text_model", tokenizer

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
                 trainer_state=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Score a batch: (B, Q) left-padded queries and bool mask, (B, T) responses and bool mask (True up to and
        including the stop token). `extra_columns`: {column: list of B values} for reward functions;
        `trainer_state`: passed to reward functions that take it (TRL's convention).

        Returns (combined (B,) float32, {name: (B,) float32 raw score}), on the queries' device. A function's None
        (not applicable) is NaN in its raw scores and left out of the combined score; a row that no reward scores
        is an error."""
        query_mask, response_mask = query_mask.bool(), response_mask.bool()
        B = queries.shape[0]
        extra_columns = self._check_columns(extra_columns, B)
        device = queries.device
        text_cache: dict[str, Any] = {}

        per_source: dict[str, torch.Tensor] = {}
        pending: dict[str, Any] = {}  # async reward functions, awaited together below
        for src in self._sources:
            if src.kind == "function":
                result = self._call_function(src, text_cache, queries, query_mask, responses, response_mask,
                                             extra_columns, trainer_state)
                if src.is_async:
                    pending[src.name] = result
                    continue
                scores = check_reward_function_output(result, B, name=f"reward function {src.name!r}",
                                                      allow_none=True)
            elif src.kind == "model":
                inputs = sequence_inputs(queries, query_mask, responses, response_mask)
                scores = self._read_last_token(src.obj, inputs)
            elif src.kind == "module":
                inputs = sequence_inputs(queries, query_mask, responses, response_mask)
                scores = module_scores(src.obj, inputs, self.policy_tokenizer.pad_token_id, src.name)
            else:
                scores = self._score_text_model(src, text_cache, queries, query_mask, responses, response_mask)
            scores = scores.float().to(device)
            if src.kind != "function":
                self._check_model_scores(src, scores, B)
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

    def _texts(self, cache, queries, query_mask, responses, response_mask):
        """(prompts, completions) decoded from the policy's tokens: no padding, no special tokens, completion cut
        after the stop token."""
        if "texts" not in cache:
            tok = self.policy_tokenizer
            prompts = tok.batch_decode([q[m] for q, m in zip(queries, query_mask)], skip_special_tokens=True)
            completions = tok.batch_decode([r[m] for r, m in zip(responses, response_mask)],
                                           skip_special_tokens=True)
            cache["texts"] = (prompts, completions)
        return cache["texts"]

    def _joined_texts(self, cache, queries, query_mask, responses, response_mask) -> list[str]:
        """Prompt and completion tokens decoded together: prompt + completion with the seam's spacing kept (decoding
        them apart drops a leading space with SentencePiece and word-level tokenizers)."""
        if "joined" not in cache:
            cache["joined"] = self.policy_tokenizer.batch_decode(
                [torch.cat([q[qm], r[rm]]) for q, qm, r, rm in zip(queries, query_mask, responses, response_mask)],
                skip_special_tokens=True)
        return cache["joined"]

    def _call_function(self, src: _Source, cache, queries, query_mask, responses, response_mask, extra_columns,
                       trainer_state):
        """Call reward function `src` with its convention (see `_inspect_function`); returns what it returned (a
        coroutine for an async function)."""
        prompts, completions = self._texts(cache, queries, query_mask, responses, response_mask)
        completion_ids = [r[m].tolist() for r, m in zip(responses, response_mask)]
        columns = dict(extra_columns)
        offered = {"completion_ids": completion_ids, "trainer_state": trainer_state}
        if src.convention == "keyword":  # TRL's: the dataset's own prompts, conversational completions for them
            original = columns.pop("prompt", None)
            if original is not None:
                prompts = list(original)
                if _is_conversation(prompts[0]):
                    completions = [[{"role": "assistant", "content": c}] for c in completions]
            offered.update(prompts=list(prompts), completions=list(completions))
        clash = sorted(set(columns) & (set(offered) | {"prompts", "completions"}))
        if clash:
            raise ValueError(f"dataset columns {clash} have the names of reward function arguments (prompts, "
                             "completions, completion_ids, trainer_state); rename the columns.")
        offered.update(columns)
        if src.accepts_var_kwargs:
            kwargs = offered
        else:
            kwargs = {k: v for k, v in offered.items() if k in src.keyword_params}
        missing = sorted(src.required_keywords - set(kwargs))
        if missing:
            raise ValueError(f"reward function {src.name!r} needs the column(s) {missing}, but extra_columns has "
                             f"{sorted(extra_columns)}; keep those columns in the dataset.")
        try:
            if src.convention == "keyword":
                return src.obj(**kwargs)
            return src.obj(list(prompts), list(completions), **kwargs)
        except Exception as e:  # noqa: BLE001 — re-raised with the function's name, never scored as zero
            raise RuntimeError(f"reward function {src.name!r} failed: {e}") from e

    @staticmethod
    def _read_last_token(model: nn.Module, inputs: dict) -> torch.Tensor:
        """(B,) the scalar head's output at each row's last real token (positionally, from the attention mask)."""
        device = _model_device(model)
        inputs = {k: v.to(device) for k, v in inputs.items()}
        per_position = scalar_head_outputs(model, inputs)  # (B, L)
        last = last_true_index(inputs["attention_mask"].bool())
        return per_position.gather(1, last[:, None]).squeeze(1)

    def _score_text_model(self, src: _Source, cache, queries, query_mask, responses, response_mask):
        tok = src.tokenizer
        if getattr(tok, "chat_template", None):
            prompts, completions = self._texts(cache, queries, query_mask, responses, response_mask)
            texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                             tokenize=False) for p, c in zip(prompts, completions)]
            add_special_tokens = False  # the template renders them
        else:
            texts = self._joined_texts(cache, queries, query_mask, responses, response_mask)
            add_special_tokens = True
        input_ids, attention_mask = self._tokenize(tok, texts, add_special_tokens)
        model = src.obj
        if not has_score_head(model):  # an encoder classifier (DeBERTa, BERT, ...): it pools its own way
            device = _model_device(model)
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            return logits[:, 0]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "position_ids": position_ids_from_mask(attention_mask)}
        return self._read_last_token(model, inputs)

    @staticmethod
    def _tokenize(tok, texts: list[str], add_special_tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, L) ids and attention mask; padded on the tokenizer's side, or right-padded by hand if it has no pad
        token (the pad id is then irrelevant: it is masked and never read)."""
        if getattr(tok, "pad_token_id", None) is not None:
            enc = tok(texts, padding=True, return_tensors="pt", add_special_tokens=add_special_tokens)
            input_ids, attention_mask = enc["input_ids"], enc["attention_mask"]
        else:
            rows = tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
            L = max(len(r) for r in rows)
            input_ids = torch.zeros(len(rows), L, dtype=torch.long)
            attention_mask = torch.zeros(len(rows), L, dtype=torch.long)
            for i, r in enumerate(rows):
                input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
                attention_mask[i, : len(r)] = 1
        empty = (attention_mask.sum(1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"rows {empty} tokenize to no tokens for the reward model's tokenizer; nothing to score.")
        return input_ids, attention_mask

    @staticmethod
    def _check_model_scores(src: _Source, scores: torch.Tensor, B: int) -> None:
        if scores.shape != (B,):
            raise ValueError(f"reward model {src.name!r} gave scores of shape {tuple(scores.shape)} for a batch of "
                             f"{B}; it needs a 1-output head.")
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"reward model {src.name!r} gave non-finite scores at rows {bad[:5]} "
                             f"({scores[bad[:5]].tolist()}); check its precision (fp16 overflow) and inputs.")


def _await_all(coroutines: dict[str, Any]) -> dict[str, Any]:
    """Await the async reward functions' coroutines together (asyncio.gather); in a thread of its own if an event
    loop already runs in this one (a notebook). An exception is re-raised naming its function."""
    if not coroutines:
        return {}
    import asyncio

    async def gather():
        return await asyncio.gather(*coroutines.values(), return_exceptions=True)

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        results = asyncio.run(gather())
    else:
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    for name, result in zip(coroutines, results):
        if isinstance(result, BaseException):
            raise RuntimeError(f"reward function {name!r} failed: {result}") from result
    return dict(zip(coroutines, results))


# ------------------------------------------------------------------------------------------------ RewardNormalizer

_STD_FLOOR = 1e-8  # divide by max(std, this), so a batch of identical scores gives 0, not NaN
NORMALIZER_MODES = ("none", "running", "fixed")


class RewardNormalizer:
    """Normalise (B,) scores: "none" (identity), "fixed" ((s − mean) / std with the given mean/std) or "running"
    ((s − μ) / σ with the mean μ and SAMPLE standard deviation σ (n − 1 in the denominator, as `torch.std`) of every
    score seen so far, this batch included; σ = 1 while fewer than 2 scores have been seen). Then, in every mode,
    `clip` (if not None) clamps the result to [−clip, clip]. σ is floored at 1e-8.

    The running statistics are updated with Chan et al.'s parallel (Welford) merge in float64. Under several
    processes, call `update()` with the gathered scores and `normalize()` on the local ones, so every rank uses the
    same statistics; `__call__` is `update` then `normalize` on the same scores.

    The trainer normalises the score before it subtracts `missing_eos_penalty`: the penalty is applied afterwards,
    in normalised units, never scaled by σ or clipped.

    `state_dict()` / `load_state_dict()` carry the running statistics (JSON-able), so a resumed run continues them;
    the settings (mode, mean, std, clip) come from the constructor.
    """

    def __init__(self, mode: str = "none", mean: float = 0.0, std: float = 1.0, clip: float | None = None):
        if mode not in NORMALIZER_MODES:
            raise ValueError(f"RewardNormalizer mode must be one of {NORMALIZER_MODES}, got {mode!r}.")
        for label, v in (("mean", mean), ("std", std)):
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise ValueError(f"RewardNormalizer {label} must be a finite number, got {v!r}.")
        if std <= 0:
            raise ValueError(f"RewardNormalizer std must be > 0, got {std!r}.")
        if clip is not None:
            if isinstance(clip, bool) or not isinstance(clip, numbers.Real) or not float(clip) > 0 \
                    or math.isnan(float(clip)):
                raise ValueError(f"RewardNormalizer clip must be None or a number > 0, got {clip!r}.")
        self.mode, self.mean, self.std = mode, float(mean), float(std)
        self.clip = None if clip is None else float(clip)
        self.count = 0
        self.running_mean = 0.0
        self.m2 = 0.0  # sum of squared deviations from the running mean

    @property
    def running_std(self) -> float:
        """Sample std of every score seen so far (1.0 with fewer than 2)."""
        if self.count < 2:
            return 1.0
        return math.sqrt(self.m2 / (self.count - 1))

    def update(self, scores: torch.Tensor) -> None:
        """Merge a batch into the running statistics (only in "running" mode)."""
        if self.mode != "running":
            return
        x = self._check(scores).detach().double().reshape(-1).cpu()
        n = x.numel()
        if n == 0:
            return
        b_mean = float(x.mean())
        b_m2 = float(((x - b_mean) ** 2).sum())
        total = self.count + n
        delta = b_mean - self.running_mean
        self.running_mean += delta * n / total
        self.m2 += b_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        """Normalise with the current statistics, without updating them."""
        scores = self._check(scores)
        if self.mode == "fixed":
            out = (scores - self.mean) / self.std
        elif self.mode == "running":
            out = (scores - self.running_mean) / max(self.running_std, _STD_FLOOR)
        else:
            out = scores
        if self.clip is not None:
            out = out.clamp(-self.clip, self.clip)
        return out

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        """(B,) -> (B,): update the running statistics with these scores (mode "running"), then normalise them."""
        self.update(scores)
        return self.normalize(scores)

    @staticmethod
    def _check(scores: torch.Tensor) -> torch.Tensor:
        if not isinstance(scores, torch.Tensor):
            scores = torch.as_tensor(scores, dtype=torch.float32)
        if scores.dim() != 1:
            raise ValueError(f"RewardNormalizer takes (B,) scores, got shape {tuple(scores.shape)}.")
        if not torch.isfinite(scores).all():
            raise ValueError(f"RewardNormalizer got non-finite scores {scores.tolist()[:5]}...; they would poison "
                             "the running statistics.")
        return scores

    def state_dict(self) -> dict:
        return {"mode": self.mode, "mean": self.mean, "std": self.std, "clip": self.clip,
                "count": int(self.count), "running_mean": float(self.running_mean), "m2": float(self.m2)}

    def load_state_dict(self, state: dict) -> None:
        """Restore the running statistics (count, running_mean, m2); settings stay as constructed."""
        try:
            count, mean, m2 = int(state["count"]), float(state["running_mean"]), float(state["m2"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a RewardNormalizer state: {state!r}") from e
        if count < 0 or m2 < 0 or not math.isfinite(mean) or not math.isfinite(m2):
            raise ValueError(f"corrupt RewardNormalizer state: {state!r}")
        self.count, self.running_mean, self.m2 = count, mean, m2
