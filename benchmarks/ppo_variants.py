"""The PPO variants (docs/ppo-variants.md) side by side on a small CPU task: each variant trains the same tiny Llama
for the same budget, over several seeds, and the table reports how fast and how far the reward rose and what the
variant's own diagnostics showed.

    python benchmarks/ppo_variants.py                                   # 3 seeds, ~3 minutes on 2 cores
    python benchmarks/ppo_variants.py --seeds 1 --steps 10 --out /tmp/v  # a quick check of the script

The task (as tests/trainer/test_trainer.py's): the reward is the share of a response's words that come from 8 of the 73
tokens (about 0.1 for a random response), responses stop at EOS (lengths vary) within `--response_length` tokens,
β = 0.01, lr 1e-2, 2 PPO epochs over 2 minibatches per iteration of 16 prompts. Writes `<out>/results.json` and
`<out>/results.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

import torch

from trl_ext import PPOConfig, PPOTrainer
from trl_ext.testing import tiny_causal_lm, tiny_prompt_dataset, tiny_scalar_model, tiny_tokenizer

TARGETS = {f"w{i}" for i in range(8)}

VARIANTS = {
    "TRL 1.12 PPO (defaults)": {},
    "clip-higher (ε 0.2 / 0.28)": dict(clip_ratio_low=0.2, clip_ratio_high=0.28),
    "dual-clip (c = 3)": dict(clip_ratio_c=3.0),
    "8 PPO epochs (stale ratios)": dict(num_ppo_epochs=8),
    "8 PPO epochs, dual-clip (c = 3)": dict(num_ppo_epochs=8, clip_ratio_c=3.0),
    "token-sum": dict(loss_agg_mode="token-sum"),
    "seq-mean-token-sum": dict(loss_agg_mode="seq-mean-token-sum"),
    "seq-mean-token-mean": dict(loss_agg_mode="seq-mean-token-mean"),
    "seq-mean-token-sum-norm": dict(loss_agg_mode="seq-mean-token-sum-norm"),
    "decoupled λ (policy 0.95, value 1.0)": dict(lam_policy=0.95, lam_value=1.0),
    "length-adaptive λ (α 0.5), value λ 1.0": dict(length_adaptive_alpha=0.5, lam_value=1.0),
    "value loss: mse": dict(vf_loss_type="mse"),
    "value loss: huber (δ 0.05)": dict(vf_loss_type="huber", vf_huber_delta=0.05),
    "vf_coef 0.1 → 0.01": dict(vf_coef_end=0.01),
}
LAST_5 = ("objective/scores", "rollout/response_length_mean", "policy/entropy_avg", "val/explained_variance")
WHOLE_RUN = ("policy/clipfrac_low_avg", "policy/clipfrac_high_avg", "policy/clipfrac_dual_avg", "policy/lam_mean")


def target_share(prompts, completions):
    return [sum(w in TARGETS for w in c.split()) / max(len(c.split()), 1) for c in completions]


def run(overrides: dict, seed: int, steps: int, response_length: int) -> list[dict]:
    tok = tiny_tokenizer()
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = dict(output_dir=out, per_device_train_batch_size=8, num_mini_batches=2, total_episodes=16 * steps,
                      learning_rate=1e-2, num_ppo_epochs=2, kl_coef=0.01, response_length=response_length,
                      logging_steps=1, report_to=[], save_strategy="no", num_sample_generations=0, bf16=False,
                      disable_tqdm=True, seed=seed, alarms=False)
        args = PPOConfig(**{**kwargs, **overrides})
        t = PPOTrainer(args=args, processing_class=tok, model=tiny_causal_lm(tok, seed=seed), ref_model=None,
                       reward_model=target_share, train_dataset=tiny_prompt_dataset(tok, 32),
                       value_model=tiny_scalar_model(tok, seed=seed + 1))
        t.train()
    return [h for h in t.state.log_history if "objective/scores" in h]


def summarise(logs_by_seed: list[list[dict]], threshold: float) -> dict:
    def tail_mean(logs, key, n):
        values = [log[key] for log in logs[-n:] if key in log]
        return sum(values) / len(values) if values else None

    def steps_to(logs):
        return next((i + 1 for i, log in enumerate(logs) if log["objective/scores"] >= threshold), None)

    out = {"first score": statistics.mean(logs[0]["objective/scores"] for logs in logs_by_seed)}
    for keys, n in ((LAST_5, 5), (WHOLE_RUN, None)):
        for key in keys:
            values = [v for v in (tail_mean(logs, key, n or len(logs)) for logs in logs_by_seed) if v is not None]
            out[key] = statistics.mean(values) if values else None
    reached = [steps_to(logs) for logs in logs_by_seed]
    out["steps to threshold"] = reached
    return out


def table(results: dict, threshold: float, seeds: int, steps: int) -> str:
    head = (f"| variant | score, step 1 | score, last 5 | steps to {threshold} (each seed) | response length, last 5 | "
            "entropy, last 5 | explained var., last 5 | clipfrac low / high, whole run | clipfrac dual, whole run | "
            "λ_policy, whole run |")
    lines = [head, "|" + "---|" * 10]
    for name, r in results.items():
        def f(key, fmt="{:.3f}", r=r):
            return "-" if r[key] is None else fmt.format(r[key])
        reached = ", ".join("-" if s is None else str(s) for s in r["steps to threshold"])
        lines.append(f"| {name} | {r['first score']:.3f} | {f('objective/scores')} | {reached} | "
                     f"{f('rollout/response_length_mean', '{:.2f}')} | {f('policy/entropy_avg')} | "
                     f"{f('val/explained_variance')} | {f('policy/clipfrac_low_avg', '{:.4f}')} / "
                     f"{f('policy/clipfrac_high_avg', '{:.4f}')} | {f('policy/clipfrac_dual_avg', '{:.4f}')} | "
                     f"{f('policy/lam_mean', '{:.2f}')} |")
    return (f"{seeds} seeds × {steps} PPO iterations each; means over the last 5 iterations or the whole run, "
            "averaged over seeds (`benchmarks/ppo_variants.py`).\n\n" + "\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--response_length", type=int, default=6)
    parser.add_argument("--threshold", type=float, default=0.6)
    parser.add_argument("--only", nargs="*", help="variant names (default: all)")
    parser.add_argument("--out", default="benchmarks/results/ppo-variants-" + time.strftime("%Y-%m"))
    cli = parser.parse_args()
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    start, results = time.time(), {}
    for name, overrides in VARIANTS.items():
        if cli.only and name not in cli.only:
            continue
        logs = [run(overrides, seed, cli.steps, cli.response_length) for seed in range(cli.seeds)]
        results[name] = summarise(logs, cli.threshold)
        print(f"{name}: {results[name]['objective/scores']:.3f} ({time.time() - start:.0f} s)", flush=True)
    os.makedirs(cli.out, exist_ok=True)
    md = table(results, cli.threshold, cli.seeds, cli.steps)
    with open(os.path.join(cli.out, "results.md"), "w") as f:
        f.write(f"{time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {time.time() - start:.0f} s in all.\n\n" + md)
    with open(os.path.join(cli.out, "results.json"), "w") as f:
        json.dump({"args": vars(cli), "variants": VARIANTS, "results": results}, f, indent=1)
    print(md)


if __name__ == "__main__":
    main()
