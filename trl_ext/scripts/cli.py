"""The ``trl-ext`` command (pyproject.toml's entry point): ``trl-ext ppo`` trains (trl_ext/scripts/ppo.py, with the
flags of ``trl grpo``); every other command is a tool of trl_ext/tools/cli.py (``report``, ``estimate-memory``).

    trl-ext ppo --model_name_or_path ... --dataset_name ... --reward_funcs accuracy_reward
    python -m trl_ext.scripts.cli ppo ...      # the same
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ppo"]:  # its own parser: every PPOConfig and ModelConfig flag
        from .ppo import run

        return run(argv[1:])
    from ..tools.cli import main as tools

    return tools(argv)


if __name__ == "__main__":
    sys.exit(main())
