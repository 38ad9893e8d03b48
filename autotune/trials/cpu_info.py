"""py-cpuinfo's answer kept for the machine's boot, for the trial processes that ask it
(DeepSpeed's CPU ops): the warm launcher installs it before its imports, a cold trial's
worker as it starts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
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
            with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as kept:
                read = json.load(kept)
                if isinstance(read, dict) and read:
                    known.update(read)
        if not known:
            known.update(asked())
            if path is not None:
                with contextlib.suppress(OSError, TypeError, ValueError):
                    tmp = f"{path}.{os.getpid()}.tmp"
                    with open(tmp, "w", encoding="utf-8") as out:
                        json.dump(known, out)
                    os.replace(tmp, path)
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
