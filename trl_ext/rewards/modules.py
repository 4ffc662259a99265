"""Reward models, one class per kind, each `score(batch) -> (B,)`:

- `ModelReward`: TRL's layout (a backbone and a 1-output `score` head) on the policy's token ids, read at the last
  real token (positionally, from the attention mask: with pad == EOS it still reads the EOS token).
- `ModuleReward`: a module without a `score` head on the policy's ids (a rule-based `PreTrainedModel`, any
  `nn.Module`): one score per row (`module_scores`).
- `TextModelReward`: a model with its own tokenizer: the text decoded from the policy's tokens, re-rendered and
  re-tokenized for it (see `RewardScorer`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from ..core import last_true_index, real_rows
from ..models import Packing, position_ids_from_mask, scalar_head_outputs, sequence_inputs
from .batch import RewardBatch
from .functions import check_reward_function_output, is_reward_function


def load_reward_model(path: str | os.PathLike) -> tuple[nn.Module, Any]:
    """A reward model given by path (a local folder or a hub id), loaded as TRL's GRPOTrainer loads one:
    `AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)` and its own tokenizer (pad token = EOS
    if it has none). Returns (model, tokenizer): it reads text through that tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = str(path)
    try:
        architectures = AutoConfig.from_pretrained(path).architectures or []
    except (OSError, ValueError) as e:
        raise ValueError(f"reward_model={path!r} is a string, so it is loaded as a reward model from that folder or "
                         f"hub id, and that failed: {e}. Pass a path to a sequence-classification model (with its "
                         "tokenizer), or the model itself.") from e
    if not any(name.endswith("ForSequenceClassification") for name in architectures):
        raise ValueError(f"reward {path!r} is a {', '.join(architectures) or 'model'} checkpoint, not a sequence "
                         "classifier: loaded as one it would score with a new, random head (GRPOTrainer does so "
                         "silently). Pass a reward model saved as AutoModelForSequenceClassification "
                         "(num_labels=1), or a reward function.")
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

@torch.no_grad()
def score_responses(reward, tokenizer, queries, query_mask, responses, response_mask) -> torch.Tensor:
    """(B,) float32 score of each query+response (the response cut after its stop token)."""
    if is_reward_function(reward):
        prompts = tokenizer.batch_decode(real_rows(queries, query_mask), skip_special_tokens=True)
        completions = tokenizer.batch_decode(real_rows(responses, response_mask), skip_special_tokens=True)
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

def read_last_token(model: nn.Module, inputs: dict, padding_free: bool = False) -> torch.Tensor:
    """(B,) the scalar head's output at each row's last real token (positionally, from the attention mask);
    padding_free: the rows' real tokens run as one packed sequence (`models.Packing`)."""
    device = _model_device(model)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    if padding_free:
        packing = Packing.of(inputs)
        return packing.last_tokens(scalar_head_outputs(model, packing.inputs))
    per_position = scalar_head_outputs(model, inputs)  # (B, L)
    last = last_true_index(inputs["attention_mask"].bool())
    return per_position.gather(1, last[:, None]).squeeze(1)


def tokenize(tok, texts: list[str], add_special_tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
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


def check_model_scores(name: str, scores: torch.Tensor, B: int) -> None:
    if scores.shape != (B,):
        raise ValueError(f"reward model {name!r} gave scores of shape {tuple(scores.shape)} for a batch of "
                         f"{B}; it needs a 1-output head.")
    bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"reward model {name!r} gave non-finite scores at rows {bad[:5]} "
                         f"({scores[bad[:5]].tolist()}); check its precision (fp16 overflow) and inputs.")


class ModelReward:
    """TRL's layout on the policy's ids, read at each row's last real token."""

    kind = "model"

    def __init__(self, model: nn.Module, name: str):
        self.obj, self.name, self.tokenizer = model, name, None

    def score(self, batch: RewardBatch) -> torch.Tensor:
        return read_last_token(self.obj, batch.inputs, batch.padding_free)


class ModuleReward(ModelReward):
    """A module without a `score` head on the policy's ids: it scores whole rows."""

    kind = "module"

    def score(self, batch: RewardBatch) -> torch.Tensor:
        return module_scores(self.obj, batch.inputs, batch.policy_tokenizer.pad_token_id, self.name)


class TextModelReward(ModelReward):
    """A model with its own tokenizer, reading the text re-rendered for it."""

    kind = "text_model"

    def __init__(self, model: nn.Module, name: str, tokenizer):
        super().__init__(model, name)
        self.tokenizer = tokenizer

    def score(self, batch: RewardBatch) -> torch.Tensor:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None):
            prompts, completions = batch.texts()
            texts = [tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                             tokenize=False) for p, c in zip(prompts, completions)]
            add_special_tokens = False  # the template renders them
        else:
            texts = batch.joined_texts()
            add_special_tokens = True
        input_ids, attention_mask = tokenize(tok, texts, add_special_tokens)
        model = self.obj
        if not has_score_head(model):  # an encoder classifier (DeBERTa, BERT, ...): it pools its own way
            device = _model_device(model)
            logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits
            return logits[:, 0]
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask,
                  "position_ids": position_ids_from_mask(attention_mask)}
        return read_last_token(model, inputs, batch.padding_free)
