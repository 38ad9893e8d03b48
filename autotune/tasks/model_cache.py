"""What reading a model section found, remembered on disk by what it was read from.

A search's driver needs a handful of facts about its model (the parameter counts of
plan/shape.py, which attention kernels its class supports) and, to learn them, imports
torch, transformers and the model's modeling module: 4-6 s of a 2-core machine's CPU
before the first trial, for the same answer every time the same model is searched again.
The answer is a pure function of the model section (and of a saved folder's config.json),
the sequence lengths and the libraries' versions, so it is kept under that key in
$XDG_CACHE_HOME/autotune/models (or ~/.cache/autotune/models) and read back.

Only answers are kept: a read that fails is not, so a broken model says why each time. A
folder that cannot be written is no error (the facts are worked out each time).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

from autotune.versions import installed

ENV = "AUTOTUNE_MODEL_CACHE"  # a folder, or "off"
# What the facts are computed with: a new version of any may count otherwise.
LIBRARIES = ("torch", "transformers", "peft")


class NotKept(Exception):  # noqa: N818 - a value carried out, not an error
    """Raised by a `work` whose answer stands for this call but must not be kept (a read
    that failed in part: an import a fixed environment would pass)."""

    def __init__(self, value: dict[str, Any]) -> None:
        super().__init__("not kept")
        self.value = value


def folder() -> Path | None:
    """Where the facts are kept; None where $AUTOTUNE_MODEL_CACHE is "off" (or there is
    no home to keep them in)."""
    said = os.environ.get(ENV, "").strip()
    if said.lower() in ("off", "0", "none"):
        return None
    if said:
        return Path(said)
    try:
        home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    except RuntimeError:  # a user with no home (an arbitrary UID in a container)
        return None
    return Path(home) / "autotune" / "models"


# This process's answers by file: read (or worked out and kept) once a process.
_READ: dict[str, dict[str, Any]] = {}


@cache
def _libraries() -> dict[str, str]:
    return {name: installed(name) for name in LIBRARIES}


@cache
def _code() -> str:
    """A digest of the code that works the facts out (the tasks, and plan/shape.py): an
    edited checkout does not read what its previous code counted."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), root.parent / "plan" / "shape.py"]):
        with contextlib.suppress(OSError):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:16]


def content_key(model: dict[str, Any]) -> dict[str, Any] | None:
    """What a model section's facts are keyed by: the section, and a saved folder's
    config.json as read (what AutoConfig reads of it); None where they cannot be keyed by
    content (a hub name, whose contents can change; a factory)."""
    saved = None
    if model.get("name_or_path"):
        try:
            path = Path(str(model["name_or_path"])).expanduser() / "config.json"
            saved = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None
    elif not model.get("config"):
        return None
    return {"model": model, "config.json": saved}


def remembered(kind: str, key: dict[str, Any], work: Callable[[], dict[str, Any]]
               ) -> dict[str, Any]:
    """`work()`'s answer for `key` (JSON), read from the cache where it was worked out
    before with these libraries and this code; worked out and kept otherwise (not where
    `work` raises NotKept, nor a value JSON would not give back as it is)."""
    where = folder()
    full = {"kind": kind, "key": key, "code": _code(), "libraries": _libraries()}
    try:
        said = json.dumps(full, sort_keys=True, default=str)
    except (TypeError, ValueError):  # a key JSON cannot order (mixed key types)
        where = None
    if where is None:
        return _worked(work)[0]
    path = where / f"{kind}-{hashlib.sha256(said.encode()).hexdigest()[:32]}.json"
    if str(path) in _READ:  # the knob rules ask once per value of every knob
        return copy.deepcopy(_READ[str(path)])
    expected = json.loads(said)
    with contextlib.suppress(OSError, ValueError):
        kept = json.loads(path.read_text(encoding="utf-8"))
        if (isinstance(kept, dict) and kept.get("key") == expected
                and isinstance(kept.get("value"), dict)):
            _READ[str(path)] = kept["value"]
            return copy.deepcopy(kept["value"])
    value, keep = _worked(work)
    if not keep:
        return value
    _READ[str(path)] = copy.deepcopy(value)
    with contextlib.suppress(OSError, TypeError, ValueError):
        text = json.dumps({"key": expected, "value": value}, sort_keys=True)
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=f".{kind}-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(text)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return value


def _worked(work: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """(work's answer, whether it may be kept)."""
    try:
        return work(), True
    except NotKept as partial:
        return partial.value, False
