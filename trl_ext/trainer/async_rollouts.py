"""Asynchronous rollouts (`PPOConfig.async_rollouts`): a thread of its own draws the responses of the next batches
while the trainer scores and updates on this one.

Versions: version v is the policy after v iterations' updates; iteration j trains batch j at version j. Batch j is
drawn with version

    sampler_version(j) = the smallest multiple of weight_sync_steps that is >= j - max_staleness (and >= 0)

so its staleness j - sampler_version(j) is at most max_staleness, and the version depends on j alone: the run is the
same however fast either side is, and a resumed run is exact. The trainer publishes every version the schedule uses
right after the update that makes it (`publish`); the sampler waits for the version a batch needs, then draws it with
the batch's own seed (`ResponseSampler.rollout_generator`, vLLM's per-request seeds). With max_staleness=0 every
batch waits for the update before it: synchronous PPO, the same numbers.

What the trainer does with a drawn batch is the synchronous rollout's steps 3-7 at version j (`RolloutPhase`): the
reference log-probs, π_old, the values, the scores, the rewards and GAE are all computed at training time, with the
current policy and critic; only the tokens and the sampler's log-probs are older. π_old is the current policy's
log-probs (rollout_logprobs='trainer', with vllm_importance_sampling_correction's weights π_old / π_sampler
correcting for the older sampler) or the sampler's (rollout_logprobs='sampler': the PPO ratio is taken against the
policy that sampled).

Checkpoints: at iteration k the batches drawn with a version older than k (they cannot be drawn again from the
checkpoint's weights) are waited for and saved (`state`); the others are drawn after a resume with version k, as
the uninterrupted run draws them. A saved batch older than a resumed run's max_staleness is dropped and drawn again
(`rollout/dropped_share`).

Two samplers (`ThreadSampler`, `ServerSampler`) share one interface: `weights(policy, version)` on the trainer's thread
(every process, at the same iteration), `draw(weights, queries, query_mask, step)` and `release(weights)` on the
sampler's.
"""

from __future__ import annotations

import copy
import math
import os
import threading
import time
from dataclasses import dataclass

import torch

from ..core.types import Rollout
from .rollout import prompt_tensors
from .seeds import request_seeds, rollout_seed

DRAWN_FILE = "async_rollouts_{process}.pt"  # in a checkpoint: the batches drawn with versions older than it


def sampler_version(step: int, max_staleness: int, weight_sync_steps: int) -> int:
    """The policy version batch `step` is drawn with: the smallest multiple of weight_sync_steps >= step -
    max_staleness, at least 0."""
    return weight_sync_steps * math.ceil(max(step - max_staleness, 0) / weight_sync_steps)


@dataclass
class Drawn:
    """One batch's draw: its prompts (the collator's batch), the responses, and where they came from."""
    step: int  # the iteration that trains it
    version: int  # the policy version that drew it
    batch: dict | None  # the collator's batch (input_ids, attention_mask, other columns)
    responses: torch.Tensor  # (B, T) ids, the pad id after the stop token
    response_mask: torch.Tensor  # (B, T) bool
    sampler_logprobs: torch.Tensor  # (B, T) the sampler's log-probs
    weight_wait: float = 0.0  # seconds the sampler waited for this batch's weights
    dropped: int = 0  # earlier draws of this batch dropped as too stale

    def saved(self) -> dict:
        return {"step": self.step, "version": self.version, "responses": self.responses.cpu(),
                "response_mask": self.response_mask.cpu(), "sampler_logprobs": self.sampler_logprobs.cpu()}


class ThreadSampler:
    """HF generate on a copy of the policy, in the sampler's thread: the trainer updates its own weights meanwhile.
    The copy shares every frozen tensor with the policy (a LoRA policy's base, its 4-bit weights): only the trained
    parameters are held twice, plus one snapshot of them per version not yet drawn with."""

    def __init__(self, sampler, policy: torch.nn.Module):
        self.sampler = sampler  # the trainer's ResponseSampler: the sampling settings, the precision, the seeds
        frozen = {id(t): t for t in list(policy.parameters()) + list(policy.buffers()) if not t.requires_grad}
        self.copy = copy.deepcopy(policy, memo=frozen)
        self.trained = [name for name, p in policy.named_parameters() if p.requires_grad]
        self.copy_params = dict(self.copy.named_parameters())
        self.loaded = None  # the version the copy holds

    def weights(self, policy: torch.nn.Module, version: int):
        params = dict(policy.named_parameters())
        return version, {name: params[name].detach().clone() for name in self.trained}

    def draw(self, weights, queries: torch.Tensor, query_mask: torch.Tensor, step: int):
        version, tensors = weights
        if self.loaded != version:
            with torch.no_grad():
                for name, tensor in tensors.items():
                    self.copy_params[name].copy_(tensor)
            self.loaded = version
        return self.sampler.generate(self.copy, queries, query_mask, self.sampler.rollout_generator(step))

    def release(self, weights) -> None:
        pass  # the snapshot goes with the last reference to it


class ServerSampler:
    """The vLLM servers of vllm_mode='server': each version a LoRA adapter of its own name on the servers
    (`VLLMServerSampler.load_version`), unloaded once no draw needs it."""

    def __init__(self, sampler):
        self.sampler, self.server = sampler, sampler.generator.engine

    def weights(self, policy: torch.nn.Module, version: int) -> str:
        return self.server.load_version(policy, version)

    def draw(self, weights: str, queries: torch.Tensor, query_mask: torch.Tensor, step: int):
        seeds = request_seeds(rollout_seed(self.sampler.local_seed, step), queries.shape[0])
        return self.sampler.masked(*self.server.generate(queries, query_mask, seeds, adapter_name=weights))

    def release(self, weights: str) -> None:
        self.server.unload(weights)


class AsyncRollouts:
    """The sampler's thread and the hand-over between it and the trainer (module docstring).

    `batches`: the prompt batches from iteration `first_step` on; `saved`: what a checkpoint saved (`state`): the
    draws, by step, and the counts behind the metrics."""

    def __init__(self, engine, batches, device: torch.device, first_step: int, total_steps: int, max_staleness: int,
                 weight_sync_steps: int, saved: dict | None = None, phase=None):
        self.engine, self.batches, self.device = engine, batches, device
        self.phase = phase  # the RolloutPhase that runs steps 3-7 of a draw (`next`)
        self.first_step, self.total_steps = first_step, total_steps
        self.max_staleness, self.weight_sync_steps = max_staleness, weight_sync_steps
        saved = saved or {}
        self.saved = {d["step"]: d for d in saved.get("draws", [])}
        self.ready: dict[int, Drawn] = {}
        self.published: dict[int, object] = {}  # version -> the engine's weights of it, until no draw needs them
        self.log: list[dict] = []  # one entry per batch trained: step, version, staleness, dropped draws
        self.publish_log: list[int] = []  # every version published to the sampler, in order
        # batches handed to the trainer, the draws of them dropped as too stale, the largest staleness trained on
        self.trained, self.dropped = saved.get("trained", 0), saved.get("dropped", 0)
        self.max_seen = saved.get("max_staleness_seen", 0)
        self.error: BaseException | None = None
        self.stopping = False
        self.condition = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="trl_ext-async-rollouts", daemon=True)

    # ------------------------------------------------------------------------------------------------ schedule
    def version_of(self, step: int) -> int:
        """The version batch `step` is drawn with: the schedule's, or (after a resume at `first_step`) the resumed
        weights' when the schedule's is older than them."""
        return max(sampler_version(step, self.max_staleness, self.weight_sync_steps), self.first_step)

    def needed(self, version: int) -> bool:
        return any(self.version_of(j) == version for j in range(max(version, self.first_step),
                                                                  min(version + self.max_staleness + 1,
                                                                      self.total_steps)))

    # ------------------------------------------------------------------------------------------------ trainer side
    def start(self, policy: torch.nn.Module) -> None:
        """Publish the starting weights (version `first_step`) and start the sampler's thread."""
        self.publish(policy, self.first_step)
        self.thread.start()

    def publish(self, policy: torch.nn.Module, version: int) -> None:
        """After the update that makes `version` (every process, the trainer's thread): hand its weights to the
        sampler, if a batch is drawn with them."""
        if not self.needed(version):
            return
        weights = self.engine.weights(policy, version)
        with self.condition:
            self.published[version] = weights
            self.publish_log.append(version)
            self.condition.notify_all()

    def take(self, step: int) -> tuple[Drawn, float]:
        """Batch `step`'s draw (waiting for it) and the seconds the trainer waited."""
        start = time.perf_counter()
        with self.condition:
            while step not in self.ready and self.error is None:
                self.condition.wait()
            self._raise()
            drawn = self.ready.pop(step)
        staleness = step - drawn.version
        if staleness > self.max_staleness:  # the schedule never draws so; a guard, not a mode
            raise RuntimeError(f"batch {step} was drawn with version {drawn.version}: {staleness} versions old, "
                               f"beyond max_staleness={self.max_staleness}.")
        self.max_seen = max(self.max_seen, staleness)
        self.trained += 1
        self.dropped += drawn.dropped
        self.log.append({"step": step, "version": drawn.version, "staleness": staleness, "dropped": drawn.dropped})
        return drawn, time.perf_counter() - start

    def next(self, step: int, kl_coef: float, trainer_state=None) -> Rollout:
        """Iteration `step`'s Rollout (the rollout source's call, as `SyncRollouts.next`): its draw, waited for, then
        steps 3-7 at the current policy; the draw's staleness and waits ride on `Rollout.draw_metrics`."""
        drawn, waited = self.take(step)
        queries, query_mask, columns = prompt_tensors(drawn.batch, self.device)
        rollout = self.phase.run(queries, query_mask, columns, kl_coef=kl_coef, step=step, trainer_state=trainer_state,
                                 drawn=(drawn.responses, drawn.response_mask, drawn.sampler_logprobs))
        rollout.draw_metrics.update(self.metrics(drawn, waited))
        return rollout

    def state(self, step: int) -> dict:
        """At a checkpoint of iteration `step` (the trainer's next batch): the draws of batches >= step made with
        versions older than `step`, waited for (the others are drawn again after a resume, with the same weights),
        and the counts behind the metrics."""
        older = [j for j in range(step, self.total_steps) if self.version_of(j) < step]
        with self.condition:
            while not all(j in self.ready for j in older) and self.error is None and self.thread.is_alive():
                self.condition.wait(timeout=1.0)  # (a stopped sampler draws no more: what it drew is saved)
            self._raise()
            draws = [self.ready[j].saved() for j in older if j in self.ready]
        return {"draws": draws, "trained": self.trained, "dropped": self.dropped, "max_staleness_seen": self.max_seen}

    def metrics(self, drawn: Drawn, waited: float) -> dict[str, float]:
        return {"rollout/staleness": float(drawn.step - drawn.version), "rollout/staleness_max": float(self.max_seen),
                "rollout/dropped_share": self.dropped / (self.dropped + self.trained),
                "perf/rollout_wait_s": waited, "perf/sampler_weight_wait_s": drawn.weight_wait}

    def close(self) -> None:
        """Stop the sampler after its current draw (it starts no other) and wait for it."""
        with self.condition:
            self.stopping = True
            self.condition.notify_all()
        if self.thread.is_alive():
            self.thread.join()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------------------------------------ sampler side
    def _run(self) -> None:
        try:
            for step in range(self.first_step, self.total_steps):
                batch = next(self.batches)
                if not self._produce(step, batch):
                    return
        except BaseException as e:  # handed to the trainer, which raises it at its next take
            with self.condition:
                self.error = e
                self.condition.notify_all()

    def _produce(self, step: int, batch: dict) -> bool:
        """Draw batch `step` (or take its saved draw); False: stopping."""
        dropped = 0
        saved = self.saved.pop(step, None)
        if saved is not None:
            if step - saved["version"] <= self.max_staleness:
                self._hand_over(Drawn(step=step, version=saved["version"], batch=batch,
                                      responses=saved["responses"].to(self.device),
                                      response_mask=saved["response_mask"].to(self.device),
                                      sampler_logprobs=saved["sampler_logprobs"].to(self.device)))
                return True
            dropped = 1  # saved by a run with a larger max_staleness: too old for this one
        version = self.version_of(step)
        start = time.perf_counter()
        with self.condition:
            while version not in self.published and not self.stopping:
                self.condition.wait()
            if self.stopping:
                return False
            weights = self.published[version]
            for old in [v for v in self.published if v < version]:  # no later batch needs an older version
                self.engine.release(self.published.pop(old))
        waited = time.perf_counter() - start
        queries = batch["input_ids"].to(self.device)
        query_mask = batch["attention_mask"].to(self.device).bool()
        responses, response_mask, sampler_logprobs = self.engine.draw(weights, queries, query_mask, step)
        self._hand_over(Drawn(step=step, version=version, batch=batch, responses=responses,
                              response_mask=response_mask, sampler_logprobs=sampler_logprobs, weight_wait=waited,
                              dropped=dropped))
        return True

    def _hand_over(self, drawn: Drawn) -> None:
        with self.condition:
            self.ready[drawn.step] = drawn
            self.condition.notify_all()


def drawn_path(folder: str, process_index: int) -> str:
    return os.path.join(folder, DRAWN_FILE.format(process=process_index))


def save_drawn(folder: str, process_index: int, state: dict) -> None:
    torch.save(state, drawn_path(folder, process_index))


def load_drawn(folder: str, process_index: int) -> dict:
    """What `AsyncRollouts.state` saved in a checkpoint for this process ({}: none, a synchronous run's checkpoint)."""
    path = drawn_path(folder, process_index)
    return torch.load(path, weights_only=True) if os.path.exists(path) else {}
