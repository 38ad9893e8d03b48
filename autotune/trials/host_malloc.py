"""A CPU trial's heap held to glibc's starting mmap threshold, so that its peak RSS is
its tensors' and not malloc's high-water mark.

glibc serves a block of at least M_MMAP_THRESHOLD bytes (128 KiB at start) from its own
mapping, returned to the system when freed; but each such block freed raises the
threshold to its size (up to 32 MiB), and blocks under it come from the heap from then
on, where a freed block's pages stay resident until the heap's top is free. A training
step frees and allocates blocks of 1-32 MiB by the thousand (a layer's activations and
gradients at long context), so the heap's high-water mark, not the tensors live at once,
set a CPU rank's RSS: 10-120% more than with the threshold held, varying between runs of
one config (1,703-1,872 MiB) and creeping up step after step (docs/memory.md). Held at
glibc's starting value (`mallopt(M_MMAP_THRESHOLD)`, which also ends the adjustment, and
the trim threshold with it), the peak is what the tensors need, reproducibly, and the
memory model's physics predicts it; the price is the page faults of fresh mappings,
8-22% of a long-context CPU step's speed (ZeRO-1 at 8192 tokens).

A CPU run of the exported config reproduces the trials' memory with the same setting in
its environment: `MALLOC_MMAP_THRESHOLD_=131072` (glibc reads it at start)."""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
THRESHOLD = 128 * 1024  # glibc's starting value (DEFAULT_MMAP_THRESHOLD_MIN)
ENVIRONMENT = f"MALLOC_MMAP_THRESHOLD_={THRESHOLD}"


def measured_under(is_cuda: bool) -> str | None:
    """What a fingerprint keeps of how a CPU trial's RSS is measured, so a resume or a
    stored record from before the threshold was held (malloc's high-water mark, 10-120%
    more) never mixes with peaks after; None on a GPU, whose peaks did not change."""
    return None if is_cuda else f"mmap threshold held at {THRESHOLD}"


def hold_mmap_threshold() -> int | None:
    """Hold this process's mmap threshold at THRESHOLD, and the heap's trim threshold at
    glibc's starting value too (frees before this one, an import's, may have raised it to
    64 MiB: free pages at the heap's top kept); the threshold held, or None where the C
    library has no such settings (not glibc) or refused them. A process started with
    ENVIRONMENT has both from its start."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    held = mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
    return THRESHOLD if held and mallopt(M_TRIM_THRESHOLD, THRESHOLD) == 1 else None
