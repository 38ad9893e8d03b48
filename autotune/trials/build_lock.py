"""torch's JIT-build lock, made so that a killed process cannot leave it behind.

torch.utils.cpp_extension guards each op's build folder with a FileBaton: a `lock` file
made with O_EXCL and removed by its holder, on which every other process waits with no
time limit. DeepSpeed loads its ops that way in every trial (a ninja no-op once set-up
has built them), so a trial killed in that second (a search interrupted, a time limit, a
rank the host killed) left the lock, and each later DeepSpeed trial of the environment
waited on it until its own time limit: a hang that a search would blame on its configs
(CI met it as a test that never ended). `install` makes the holder write its PID into
the lock, and a waiter remove a lock whose holder has died (or, for a lock without one,
made by a process without this guard, one older than UNOWNED_STALE_S).

A waiter that removes a lock goes on as torch's waiter does: it loads what the folder
holds, which is whole unless the dead holder was rebuilding (then that load fails, with
torch's own error, and the next load rebuilds).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

# A lock with no holder's PID is removed after this long: a build on 2 cores takes
# about 100 s (CPU Adam), a check of a built op about 1 s.
UNOWNED_STALE_S = 600.0


def holder(path: str) -> int | None:
    """The PID a guarded holder wrote into the lock, or None."""
    with contextlib.suppress(OSError, ValueError), open(path) as f:
        return int(f.read().strip() or "x")
    return None


def stale(path: str) -> bool:
    """Whether the lock at `path` is one no live process will remove."""
    import psutil

    try:
        age = time.time() - os.stat(path).st_mtime
    except FileNotFoundError:
        return False
    pid = holder(path)
    if pid is None:
        return age > UNOWNED_STALE_S
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # another user's process: alive as far as we can tell
        return False


def sweep(directory: str | None = None) -> list[str]:
    """Remove the stale locks of the op folders under `directory` (by default the one
    torch builds into here: TORCH_EXTENSIONS_DIR, which the launcher sets for trials, or
    torch's default), so a process without the guard (a user's own run that shares the
    folder) does not wait on one; return the paths removed."""
    directory = directory or os.environ.get("TORCH_EXTENSIONS_DIR")
    if not directory:
        from torch.utils.cpp_extension import get_default_build_root

        directory = get_default_build_root()
    removed = []
    for lock in sorted(Path(directory).glob("*/lock")):
        if stale(str(lock)):
            with contextlib.suppress(FileNotFoundError):
                lock.unlink()
                removed.append(str(lock))
                log.warning("removed %s: the process that held it is gone", lock)
    return removed


def install() -> None:
    """Guard torch's FileBaton in this process (idempotent), after a `sweep`."""
    sweep()
    from torch.utils import file_baton

    baton = file_baton.FileBaton
    if getattr(baton, "_autotune_guarded", False):
        return

    def try_acquire(self) -> bool:
        try:
            self.fd = os.open(self.lock_file_path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        os.write(self.fd, str(os.getpid()).encode())
        return True

    def wait(self) -> None:
        while os.path.exists(self.lock_file_path):
            if stale(self.lock_file_path):
                log.warning("removing %s: the process that held it is gone",
                            self.lock_file_path)
                with contextlib.suppress(FileNotFoundError):
                    os.remove(self.lock_file_path)
                break
            time.sleep(self.wait_seconds)

    baton.try_acquire, baton.wait = try_acquire, wait
    baton._autotune_guarded = True
