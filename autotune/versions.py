"""The versions of the libraries that change what a trial measures: one list, read in one
place, so a resumed study (tuning/run.py) and the results store (store/fingerprint.py)
refuse or note the same upgrade. A list of their own drifted apart once: the study's
missed TRL, PEFT, flash-attn, Liger and torch's CUDA, and resumed across them."""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

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
    out["cuda"] = torch_cuda()
    return out


def torch_cuda() -> str:
    """The CUDA torch was built with ("none" for a CPU build, "absent" without torch), read
    from torch/version.py without importing torch (1-2 s of a driver that needs no more of
    it)."""
    return _torch_build("cuda")


def torch_gpu_build() -> bool:
    """Whether the installed torch was built for a GPU (CUDA or ROCm): a CPU build's
    `torch.cuda.is_available()` is False on any machine."""
    return any(_torch_build(name) not in ("none", "absent") for name in ("cuda", "hip"))


def _torch_build(field: str) -> str:
    """torch.version's `field` ("cuda", "hip") as a string, "none" where None, "absent"
    without torch; read from torch/version.py, or torch itself where imported already or
    the file cannot be read so."""
    torch = sys.modules.get("torch")
    if torch is None:
        read = _version_file()
        if read is not None:
            return read.get(field) or "none"
        if importlib.util.find_spec("torch") is None:
            return "absent"
        import torch  # a version.py this cannot read: ask torch itself
    return str(getattr(torch.version, field, None) or "none")


@cache
def _version_file() -> dict[str, str | None] | None:
    """torch/version.py's constant assignments (read once), or None where there is no
    torch or it cannot be read so."""
    spec = importlib.util.find_spec("torch")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            tree = ast.parse((Path(folder) / "version.py").read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        out: dict[str, str | None] = {}
        for node in tree.body:
            target = node.target if isinstance(node, ast.AnnAssign) else (
                node.targets[0] if isinstance(node, ast.Assign) and node.targets else None)
            if isinstance(target, ast.Name) and isinstance(node.value, ast.Constant):
                value = node.value.value
                out[target.id] = None if value is None else str(value)
        return out
    return None
