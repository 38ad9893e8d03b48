"""Out-of-memory is recognised here and nowhere else."""

from __future__ import annotations

import signal

# Substrings of error messages that mean the device (or host) ran out of memory.
OOM_MARKERS = (
    "CUDA out of memory",  # torch.cuda.OutOfMemoryError
    "out of memory",  # CUDA runtime / NCCL / XLA phrasing
    "CUBLAS_STATUS_ALLOC_FAILED",  # cuBLAS could not allocate its workspace
    "CUBLAS_STATUS_NOT_INITIALIZED",  # cuBLAS handle creation fails when memory is full
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous",
    "DefaultCPUAllocator: can't allocate memory",  # torch on host RAM
    "DefaultCPUAllocator: not enough memory",
    "std::bad_alloc",
    "MemoryError",
    "memory budget exceeded",  # autotune's own budget check
)


def is_oom_message(text: str) -> bool:
    return any(marker in text for marker in OOM_MARKERS)


def is_oom_exception(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    try:
        import torch

        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return True
    except ImportError:
        pass
    return is_oom_message(f"{type(exc).__name__}: {exc}")


def is_oom_signal(returncode: int) -> bool:
    """The kernel's OOM killer ends a process with SIGKILL; autotune's own timeouts are
    told apart by the caller, which knows when it killed the trial itself."""
    return returncode == -signal.SIGKILL
