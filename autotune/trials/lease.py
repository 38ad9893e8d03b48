"""Machine-wide leases on the devices a trial runs on.

Two searches on one machine (two embedded Rays, or a search beside a benchmark) each
believe they own every core and GPU: their trials overlapped and timed each other (a
false 2.07x speedup was measured that way). So a trial holds exclusive locks on what it
uses while it runs: its GPUs, or its share of the CPU cores, counted as slots. The locks
are flock(2) on files in one folder per machine, so a holder that dies, however it dies,
releases them; waiters queue in arrival order, so neither search starves the other.
AUTOTUNE_LEASE_DIR names another folder (each folder is its own set of devices), or
`off` where sharing is meant (memory benchmarks: a process's own peak does not change).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from autotune.device import node_cpus

log = logging.getLogger("autotune")
LEASE_DIR_ENV = "AUTOTUNE_LEASE_DIR"
POLL_S = 0.2


class LeaseTimeout(RuntimeError):
    """The devices stayed held by others past the wait allowed: the machine was busy, the
    config did nothing wrong."""


@dataclass(frozen=True)
class Want:
    """What a trial holds: these GPUs (by the ids CUDA_VISIBLE_DEVICES gives), or this many
    of the node's CPU slots (one per core)."""

    gpus: tuple[str, ...] = ()
    cpu_slots: int = 0

    def overlaps(self, other: Want) -> bool:
        return bool(set(self.gpus) & set(other.gpus)) or bool(self.cpu_slots and
                                                               other.cpu_slots)

    def describe(self) -> str:
        return (f"GPU {', '.join(self.gpus)}" if self.gpus
                else f"{self.cpu_slots} of the {node_cpus()} CPU cores")


def trial_want(on_cpu: bool, cpu_threads: int, world_size: int) -> Want:
    """A CPU trial's cores (its threads, all ranks together); a GPU trial's GPUs: the first
    `world_size` that this process may see (Ray narrows CUDA_VISIBLE_DEVICES to the GPUs
    it gave the task). A GPU trial's few host threads take no slot."""
    if on_cpu:
        return Want(cpu_slots=max(1, min(cpu_threads, node_cpus())))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [i.strip() for i in visible.split(",") if i.strip()] if visible else []
    return Want(gpus=tuple((ids or [str(i) for i in range(world_size)])[:world_size]))


def lease_dir() -> Path:
    path = Path(os.environ.get(LEASE_DIR_ENV) or Path(tempfile.gettempdir())
                / "autotune-leases")
    (path / "queue").mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(OSError):  # shared by the machine's users
        path.chmod(0o1777)
        (path / "queue").chmod(0o1777)
    return path


def _open(path: Path) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:  # another user's file: flock needs no write access
        return os.open(path, os.O_RDONLY)
    with contextlib.suppress(OSError):  # past the umask, for the machine's other users
        os.fchmod(fd, 0o666)
    return fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class _Queue:
    """Arrival order among waiters: each waiter's entry names what it wants and stays
    locked while it waits; an entry whose lock can be taken was left by a dead waiter."""

    def __init__(self, folder: Path, want: Want, label: str) -> None:
        self.folder = folder
        self.path = folder / f"{time.time_ns():020d}-{os.getpid()}-{id(self):x}.json"
        self.fd = _open(self.path)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.write(self.fd, json.dumps({"gpus": want.gpus, "cpu_slots": want.cpu_slots,
                                      "label": label}).encode())

    def ahead(self, want: Want) -> list[str]:
        """Labels of live waiters that came first and want some of the same devices."""
        labels = []
        for entry in sorted(self.folder.glob("*.json")):
            if entry.name >= self.path.name:
                break
            with contextlib.suppress(OSError, ValueError):
                fd = os.open(entry, os.O_RDONLY)
                try:
                    if _try_lock(fd):  # its waiter is gone
                        entry.unlink(missing_ok=True)
                        continue
                    raw = json.loads(entry.read_text() or "{}")
                finally:
                    os.close(fd)
                if want.overlaps(Want(tuple(raw.get("gpus", ())), raw.get("cpu_slots", 0))):
                    labels.append(raw.get("label", entry.name))
        return labels

    def leave(self) -> None:
        self.path.unlink(missing_ok=True)
        os.close(self.fd)


def _take(folder: Path, want: Want, label: str) -> tuple[list[int], str | None]:
    """All of `want`'s locks, or none and who holds one of them."""
    names = [f"gpu-{g}" for g in want.gpus] if want.gpus else [f"cpu-{i}" for i in _cores()]
    need = len(names) if want.gpus else want.cpu_slots
    held: list[int] = []
    holder = None
    for name in names:
        fd = _open(folder / name)
        if _try_lock(fd):
            held.append(fd)
            if len(held) == need:
                break
        else:
            with contextlib.suppress(OSError):
                holder = holder or os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if want.gpus:
                break
    if len(held) < need:
        for fd in held:
            os.close(fd)
        return [], holder or "another process"
    for fd in held:  # who holds it, for a waiter's message
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, label.encode(), 0)
    return held, None


def _cores() -> list[int]:
    """The cores this process may run on, by number: searches confined to disjoint cores
    (taskset, cgroups) never wait for each other."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(node_cpus()))


@contextlib.contextmanager
def lease(want: Want, *, timeout_s: float, label: str) -> Iterator[float]:
    """Hold `want` for the body; yields the seconds spent waiting for it. Raises
    LeaseTimeout when it is not free within `timeout_s`."""
    if os.environ.get(LEASE_DIR_ENV) == "off":
        yield 0.0
        return
    folder = lease_dir()
    started = time.monotonic()
    queue = _Queue(folder / "queue", want, label)
    said = False
    try:
        while True:
            ahead = queue.ahead(want)
            held, holder = ([], ahead[0]) if ahead else _take(folder, want, label)
            if held:
                break
            waited = time.monotonic() - started
            if waited > timeout_s:
                raise LeaseTimeout(
                    f"{want.describe()} stayed held by {holder} for {waited:.0f} s "
                    f"(another search or benchmark on this machine): the machine was busy, "
                    "not the config at fault")
            if not said:
                log.warning("%s: waiting for %s, held by %s", label, want.describe(), holder)
                said = True
            time.sleep(POLL_S)
    finally:
        queue.leave()
    try:
        yield time.monotonic() - started
    finally:
        for fd in held:
            os.close(fd)


@contextlib.contextmanager
def driver_work(label: str, *, timeout_s: float) -> Iterator[None]:
    """Every CPU core for a search's own heavy moment (starting its embedded Ray: about 5
    CPU-seconds), so it does not run while another search's CPU trial is being timed (one
    baseline probe measured 23.9 samples/s beside a starting Ray, 32.3 alone). Never fails:
    past `timeout_s` the work goes ahead unleased, with a warning."""
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(lease(Want(cpu_slots=node_cpus()), timeout_s=timeout_s,
                                     label=label))
        except LeaseTimeout as exc:
            log.warning("%s: going ahead anyway (%s)", label, exc)
        yield
