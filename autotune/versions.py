"""The versions of the libraries that change what a trial measures: one list, read in one
place, so a resumed study (tuning/run.py) and the results store (store/fingerprint.py)
refuse or note the same upgrade. A list of their own drifted apart once: the study's
missed TRL, PEFT, flash-attn, Liger and torch's CUDA, and resumed across them."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# Libraries whose version can move a trial's speed or memory (torch's CUDA apart).
MEASURING_LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "bitsandbytes",
                       "peft", "trl", "flash-attn", "liger-kernel")


def installed(name: str) -> str:
    """`name`'s installed version, or "absent"."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "absent"


def library_versions() -> dict[str, str]:
    """Each measuring library's version ("absent" where not installed), and torch's CUDA
    ("none" for a CPU build)."""
    out = {name: installed(name) for name in MEASURING_LIBRARIES}
    import torch

    out["cuda"] = str(torch.version.cuda or "none")
    return out
