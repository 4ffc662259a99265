"""Model plumbing: forward passes with real attention masks, generation that samples from the policy as is, the
policy+value wrapper the optimizer trains. Everything here takes explicit masks; nothing compares ids with the pad id.

Shapes: B = batch, Q = query (prompt) length, T = response length, V = vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from transformers import GenerationConfig


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) bool/long -> (B, L) long: 0 at the first real token, counting real tokens (left padding gets 0)."""
    return (attention_mask.long().cumsum(1) - 1).clamp(min=0)


def sequence_inputs(queries, query_mask, responses, response_mask) -> dict[str, torch.Tensor]:
    """Model inputs for query+response: (B, Q+T) ids, attention mask and position ids. Tokens after the stop token
    (response_mask False) are masked out, so nothing reads them."""
    input_ids = torch.cat([queries, responses], dim=1)  # (B, Q+T)
    attention_mask = torch.cat([query_mask, response_mask], dim=1).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask)}


def response_logits(model: nn.Module, inputs: dict, context_length: int, temperature: float) -> torch.Tensor:
    """(B, T, V) logits that predict each response token, divided by the sampling temperature."""
    logits = model(**inputs, use_cache=False).logits  # (B, Q+T, V)
    return logits[:, context_length - 1 : -1] / temperature


def sampling_config(response_length: int, temperature: float, stop_token_id: int | None, pad_token_id: int):
    """A GenerationConfig that samples from softmax(logits / temperature) and nothing else.

    Every logits processor a model's own `generation_config` may carry (repetition_penalty, top_k, top_p, min_p,
    no_repeat_ngram_size, ...) is set to its neutral value, so the tokens PPO trains on are drawn from the policy
    whose log-probs the loss uses (TRL 1.12 let such settings alter the behaviour policy)."""
    return GenerationConfig(
        max_new_tokens=response_length,
        min_new_tokens=0,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        min_p=None,
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        bad_words_ids=None,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        forced_bos_token_id=None,
        forced_eos_token_id=None,
        eos_token_id=stop_token_id,
        pad_token_id=pad_token_id,
    )


@torch.no_grad()
def generate_responses(policy, queries, query_mask, generation_config: GenerationConfig, pad_token_id: int,
                       chunk_size: int) -> torch.Tensor:
    """Sample responses for left-padded queries, in chunks. Returns (B, T) ids, T = response_length, padded with
    `pad_token_id` where generation stopped early (those positions are masked later by the stop position)."""
    out = []
    for i in range(0, queries.shape[0], chunk_size):
        q, m = queries[i : i + chunk_size], query_mask[i : i + chunk_size]
        seq = policy.generate(input_ids=q, attention_mask=m.long(), generation_config=generation_config)
        out.append(seq[:, q.shape[1]:])
    T = generation_config.max_new_tokens
    responses = torch.full((queries.shape[0], T), pad_token_id, dtype=queries.dtype, device=queries.device)
    for i, r in zip(range(0, queries.shape[0], chunk_size), out):
        responses[i : i + r.shape[0], : r.shape[1]] = r
    return responses


def scalar_head_outputs(model: nn.Module, inputs: dict) -> torch.Tensor:
    """(B, L) per-position scalar of a sequence-classification model (TRL's reward/value model layout: a backbone
    under `base_model_prefix` and a `score` head)."""
    backbone = getattr(model, model.base_model_prefix)
    hidden = backbone(**inputs, use_cache=False).last_hidden_state  # (B, L, H)
    return model.score(hidden).squeeze(-1)  # (B, L)


class PolicyAndValueWrapper(nn.Module):
    """Policy and value model as one module, so one `accelerator.prepare` (DDP/DeepSpeed/FSDP) wraps both.
    Keeps TRL's attribute names (`policy`, `value_model`) so TRL's own helpers work on it."""

    def __init__(self, policy: nn.Module, value_model: nn.Module):
        super().__init__()
        self.policy = policy
        self.value_model = value_model

    # TRL's `unwrap_model_for_generation` turns checkpointing off while generating (it breaks the KV cache)
    @property
    def is_gradient_checkpointing(self) -> bool:
        return bool(getattr(self.policy, "is_gradient_checkpointing", False))

    def gradient_checkpointing_enable(self, **kwargs):
        for module in (self.policy, self.value_model):
            if getattr(module, "supports_gradient_checkpointing", False):
                module.gradient_checkpointing_enable(**kwargs)

    def gradient_checkpointing_disable(self):
        for module in (self.policy, self.value_model):
            if getattr(module, "supports_gradient_checkpointing", False):
                module.gradient_checkpointing_disable()

    def forward(self, input_ids, attention_mask, position_ids):
        """-> (policy logits (B, L, V), values (B, L))."""
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        logits = self.policy(**inputs, use_cache=False).logits
        return logits, scalar_head_outputs(self.value_model, inputs)


def build_value_model(init: str, head_init: str | None, value_model, policy, reward_model):
    """The critic a run trains, chosen by `PPOConfig.value_model_init`:

    - "given": `value_model` as passed (TRL's behaviour);
    - "reward_model": a copy of the reward model, head included (InstructGPT: the critic starts from the RM);
    - "policy": a sequence-classification model of the policy's architecture, its backbone copied from the policy,
      with a fresh 1-output `score` head.

    `head_init` "zero" zeroes the `score` head so V ≈ 0 at step 0 (None: "zero" for a built model, "keep" for a
    given one).
    """
    import copy

    from transformers import AutoModelForSequenceClassification

    if init == "given":
        if value_model is None:
            raise ValueError("No value model: pass `value_model=...`, or set value_model_init='policy' or "
                             "'reward_model' to build one.")
        critic = value_model
    else:
        if value_model is not None:
            raise ValueError(f"value_model_init={init!r} builds the value model, but a `value_model` was passed too: "
                             "pass value_model=None, or set value_model_init='given'.")
        if init == "reward_model":
            if not isinstance(reward_model, nn.Module):
                raise ValueError("value_model_init='reward_model' needs a reward *model*; the reward is a function. "
                                 "Use value_model_init='policy' or pass a value_model.")
            critic = copy.deepcopy(reward_model)
        else:  # "policy"
            base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
            if getattr(base, "is_loaded_in_4bit", False) or getattr(base, "is_loaded_in_8bit", False):
                raise ValueError("value_model_init='policy' cannot copy a quantized policy's backbone; pass a "
                                 "value_model.")
            config = copy.deepcopy(base.config)
            config.num_labels = 1
            critic = AutoModelForSequenceClassification.from_config(config)
            backbone = getattr(base, base.base_model_prefix)
            getattr(critic, critic.base_model_prefix).load_state_dict(backbone.state_dict())
            critic.to(dtype=next(base.parameters()).dtype, device=next(base.parameters()).device)
        critic.config.pad_token_id = getattr(critic.config, "pad_token_id", None) or policy.config.pad_token_id
    if (head_init or ("keep" if init == "given" else "zero")) == "zero":
        with torch.no_grad():
            for p in critic.score.parameters():
                p.zero_()
    return critic
