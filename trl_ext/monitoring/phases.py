"""`Phases`: the named phases of a PPO iteration, announced as they start and stop.

The trainer and its collaborators open a phase around each step: "generation" (sampling, a vLLM weight sync
included), "reference" (the reference pass), "policy_and_value" (the rollout's π_old and value forward), "reward"
(the rewards' scores), "update" or "critic_warmup" (the PPO epochs) and "evaluation". Phases nest (evaluation
samples, so "generation" opens inside "evaluation"). Listeners get `start(name)` and `stop(name)`: the progress bar
shows the outermost phase, and benchmarks time every phase through this hook (`trainer.phases.add(listener)`).
"""

from __future__ import annotations

from contextlib import contextmanager

PHASE_NAMES = ("generation", "reference", "policy_and_value", "reward", "update", "critic_warmup", "evaluation")


class Phases:
    def __init__(self):
        self.listeners: list = []
        self.open: list[str] = []

    def add(self, listener) -> None:
        """`listener.start(name)` and `listener.stop(name)` are called as each phase starts and stops."""
        self.listeners.append(listener)

    @contextmanager
    def __call__(self, name: str):
        if name not in PHASE_NAMES:
            raise ValueError(f"unknown phase {name!r}; phases are {PHASE_NAMES}")
        self.open.append(name)
        for listener in self.listeners:
            listener.start(name)
        try:
            yield
        finally:
            for listener in reversed(self.listeners):
                listener.stop(name)
            self.open.pop()
