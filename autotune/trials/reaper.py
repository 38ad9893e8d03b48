"""Leaves nothing behind a driver that dies, even by SIGKILL.

The embedded Ray's processes and the trials under them go when the driver goes (raylet
and GCS share its fate, trials die with their parents), except Ray's per-node agents,
which mean to exit when the raylet dies but were seen living on. This process, in its
own session, notes the Ray process trees under the driver (its children that are Ray's,
and their descendants; never the driver's other children) every second while the driver
lives, and kills what is left of them once the driver is gone. A search that closes its
Ray normally stops the reaper first.

    python -m autotune.trials.reaper DRIVER_PID
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import subprocess
import sys
import time

import psutil

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent exits (a no-op elsewhere): a
    trial never outlives what launched it, even when that was killed with SIGKILL."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


POLL_S = 1.0
GRACE_S = 3.0  # Ray's own shutdown first


def note_ray_trees(driver: psutil.Process, seen: dict[int, float]) -> None:
    """Add the Ray process trees under `driver` (its children that are Ray's, and their
    descendants; never its other children) to `seen`: pid -> create time, so a reused
    pid is never taken for one of them."""
    with contextlib.suppress(psutil.Error):
        for root in driver.children():
            with contextlib.suppress(psutil.Error):
                if "ray" not in " ".join(root.cmdline()):
                    continue
                for proc in [root, *root.children(recursive=True)]:
                    seen.setdefault(proc.pid, proc.create_time())


def kill_survivors(seen: dict[int, float]) -> None:
    """SIGKILL what of `seen` still lives."""
    for pid, created in seen.items():
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                proc.send_signal(signal.SIGKILL)


def watch(driver_pid: int) -> None:
    seen: dict[int, float] = {}
    try:
        driver = psutil.Process(driver_pid)
        while driver.is_running() and driver.status() != psutil.STATUS_ZOMBIE:
            note_ray_trees(driver, seen)
            time.sleep(POLL_S)
    except psutil.Error:
        pass
    time.sleep(GRACE_S)
    kill_survivors(seen)


def start(driver_pid: int) -> subprocess.Popen:
    """The reaper for `driver_pid`, in a session of its own so a signal to the driver's
    process group does not take it down first."""
    return subprocess.Popen([sys.executable, "-m", "autotune.trials.reaper", str(driver_pid)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]))
