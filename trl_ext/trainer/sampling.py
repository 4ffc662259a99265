"""`ResponseSampler`: every draw of responses goes through here.

- `rollout_responses`: the rollout's draw (step 1), seeded by (process, iteration).
- `turn_generator`: the turns of a multi-turn rollout, seeded alike.
- `stream_responses`: evaluation's and the samples' draws, of the policy or the reference, from an RNG stream of their
  own, so the training run never changes and the two share random numbers (a paired comparison).

What draws is the generator chosen at set-up (trl_ext/trainer/generators.py: HF generate, or vLLM colocated or as a
server), behind `sync` and `generate`. Either way the response mask comes from the stop position, and the pad id
fills what follows it.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager, nullcontext

import torch

from ..core import real_rows, response_mask_from_stop
from ..models import Sampling
from .backend import Backend, Reference
from .generators import HFGenerate, Seeds
from .multi_turn import left_pad
from .seeds import rollout_seed, vllm_stream_seed


class ResponseSampler:
    """`hf`: HF generate, which draws evaluation's completions of any model and the async sampler's copy;
    `generator`: what draws the rollouts (`hf` itself, or a `VLLMGenerate`)."""

    def __init__(self, backend: Backend, reference: Reference, sampling: Sampling, pad_token_id: int,
                 hf: HFGenerate, generator, local_seed: int):
        self.backend, self.reference, self.sampling, self.pad_token_id = backend, reference, sampling, pad_token_id
        self.hf, self.generator, self.local_seed = hf, generator, local_seed

    def masked(self, responses: torch.Tensor, sampler_logprobs: torch.Tensor):
        """Drawn ids -> the ids with the pad id after the stop token, their response mask, the log-probs."""
        response_mask = response_mask_from_stop(responses, self.sampling.stop_token_id)
        return responses.masked_fill(~response_mask, self.pad_token_id), response_mask, sampler_logprobs

    def generate(self, policy, queries: torch.Tensor, query_mask: torch.Tensor,
                 generator: torch.Generator | None = None):
        """Sample with `policy` by HF generate -> (B, T) responses (the pad id after the stop token), their (B, T)
        bool mask (up to and including the stop token) and the sampler's (B, T) log-probs."""
        return self.masked(*self.hf.draw(policy, queries, query_mask, self.sampling, generator))

    def rollout_generator(self, step: int, draw: int = 0) -> torch.Generator:
        """The RNG of iteration `step`'s rollout draw by HF generate on this process (the async sampler's copy)."""
        return Seeds(rollout_seed(self.local_seed, step, draw)).generator(self.backend.device)

    def _draw(self, queries, query_mask, step: int, seeds: Seeds, **kwargs):
        """The generator's draw once it holds step `step`'s weights, masked."""
        self.generator.sync(step)
        return self.masked(*self.generator.generate(queries, query_mask, seeds, self.sampling, **kwargs))

    def rollout_responses(self, queries: torch.Tensor, query_mask: torch.Tensor, step: int, draw: int = 0):
        """Step 1 of iteration `step`: the policy's responses, mask and sampler log-probs, drawn from seeds of
        (process, step, draw) alone, so a resumed run, or a sampler in another thread, draws what the uninterrupted
        run drew. `draw` >= 1: dynamic sampling's further draws of the same iteration."""
        return self._draw(queries, query_mask, step, Seeds(rollout_seed(self.local_seed, step, draw)))

    def turn_generator(self, step: int, draw: int = 0, seed: int | None = None):
        """Multi-turn rollouts (trl_ext/trainer/multi_turn.py) of iteration `step`: a function (contexts, n) -> one
        model turn of at most n tokens for each context (a token-id list): (ids up to and including the stop token,
        the sampler's log-probs). Every turn reads the draw's `Seeds` of (process, step, draw), or of `seed`: a
        stream of its own instead (evaluation), the training draws untouched."""
        seeds = Seeds(rollout_seed(self.local_seed, step, draw) if seed is None else seed)

        def generate(contexts: list[list[int]], max_new_tokens: int):
            queries, query_mask = left_pad(contexts, self.pad_token_id, torch.long)
            queries, query_mask = queries.to(self.backend.device), query_mask.to(self.backend.device)
            with self.turn_length(max_new_tokens):
                ids, mask, logprobs = self._draw(queries, query_mask, step, seeds)
            return [(row, lp[: len(row)]) for row, lp in zip(real_rows(ids, mask), logprobs.cpu().tolist())]

        return generate

    @contextmanager
    def turn_length(self, n: int):
        """Inside, every draw is of at most n tokens."""
        kept = self.sampling
        self.sampling = dataclasses.replace(kept, response_length=n)
        try:
            yield
        finally:
            self.sampling = kept

    def stream_responses(self, queries: torch.Tensor, query_mask: torch.Tensor, seed: int, reference: bool,
                         step: int):
        """Responses of the policy (or the reference) drawn from their own RNG stream `seed`: the training RNG is
        untouched, and policy and reference share random numbers (identical models give identical completions).
        With vLLM serving a LoRA policy both sample there, the same seed per row; otherwise HF generate samples."""
        if self.generator.samples_reference:
            seeds = Seeds(vllm_stream_seed(seed))
            return self._draw(queries, query_mask, step, seeds, adapter=not reference)[:2]
        with self.own_rng(seed):
            policy = self.backend.unwrap().policy
            model, context = self.reference.generation_model(policy) if reference else (policy, nullcontext())
            with context:
                return self.generate(model, queries, query_mask)[:2]

    @contextmanager
    def own_rng(self, seed: int):
        """Draw from an RNG stream of its own inside (seeded with `seed`); the training RNG is restored after."""
        device = self.backend.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            yield
