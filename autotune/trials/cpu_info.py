"""py-cpuinfo's answer kept for the machine's boot, for the trial processes that ask it
(DeepSpeed's CPU ops): the warm launcher installs it before its imports, a cold trial's
worker as it starts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import stat
from typing import Any


def remember_cpu_info(folder: str | None = None) -> None:
    """py-cpuinfo answering from a file kept per machine boot: DeepSpeed asks it three
    times each time a trial loads a CPU op (CPU-Adam, the optimizer offload's; the flags
    of its JIT build), 1.1 s each in a subprocess of its own, 3.3 s of a 0.5B trial's
    engine on this machine. The answer does not change until the machine restarts, so the
    first trial that asks writes it down and every later one (of any search here) reads
    it; a search whose trials load no CPU op never asks (it asked once beside the
    launcher's imports before: 1.1 core-seconds of every search)."""
    if importlib.util.find_spec("cpuinfo") is None:
        return
    import copy

    import cpuinfo

    path = _cpu_info_file(folder)
    asked = cpuinfo.get_cpu_info
    known: dict[str, Any] = {}

    def get_cpu_info() -> dict[str, Any]:
        if not known and path is not None:
            known.update(_read_own(path))
        if not known:
            known.update(asked())
            if path is not None:
                _write(path, known)
        return copy.deepcopy(known)  # a new dict each time, as py-cpuinfo's own

    cpuinfo.get_cpu_info = get_cpu_info


def _cpu_info_file(folder: str | None = None) -> str | None:
    """Where this boot's answer is kept (the temporary folder, the machine's own), named by
    the user and the kernel's boot id; None where Linux gives no boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as boot:
            booted = boot.read().strip()
    except OSError:
        return None
    import tempfile

    return os.path.join(folder or tempfile.gettempdir(),
                        f"autotune-cpuinfo-{os.getuid()}-{booted}.json")


def _read_own(path: str) -> dict[str, Any]:
    """The answer kept at `path`, where it is a plain file of this user's (the folder is
    shared: another user's file is not believed); {} otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return {}
    with os.fdopen(fd, encoding="utf-8") as kept:
        info = os.fstat(kept.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return {}
        with contextlib.suppress(ValueError):
            read = json.load(kept)
            if isinstance(read, dict):
                return read
    return {}


def _write(path: str, answer: dict[str, Any]) -> None:
    """`answer` at `path`, whole or not at all (a temporary file of its own, replaced)."""
    import tempfile

    with contextlib.suppress(OSError, TypeError, ValueError):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".autotune-cpuinfo-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(answer, out)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
