"""Ragged answers: trl_ext padded, trl_ext with padding_free=True, and TRL 1.12's PPOTrainer, in one run.

    python benchmarks/padding_free.py                                     # SmolLM2-135M, T=64, B=8, CPU
    python benchmarks/padding_free.py --model tiny49k --response_length 128 --out /tmp/pf
    python benchmarks/padding_free.py --repeats 2                         # each trainer twice, orders alternating
    python benchmarks/padding_free.py --device cuda --out benchmarks/results/gpu-padding-free-<date>

Every answer stops at EOS at a length drawn uniformly from [T/4, T] (seeded by the iteration and the row, the same
for every trainer): the responses are sampled to the cap, then cut there (EOS at the drawn length, padding after),
so generation costs every trainer the same and what differs is how the scoring passes and the update treat the
padding. Each run is a fresh process (`bench_vs_trl.run_case`, whose models, phases, memory method and iteration
count it reuses: 1 warm-up iteration dropped, the median of the rest); TRL runs only where trl 1.12 is installed
(`pip install trl==1.12.0`), else its row says so. With `--repeats R` the three runs are made R times, in reverse
order every other time, and each figure is the median over the R runs: a shared machine's slow spell then falls on
every trainer. Generation is the same work for every trainer, so its time in the table shows how fast the machine
was during each run. Writes `<out>/results.json` and `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_vs_trl as bench  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAINERS = ("trl_ext", "trl_ext_padding_free", "trl")


def stop_lengths(step: int, batch: int, T: int):
    """(B,) the answers' lengths at iteration `step`: uniform in [T/4, T], the same for every trainer."""
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(max(T // 4, 1), T + 1, (batch,), generator=g)


def cut(responses, lengths, eos: int, pad: int):
    """Each row's response cut to its length: EOS at the last position, padding after. -> (responses, mask)."""
    import torch

    positions = torch.arange(responses.shape[1], device=responses.device)[None]
    lengths = lengths.to(responses.device)[:, None]
    mask = positions < lengths
    out = responses.masked_fill(~mask, pad)
    return out.masked_fill(positions == lengths - 1, eos), mask


def ragged_trl_ext(trainer) -> None:
    sampler, tok, steps = trainer.rollout_phase.sampler, trainer.processing_class, [0]
    original = sampler.rollout_responses

    def rollout_responses(queries, query_mask, step, draw=0):
        responses, _, logprobs = original(queries, query_mask, step, draw)
        lengths = stop_lengths(steps[0], responses.shape[0], responses.shape[1])
        steps[0] += 1
        responses, mask = cut(responses, lengths, tok.eos_token_id, tok.pad_token_id)
        return responses, mask, logprobs * mask

    sampler.rollout_responses = rollout_responses


def ragged_trl(trainer) -> None:
    """TRL 1.12 reads each answer's length from its first pad token (no stop token set: it truncates nothing)."""
    import torch
    import trl.experimental.ppo.ppo_trainer as trl_ppo

    tok, steps, original = trainer.processing_class, [0], trl_ppo.batch_generation

    def batch_generation(model, queries, *args, **kwargs):
        query_responses, logits = original(model, queries, *args, **kwargs)
        Q = queries.shape[1]
        responses = query_responses[:, Q:]
        lengths = stop_lengths(steps[0], responses.shape[0], responses.shape[1])
        steps[0] += 1
        responses, _ = cut(responses, lengths, tok.eos_token_id, tok.pad_token_id)
        return torch.cat([query_responses[:, :Q], responses], 1), logits

    trl_ppo.batch_generation = batch_generation


def run_case(case: bench.Case, padding_free: bool) -> dict:
    """bench_vs_trl.run_case with ragged answers (and padding_free for trl_ext)."""
    build = bench.build_trainer

    def build_trainer(case, output_dir, models):
        import trl_ext

        if case.trainer == "trl":
            trainer = build(case, output_dir, models)
            ragged_trl(trainer)
            return trainer
        config = trl_ext.PPOConfig
        trl_ext.PPOConfig = lambda **kw: config(**{**kw, "padding_free": padding_free})
        try:
            trainer = build(case, output_dir, models)
        finally:
            trl_ext.PPOConfig = config
        ragged_trl_ext(trainer)
        return trainer

    bench.build_trainer = build_trainer
    return bench.run_case(case)


def median_summary(summaries: list[dict]) -> dict:
    """The median over runs of each figure the table shows."""
    return {"seconds_per_iteration": statistics.median(s["seconds_per_iteration"] for s in summaries),
            "phases": {k: statistics.median(s["phases"][k] for s in summaries) for k in summaries[0]["phases"]},
            "peak_growth_mb": statistics.median(s["peak_growth_mb"] for s in summaries)}


def run_in_subprocess(case: bench.Case, name: str, log_dir: Path, padding_free: bool = False) -> dict | None:
    if case.trainer == "trl" and importlib.util.find_spec("trl.experimental.ppo") is None:
        return None
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
               "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        log = log_dir / f"{name}.log"
        with open(log, "w") as f:
            proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(case)), "--result",
                                   result.name] + (["--padding_free"] if padding_free else []), stdout=f,
                                  stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed (exit {proc.returncode}); see {log}:\n" + log.read_text()[-3000:])
        return json.loads(Path(result.name).read_text())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", choices=bench.MODELS)
    parser.add_argument("--response_length", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=2, help="measured iterations (after 1 warm-up)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per trainer, orders alternating (medians)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--padding_free", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    cli = parser.parse_args(argv)
    if cli.worker:
        result = run_case(bench.Case(**json.loads(cli.worker)), padding_free=cli.padding_free)
        Path(cli.result).write_text(json.dumps(result))
        return
    today = datetime.date.today().isoformat()
    out = Path(cli.out or ROOT / "benchmarks" / "results" / f"{cli.device}-{today}-padding-free")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    base = bench.Case(cli.model, "trl_ext", "plain", cli.response_length, cli.batch_size, cli.iterations,
                      device=cli.device)
    runs: dict[str, list] = {name: [] for name in TRAINERS}
    for repeat in range(cli.repeats):
        for name in TRAINERS if repeat % 2 == 0 else TRAINERS[::-1]:
            case = replace(base, trainer="trl" if name == "trl" else "trl_ext")
            run = run_in_subprocess(case, f"{name}-{repeat}", out / "logs", padding_free=name == "trl_ext_padding_free")
            if run is None:
                continue
            runs[name].append(run)
            s = bench.summarize(run)
            print(f"{name} (run {repeat + 1}): {s['seconds_per_iteration']:.2f} s/iter, generation "
                  f"{s['phases']['generation']:.2f} s, peak growth {s['peak_growth_mb']:.0f} MB", flush=True)
    rows = {name: {"runs": r, "summary": median_summary([bench.summarize(run) for run in r])} if r else None
            for name, r in runs.items()}
    padded = rows["trl_ext"]["summary"]
    lines = [f"{today}, {bench.hardware(cli.device)}; {cli.model}, T={cli.response_length}, B={cli.batch_size}, "
             f"answers cut at lengths uniform in [T/4, T]; median of {cli.iterations} iterations after 1 warm-up"
             + (f", median of {cli.repeats} runs per trainer (orders alternating)." if cli.repeats > 1 else "."),
             "", "| trainer | s/iter | × trl_ext padded | scoring + update s | × | generation s | peak growth MB | × |",
             "|---|---|---|---|---|---|---|---|"]
    for name in TRAINERS:
        if rows[name] is None:
            lines.append(f"| {name} | not run: needs trl==1.12.0 | | | | | | |")
            continue
        s = rows[name]["summary"]
        work = sum(v for k, v in s["phases"].items() if k in ("critic", "reference", "reward", "update"))
        padded_work = sum(v for k, v in padded["phases"].items() if k in ("critic", "reference", "reward", "update"))
        lines.append(f"| {name} | {s['seconds_per_iteration']:.2f} | "
                     f"{s['seconds_per_iteration'] / padded['seconds_per_iteration']:.2f} | {work:.2f} | "
                     f"{work / padded_work:.2f} | {s['phases']['generation']:.2f} | {s['peak_growth_mb']:.0f} | "
                     f"{s['peak_growth_mb'] / padded['peak_growth_mb']:.2f} |")
    table = "\n".join(lines) + "\n"
    (out / "results.json").write_text(json.dumps({"command": " ".join(sys.argv), "rows": rows}, indent=1))
    (out / "results.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
