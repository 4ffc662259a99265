"""Measure the GPU memory of QLoRA PPO on a 7B-shaped model and compare it with the memory planner.

    python benchmarks/memory_7b_gpu.py --model llama-2-7b --plan recipes/qlora_7b/shared_16gb.yaml --json out.json

Builds a Llama of the preset's shape with random weights directly in 4-bit on the GPU (one decoder layer at a time:
random bf16 weights on the device, then each nn.Linear of the layer replaced by a bitsandbytes Linear4bit, nf4 with
double quant, so no 7B checkpoint and no hub are needed), runs `--iterations` (2) PPO iterations with trl_ext's
PPOTrainer, and compares torch.cuda.max_memory_allocated — overall and per phase (generation, scoring, PPO update) —
with the planner's estimate (trl_ext/tools/memory.py). Prints a table and writes JSON.

Layouts (the plan's `layout`): "shared" (trl_ext.models.build_shared_base: one 4-bit base, policy and critic LoRA
adapters, value head; the reward is a function of the text, so the planner's reward-forward phase is not exercised)
or "separate" (4-bit policy with LoRA, 4-bit critic with LoRA and a value head, 4-bit reward model).

Needs CUDA and bitsandbytes; without CUDA it exits with status 2 and says so. `--device cpu` runs the same code on
CPU with a small `--shape` (the tests do that), without the CUDA memory counters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trl_ext.tools.memory import GIB, ModelShape, PlanConfig, estimate_memory, load_shape  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_PLAN = os.path.join(ROOT, "recipes", "qlora_7b", "shared_16gb.yaml")


def benchmark_plan(plan: PlanConfig, iterations: int = 2, **overrides) -> PlanConfig:
    """The plan the benchmark runs: `plan` with `overrides` (e.g. response_length) applied; validated."""
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be >= 1")
    unknown = set(overrides) - {f.name for f in dataclasses.fields(PlanConfig)}
    if unknown:
        raise ValueError(f"unknown plan field(s) {sorted(unknown)}")
    return dataclasses.replace(plan, **overrides)


# ---------------------------------------------------------------------------------------------------- the model


def _quantize_linears(module, plan: PlanConfig, device):
    """Replace every nn.Linear inside `module` by a bitsandbytes Linear4bit holding its weight (quantized on
    `device`); the bf16 weight is freed."""
    import bitsandbytes as bnb
    import torch
    import torch.nn as nn

    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.compute_dtype]
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=compute, compress_statistics=plan.bnb_4bit_use_double_quant,
                                  quant_type=plan.base_dtype, device="meta")
            q.weight = bnb.nn.Params4bit(child.weight.data.to("cpu") if device.type == "cpu" else child.weight.data,
                                         requires_grad=False, compress_statistics=plan.bnb_4bit_use_double_quant,
                                         quant_type=plan.base_dtype, module=q)
            if child.bias is not None:
                q.bias = nn.Parameter(child.bias.data, requires_grad=False)
            q = q.to(device)  # quantizes
            if hasattr(q, "support_avx512bf16_for_cpu"):
                q.support_avx512bf16_for_cpu = False  # see trl_ext.models.disable_bnb_cpu_repack
            setattr(module, name, q)
            del child
        else:
            _quantize_linears(child, plan, device)


def build_4bit_llama(shape: ModelShape, plan: PlanConfig, device, head: str = "lm", seed: int = 0):
    """A Llama of `shape` with random weights, its decoder linears in 4-bit (`plan.base_dtype`), the embeddings,
    norms and head in the compute dtype, built on `device` one decoder layer at a time. head: "lm" (causal LM) or
    "score" (1-output sequence classification: a critic or reward model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    if plan.base_dtype not in ("nf4", "fp4"):
        raise ValueError(f"base_dtype={plan.base_dtype!r}: this benchmark builds 4-bit bases (nf4, fp4) only")
    device = torch.device(device)
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[plan.compute_dtype]
    config = LlamaConfig(**{**shape.to_config(), "num_hidden_layers": 0}, max_position_embeddings=4096,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None, num_labels=1)
    torch.manual_seed(seed)
    cls = LlamaForCausalLM if head == "lm" else LlamaForSequenceClassification
    with torch.device(device):
        model = cls(config).to(compute)  # embeddings, final norm, head; no decoder layer yet
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config.num_hidden_layers = shape.num_hidden_layers
    layers = model.model.layers
    for i in range(shape.num_hidden_layers):
        with torch.device(device):
            layer = LlamaDecoderLayer(config, layer_idx=i).to(compute)
        for p in layer.parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.02)
        _quantize_linears(layer, plan, device)
        layers.append(layer)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    model.config.num_hidden_layers = shape.num_hidden_layers
    if hasattr(model.config, "layer_types") and model.config.layer_types is not None:
        model.config.layer_types = ["full_attention"] * shape.num_hidden_layers
    model.requires_grad_(False)
    model.is_loaded_in_4bit = True  # what peft and trl_ext look at to pick the 4-bit LoRA layers
    if head == "lm":
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = 1
    return model


def _tokenizer(vocab_size: int):
    """A word-level tokenizer whose vocabulary is the model's (ids 0 pad, 1 eos, 2 unk, then t3, t4, ...), so every
    sampled id decodes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
                                   padding_side="left")


def _prompts(n: int, length: int, vocab_size: int, seed: int = 0):
    """n prompts of exactly `length` tokens (the plan's max_prompt_length)."""
    import torch
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (n, length), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def length_reward(prompts, completions, **kwargs):
    """A cheap reward: longer completions score higher (the benchmark measures memory, not learning)."""
    return [min(len(c.split()), 50) / 50.0 for c in completions]


# ---------------------------------------------------------------------------------------------------- the run


class _PhaseMeter:
    """Per-phase torch.cuda.max_memory_allocated, a listener of the trainer's phase hooks (`trainer.phases`): each
    outermost phase closes the previous one and resets the peak counter; the update's end closes the update."""

    NAMES = {"generation": "generation", "reference": "scoring", "policy_and_value": "scoring", "reward": "scoring",
             "update": "training", "critic_warmup": "training", "evaluation": "evaluation"}

    def __init__(self, cuda: bool):
        import torch

        self.torch, self.cuda = torch, cuda
        self.current: str | None = None
        self.peaks: dict[str, int] = {}
        self.depth = 0  # phases open

    def switch(self, name: str | None):
        if self.cuda:
            if self.current is not None:
                peak = self.torch.cuda.max_memory_allocated()
                self.peaks[self.current] = max(self.peaks.get(self.current, 0), peak)
            self.torch.cuda.reset_peak_memory_stats()
        self.current = name

    def start(self, phase: str):
        self.depth += 1
        if self.depth == 1:
            self.switch(self.NAMES[phase])

    def stop(self, phase: str):
        self.depth -= 1
        if self.depth == 0 and self.NAMES[phase] in ("training", "evaluation"):
            self.switch(None)


def run(shape: ModelShape, plan: PlanConfig, iterations: int = 2, device: str = "cuda", output_dir: str | None = None):
    """Build the models of `plan.layout` for `shape`, run `iterations` PPO iterations with trl_ext.PPOTrainer and
    return {"measured": {...}, "estimate": {...}}."""
    import tempfile

    import torch
    from peft import LoraConfig

    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext.models import build_shared_base

    cuda = torch.device(device).type == "cuda"
    lora = LoraConfig(r=plan.lora_r, lora_alpha=2 * plan.lora_r, lora_dropout=0.0,
                      target_modules=list(plan.lora_targets), task_type="CAUSAL_LM")
    t0 = time.perf_counter()
    if plan.layout == "shared":
        policy = build_shared_base(build_4bit_llama(shape, plan, device), lora)
        ref = value = None
        reward = length_reward
        peft_config = None
    else:
        policy = build_4bit_llama(shape, plan, device, seed=0)
        value = build_4bit_llama(shape, plan, device, head="score", seed=1)
        reward = build_4bit_llama(shape, plan, device, head="score", seed=2)
        ref = None
        peft_config = lora
    build_s = time.perf_counter() - t0
    weights = torch.cuda.memory_allocated() if cuda else 0

    tokenizer = _tokenizer(shape.vocab_size)
    B = plan.local_batch_size
    out = output_dir or tempfile.mkdtemp(prefix="memory_7b_")
    args = _ppo_config(PPOConfig, plan, out, iterations, cuda)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=ref, reward_model=reward,
                         value_model=value, train_dataset=_prompts(max(B, 8), plan.max_prompt_length, shape.vocab_size),
                         peft_config=peft_config)
    meter = _PhaseMeter(cuda)
    trainer.phases.add(meter)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    measured = {"build_seconds": build_s, "train_seconds": train_s, "iterations": trainer.state.global_step}
    if cuda:
        measured.update({"weights_allocated_gib": weights / GIB,
                         "max_memory_allocated_gib": max(meter.peaks.values()) / GIB,
                         "phases_gib": {k: v / GIB for k, v in meter.peaks.items()},
                         "max_memory_reserved_gib": torch.cuda.max_memory_reserved() / GIB})
    est = estimate_memory(shape, plan)
    by_kind = {"generation": [p for p in est.phases if p.name.startswith("generation")],
               "scoring": [p for p in est.phases if p.name.startswith("scoring")],
               "training": [p for p in est.phases if p.name.startswith("training")]}
    estimate = {"peak_gib": est.peak_bytes / GIB, "peak_phase": est.peak_phase.name,
                "required_gib": est.required_bytes / GIB, "static_gib": est.static_bytes / GIB,
                "phases_gib": {k: max(est.phase_total(p) for p in ps) / GIB for k, ps in by_kind.items()},
                "verdicts": est.verdicts()}
    result = {"model": shape.name, "plan": dataclasses.asdict(plan), "device": device, "measured": measured,
              "estimate": estimate}
    if cuda:
        m = measured["max_memory_allocated_gib"]
        result["error"] = (estimate["peak_gib"] - m) / m
        result["phase_errors"] = {k: (estimate["phases_gib"][k] - v) / v for k, v in measured["phases_gib"].items()
                                  if k in estimate["phases_gib"]}
    return result


def _ppo_config(PPOConfig, plan: PlanConfig, out: str, iterations: int, cuda: bool):
    return PPOConfig(
        output_dir=out, report_to=[], seed=0, bf16=plan.compute_dtype == "bf16" and cuda,
        per_device_train_batch_size=plan.per_device_train_batch_size,
        gradient_accumulation_steps=plan.gradient_accumulation_steps, num_mini_batches=plan.num_mini_batches,
        local_rollout_forward_batch_size=plan.local_rollout_forward_batch_size, response_length=plan.response_length,
        max_prompt_length=plan.max_prompt_length, gradient_checkpointing=plan.gradient_checkpointing,
        optim=plan.optim, total_episodes=iterations * plan.local_batch_size, num_ppo_epochs=1, stop_token="none",
        num_sample_generations=0, save_strategy="no", learning_rate=1e-5,
    )


def format_result(r: dict) -> str:
    lines = [f"model {r['model']}, layout {r['plan']['layout']}, device {r['device']}: built in "
             f"{r['measured']['build_seconds']:.1f} s, trained in {r['measured']['train_seconds']:.1f} s "
             f"(PPO iterations: {r['measured']['iterations']})"]
    if "error" in r:
        m, e = r["measured"], r["estimate"]
        lines.append(f"  {'phase':<12}{'measured GiB':>14}{'planner GiB':>13}{'error':>8}")
        for k, v in m["phases_gib"].items():
            lines.append(f"  {k:<12}{v:>14.2f}{e['phases_gib'].get(k, float('nan')):>13.2f}"
                         f"{r['phase_errors'].get(k, float('nan')):>+8.1%}")
        lines.append(f"  {'peak':<12}{m['max_memory_allocated_gib']:>14.2f}{e['peak_gib']:>13.2f}{r['error']:>+8.1%}")
        lines.append(f"  weights after build {m['weights_allocated_gib']:.2f} GiB (planner static "
                     f"{e['static_gib']:.2f}); max reserved {m['max_memory_reserved_gib']:.2f} GiB")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-2-7b", help="preset or config.json (default llama-2-7b)")
    ap.add_argument("--plan", default=DEFAULT_PLAN, help="plan file (default recipes/qlora_7b/shared_16gb.yaml)")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--response-length", type=int, help="override the plan's response_length")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    import torch

    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("memory_7b_gpu: error: CUDA is not available; this benchmark measures torch.cuda.max_memory_allocated "
              "on a GPU (use --device cpu only to smoke-test the code path with a small --model config.json).",
              file=sys.stderr)
        return 2
    try:
        overrides = {"response_length": args.response_length} if args.response_length else {}
        plan = benchmark_plan(PlanConfig.from_file(args.plan), args.iterations, **overrides)
        shape = load_shape(args.model)
    except (FileNotFoundError, ValueError) as e:
        print(f"memory_7b_gpu: error: {e}", file=sys.stderr)
        return 2
    result = run(shape, plan, args.iterations, args.device)
    print(format_result(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
