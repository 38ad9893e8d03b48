"""What stops a test's `ray start` cluster when the pytest process that started it dies
without its teardown (SIGKILL: a CI's timeout, the OOM killer). `ray start` detaches its
daemons, so nothing else would: they lived on, a head and its workers per killed test.

    python -m tests.cluster_watch OWNER_PID TEMP_DIR KEY [KEY ...]

It runs in a session of its own, checks every second that OWNER_PID lives, and once it
is gone kills the cluster's processes (`processes`) and removes TEMP_DIR. The cluster's
own stop ends it first.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
POLL_S = 1.0
MODULE = "tests.cluster_watch"


def processes(keys: tuple[str, ...]) -> list[psutil.Process]:
    """A cluster's processes: those whose command line holds one of `keys` (its temp
    folder, its head's address and ports), and their descendants (Ray's workers, the
    client proxy's servers); never a watch, which names them too."""
    roots = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            cmdline = p.info["cmdline"] or []
            line = " ".join(cmdline) + " "
            if any(k in line for k in keys) and cmdline[1:3] != ["-m", MODULE]:
                roots.append(p)
    found = {p.pid: p for p in roots}
    for p in roots:
        with contextlib.suppress(psutil.Error):
            found |= {c.pid: c for c in p.children(recursive=True)}
    return [p for pid, p in found.items() if pid != os.getpid()]


def kill(keys: tuple[str, ...], timeout_s: float = 60.0) -> list[psutil.Process]:
    """Kill the cluster's processes until none is left or `timeout_s` passes; what is left."""
    deadline = time.time() + timeout_s
    while (left := processes(keys)) and time.time() < deadline:
        for p in left:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(left, timeout=5)
    return processes(keys)


def start(temp: Path, keys: tuple[str, ...]) -> subprocess.Popen:
    """The watch for this process's cluster (a session of its own: a signal to the suite's
    group does not end it before the cluster)."""
    return subprocess.Popen([sys.executable, "-m", MODULE, str(os.getpid()),
                             str(temp), *keys], cwd=ROOT, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def watch(owner: int, temp: Path, keys: tuple[str, ...]) -> None:
    """Until the owner is gone; then its cluster, unless its folder went first (the
    cluster stopped without ending this watch: its ports may be another's by now)."""
    with contextlib.suppress(psutil.Error):
        proc = psutil.Process(owner)
        while proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
            if not temp.exists():
                return
            time.sleep(POLL_S)
    if not temp.exists():
        return
    kill(keys)
    shutil.rmtree(temp, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), Path(sys.argv[2]), tuple(sys.argv[3:]))
