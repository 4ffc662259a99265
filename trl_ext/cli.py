"""The ``trl-ext`` command line.

    trl-ext report RUN_DIR               # or: python -m trl_ext.cli report RUN_DIR

``report`` prints a summary of ``RUN_DIR/metrics.jsonl`` (start vs end of the key metrics, alarms raised) and writes
``RUN_DIR/dashboard.png``; the last line printed is the PNG's path.

Exit codes: 0 done; 1 metrics.jsonl is malformed; 2 usage error, or the folder or its metrics.jsonl does not exist.
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trl-ext", description="Tools for trl_ext PPO runs.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    rep = sub.add_parser(
        "report",
        help="summarize a run and write RUN_DIR/dashboard.png",
        description="Print a summary of RUN_DIR/metrics.jsonl (key metrics at start vs end, alarms raised) and write "
        "a PNG dashboard to RUN_DIR/dashboard.png.",
    )
    rep.add_argument("run_dir", metavar="RUN_DIR", help="a trl_ext run's output_dir (holds metrics.jsonl)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line with `argv` (default: ``sys.argv[1:]``); return the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)  # exits 2 on a usage error
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "report":
        from .report import report

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
    parser.error(f"unknown command {args.command!r}")  # unreachable: argparse rejects unknown choices
    return 2


if __name__ == "__main__":
    sys.exit(main())
