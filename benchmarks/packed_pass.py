"""One policy forward + backward of SmolLM2-135M-Instruct, padded against padding-free, at two row shapes.

    python benchmarks/packed_pass.py                 # both shapes, 5 interleaved repeats each, CPU

What `padding_free=True` changes in every scoring pass and update micro-batch, without generation or the optimizer:
the log-probs of the response tokens (the trainer's `response_logprobs`: logits of the positions that predict response
tokens only, fp32 log-softmax in chunks) and their backward, over the padded (B, Q + T) rows, over the rows packed
into one sequence (`trl_ext.models.Packing`), and over consecutive rows of at most `BUDGET` tokens packed pass by pass
(what `max_tokens_per_micro_batch` does: shorter sequences, more passes). They are run in turn, 5 times each after a
warm-up, and the medians compared, so a slow spell of a shared machine hits all. Shapes:

- `plain`: 8 of the shipped opinion prompts as plain text (9-15 tokens), answers cut at lengths uniform in
  [T/4, T], T = 64 (the ragged benchmark's shape, `benchmarks/padding_free.py`);
- `chat`: 16 of them through the chat template (the quickstart's prompts, 40-45 tokens), T = 32.

Prints the real-token fraction, the packed sequence's length and each median with its ratio to the padded one.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl as bench  # noqa: E402

SHAPES = {"plain": (8, 64, False), "chat": (16, 32, True)}
BUDGET = 256  # the third way: rows in passes of at most this many real tokens (max_tokens_per_micro_batch)


def rows(tok, dataset, batch: int, T: int, chat: bool):
    """(inputs, response mask) of `batch` prompts with random answers cut at lengths uniform in [T/4, T]."""
    import torch

    from trl_ext.models import sequence_inputs

    texts = [tok.decode(dataset[i]["input_ids"]) for i in range(batch)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] if chat else dataset[i]["input_ids"]
               for i, t in enumerate(texts)]
    Q = max(map(len, prompts))
    queries = torch.full((batch, Q), tok.pad_token_id)
    query_mask = torch.zeros(batch, Q, dtype=torch.bool)
    for i, p in enumerate(prompts):
        queries[i, Q - len(p):] = torch.tensor(p)
        query_mask[i, Q - len(p):] = True
    g = torch.Generator().manual_seed(1000)
    lengths = torch.randint(max(T // 4, 1), T + 1, (batch,), generator=g)
    responses = torch.randint(0, len(tok), (batch, T), generator=g)
    response_mask = torch.arange(T)[None] < lengths[:, None]
    return sequence_inputs(queries, query_mask, responses, response_mask), responses, response_mask


def main() -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from trl_ext.data.batches import token_budget_groups
    from trl_ext.embedded import smollm2_path
    from trl_ext.models import Packing, Padded

    tok = bench._smollm2_tokenizer()
    dataset = bench._opinion_dataset(tok, 64)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path(), dtype=torch.float32)
    print(f"{bench.hardware('cpu')}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name, (batch, T, chat) in SHAPES.items():
        inputs, _, mask = rows(tok, dataset, batch, T, chat)
        packing = Packing.of(inputs, mask)
        lengths = inputs["attention_mask"].sum(1).tolist()
        groups = token_budget_groups(lengths, BUDGET)  # consecutive rows of at most BUDGET tokens, one pass each
        split = [(slice(g[0], g[-1] + 1), Packing.of({k: v[g[0] : g[-1] + 1] for k, v in inputs.items()},
                                                     mask[g[0] : g[-1] + 1])) for g in groups]
        runs = {"padded": [(slice(None), Padded.of(inputs, mask))], "padding-free": [(slice(None), packing)],
                f"padding-free, at most {BUDGET} tokens a pass": split}
        times = {k: [] for k in runs}
        for repeat in range(6):  # the first a warm-up
            for k, passes in runs.items():
                start = time.perf_counter()
                for rows_, layout in passes:
                    (layout.model_logprobs(model, 1.0) * mask[rows_]).sum().backward()
                if repeat:
                    times[k].append(time.perf_counter() - start)
        padded = statistics.median(times["padded"])
        real = inputs["attention_mask"].float().mean().item()
        print(f"{name}: B={batch}, T={T}, real tokens {real:.2f} of the padded positions, packed sequence "
              f"{packing.num_tokens} tokens; " + ", ".join(
                  f"{k} {statistics.median(v):.2f} s ({statistics.median(v) / padded:.2f}x)" for k, v in times.items()),
              flush=True)


if __name__ == "__main__":
    main()
