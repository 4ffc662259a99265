"""Verifiable rewards, head to head: trl_ext's PPO (the recipe's plain settings, and VAPO-style) against TRL's
GRPOTrainer on the same task, model, LoRA, prompts, reward and completion budget, several seeds each.

    python benchmarks/verifiable_vs_grpo.py --out benchmarks/results/verifiable-2026-12     # 3 seeds x 3 trainers
    python benchmarks/verifiable_vs_grpo.py --seeds 0 --budget 32 --trainers grpo ppo --out /tmp/v   # a quick check

The task is recipes/ppo_smollm2_arithmetic.py's: SmolLM2-135M-Instruct + LoRA (r=8, all linear layers) learns
"What is a + b?" for a, b in 1..25, the reward 1.0 when the completion's last number is the sum (TRL's
reward-function convention, the same function for both trainers), 16 tokens at most, temperature 0.7, 369 training
prompts. Each trainer trains on `--budget` completions (PPO: `total_episodes`; GRPO: `max_steps` × 8 completions);
dynamic sampling draws more than it trains on, and every drawn completion is counted (the reward function counts the
completions it scores). Every run is its own Python process with all the machine's threads, one after another.

Held-out accuracy: the recipe's `held_out_accuracy` (256 prompts never trained on, one completion each at temperature
0.7 from a fixed seed) of the LoRA adapter as it was when the run had drawn 1/3, 2/3 and all of its completions (the
adapter is copied then and evaluated after training, so the wall-clock is training alone), and of the untrained model
once. For trl_ext's runs the seconds of each phase (generation, reference, policy_and_value, reward, update,
critic_warmup) are kept too: where PPO's time goes. Writes `<out>/results.json` (every run, every snapshot),
`<out>/results.md` (the table) and `<out>/accuracy.png` (held-out accuracy against completions drawn and against
training seconds).

Trainers (their settings beyond the shared ones):
- `grpo`: TRL's `GRPOTrainer` with its defaults (loss_type "dapo", β 0, one iteration per generation, scale_rewards
  "group"), num_generations 4, 8 completions per step (2 prompts), the recipe's learning rate (3e-4; at 1e-3 its
  training score fell to 0 by step 13 on this task, as PPO's did), constant schedule.
- `ppo`: the recipe's defaults (8 prompts per step, 2 PPO epochs, kl_coef 0.05, value model SmolLM2-135M with its top
  2 layers trained, learning rate as the recipe).
- `ppo_vapo`: the recipe with VAPO's ingredients (Yue et al. 2025): num_generations 4, dynamic sampling (at most 3
  draws), decoupled λ (λ_value 1.0), clip-higher (0.28), and value pretraining until the explained variance reaches
  0.2 (at most 4 iterations).
- `ppo_grpo_script`: the `grpo` run's script with its two class names changed to trl_ext's `PPOConfig` and
  `PPOTrainer`: PPO's defaults where the script sets nothing, the critic and the reference made for it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))

PPO_FLAGS = {
    "ppo": [],
    "ppo_vapo": ["--num_generations", "4", "--dynamic_sampling", "true", "--max_num_gen_batches", "3",
                 "--lam_value", "1.0", "--clip_ratio_high", "0.28", "--critic_warmup_steps", "4",
                 "--critic_warmup_explained_variance", "0.2"],
}
TRAINERS = ("grpo", "ppo", "ppo_vapo", "ppo_grpo_script")
SNAPSHOTS = (1 / 3, 2 / 3)  # shares of the budget drawn at which the adapter is copied (and at the end)


class CountingReward:
    """The recipe's `correct`, counting the completions it scores (the completions a trainer drew)."""

    __name__ = "correct"

    def __init__(self):
        from ppo_smollm2_arithmetic import correct

        self.correct, self.count = correct, 0

    def __call__(self, completions, answer, **kwargs):
        self.count += len(completions)
        return self.correct(completions, answer, **kwargs)


def snapshot_callback(policy, reward: CountingReward, marks: list[int], snapshots: list):
    """A TrainerCallback copying the LoRA weights (and the completions drawn, the training seconds) after the first
    step at which the drawn completions reach each mark, and at the end of training."""
    from peft import get_peft_model_state_dict
    from transformers import TrainerCallback

    def take(state):
        weights = {k: v.detach().clone() for k, v in get_peft_model_state_dict(policy).items()}
        snapshots.append({"completions": reward.count, "seconds": time.perf_counter() - clock["start"],
                          "step": state.global_step, "weights": weights})

    clock = {"start": None}

    class Snapshots(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            clock["start"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            while marks and reward.count >= marks[0]:
                marks.pop(0)
                take(state)

        def on_train_end(self, args, state, control, **kwargs):
            take(state)

    return Snapshots()


class PhaseSeconds:
    """A `trainer.phases` listener: the seconds spent in each of trl_ext's phases (trl_ext/monitoring/phases.py)."""

    def __init__(self):
        self.seconds, self.started = {}, {}

    def start(self, name):
        self.started[name] = time.perf_counter()

    def stop(self, name):
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - self.started.pop(name)


def grpo_trainer(seed: int, budget: int, output_dir: str, reward, callbacks, learning_rate: float = 3e-4,
                 ppo: bool = False):
    """The GRPO script: GRPOTrainer's call with the model by path; `ppo`: the same script with the class names
    changed (trl_ext's PPOConfig and PPOTrainer: PPO's defaults where GRPO's script sets nothing, the critic and
    reference made for it)."""
    from ppo_smollm2_arithmetic import build_datasets
    from trl import ModelConfig, get_peft_config

    if ppo:
        from trl_ext import PPOConfig as GRPOConfig
        from trl_ext import PPOTrainer as GRPOTrainer
    else:
        from trl import GRPOConfig, GRPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.scripts import LORA_DEFAULTS, load_tokenizer

    path = str(smollm2_path())
    tokenizer = load_tokenizer(path)
    train_dataset, held_out = build_datasets()
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=8, num_generations=4,
                      max_completion_length=16, temperature=0.7, learning_rate=learning_rate,
                      max_steps=budget // 8, lr_scheduler_type="constant", logging_steps=1, report_to="none",
                      save_strategy="no", bf16=False, use_cpu=True, gradient_checkpointing=False, seed=seed,
                      disable_tqdm=True)
    trainer = GRPOTrainer(model=path, reward_funcs=reward, args=args, train_dataset=train_dataset,
                          processing_class=tokenizer, peft_config=get_peft_config(ModelConfig(**LORA_DEFAULTS)),
                          callbacks=callbacks)
    policy = trainer.unwrapped.policy if ppo else trainer.model
    return trainer, policy, tokenizer, held_out, args.temperature, args.max_completion_length


def ppo_trainer(name: str, seed: int, budget: int, output_dir: str, reward, callbacks):
    from ppo_smollm2_arithmetic import RECIPE_DEFAULTS, ScriptArguments, build_trainer
    from trl import ModelConfig

    from trl_ext import PPOConfig
    from trl_ext.scripts import parse_args

    argv = ["--output_dir", output_dir, "--seed", str(seed), "--total_episodes", str(budget), "--disable_tqdm",
            "true", *PPO_FLAGS[name]]
    script_args, args, model_args = parse_args((ScriptArguments, PPOConfig, ModelConfig), RECIPE_DEFAULTS, argv)
    trainer, held_out = build_trainer(script_args, args, model_args, reward=reward, callbacks=callbacks)
    return (trainer, trainer.unwrapped.policy, trainer.processing_class, held_out, args.temperature,
            args.response_length)


def worker(name: str, seed: int, budget: int, out: str, held_out_size: int, grpo_lr: float) -> None:
    """One run: train, then the held-out accuracy of each snapshot; `out`: its JSON."""
    import warnings

    import torch
    from peft import set_peft_model_state_dict
    from ppo_smollm2_arithmetic import held_out_accuracy

    warnings.filterwarnings("ignore")
    torch.set_num_threads(os.cpu_count())
    reward, snapshots = CountingReward(), []
    marks = [round(budget * share) for share in SNAPSHOTS]
    with tempfile.TemporaryDirectory() as tmp:
        if name == "base":  # the untrained model: the grpo build, no training
            _, policy, tokenizer, held_out, temperature, length = grpo_trainer(seed, 8, tmp, reward, [], grpo_lr)
            runs = [{"completions": 0, "seconds": 0.0, "step": 0, "weights": None}]
        else:
            build = ((lambda *a: grpo_trainer(*a, grpo_lr, ppo=name == "ppo_grpo_script"))
                     if name in ("grpo", "ppo_grpo_script") else (lambda *a: ppo_trainer(name, *a)))
            trainer, policy, tokenizer, held_out, temperature, length = build(seed, budget, tmp, reward, [])
            trainer.add_callback(snapshot_callback(policy, reward, marks, snapshots))
            phases = PhaseSeconds()
            if hasattr(trainer, "phases"):  # trl_ext's: where PPO's time goes
                trainer.phases.add(phases)
            start = time.perf_counter()
            trainer.train()
            train_s = time.perf_counter() - start
            runs = snapshots
        held_out = held_out.select(range(min(held_out_size, len(held_out))))
        for snap in runs:
            if snap["weights"] is not None:
                set_peft_model_state_dict(policy, snap.pop("weights"))
            snap.pop("weights", None)
            snap["accuracy"] = held_out_accuracy(policy, tokenizer, held_out, temperature, length)
    result = {"trainer": name, "seed": seed, "budget": budget, "held_out": len(held_out), "snapshots": runs}
    if name != "base":
        result["train_seconds"] = train_s
        # the process's peak resident memory (the model load, training and the evaluations): Linux reports KiB
        result["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        result["phase_seconds"] = phases.seconds
        history = [h for h in trainer.state.log_history if "loss" in h or "objective/scores" in h]
        result["log_history"] = history
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


def _spread(values: list[float]) -> str:
    mean = statistics.mean(values)
    return f"{mean:.3f} ({min(values):.3f}–{max(values):.3f})" if len(values) > 1 else f"{mean:.3f}"


def report(results: list[dict], out: str) -> str:
    """The table (means over seeds, min–max in brackets) and the plot."""
    first = next(r for r in results if r["trainer"] == "base")
    base = first["snapshots"][0]["accuracy"]
    lines = [f"Held-out accuracy of the untrained model: {base:.3f} ({first['held_out']} prompts, temperature 0.7).",
             "",
             "| trainer | seeds | accuracy at 1/3 | at 2/3 | at the end | completions drawn | training s | "
             "s per 100 completions | peak RSS GiB |", "|---|---|---|---|---|---|---|---|---|"]
    for name in TRAINERS:
        runs = [r for r in results if r["trainer"] == name]
        if not runs:
            continue
        at = [[r["snapshots"][i]["accuracy"] for r in runs] for i in range(3)]
        drawn = [r["snapshots"][-1]["completions"] for r in runs]
        seconds = [r["train_seconds"] for r in runs]
        peak = _spread([r["peak_rss_gib"] for r in runs]) if all("peak_rss_gib" in r for r in runs) else "-"
        lines.append(f"| {name} | {len(runs)} | {_spread(at[0])} | {_spread(at[1])} | {_spread(at[2])} | "
                     f"{statistics.mean(drawn):.0f} | {statistics.mean(seconds):.0f} | "
                     f"{statistics.mean(s / d * 100 for s, d in zip(seconds, drawn)):.1f} | "
                     f"{peak} |")
    table = "\n".join(lines) + "\n"
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(table)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return table
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    colours = {"grpo": "tab:orange", "ppo": "tab:blue", "ppo_vapo": "tab:green", "ppo_grpo_script": "tab:purple"}
    for r in results:
        if r["trainer"] == "base":
            continue
        points = [(0, 0.0, base)] + [(s["completions"], s["seconds"], s["accuracy"]) for s in r["snapshots"]]
        label = r["trainer"] if r["seed"] == min(x["seed"] for x in results if x["trainer"] == r["trainer"]) else None
        for ax, i in ((axes[0], 0), (axes[1], 1)):
            ax.plot([p[i] for p in points], [p[2] for p in points], "o-", color=colours[r["trainer"]], alpha=0.7,
                    label=label)
    axes[0].set_xlabel("completions drawn")
    axes[1].set_xlabel("training seconds (2 CPU cores)")
    axes[0].set_ylabel("held-out accuracy")
    axes[0].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle("SmolLM2-135M-Instruct + LoRA, addition (recipes/ppo_smollm2_arithmetic.py)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "accuracy.png"), dpi=100)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trainers", nargs="+", default=list(TRAINERS), choices=TRAINERS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--budget", type=int, default=320, help="completions each run trains on")
    parser.add_argument("--held_out", type=int, default=256, help="held-out prompts evaluated (at most 256)")
    parser.add_argument("--grpo_learning_rate", type=float, default=3e-4)
    parser.add_argument("--out", default="benchmarks/results/verifiable-dev")
    parser.add_argument("--worker", nargs=3, metavar=("TRAINER", "SEED", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        name, seed, out = args.worker
        worker(name, int(seed), args.budget, out, args.held_out, args.grpo_learning_rate)
        return
    os.makedirs(args.out, exist_ok=True)
    results = []
    jobs = [("base", 0)] + [(name, seed) for seed in args.seeds for name in args.trainers]
    for name, seed in jobs:
        path = os.path.join(args.out, f"{name}-seed{seed}.json")
        started = time.time()
        subprocess.run([sys.executable, __file__, "--budget", str(args.budget), "--held_out", str(args.held_out),
                        "--grpo_learning_rate", str(args.grpo_learning_rate), "--worker", name, str(seed), path],
                       check=True)
        results.append(json.load(open(path)))
        last = results[-1]["snapshots"][-1]
        print(f"[verifiable] {name} seed {seed}: accuracy {last['accuracy']:.3f} after {last['completions']} "
              f"completions ({time.time() - started:.0f} s with evaluation)", flush=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"budget": args.budget, "grpo_learning_rate": args.grpo_learning_rate, "runs": results}, f,
                  indent=1)
    print(report(results, args.out))


if __name__ == "__main__":
    main()
