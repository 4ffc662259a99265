"""CPU training: let glibc's malloc keep freed memory for reuse (process plumbing, no PPO math).

PyTorch's CPU allocator is plain `malloc`/`free`. A PPO step on CPU allocates and frees about a gigabyte: every
gradient (set to None after each optimizer step), activations, logits. With glibc's defaults the free top of the heap
goes back to the OS after a step (the trim threshold follows the mmap threshold, at most 64 MiB) and blocks above
the mmap threshold (which glibc moves up to 32 MiB by itself) are mapped afresh and unmapped on free, so the next
step page-faults the same memory in again, page by page. `keep_freed_memory(largest_block)` fixes the mmap threshold
at max(32 MiB, largest_block) and never trims the heap, for the whole process, at any time:
`PPOConfig.cpu_reuse_freed_memory` (default: on when training on CPU), with the largest trained parameter as
`largest_block`, so that every gradient (SmolLM2-135M's embedding: 108 MiB, and the embedding backward's output of
that size) is served from the heap; blocks larger than that, which grow with batch and length (logits), are still
mapped and given back.

Keeping every block above 32 MiB as well (`MALLOC_MMAP_MAX_=0`) is faster still but fragments the heap with the
batch-sized blocks, raising the peak, so it is left to the environment: `MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=<large>`, or jemalloc/tcmalloc through `LD_PRELOAD` (Intel's advice for PyTorch on CPU);
where any of these is set, the trainer leaves the allocator alone. The resident size no longer shrinks after a peak.
The three settings' times and peaks: docs/results.md.
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 * 2**20  # the ceiling of glibc's own (dynamic) threshold, and the least keep_freed_memory sets
MAX_THRESHOLD = 2**31 - 2**20  # mallopt takes an int
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


def largest_trained_block(module) -> int:
    """Bytes of `module`'s largest trainable parameter: the size of its gradient, the block keep_freed_memory keeps."""
    return max((p.numel() * p.element_size() for p in module.parameters() if p.requires_grad), default=0)


def keep_freed_memory(largest_block: int = 0) -> int:
    """Make glibc's malloc serve every block up to max(32 MiB, `largest_block` bytes and a MiB at most above) from its
    heap (M_MMAP_THRESHOLD, fixed instead of moving by itself) and never hand the heap's free top back to the OS
    (M_TRIM_THRESHOLD), for the whole process from now on. Larger blocks are still mapped afresh and unmapped on
    free: keeping them too (MALLOC_MMAP_MAX_=0) is faster again but fragments the heap (+60 % peak memory with the
    49k-vocabulary logits at T = 256). A glibc that refuses a threshold above 32 MiB (2.36 takes it) gets
    32 MiB. Returns the threshold set, 0 where nothing was set (the C library is not glibc)."""
    libc = glibc()
    if libc is None:
        return 0
    # above the block with its allocation overhead (PyTorch asks for 64-byte-aligned memory): the next whole MiB up
    threshold = min(max(MMAP_THRESHOLD, (largest_block // 2**20 + 1) * 2**20), MAX_THRESHOLD)
    if not libc.mallopt(M_MMAP_THRESHOLD, threshold):
        threshold = MMAP_THRESHOLD
        if not libc.mallopt(M_MMAP_THRESHOLD, threshold):
            return 0
    return threshold if libc.mallopt(M_TRIM_THRESHOLD, NEVER) else 0


def reuse_freed_memory(setting: bool | None, device_type: str, trained) -> bool:
    """`PPOConfig.cpu_reuse_freed_memory` applied: keep freed blocks up to `trained`'s largest trainable parameter
    (True: asked for; None: on CPU unless the environment chose the allocator; False: never). Whether it now does."""
    if setting is True and glibc() is None:
        raise ValueError("cpu_reuse_freed_memory=True sets glibc's malloc options, but this C library is not "
                         "glibc: drop the setting (or preload jemalloc/tcmalloc, which keep freed memory "
                         "themselves).")
    if setting is False:
        return False
    if setting is None and (device_type != "cpu" or allocator_chosen_by_user()):
        return False  # not on CPU, or the environment already chose the allocator's behaviour
    return keep_freed_memory(largest_trained_block(trained)) > 0
