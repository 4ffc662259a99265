"""CPU training: let glibc's malloc keep freed memory for reuse (process plumbing, no PPO math).

PyTorch's CPU allocator is plain `malloc`/`free`. A PPO step on CPU allocates and frees about a gigabyte: every
gradient (set to None after each optimizer step), activations, logits. With glibc's defaults the free top of the heap
goes back to the OS after a step (the trim threshold follows the mmap threshold, at most 64 MiB) and blocks above
the mmap threshold are mapped afresh and unmapped on free, so the next step page-faults the same memory in again,
page by page. `keep_freed_memory()` fixes the mmap threshold at glibc's largest value (32 MiB) and never trims the
heap, for the whole process, at any time: `PPOConfig.cpu_reuse_freed_memory` (default: on when training on CPU).

Measured by trl_ext's trainer on 2 cores (benchmarks/README.md), glibc's defaults / this / also every block above
32 MiB kept (`MALLOC_MMAP_MAX_=0`): SmolLM2-135M, T = 32, update 5.0 / 4.3 / 3.7 s per iteration, peak memory level;
the 49k-vocabulary tiny Llama at T = 256, iteration 7.3 / 6.9 / 5.4 s, peak growth 977 / 1007 / 1572 MB. The last
is faster but fragments the heap, so it is left to the environment: `MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=
<large>`, or jemalloc/tcmalloc through `LD_PRELOAD` (Intel's advice for PyTorch on CPU); where any of these is set,
the trainer leaves the allocator alone. The resident size no longer shrinks after a peak.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks up to 32 MiB come from the heap, larger ones are mapped
NEVER = -1  # mallopt takes an int; glibc reads the trim threshold as a size_t, so -1 is "never trim"
# environment variables by which a user has already chosen how the C allocator behaves
ALLOCATOR_ENVIRONMENT = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
                         "GLIBC_TUNABLES", "LD_PRELOAD")


def allocator_chosen_by_user() -> str | None:
    """The environment variable by which the user chose the allocator's behaviour (None: glibc's defaults)."""
    return next((name for name in ALLOCATOR_ENVIRONMENT if os.environ.get(name)), None)


@functools.cache
def glibc():
    """The C library through ctypes where it is glibc, else None."""
    if not hasattr(os, "confstr"):
        return None
    try:  # "glibc 2.36" where the C library is glibc; musl and others do not answer
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return None
    except (ValueError, OSError):
        return None
    return ctypes.CDLL("libc.so.6")  # glibc's soname on every Linux architecture


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve every block up to 32 MiB from its heap (M_MMAP_THRESHOLD, fixed at glibc's largest
    value instead of growing to it by itself) and never hand the heap's free top back to the OS (M_TRIM_THRESHOLD),
    for the whole process from now on. Blocks above 32 MiB are still mapped afresh and unmapped on free: keeping them
    too (MALLOC_MMAP_MAX_=0) is faster again but fragments the heap (+60 % peak memory with the 49k-vocabulary logits
    at T = 256). Returns whether it was set: False where the C library is not glibc."""
    libc = glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NEVER))
