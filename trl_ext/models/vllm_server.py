"""Rollouts sampled by vLLM servers of their own (`PPOConfig(use_vllm=True, vllm_mode="server")`): `vllm serve` or
`trl vllm-serve` on other GPUs or nodes, reached over HTTP (docs/scale-out.md has the launch lines).

- Sampling: one `/v1/completions` request per row (its own seed), sent concurrently; the server batches them. It
  samples what the colocated engine samples (vllm_sampler.py): softmax(logits / temperature), up to `response_length`
  tokens, stopping at the stop token only, with the sampled tokens' log-probs (the server runs with
  `--logprobs-mode processed_logprobs`, as `trl vllm-serve` sets it). Several servers split the rows.
- A LoRA policy sends only its adapter (a 4-bit base is never merged): the main process saves each version to
  `vllm_server_sync_dir` and loads it on every server under a new name (`/v1/load_lora_adapter`, the server started
  with `--enable-lora` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`), then unloads the previous one. With
  `async_rollouts` (`load_version`) each version gets its own name and stays loaded until no draw needs it: a draw
  names one version at a time. Each request names
  the version it must be sampled with, and the server answers with that name or an error: a version it lacks (it
  restarted, or the load did not apply) is loaded again from its saved folder, never sampled stale.
- A full policy sends every weight over TRL's NCCL weight-transfer group (TRL's `VLLMClient`, `trl vllm-serve`'s
  protocol): CUDA only. A server restarted between syncs has its original weights again, which no name reveals:
  `rollout/sampler_logprob_diff_*` does.
- A server that is down, starting or restarting is retried until `vllm_server_timeout`, then the run stops with an
  error naming the server.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from ..core import real_rows
from .forward import _underlying
from .generation import Sampling

logger = logging.getLogger(__name__)
RETRY_STATUS = (500, 502, 503, 504)  # a server starting or overloaded
REQUESTS_IN_FLIGHT = 64  # per server, as TRL's VLLMClient


class ServerUnavailable(ConnectionError):
    """A server did not answer within `vllm_server_timeout`."""


class VLLMServer:
    """One server's HTTP API (stdlib only: the trainer's side needs neither vLLM nor `requests` for LoRA)."""

    def __init__(self, url: str, timeout: float):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, path: str, body: dict | None = None, wait_for_answer: bool = False) -> tuple[int, dict | str]:
        """GET (no body) or POST `path` -> (status, parsed JSON or text). Connection errors and 5xx answers are retried
        with backoff until `timeout` seconds have passed; 4xx answers come back to the caller. `wait_for_answer`: no
        limit on the wait for the answer of a request that connected (a completion takes as long as it takes, as
        with TRL's client; a server that dies drops the connection, which is retried)."""
        data = None if body is None else json.dumps(body).encode()
        start, wait = time.monotonic(), 0.5
        while True:
            request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(request, timeout=None if wait_for_answer else self.timeout) as response:
                    return response.status, _parse(response.read())
            except urllib.error.HTTPError as error:  # the server answered
                if error.code not in RETRY_STATUS:
                    return error.code, _parse(error.read())
                problem = f"HTTP {error.code}"
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as error:  # no answer
                problem = f"{type(error).__name__}: {getattr(error, 'reason', error)}"
            if time.monotonic() - start + wait > self.timeout:
                raise ServerUnavailable(
                    f"the vLLM server at {self.url} did not answer {path} for {self.timeout:.0f} s ({problem}). "
                    "Start it (docs/scale-out.md: `vllm serve MODEL --enable-lora ...`), check vllm_server_base_url, "
                    "or raise vllm_server_timeout for a server that takes longer to start.")
            time.sleep(wait)
            wait = min(2 * wait, 8.0)

    def ok(self, path: str, body: dict | None = None, what: str = "") -> dict:
        status, answer = self.call(path, body)
        if status != 200:
            raise RuntimeError(f"the vLLM server at {self.url} refused {what or path} (HTTP {status}): {answer}")
        return answer


def _parse(raw: bytes):
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode(errors="replace")


class VLLMServerSampler:
    """vLLM servers serving the policy: `sync(policy, version)` before each rollout, then `generate(...)` (the
    colocated `VLLMSampler`'s interface). Every process samples its own rows; the main process syncs the weights."""

    def __init__(self, policy: nn.Module, sampling: Sampling, pad_token_id: int, *, urls: list[str], timeout: float,
                 sync_dir: str, group_port: int, device: torch.device, accelerator=None,
                 adapter_name: str | None = None):
        self.sampling, self.pad_token_id, self.accelerator = sampling, pad_token_id, accelerator
        self.policy_adapter = adapter_name  # the trained adapter of a peft policy (None: its active one)
        self.servers = [VLLMServer(url, timeout) for url in urls]
        self.is_peft = hasattr(policy, "peft_config")
        if not self.is_peft and device.type != "cuda":
            raise ValueError(
                "vllm_mode='server' with a full (non-LoRA) policy sends its weights over NCCL (TRL's VLLMClient), "
                f"which needs a CUDA device; this trainer runs on {device.type}. Train a LoRA policy (peft_config: "
                "only the adapter is sent), or use vllm_mode='colocate'.")
        self.is_main = accelerator is None or accelerator.is_main_process
        self.syncs, self.version = 0, None
        self.resyncs = 0  # adapter versions loaded again because a server lacked the one a request named
        self.adapter_name, self.adapter_path = None, None
        self.folders: dict[str, str] = {}  # every adapter of this run loaded now: name -> its saved folder
        self.loading = threading.Lock()
        # each server's model: the entry that is no adapter (`vllm serve MODEL`'s name, or its --served-model-name);
        # the reference (a LoRA policy's base) is sampled under that name, on whichever server gets the row
        bases = [next(m["id"] for m in server.ok("/v1/models", what="the model list")["data"] if not m.get("parent"))
                 for server in self.servers]
        if len(set(bases)) > 1:
            raise ValueError(f"the servers of vllm_server_base_url serve different models: {dict(zip(urls, bases))}. "
                             "Serve the same model under the same name on each (--served-model-name).")
        self.base_name = bases[0]
        # adapter names carry this run's tag, the same on every process: runs sharing a server never collide
        tag = [uuid.uuid4().hex[:8]]
        if accelerator is not None and accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(tag)
        self.tag, self.sync_dir = tag[0], sync_dir
        self.client = None
        if not self.is_peft and self.is_main:  # every weight over TRL's NCCL group (its VLLMClient)
            self.client = _trl_client(urls, timeout, group_port, device)

    # ------------------------------------------------------------------------------------------------ weights
    def sync(self, policy: nn.Module, version=None) -> None:
        """Put the policy's current weights on every server (the main process sends them; the others wait). `version`
        already there: a no-op."""
        if version is not None and version == self.version:
            return
        self.syncs += 1
        self.version = version
        if self.is_peft:
            previous = self.adapter_name, self.adapter_path
            self.adapter_name = f"trl_ext-{self.tag}-v{self.syncs}"
            self.adapter_path = os.path.join(self.sync_dir, self.adapter_name)
            self._put(policy, self.adapter_name, self.adapter_path)
            if self.is_main and previous[0] is not None:
                self.unload(previous[0])
        elif self.is_main:
            model = _underlying(policy)
            with self.client.weight_update():
                for name, param in model.named_parameters():
                    self.client.update_named_param(name, param.data)
            self.client.reset_prefix_cache()  # cached prefixes hold the old weights' keys and values
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()  # no process samples before the weights are there

    def load_version(self, policy: nn.Module, version: int) -> str:
        """Put the policy's current adapter on every server under a name of its own (`async_rollouts`: the sampler
        draws with the versions it was given while newer ones arrive), keeping the others; every process calls this.
        Returns the name requests give (`generate(adapter_name=...)`); `unload` it once no draw needs it."""
        if not self.is_peft:
            raise ValueError("async_rollouts with vllm_mode='server' keeps several policy versions on the server at "
                             "once, as LoRA adapters: train a LoRA policy (peft_config), or use async_rollouts with "
                             "HF generate (use_vllm=False).")
        name = f"trl_ext-{self.tag}-step{version}"
        self._put(policy, name, os.path.join(self.sync_dir, name))
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()  # no process samples before the weights are there
        return name

    def _put(self, policy: nn.Module, name: str, path: str) -> None:
        """The main process saves the adapter to `path` and loads it on every server as `name`."""
        self.folders[name] = path
        if self.is_main:
            _save_adapter(policy, path, self.policy_adapter)
            for server in self.servers:
                self._load(server, name)

    def unload(self, name: str) -> None:
        """Unload adapter `name` from every server and delete its folder (the main process; the others forget it)."""
        path = self.folders.pop(name, None)
        if not self.is_main:
            return
        try:
            for server in self.servers:
                server.call("/v1/unload_lora_adapter", {"lora_name": name})
        finally:
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)

    def _load(self, server: VLLMServer, name: str, again: bool = False) -> None:
        """Load adapter `name` from its folder on `server` (`again`: a request found it missing; another one may have
        loaded it just now)."""
        with self.loading:  # requests that found the version missing load it once
            status, answer = server.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": self.folders[name]})
            if again and status == 200:
                self.resyncs += 1
                logger.warning("the vLLM server at %s lacked adapter %s (restarted, or a load that did not apply): "
                               "loaded it again before sampling", server.url, name)
        if status != 200 and "already been loaded" not in str(answer):
            hint = (" Start the server with --enable-lora (and --max-lora-rank at least the adapter's r) and "
                    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 in its environment; vllm_server_sync_dir must be a folder the "
                    "server can read." if status in (400, 404, 405) else "")
            raise RuntimeError(f"the vLLM server at {server.url} did not load adapter {name} from "
                               f"{self.folders[name]} (HTTP {status}): {answer}.{hint}")

    # ------------------------------------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, queries: torch.Tensor, query_mask: torch.Tensor, seeds: list[int], adapter: bool = True,
                 adapter_name: str | None = None):
        """(B, Q) left-padded prompts -> (B, T) responses (the pad id after the end) and the server's (B, T) fp32
        log-probs of them (0 after the end). `adapter=False`: a LoRA policy's base (its reference) samples;
        `adapter_name`: that version of `load_version` (None: the one of the last `sync`)."""
        adapter_name = adapter_name or self.adapter_name
        if self.is_peft and adapter and adapter_name is None:
            raise RuntimeError("the server has no adapter of this run yet: call sync(policy) before generate")
        s, stop = self.sampling, self.sampling.stop_token_id
        B, T = queries.shape[0], s.response_length
        model = adapter_name if (self.is_peft and adapter) else self.base_name
        rows = real_rows(queries, query_mask.bool())
        share = -(-B // len(self.servers))  # the rows split in contiguous shares, one per server

        def complete(i: int):
            body = {"model": model, "prompt": rows[i], "max_tokens": T, "temperature": s.temperature, "top_p": 1.0,
                    "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0, "seed": seeds[i], "logprobs": 0,
                    "ignore_eos": True, "stop_token_ids": [stop] if stop is not None else [],
                    "skip_special_tokens": False, "return_token_ids": True, "return_tokens_as_token_ids": True}
            return self._complete(self.servers[i // share], body)

        with ThreadPoolExecutor(max_workers=min(B, REQUESTS_IN_FLIGHT * len(self.servers))) as pool:
            choices = list(pool.map(complete, range(B)))
        responses = torch.full((B, T), self.pad_token_id, dtype=queries.dtype)
        logprobs = torch.zeros((B, T), dtype=torch.float32)
        for i, choice in enumerate(choices):
            ids = list(choice["token_ids"])[:T]
            responses[i, : len(ids)] = torch.tensor(ids, dtype=queries.dtype)
            logprobs[i, : len(ids)] = torch.tensor(choice["logprobs"]["token_logprobs"][: len(ids)],
                                                   dtype=torch.float32)
        return responses.to(queries.device), logprobs.to(queries.device)

    def _complete(self, server: VLLMServer, body: dict) -> dict:
        """One completion, sampled by the model `body` names. A server that lacks that adapter version (it restarted,
        or a load did not apply) loads it again from its saved folder, once."""
        for attempt in range(2):
            status, answer = server.call("/v1/completions", body, wait_for_answer=True)
            if status == 200:
                if answer.get("model") != body["model"]:
                    raise RuntimeError(f"the vLLM server at {server.url} answered with model {answer.get('model')!r} "
                                       f"where {body['model']!r} was asked: the samples would not be the policy's.")
                return answer["choices"][0]
            if status == 404 and body["model"] in self.folders and attempt == 0:
                self._load(server, body["model"], again=True)
                continue
            raise RuntimeError(f"the vLLM server at {server.url} refused a completion of {body['model']!r} "
                               f"(HTTP {status}): {answer}")

    def close(self) -> None:
        """Unload this run's adapters and delete their folders (the main process's: shared by all)."""
        for name in list(self.folders):
            try:
                self.unload(name)
            except ServerUnavailable:
                pass


def _save_adapter(policy: nn.Module, path: str, name: str | None = None) -> None:
    """The policy's adapter `name` (None: its active one) alone, as a folder vLLM loads (adapter_config.json and
    the weights)."""
    name = name or policy.active_adapter
    policy.save_pretrained(path, selected_adapters=[name])
    if name != "default":  # peft puts a named adapter in a subfolder of its own
        nested = os.path.join(path, name)
        for entry in os.listdir(nested):
            os.replace(os.path.join(nested, entry), os.path.join(path, entry))
        os.rmdir(nested)


def _trl_client(urls: list[str], timeout: float, group_port: int, device: torch.device):
    """TRL's VLLMClient with its NCCL weight-transfer group open (`trl vllm-serve`'s protocol)."""
    if len(urls) > 1:
        raise ValueError(f"vllm_server_base_url names {len(urls)} servers: full weights go to one server over TRL's "
                         "NCCL group; serve it with --data_parallel_size instead, or train a LoRA policy.")
    from trl.generation.vllm_client import VLLMClient  # (trl >= 1.12, trl_ext's floor)
    client = VLLMClient(base_url=urls[0], group_port=group_port, connection_timeout=timeout)
    client.init_communicator(device=device)
    return client


def server_urls(args) -> list[str]:
    """The servers of `vllm_mode="server"`: vllm_server_base_url's (comma-separated), else host:port."""
    if args.vllm_server_base_url:
        return [url.strip() for url in args.vllm_server_base_url.split(",")]
    return [f"http://{args.vllm_server_host}:{args.vllm_server_port}"]
