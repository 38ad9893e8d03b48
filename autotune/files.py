"""Writing the files a search leaves: whole or not at all. A search can be killed at any
moment (a time box, the kernel, a second Ctrl-C), and a half-written summary.json or
training_args.json reads as broken where the previous one was whole."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomically(path: str | Path, text: str) -> Path:
    """Write `text` to a sibling, then rename it over `path` (atomic on POSIX)."""
    path = Path(path)
    part = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        part.write_text(text, encoding="utf-8")
        os.replace(part, path)
    finally:
        part.unlink(missing_ok=True)
    return path
