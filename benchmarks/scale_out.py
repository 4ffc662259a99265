"""What each engine costs and what it saves, per process: DDP, DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 through the shipped
accelerate configs, on one small model, side by side with ratios to DDP.

    python benchmarks/scale_out.py                        # 2 CPU processes, every engine (about 5 minutes)
    python benchmarks/scale_out.py --engines ddp,zero2 --iterations 3 --out /tmp/scale
    python benchmarks/scale_out.py --gpu --num_processes 1   # on a GPU machine: bf16, the configs as shipped

Each engine runs in its own `accelerate launch` (this file is also the launched worker): `warmup + iterations` PPO
iterations of a 4-layer Llama (hidden 512, about 12M parameters per model: policy, reference, value, reward), a
global batch of 8 prompts, 16-token responses, 2 PPO epochs. Reported per process, the first (warm-up) iteration
left out: seconds per iteration (median), the bytes of the trained models' parameters, gradients-to-be and optimizer
state that the process holds (its shards only; AdamW keeps two fp32 values per trained parameter), and its peak
resident memory. On CPU, accelerate needs the tests' shim to run DeepSpeed and FSDP (tests/scripts/engine_shim.py).
Writes `<out>/results.json` and `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "recipes" / "accelerate_configs"
ENGINES = {
    "ddp": ["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"],
    "zero2": ["--config_file", str(CONFIGS / "deepspeed_zero2.yaml")],
    "zero3": ["--config_file", str(CONFIGS / "deepspeed_zero3.yaml")],
    "fsdp2": ["--config_file", str(CONFIGS / "fsdp.yaml")],
}


def _local_bytes(tensor) -> int:
    """Bytes this process holds of a parameter or state tensor: its FSDP2 shard, its ZeRO-3 partition, or all."""
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    if hasattr(tensor, "ds_tensor"):
        tensor = tensor.ds_tensor
    return tensor.numel() * tensor.element_size()


def worker(args) -> None:
    sys.path.insert(0, str(ROOT / "tests" / "scripts"))
    import engine_shim  # noqa: F401  (DeepSpeed and FSDP on CPU processes under accelerate 1.15)
    import torch
    from transformers import TrainerCallback

    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

    tok = tiny_tokenizer()
    size = dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4)
    models = (tiny_causal_lm(tok, seed=0, **size), tiny_scalar_model(tok, seed=2, **size),
              tiny_scalar_model(tok, seed=1, **size))  # whole, before the config (see tests/scripts/ddp_runs.py)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps = args.warmup + args.iterations
    config = PPOConfig(output_dir=os.path.join(args.out, "run"), per_device_train_batch_size=8 // world,
                       num_mini_batches=1, num_ppo_epochs=2, total_episodes=8 * steps, response_length=16,
                       stop_token="none", learning_rate=1e-5, report_to=[], save_strategy="no",
                       num_sample_generations=0, bf16=args.gpu, disable_tqdm=True, logging_steps=1, seed=0,
                       gradient_checkpointing=False)  # (use_cpu=True would turn a DeepSpeed launch into DDP)
    times = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_, **__):
            times.append(time.perf_counter())

    start = time.perf_counter()
    trainer = PPOTrainer(args=config, processing_class=tok, model=models[0], ref_model=None, reward_model=models[1],
                         train_dataset=tiny_prompt_dataset(tok, n=64), value_model=models[2], callbacks=[Clock()])
    trainer.train()
    wrapper = trainer.unwrapped
    trained = [p for p in wrapper.parameters() if p.requires_grad]
    if trainer.is_deepspeed_enabled:
        state = trainer.model.optimizer.optimizer.state
    else:
        state = trainer.optimizer.optimizer.state
    state_bytes = sum(_local_bytes(v) for s in state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
    per_iteration = [b - a for a, b in zip([start] + times, times)][args.warmup:]
    result = {"rank": int(os.environ.get("RANK", "0")), "engine": trainer.accelerator.distributed_type.value,
              "seconds_per_iteration": statistics.median(per_iteration),
              "trained_parameters_mb": sum(_local_bytes(p) for p in trained) / 2**20,
              "optimizer_state_mb": state_bytes / 2**20,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "parameters_per_model_m": sum(getattr(p, "ds_numel", p.numel()) for p in wrapper.policy.parameters())
              / 1e6}
    if torch.cuda.is_available():
        result["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    with open(os.path.join(args.out, f"rank{result['rank']}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--gpu", action="store_true", help="bf16 on GPUs, as the configs ship")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / f"scale-out-{time.strftime('%Y-%m')}"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    results = {}
    for engine in args.engines.split(","):
        out = os.path.join(args.out, engine)
        os.makedirs(out, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // args.num_processes)),
               "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if not args.gpu:
            env["DS_ACCELERATOR"] = "cpu"
            if engine == "ddp":
                env["ACCELERATE_USE_CPU"] = "true"
        precision = [] if args.gpu else ["--mixed_precision", "no"]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *ENGINES[engine], "--num_processes",
               str(args.num_processes), *precision, "--main_process_port", "29561", __file__, "--worker",
               "--out", out, "--warmup", str(args.warmup), "--iterations", str(args.iterations)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode:
            sys.exit(f"{engine} failed:\n{proc.stderr[-3000:]}")
        results[engine] = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(args.num_processes)]
        print(engine, "done", flush=True)
    base = results.get("ddp", [None])[0]
    keys = ["seconds_per_iteration", "trained_parameters_mb", "optimizer_state_mb", "peak_rss_mb"]
    if args.gpu:
        keys.append("peak_gpu_mb")
    lines = [f"{args.num_processes} processes, {'GPU bf16' if args.gpu else 'CPU fp32'}; per process (rank 0), "
             f"ratio to DDP in brackets; {results[next(iter(results))][0]['parameters_per_model_m']:.1f}M parameters "
             "per model", "", "| engine | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for engine, ranks in results.items():
        row = ranks[0]
        engine = f"{engine} ({row['engine']})"
        cells = [f"{row[k]:.2f}" + (f" ({row[k] / base[k]:.2f})" if base and base[k] else "") for k in keys]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"results": results, "command": sys.argv}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
