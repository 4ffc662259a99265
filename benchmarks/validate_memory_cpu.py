"""Check the memory planner (trl_ext/tools/memory.py) against the real trainer's live tensor bytes, on CPU.

    python benchmarks/validate_memory_cpu.py                      # every configuration, a table; --json PATH too
    python benchmarks/validate_memory_cpu.py --only separate-bf16

For each configuration a fresh subprocess saves random Llamas of the configuration's shape to disk, then builds the
models the way the QLoRA recipe does (`trl_ext.scripts.qlora.build_models`: the plan's layout, base dtype and LoRA)
and trains two PPO iterations with `trl_ext.PPOTrainer` (bf16 configurations under bf16 autocast, `bf16=True,
use_cpu=True`), everything created inside `trl_ext.tools.live_memory.LiveTensorBytes`: the bytes of live tensor
storages, what ``torch.cuda.max_memory_allocated`` reports on a GPU. The trainer's phase hooks (`trainer.phases`) give
the peak of each phase; the second iteration is compared (the first also allocates the optimizer states, which the
planner counts as static). Prompts are exactly `max_prompt_length` tokens and responses never stop early
(`stop_token="none"`), as the planner assumes.

Compared: for each phase, the measured peak against the planner's static + that phase (without the GPU headroom), and
the relative error (estimate - measured) / measured; the static part alone (live bytes between iterations). The
shared layout's reward is a function (no reward adapter), so its reward phase and the reward adapter's static bytes
are not the planner's and are left out of the comparison.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from trl_ext.tools.memory import ModelShape, PlanConfig, estimate_memory  # noqa: E402

MIB = 1024**2

# a Llama wide enough for bitsandbytes' blocks, with a real vocabulary: the logits dominate as they do on a 7B
SHAPE = ModelShape("llama-256x2-v32k", 256, 688, 2, 4, 2, 32000)
COMMON = dict(lora_r=8, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_mini_batches=1,
              local_rollout_forward_batch_size=4, max_prompt_length=32, response_length=64,
              gradient_checkpointing=False)
CONFIGS = {
    "separate-fp32": dict(layout="separate", base_dtype="fp32", compute_dtype="fp32"),
    "separate-bf16": dict(layout="separate", base_dtype="fp32", compute_dtype="bf16", autocast=True),
    "shared-fp32": dict(layout="shared", base_dtype="fp32", compute_dtype="fp32"),
    "shared-bf16": dict(layout="shared", base_dtype="fp32", compute_dtype="bf16", autocast=True),
    "shared-bf16-ckpt": dict(layout="shared", base_dtype="fp32", compute_dtype="bf16", autocast=True,
                             gradient_checkpointing=True),
    "shared-nf4-bf16": dict(layout="shared", base_dtype="nf4", compute_dtype="bf16", autocast=True),
    # padding-free passes of at most 2 rows' tokens (the prompts are all max_prompt_length: the worst packing)
    "separate-fp32-packed": dict(layout="separate", base_dtype="fp32", compute_dtype="fp32", padding_free=True,
                                 max_tokens_per_micro_batch=192, min_prompt_length=32),
    "shared-bf16-packed": dict(layout="shared", base_dtype="fp32", compute_dtype="bf16", autocast=True,
                               padding_free=True, max_tokens_per_micro_batch=192, min_prompt_length=32),
}
SMALLEST = "separate-fp32"
PHASES = {"generation": "generation (KV cache)", "policy_and_value": "scoring: policy + value forward",
          "reference": "scoring: reference forward", "reward": "scoring: reward forward", "update": "training step"}


def plan_of(name: str, **common) -> PlanConfig:
    """Configuration `name`'s plan; `common` replaces its values (the tests' shorter sequences)."""
    return PlanConfig(**{**COMMON, **CONFIGS[name], **common})


# ---------------------------------------------------------------------------------------------------- one run


def _save_models(folder: str, shape: ModelShape) -> None:
    """A random causal Llama (the policy, the critic's and the reward model's start) saved to `folder`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**shape.to_config(), max_position_embeddings=512, pad_token_id=0, eos_token_id=1,
                         bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(folder)


def _worker(name: str, **common) -> dict:
    """Train two iterations of configuration `name` under the live-bytes counter; its phase peaks and static bytes."""
    import torch

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    from memory_7b_gpu import _prompts, _tokenizer, length_reward

    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext.scripts.qlora import build_models
    from trl_ext.tools.live_memory import LiveTensorBytes, PhasePeaks

    plan, shape = plan_of(name, **common), SHAPE
    work = tempfile.mkdtemp(prefix="validate_memory_")
    _save_models(os.path.join(work, "base"), shape)
    tokenizer = _tokenizer(shape.vocab_size)
    dataset = _prompts(plan.local_batch_size, plan.max_prompt_length, shape.vocab_size)
    script_args = argparse.Namespace(model_name_or_path=os.path.join(work, "base"), reward_adapter=None,
                                     reward_tokenizer_path=None, value_model_path=None, lora_alpha=None,
                                     lora_dropout=0.0, attn_implementation="sdpa")
    bf16 = plan.uses_autocast and plan.compute_dtype == "bf16"
    torch.manual_seed(0)
    with LiveTensorBytes() as live:
        args = PPOConfig(output_dir=os.path.join(work, "run"), report_to=[], save_strategy="no", seed=0,
                         bf16=bf16, use_cpu=True, num_sample_generations=0, disable_tqdm=True, stop_token="none",
                         reward_model_path=os.path.join(work, "base") if plan.layout == "separate" else None,
                         per_device_train_batch_size=plan.per_device_train_batch_size,
                         gradient_accumulation_steps=plan.gradient_accumulation_steps,
                         num_mini_batches=plan.num_mini_batches, num_ppo_epochs=1,
                         local_rollout_forward_batch_size=plan.local_rollout_forward_batch_size,
                         response_length=plan.response_length, max_prompt_length=plan.max_prompt_length,
                         gradient_checkpointing=plan.gradient_checkpointing, padding_free=plan.padding_free,
                         max_tokens_per_micro_batch=plan.max_tokens_per_micro_batch,
                         total_episodes=2 * plan.local_batch_size, cpu_reuse_freed_memory=False)
        models = build_models(script_args, args, plan, tokenizer, reward_function=length_reward)
        trainer = PPOTrainer(args=args, processing_class=tokenizer, train_dataset=dataset, **models)
        del models
        frozen = [m for m in (trainer.ref_model, *trainer.reward_scorer.models.values()) if m is not None]
        live.track(trainer.unwrapped, *frozen)  # the weights, read from files outside the dispatcher
        peaks = PhasePeaks(live)
        static: list[int] = []

        class Static:  # live bytes as each iteration's generation starts: what stays between iterations
            def start(self, phase):
                if phase == "generation" and len(peaks.peaks) == len(static):
                    static.append(live.current)

            def stop(self, phase):
                pass

        trainer.phases.add(Static())
        trainer.phases.add(peaks)
        trainer.train()
    return {"phases": peaks.peaks[-1], "static": static[-1]}


def measure(name: str, **common) -> dict:
    """The worker's figures for `name`, from a fresh subprocess (nothing allocated before it)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2"), "TOKENIZERS_PARALLELISM": "false"}
    argv = [sys.executable, __file__, "--child", name, "--common", json.dumps(common)]
    out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{name}: the measuring subprocess failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(name: str, measured: dict, **common) -> dict:
    plan = plan_of(name, **common)
    est = estimate_memory(SHAPE, plan)
    by_name = {p.name.split(" (")[0] if p.name.startswith("training") else p.name: p for p in est.phases}
    static = est.static_bytes
    if plan.layout == "shared":  # the reward is a function here: no reward adapter
        static -= next(v for k, v in est.static.items() if k.startswith("LoRA reward adapter"))
    rows = []
    for phase, planner_name in PHASES.items():
        if phase not in measured["phases"] or (phase == "reward" and plan.layout == "shared"):
            continue
        estimate = static + by_name[planner_name].activations
        got = measured["phases"][phase]
        rows.append({"phase": phase, "measured": got, "estimate": estimate, "error": (estimate - got) / got})
    return {"name": name, "plan": dataclasses.asdict(plan), "rows": rows,
            "static": {"measured": measured["static"], "estimate": static,
                       "error": (static - measured["static"]) / measured["static"]}}


def format_report(results: list[dict]) -> str:
    lines = [f"{'configuration':<20}{'phase':<18}{'measured MiB':>13}{'planner MiB':>12}{'error':>8}"]
    for r in results:
        s = r["static"]
        lines.append(f"{r['name']:<20}{'static':<18}{s['measured'] / MIB:>13.1f}{s['estimate'] / MIB:>12.1f}"
                     f"{s['error']:>+8.1%}")
        for row in r["rows"]:
            lines.append(f"{'':<20}{row['phase']:<18}{row['measured'] / MIB:>13.1f}{row['estimate'] / MIB:>12.1f}"
                         f"{row['error']:>+8.1%}")
    return "\n".join(lines)


def validate(names=None, **common) -> list[dict]:
    return [compare(n, measure(n, **common), **common) for n in (names or CONFIGS)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS))
    parser.add_argument("--json")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--common", default="{}", help=argparse.SUPPRESS)
    opts = parser.parse_args(argv)
    if opts.child:
        print(json.dumps(_worker(opts.child, **json.loads(opts.common))))
        return 0
    results = validate(opts.only)
    print(format_report(results))
    if opts.json:
        with open(opts.json, "w") as fh:
            json.dump(results, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
