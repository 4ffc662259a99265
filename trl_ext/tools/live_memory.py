"""`LiveTensorBytes`: the bytes of live tensor storages on one device type, and their peak, on any device (CPU
included): what ``torch.cuda.memory_allocated`` / ``max_memory_allocated`` report on a GPU, measured where there is
none. It validates the memory planner (trl_ext/tools/memory.py) against the real trainer on CPU
(benchmarks/validate_memory_cpu.py, tests/tools/test_live_memory.py).

    with LiveTensorBytes() as live:          # create the models inside: only storages made inside are counted
        model = ...
        live.reset_peak()
        loss = model(x).sum(); loss.backward()
        print(live.current, live.peak)

How: a `TorchDispatchMode` sees every tensor an ATen op returns (factories, results, views, autograd's saved tensors
and gradients); each new storage is counted once with its size, and a `weakref.finalize` on the storage (torch keeps
one Python object per storage) subtracts it when the last tensor using it dies. A storage resized in place is
re-counted. Not seen: buffers an op allocates and frees inside itself (kernel workspaces), and tensors made outside
torch's dispatcher (``torch.from_numpy``, weights read from safetensors files: `track` adds a model's weights).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["LiveTensorBytes", "PhasePeaks"]


class LiveTensorBytes(TorchDispatchMode):
    """Live and peak bytes of the tensor storages on `device_type` made while this mode is active."""

    def __init__(self, device_type: str = "cpu"):
        super().__init__()
        self.device_type = device_type
        self.current = 0
        self.peak = 0
        self._sizes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> [bytes counted]

    def track(self, *modules: torch.nn.Module) -> None:
        """Count the parameters and buffers of `modules` too: weights read from safetensors files are made outside
        torch's dispatcher, so the mode never sees them made. Storages already counted are not counted again."""
        for module in modules:
            for tensor in list(module.parameters()) + list(module.buffers()):
                self._count(tensor)

    def reset_peak(self) -> None:
        self.peak = self.current

    def _free(self, size: list) -> None:
        self.current -= size[0]

    def _count(self, tensor: torch.Tensor) -> None:
        if tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        size = self._sizes.get(storage)
        if size is None:
            size = self._sizes[storage] = [0]
            weakref.finalize(storage, self._free, size)
        if nbytes != size[0]:  # new, or resized in place
            self.current += nbytes - size[0]
            size[0] = nbytes
            self.peak = max(self.peak, self.current)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                self._count(leaf)
        return out


class PhasePeaks:
    """A listener of the trainer's phases (`trainer.phases.add(PhasePeaks(live))`): the peak live bytes of each
    outermost phase, per iteration (`peaks[k][phase]`: iteration k counted from 0, a new one at each "generation")."""

    def __init__(self, live: LiveTensorBytes):
        self.live = live
        self.peaks: list[dict[str, int]] = []
        self.depth = 0

    def start(self, name: str) -> None:
        self.depth += 1
        if self.depth == 1:
            if name == "generation":
                self.peaks.append({})
            self.live.reset_peak()

    def stop(self, name: str) -> None:
        self.depth -= 1
        if self.depth == 0 and self.peaks:
            self.peaks[-1][name] = max(self.peaks[-1].get(name, 0), self.live.peak)
