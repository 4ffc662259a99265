"""Check the memory planner (trl_ext/tools/memory.py) against measured peaks of scaled-down models on CPU.

    python benchmarks/validate_memory_cpu.py                 # all configurations, a table; --json PATH writes it
    python benchmarks/validate_memory_cpu.py --only fp32-small

For each configuration a fresh subprocess builds the models of the planner's "separate" layout (policy with LoRA,
reference = the policy with its adapter disabled, critic = its own backbone with LoRA and a value head, frozen reward
model), then runs the PPO phases the way trl_ext's trainer does: generation with a KV cache
(trl_ext.models.generate_responses), the policy+value scoring forward, the reference forward and the reward forward
(chunks of local_rollout_forward_batch_size), and two training steps on one micro-batch (policy and value losses from
trl_ext.core, backward, AdamW step, then the entropy under no_grad, as in PPOTrainer.ppo_update).

Measuring: peak resident memory of the process (VmHWM in /proc/self/status), reset before each phase by writing "5"
to /proc/self/clear_refs, minus the resident memory after the imports and before any model exists. The subprocess
runs with MALLOC_MMAP_THRESHOLD_=65536, so every tensor larger than 64 KiB is its own mmap and is returned to the
OS when freed (otherwise glibc keeps freed memory and the peaks drift upwards). RSS counts a little more than live
tensor bytes (Python objects, library buffers: a few MiB); the numbers repeat within ~1%.

Precision: fp32 only. On CPU, bf16 matmuls go through oneDNN, which keeps packed copies of the weights outside
torch's tensors (+90 to +250 MiB of RSS for a 200 MiB bf16 model), so RSS does not measure what a GPU allocates; the
bf16/autocast saved-activation terms are checked against autograd's saved tensors instead
(tests/tools/test_memory_planner.py::test_saved_activations_per_layer_match_autograd).

Compared: for each phase, the measured peak against the planner's static + that phase (without the GPU headroom),
and the relative error (estimate − measured) / measured. The second training step is compared (the first also
allocates the optimizer states, which the planner counts as static).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl_ext.tools.memory import ModelShape, PlanConfig, estimate_memory  # noqa: E402

MIB = 1024**2

# scaled-down Llama shapes: weights and activations of a few hundred MiB, a few seconds per phase on 2 cores
CONFIGS = {
    "fp32-small": (
        ModelShape("llama-384x2", 384, 1024, 2, 6, 6, 32000),
        PlanConfig(layout="separate", base_dtype="fp32", compute_dtype="fp32", lora_r=16,
                   per_device_train_batch_size=4, gradient_accumulation_steps=1, local_rollout_forward_batch_size=4,
                   max_prompt_length=160, response_length=32, gradient_checkpointing=False, chunked_logits=False),
    ),
    "fp32-512x4": (
        ModelShape("llama-512x4", 512, 1408, 4, 8, 8, 32000),
        PlanConfig(layout="separate", base_dtype="fp32", compute_dtype="fp32", lora_r=16,
                   per_device_train_batch_size=4, gradient_accumulation_steps=2, local_rollout_forward_batch_size=8,
                   max_prompt_length=192, response_length=64, gradient_checkpointing=False, chunked_logits=False),
    ),
    "fp32-gqa-ckpt-chunked": (
        ModelShape("llama-768x4-gqa", 768, 2048, 4, 12, 4, 32000),
        PlanConfig(layout="separate", base_dtype="fp32", compute_dtype="fp32", lora_r=16,
                   per_device_train_batch_size=4, gradient_accumulation_steps=2, local_rollout_forward_batch_size=4,
                   max_prompt_length=192, response_length=64, gradient_checkpointing=True, chunked_logits=True),
    ),
    "fp32-deep-ckpt-qv": (
        ModelShape("llama-640x8", 640, 1792, 8, 10, 5, 32000),
        PlanConfig(layout="separate", base_dtype="fp32", compute_dtype="fp32", lora_r=8,
                   lora_target_modules=["q_proj", "v_proj"],
                   per_device_train_batch_size=2, gradient_accumulation_steps=4, local_rollout_forward_batch_size=8,
                   max_prompt_length=224, response_length=32, gradient_checkpointing=True, chunked_logits=True),
    ),
}
SMALLEST = "fp32-small"


# ---------------------------------------------------------------------------------------------------- measuring


def _status(key: str) -> int:
    with open("/proc/self/status") as fh:
        return int(re.search(key + r":\s+(\d+) kB", fh.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


class _Meter:
    """Peak RSS per phase, relative to the RSS after the imports."""

    def __init__(self):
        self.base = _status("VmRSS")
        self.results: dict[str, dict[str, int]] = {}

    def phase(self, name: str, fn):
        import gc

        gc.collect()
        before = _status("VmRSS") - self.base
        _reset_peak()
        t = time.perf_counter()
        out = fn()
        self.results[name] = {"before": before, "peak": _status("VmHWM") - self.base,
                              "seconds": round(time.perf_counter() - t, 2)}
        return out


def _warm_up(torch) -> None:
    """Run every code path once on a tiny model, so lazy imports and library set-up (a few tens of MiB of RSS that
    are not tensors) happen before the baseline is taken."""
    import gc

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from trl_ext.core.losses import entropy_from_logits, logprobs_from_logits, token_logprobs
    from trl_ext.models import Sampling, generate_responses

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, pad_token_id=0)
    for dtype, autocast in ((torch.float32, False), (torch.bfloat16, True)):
        model = get_peft_model(LlamaForCausalLM(cfg).to(dtype), LoraConfig(r=4, target_modules="all-linear",
                                                                             task_type="CAUSAL_LM"))
        model.train()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        q = torch.randint(3, 256, (2, 8))
        qm = torch.ones(2, 8, dtype=torch.bool)
        qm[0, :2] = False
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            with torch.no_grad():
                r, _ = generate_responses(model, q, qm, Sampling(4, 1.0, None), 2)
            ids = torch.cat([q, r], 1)
            am = torch.cat([qm, torch.ones_like(r, dtype=torch.bool)], 1).long()
            for ckpt in (False, True):
                if ckpt:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                logits = model(input_ids=ids, attention_mask=am, use_cache=False, logits_to_keep=5).logits[:, :-1]
                loss = token_logprobs(logits, r, 1.0, 2).sum() + logprobs_from_logits(logits.float(), r).sum()
                with torch.no_grad():
                    entropy_from_logits(logits, 1.0, 2), entropy_from_logits(logits.float())
                loss.backward()
                opt.step()
                opt.zero_grad()
            with torch.no_grad(), model.disable_adapter():
                model(input_ids=ids, attention_mask=am, use_cache=False)
        del model, opt, logits, loss
    gc.collect()


def _worker(name: str) -> dict:
    """Build the models of CONFIGS[name] and measure each phase (runs in a fresh process)."""
    import torch
    import torch.nn as nn
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    from trl_ext.core.losses import (
        clipped_policy_loss,
        clipped_value_loss,
        entropy_from_logits,
        logprobs_from_logits,
        token_logprobs,
    )
    from trl_ext.core.masks import masked_mean
    from trl_ext.models import Sampling, generate_responses, sequence_inputs

    shape, plan = CONFIGS[name]
    torch.manual_seed(0)
    torch.set_num_threads(2)
    _warm_up(torch)
    meter = _Meter()
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[plan.base_dtype]
    autocast = (torch.autocast("cpu", dtype=torch.bfloat16) if plan.uses_autocast and plan.compute_dtype == "bf16"
                else torch.autocast("cpu", enabled=False))
    cfg = LlamaConfig(**shape.to_config(), max_position_embeddings=1024, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    lora = dict(r=plan.lora_r, lora_alpha=2 * plan.lora_r, lora_dropout=0.0,
                target_modules=list(plan.lora_targets))

    class Scalar(nn.Module):
        """A backbone and a 1-output head (critic or reward model)."""

        def __init__(self, trainable: bool):
            super().__init__()
            backbone = LlamaModel(cfg).to(dtype)
            self.backbone = (get_peft_model(backbone, LoraConfig(**lora)) if trainable
                             else backbone.requires_grad_(False))
            self.head = nn.Linear(shape.hidden_size, 1, bias=False).to(dtype).requires_grad_(trainable)

        def forward(self, input_ids, attention_mask, position_ids):
            hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False).last_hidden_state
            return self.head(hidden).squeeze(-1)

    def build():
        policy = get_peft_model(LlamaForCausalLM(cfg).to(dtype), LoraConfig(task_type="CAUSAL_LM", **lora))
        return policy, Scalar(trainable=True), Scalar(trainable=False)

    policy, critic, reward = meter.phase("build", build)
    for m in (policy, critic, reward):
        m.train()  # checkpointing is active in train mode only; dropout is 0 everywhere
    if plan.gradient_checkpointing:
        for m in (policy, critic.backbone):
            m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = [p for p in list(policy.parameters()) + list(critic.parameters()) if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)

    B, P, R, f, mb = (plan.local_batch_size, plan.max_prompt_length, plan.response_length,
                      plan.local_rollout_forward_batch_size, plan.per_device_train_batch_size)
    g = torch.Generator().manual_seed(0)
    queries = torch.randint(3, shape.vocab_size, (B, P), generator=g)
    query_mask = torch.ones(B, P, dtype=torch.bool)
    for i in range(B):  # left padding, up to a quarter of the prompt
        query_mask[i, : (i * P // 4) // B] = False
    queries = queries.masked_fill(~query_mask, 0)
    sampling = Sampling(R, 1.0, None)  # no stop token: every response runs to response_length

    def generate():
        with torch.no_grad(), autocast:
            return generate_responses(policy, queries, query_mask, sampling, f)[0]

    responses = meter.phase("generation (KV cache)", generate)
    response_mask = torch.ones_like(responses, dtype=torch.bool)
    chunks = [slice(i, i + f) for i in range(0, B, f)]

    T1 = R + 1  # chunked (trl_ext): logits of the T + 1 positions that predict response tokens only

    def policy_logits(inputs):
        if plan.chunked_logits:
            return policy(**inputs, use_cache=False, logits_to_keep=T1).logits[:, :-1]  # (b, T, V) view
        return policy(**inputs, use_cache=False).logits  # (b, Q+T, V)

    def logprobs_of(logits, tokens):
        """trl_ext: token_logprobs on the kept positions; TRL 1.12: fp32 copy of the response logits / T."""
        if plan.chunked_logits:
            return token_logprobs(logits, tokens, 1.0, plan.logits_chunk_size)
        return logprobs_from_logits(logits[:, P - 1 : -1].float() / 1.0, tokens)

    def score_policy():
        out = []
        with torch.no_grad(), autocast:
            for s in chunks:
                inputs = sequence_inputs(queries[s], query_mask[s], responses[s], response_mask[s])
                logits = policy_logits(inputs)
                value = critic(**inputs)  # the policy's logits stay alive meanwhile (as in the trainer)
                out.append((logprobs_of(logits, responses[s]), value[:, P - 1 : -1].float()))
                del logits
        return out

    def score_ref():
        out = []
        with torch.no_grad(), autocast, policy.disable_adapter():
            for s in chunks:
                inputs = sequence_inputs(queries[s], query_mask[s], responses[s], response_mask[s])
                if plan.chunked_logits:
                    out.append(logprobs_of(policy_logits(inputs), responses[s]))
                else:  # TRL 1.12: (logits[:, Q-1:-1] / T).float()
                    resp = policy(**inputs, use_cache=False).logits[:, P - 1 : -1] / 1.0
                    out.append(logprobs_from_logits(resp.float(), responses[s]))
                    del resp
        return out

    def score_reward():
        with torch.no_grad(), autocast:
            return [reward(**sequence_inputs(queries[s], query_mask[s], responses[s], response_mask[s]))[:, -1].float()
                    for s in chunks]

    pv = meter.phase("scoring: policy + value forward", score_policy)
    meter.phase("scoring: reference forward", score_ref)
    meter.phase("scoring: reward forward", score_reward)
    old_logprobs = torch.cat([x for x, _ in pv])[:mb]
    old_values = torch.cat([v for _, v in pv])[:mb]
    advantages = torch.randn(mb, R, generator=g)
    returns = torch.randn(mb, R, generator=g)

    def train_step():
        inputs = sequence_inputs(queries[:mb], query_mask[:mb], responses[:mb], response_mask[:mb])
        with autocast:
            logits = policy_logits(inputs)
            values = critic(**inputs)
            if plan.chunked_logits:  # trl_ext's PPOTrainer._policy_terms: entropy in chunks, then the logits go
                new_logprobs = token_logprobs(logits, responses[:mb], 1.0, plan.logits_chunk_size)
                with torch.no_grad():
                    entropy = entropy_from_logits(logits, 1.0, plan.logits_chunk_size)
                del logits
            else:  # TRL 1.12 / trl_ext before: fp32 response logits, entropy after the step
                logits = logits[:, P - 1 : -1].float() / 1.0
                new_logprobs = logprobs_from_logits(logits, responses[:mb])
            vpred = values[:, P - 1 : -1].float()
            pg_loss, _ = clipped_policy_loss(new_logprobs, old_logprobs, advantages, response_mask[:mb], 0.2)
            vf_loss, _ = clipped_value_loss(vpred, old_values, returns, response_mask[:mb], 0.2)
            loss = pg_loss + 0.1 * vf_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if not plan.chunked_logits:
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        masked_mean(entropy, response_mask[:mb])
        return loss.item()

    meter.phase("training step 1", train_step)
    meter.phase("training step", train_step)
    tensors = {"weights": sum(p.numel() * p.element_size() for m in (policy, critic, reward) for p in m.parameters()),
               "optimizer_states": sum(t.numel() * t.element_size() for st in optimizer.state.values()
                                       for t in st.values() if torch.is_tensor(t))}
    return {"name": name, "phases": meter.results, "tensors": tensors}


def measure(name: str) -> dict:
    """Run the worker for CONFIGS[name] in a fresh subprocess and return its measurements."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", name], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"worker {name!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(name: str, measured: dict) -> dict:
    """Planner vs measurement, per phase: totals (static + phase) and the phase's own increase."""
    shape, plan = CONFIGS[name]
    est = estimate_memory(shape, plan)
    by_name = {p.name.split(" (with")[0]: p for p in est.phases}
    rows = []
    for phase, m in measured["phases"].items():
        if phase in ("build", "training step 1"):
            continue
        key = "training step" if phase.startswith("training") else phase
        ph = by_name[key]
        total_est = est.phase_total(ph)
        rows.append({"phase": phase, "measured_mib": m["peak"] / MIB, "estimated_mib": total_est / MIB,
                     "error": (total_est - m["peak"]) / m["peak"],
                     "measured_increase_mib": (m["peak"] - m["before"]) / MIB,
                     "estimated_increase_mib": ph.activations / MIB, "seconds": m["seconds"]})
    peak_measured = max(r["measured_mib"] for r in rows)
    weights_est = sum(v for k, v in est.static.items() if "base" in k)
    return {"config": name, "shape": asdict(shape), "plan": asdict(plan), "rows": rows,
            "weights_measured_mib": measured["phases"]["build"]["peak"] / MIB,
            "weights_tensor_bytes_mib": measured["tensors"]["weights"] / MIB,
            "weights_estimated_mib": weights_est / MIB,
            "peak_measured_mib": peak_measured, "peak_estimated_mib": est.peak_bytes / MIB,
            "peak_error": (est.peak_bytes / MIB - peak_measured) / peak_measured,
            "peak_phase_estimated": est.peak_phase.name}


def format_report(results: list[dict]) -> str:
    lines = []
    for r in results:
        lines.append(f"== {r['config']}: {r['shape']['name']} ({r['plan']['base_dtype']}, checkpointing "
                     f"{r['plan']['gradient_checkpointing']}, chunked logits {r['plan']['chunked_logits']})")
        lines.append(f"  weights after build: measured {r['weights_measured_mib']:.0f} MiB (tensors "
                     f"{r['weights_tensor_bytes_mib']:.0f}), planner {r['weights_estimated_mib']:.0f} MiB")
        lines.append(f"  {'phase':<36}{'measured':>10}{'planner':>10}{'error':>8}   "
                     f"{'increase: meas.':>16}{'plan.':>8}")
        for row in r["rows"]:
            lines.append(f"  {row['phase']:<36}{row['measured_mib']:>10.0f}{row['estimated_mib']:>10.0f}"
                         f"{row['error']:>+8.1%}   {row['measured_increase_mib']:>16.0f}"
                         f"{row['estimated_increase_mib']:>8.0f}")
        lines.append(f"  {'peak (MiB)':<36}{r['peak_measured_mib']:>10.0f}{r['peak_estimated_mib']:>10.0f}"
                     f"{r['peak_error']:>+8.1%}")
    return "\n".join(lines)


def validate(names=None) -> list[dict]:
    return [compare(n, measure(n)) for n in (names or list(CONFIGS))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="configurations to run (default: all)")
    ap.add_argument("--json", help="write the results to this JSON file")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker)))
        return 0
    results = validate(args.only)
    print(format_report(results))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)
    worst = max(abs(r["peak_error"]) for r in results)
    print(f"worst peak error {worst:.1%} over {len(results)} configurations (target: within 15%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
