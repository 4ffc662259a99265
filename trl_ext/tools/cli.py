"""The ``trl-ext`` command line's tools (``trl-ext ppo``, training, is trl_ext/scripts/cli.py's, which hands the
rest to this module):

    trl-ext report RUN_DIR               # or: python -m trl_ext.tools.cli report RUN_DIR
    trl-ext estimate-memory CONFIG [--model PRESET|config.json] [--json] [--all-presets]
                                   [--padding_free] [--max_tokens_per_micro_batch N]

``report`` prints a summary of ``RUN_DIR/metrics.jsonl`` (start vs end of the key metrics, alarms raised) and writes
``RUN_DIR/dashboard.png``; the last line printed is the PNG's path.

``estimate-memory`` prints the memory planner's table (trl_ext/tools/memory.py) for a recipe's plan (a YAML/JSON file of
PlanConfig fields, e.g. recipes/qlora_7b/shared_16gb.yaml) and a model: ``--model``, else the file's ``model`` key
(a preset: llama-2-7b, llama-3-8b, mistral-7b, qwen2.5-7b; or a config.json). ``--json`` prints it as JSON;
``--all-presets`` prints one line per preset instead. ``--padding_free`` and ``--max_tokens_per_micro_batch N`` (a token
budget; it implies padding-free) override the file's: the estimate is then for packed passes, a budget's for its worst
packing. The table ends with the longest response that fits 24, 16 and 12 GB with the rest as planned.

Exit codes: 0 done; 1 metrics.jsonl is malformed; 2 usage error, or the folder or its metrics.jsonl does not exist,
or (estimate-memory) the plan file or the model is missing or invalid.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-ext", description="Tools for trl_ext PPO runs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("ppo", add_help=False, help="train with PPO: the flags of `trl grpo` (trl-ext ppo --help)")  # (its
    # own parser: trl_ext/scripts/cli.py)
    rep = sub.add_parser(
        "report",
        help="summarize a run and write RUN_DIR/dashboard.png",
        description="Print a summary of RUN_DIR/metrics.jsonl (key metrics at start vs end, alarms raised) and write "
        "a PNG dashboard to RUN_DIR/dashboard.png.",
    )
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a trl_ext run's output_dir (holds metrics.jsonl)")
    est = sub.add_parser(
        "estimate-memory",
        help="estimate the GPU memory of a PPO recipe (per component and phase) and whether it fits 24/16/12 GB",
        description="Print the memory planner's table for CONFIG (a YAML/JSON file of trl_ext.tools.memory.PlanConfig "
        "fields) and a model, the peak phase, and a verdict for 24, 16 and 12 GB GPUs.",
    )
    est.add_argument("config", metavar="CONFIG", help="plan file, e.g. recipes/qlora_7b/shared_16gb.yaml")
    est.add_argument("--model", help="a preset (llama-2-7b, llama-3-8b, mistral-7b, qwen2.5-7b) or a config.json "
                     "path; default: the plan's `model` key")
    est.add_argument("--json", action="store_true", help="print the estimate as JSON")
    est.add_argument("--all-presets", action="store_true",
                     help="one line per preset model (peak, needed, verdicts) instead of the table")
    est.add_argument("--padding_free", action="store_true",
                     help="plan padding-free passes (PPOConfig.padding_free), whatever the file says")
    est.add_argument("--max_tokens_per_micro_batch", type=int, metavar="N",
                     help="plan micro-batches and scoring chunks of at most N real tokens, packed (implies "
                     "--padding_free): the peak of the worst packing")
    return parser


def _estimate_memory(args) -> int:
    import dataclasses
    import json

    from .memory import PlanConfig, estimate_memory, load_shape, presets_summary

    try:
        plan = PlanConfig.from_file(args.config)
        if args.padding_free or args.max_tokens_per_micro_batch is not None:
            budget = args.max_tokens_per_micro_batch
            plan = PlanConfig.from_dict({**dataclasses.asdict(plan), "padding_free": True,
                                         "max_tokens_per_micro_batch": plan.max_tokens_per_micro_batch
                                         if budget is None else budget})
        if args.all_presets:
            print(presets_summary(plan))
            return 0
        spec = args.model or plan.model
        if not spec:
            raise ValueError(f"no model: pass --model (a preset or a config.json) or set `model:` in {args.config}")
        estimate = estimate_memory(load_shape(spec), plan)
    except (FileNotFoundError, ValueError, TypeError) as e:
        print(f"trl-ext estimate-memory: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(estimate.to_dict(), indent=1) if args.json else estimate.format_table())
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run the command line with `argv` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "report":
        from ..monitoring.report import report

        try:
            summary = report(args.run_dir)
        except FileNotFoundError as e:
            print(f"trl-ext report: error: {e}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"trl-ext report: error: {e}", file=sys.stderr)
            return 1
        print(summary)
        return 0
    if args.command == "estimate-memory":
        return _estimate_memory(args)
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse rejects unknown choices
    return 2


if __name__ == "__main__":
    sys.exit(main())
