"""Preemption: SIGTERM (SLURM, Kubernetes and `accelerate launch` send it before killing a job) and SIGINT (Ctrl-C)
during `train()` set a flag; at the end of the iteration in progress every process learns of it (one all-reduce),
the trainer saves a checkpoint and the process exits with status 0, printing the checkpoint's path. A second Ctrl-C
stops at once (KeyboardInterrupt). The grace period the scheduler gives must cover the rest of an iteration and one
save (docs/checkpoints.md)."""

from __future__ import annotations

import signal
import sys
import threading

import torch

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Preemption:
    """Inside: SIGTERM and SIGINT are caught (main thread only: Python delivers signals there); `requested` tells
    every process whether any received one."""

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handler(self, signum, frame) -> None:
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the save
        self.received = signal.Signals(signum).name
        print(f"[trl_ext] {self.received} received: saving a checkpoint at the end of this iteration, then exiting "
              "(Ctrl-C again to stop at once, without it)", file=sys.stderr, flush=True)

    def requested(self, backend) -> bool:
        """Whether any process received a signal (a collective under several processes: every one must call it)."""
        flag = torch.tensor(float(self.received is not None), device=backend.device)
        return float(backend.sum_over_processes(flag)) > 0
