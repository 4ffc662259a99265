"""Generation that samples from the policy as is: softmax(logits / temperature), nothing else (`TokenSampler`),
whatever the model's own `generation_config` says, stopping at the stop token."""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager

import torch
import torch.nn as nn
from transformers import GenerationConfig

from .forward import _underlying, model_input_ids


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What PPO samples: `response_length` tokens from softmax(logits / temperature), stopping at `stop_token_id`
    (None: no stop token; EOS is then an ordinary token and every response has `response_length` tokens)."""

    response_length: int
    temperature: float
    stop_token_id: int | None


def sampling_config(sampling: Sampling) -> GenerationConfig:
    """The complete GenerationConfig `generate_responses` runs `generate()` with: greedy decoding over the one-hot
    scores of `TokenSampler` (which draws the token itself), every other logits processor off, KV cache on.

    Every field is set: transformers' defaults for everything else, and nothing is ever filled in from a model's own
    `generation_config` (`generate_responses` swaps it for this one during the call). Finished rows are filled with
    the stop token (an id the model has), never with the tokenizer's pad id."""
    config = GenerationConfig(**GenerationConfig()._get_default_generation_params())
    config.update(
        max_new_tokens=sampling.response_length, max_length=None, min_length=0,
        do_sample=False, num_beams=1, num_return_sequences=1, use_cache=True,
        eos_token_id=sampling.stop_token_id,
        pad_token_id=0 if sampling.stop_token_id is None else sampling.stop_token_id,
        output_scores=False, output_logits=False, return_dict_in_generate=False,
    )
    return config


class TokenSampler:
    """A logits processor that *is* the sampler: it draws each next token from softmax(scores / temperature) with
    torch's RNG, records that token's log-prob (fp32), and returns scores that are 0 at the drawn token and −inf
    elsewhere, so greedy decoding in `generate()` takes exactly that token. No warper of transformers (top-k, top-p,
    min-p, temperature, ...) can then change what is sampled: whatever a model's generation_config says, the tokens
    PPO trains on come from the policy's own distribution, and `logprobs` are the sampler's log-probs of them."""

    def __init__(self, temperature: float, generator: torch.Generator | None = None):
        self.temperature, self.generator = temperature, generator  # generator None: torch's global RNG
        self.steps: list[torch.Tensor] = []  # one (B,) fp32 tensor per generation step

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        logp = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        try:
            tokens = torch.multinomial(logp.exp(), num_samples=1, generator=self.generator)  # (B, 1)
        except RuntimeError as e:  # torch's "probability tensor contains either inf, nan or element < 0"
            raise FloatingPointError("the policy's next-token probabilities hold NaN/inf: its logits overflowed, so "
                                     "its weights are out of range.") from e
        self.steps.append(logp.gather(1, tokens).squeeze(1))
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens, 0.0)


@contextmanager
def eval_mode(model: nn.Module):
    """Every submodule in eval mode inside, each restored to its own mode after. Generation runs so: no dropout, and
    gradient checkpointing (active only in training mode) never turns off the KV cache (transformers 5.3-5.23 drop
    the cache of a checkpointed model in training mode even without grad)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextmanager
def generation_config_of(model: nn.Module, config: GenerationConfig):
    """`model.generation_config` (the transformers model under a peft wrapper) is `config` inside: `generate()` fills
    every field left None from the model's own config (min_p, suppress_tokens, eos_token_id, ...), so the model's
    config must hold nothing but ours while PPO samples."""
    target = _underlying(model)
    saved = getattr(target, "generation_config", None)
    target.generation_config = config
    try:
        yield
    finally:
        target.generation_config = saved


@torch.no_grad()
def generate_responses(policy, queries, query_mask, sampling: Sampling, chunk_size: int,
                       generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample responses for left-padded queries, in chunks of `chunk_size` rows, drawing from `generator` (None:
    torch's global RNG).

    Returns (B, T) ids, T = `sampling.response_length` (positions after the stop token hold the stop token, or are
    unfilled past the end of generation: the response mask from the stop position hides them), and the sampler's
    (B, T) fp32 log-probs of those tokens (`TokenSampler`; meaningless after the stop token). Runs with the policy in
    eval mode, the KV cache on, and the model's own generation_config out of the way; the caller sets the precision
    (the trainer generates under the same autocast as the loss)."""
    from transformers import LogitsProcessorList

    config = sampling_config(sampling)
    B, T = queries.shape[0], sampling.response_length
    fill = config.pad_token_id
    responses = torch.full((B, T), fill, dtype=queries.dtype, device=queries.device)
    logprobs = torch.zeros((B, T), dtype=torch.float32, device=queries.device)
    with eval_mode(policy), generation_config_of(policy, config):
        for i in range(0, B, chunk_size):
            q, m = queries[i : i + chunk_size], query_mask[i : i + chunk_size].long()
            sampler = TokenSampler(sampling.temperature, generator)
            seq = policy.generate(input_ids=model_input_ids(q, m), attention_mask=m, generation_config=config,
                                  logits_processor=LogitsProcessorList([sampler]))
            n = seq.shape[1] - q.shape[1]  # tokens generated (the sampler may have run steps generate undid)
            responses[i : i + q.shape[0], :n] = seq[:, q.shape[1]:]
            if n:
                logprobs[i : i + q.shape[0], :n] = torch.stack(sampler.steps[:n], dim=1).to(logprobs.device)
    return responses, logprobs
