"""torch's JIT-build lock, guarded so that a killed process cannot leave it behind."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from autotune.trials import build_lock
from autotune.trials.launch import extensions_dir

ROOT = Path(__file__).resolve().parents[1]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_lock_is_stale_once_its_holder_is_gone(tmp_path):
    lock = tmp_path / "lock"
    lock.write_text(str(os.getpid()))
    assert not build_lock.stale(str(lock))  # held by a live process: wait
    lock.write_text(str(_dead_pid()))
    assert build_lock.stale(str(lock))
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, not yet reaped
    deadline = time.time() + 30
    while (time.time() < deadline
           and psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE):
        time.sleep(0.05)
    lock.write_text(str(zombie.pid))
    assert build_lock.stale(str(lock)), "a killed holder its parent has not reaped"
    zombie.wait()
    # A lock without a PID (made by a process without the guard) is given time to finish.
    lock.write_text("")
    assert not build_lock.stale(str(lock))
    old = time.time() - build_lock.UNOWNED_STALE_S - 1
    os.utime(lock, (old, old))
    assert build_lock.stale(str(lock))
    assert not build_lock.stale(str(tmp_path / "none"))


def test_a_sweep_removes_only_the_stale_locks(tmp_path):
    for name, pid in (("dead_op", _dead_pid()), ("live_op", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "lock").write_text(str(pid))
    (tmp_path / "built_op").mkdir()
    assert build_lock.sweep(str(tmp_path)) == [str(tmp_path / "dead_op" / "lock")]
    assert sorted(p.parent.name for p in tmp_path.glob("*/lock")) == ["live_op"]


def test_the_guarded_baton_names_its_holder_and_waits_past_a_dead_one(tmp_path):
    """torch's own FileBaton, guarded: the holder's PID is in the lock; a waiter waits on
    a live holder and goes on past a dead one, removing its lock."""
    from torch.utils.file_baton import FileBaton

    build_lock.install()
    build_lock.install()  # idempotent
    path = str(tmp_path / "lock")
    held = FileBaton(path)
    assert held.try_acquire() and build_lock.holder(path) == os.getpid()
    assert not FileBaton(path).try_acquire()
    waiter = threading.Thread(target=FileBaton(path, wait_seconds=0.01).wait)
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive()  # a live holder is waited on
    held.release()
    waiter.join(5)
    assert not waiter.is_alive()
    Path(path).write_text(str(_dead_pid()))
    started = time.time()
    FileBaton(path, wait_seconds=0.01).wait()
    assert time.time() - started < 5 and not os.path.exists(path)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_deepspeeds_ops_load_past_a_lock_a_killed_process_left():
    """The hang CI met: a process killed while it held the lock of DeepSpeed's shm op
    (every DeepSpeed process on CPU loads it) left the lock, and the next one waited on it
    for good. Loading the ops as set-up does (real torch, real DeepSpeed) now gets past a
    lock whose holder is dead, in seconds, and removes it."""
    lock = Path(extensions_dir()) / "deepspeed_shm_comm" / "lock"
    if not lock.parent.is_dir():
        pytest.skip("set-up did not build DeepSpeed's shm op here")
    if lock.exists() and not build_lock.stale(str(lock)):
        pytest.skip("another process holds the lock now")
    lock.write_text(str(_dead_pid()))
    try:
        out = subprocess.run([sys.executable, "-m", "autotune.trials.ops"], cwd=ROOT,
                             capture_output=True, text=True, timeout=240)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "DeepSpeed ops ready" in out.stdout
        assert "not built" not in out.stdout, out.stdout
        assert not lock.exists()
    finally:
        if lock.exists() and build_lock.stale(str(lock)):
            lock.unlink()
