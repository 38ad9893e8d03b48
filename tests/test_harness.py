"""The suite's own harness: a pytest stopped by SIGTERM (a CI's cancel, a `kill` of its
process group) tears down what its fixtures started, as Ctrl-C does, and one killed
(SIGKILL: a CI's timeout, the OOM killer) leaves no PostgreSQL server or Ray cluster
running."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import cluster_watch
from tests.conftest import ROOT
from tests.postgres import PREFIX, REQUIRED, alive, binaries, remove_stale

HELD = """
import os, time
from pathlib import Path

def test_held(postgres_server):
    try:
        Path(os.environ["HELD_MARK"] + ".new").write_text(str(postgres_server.root))
        os.replace(os.environ["HELD_MARK"] + ".new", os.environ["HELD_MARK"])  # whole
        time.sleep(300)
    except KeyboardInterrupt as stop:  # what ended it: the SIGTERM, or xdist's SIGINT later
        Path(os.environ["HELD_MARK"] + ".stop").write_text(str(stop))
        raise
"""


def _postmaster(root: Path) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int((root / "data" / "postmaster.pid").read_text().split()[0])
    return None


def _start_held(folder: Path, test: str, workers: list[str]) -> tuple[subprocess.Popen, str]:
    """A child pytest running `test` (which writes HELD_MARK whole, then holds), in a
    session of its own; it and what the test wrote."""
    (folder / "test_held.py").write_text(test)
    mark = folder / "mark"
    env = dict(os.environ, HELD_MARK=str(mark), PYTHONPATH=str(ROOT))
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest",
                             "-p", "no:cacheprovider", *workers, str(folder / "test_held.py")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not mark.exists():
        os.killpg(proc.pid, signal.SIGTERM)  # its teardown stops what it started
        pytest.fail(proc.communicate(timeout=120)[0][-3000:])
    return proc, mark.read_text()


def _held(tmp_path: Path, workers: list[str]) -> tuple[subprocess.Popen, Path, int]:
    """A child pytest holding the session's server: it, the server's folder, its pid."""
    proc, text = _start_held(tmp_path, HELD, workers)
    root = Path(text)
    pid = _postmaster(root)
    assert pid is not None and alive(pid)
    return proc, root, pid


def _clean_up(proc: subprocess.Popen, root: Path | None, pid: int | None) -> None:
    """What a failure would leave."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    if pid is not None and alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGQUIT)
    if root is not None and root.is_absolute() and root.name.startswith(PREFIX):
        shutil.rmtree(root, ignore_errors=True)


needs_postgres = pytest.mark.skipif(binaries() is None and not os.environ.get(REQUIRED),
                                    reason="PostgreSQL is not installed")
WORKERS = pytest.mark.parametrize("workers", [["-p", "no:xdist"], ["-n", "2"]],
                                  ids=["serial", "xdist"])


@needs_postgres
@WORKERS
def test_sigterm_to_the_suite_stops_its_postgresql_server(tmp_path, workers):
    """SIGTERM to pytest alone, not its group: a serial pytest tears down as on Ctrl-C;
    under pytest-xdist the controller passes it to its workers, one of which holds the
    server (`kill` of the group, tried by hand, reaches each worker itself, and then
    twice: the handler acts once)."""
    proc = root = pid = None
    try:
        proc, root, pid = _held(tmp_path, workers)
        os.kill(proc.pid, signal.SIGTERM)  # the held test, mid-sleep
        out = proc.communicate(timeout=120)[0]
        assert proc.returncode == pytest.ExitCode.INTERRUPTED, out[-3000:]
        assert not alive(pid), out[-3000:]  # stop() waited for it
        assert not root.exists()
        # A worker is passed the signal at once; xdist itself would send it a SIGINT only
        # 5 s after asking it to stop, and kill it 10 s after asking.
        stop = Path(f"{tmp_path / 'mark'}.stop").read_text()
        assert stop == f"signal {signal.SIGTERM.value}", stop
    finally:
        if proc is not None:
            _clean_up(proc, root, pid)


@needs_postgres
@WORKERS
def test_a_killed_suite_leaves_no_postgresql_server_and_the_next_removes_its_folder(
        tmp_path, workers):
    """SIGKILL runs no teardown: the server, the dead process's child, is stopped by the
    kernel's parent-death signal (pg_ctl's outlived it, detached), and the next session
    removes the folder left behind. Serial, the pytest is killed; under pytest-xdist its
    whole group, as a CI's timeout kills a job."""
    proc = root = pid = None
    try:
        proc, root, pid = _held(tmp_path, workers)
        if "no:xdist" in workers:
            os.kill(proc.pid, signal.SIGKILL)
        else:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 60
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(pid)
        remove_stale()  # as the next session starts (another test's may have, meanwhile)
        assert not root.exists()
    finally:
        if proc is not None:
            _clean_up(proc, root, pid)


HELD_CLUSTER = """
import json, os, time
from pathlib import Path
from tests.test_cluster import Cluster

def test_held(tmp_path):
    cluster = Cluster(tmp_path, os.environ | {"RAY_AUTH_MODE": "disabled"}).start()
    mark = Path(os.environ["HELD_MARK"])
    Path(f"{mark}.new").write_text(json.dumps([str(cluster.temp), *cluster.keys()]))
    os.replace(f"{mark}.new", mark)
    time.sleep(300)
"""


def test_a_killed_suite_leaves_no_ray_cluster_of_its_tests(tmp_path):
    """A test's `ray start` cluster (its daemons detach) is stopped, and its folder
    removed, by the watch the test started, once the pytest process is SIGKILL'd."""
    proc, keys = None, ()
    try:
        proc, text = _start_held(tmp_path, HELD_CLUSTER, ["-p", "no:xdist"])
        temp, *keys = json.loads(text)
        keys = tuple(keys)
        assert any("raylet" in " ".join(p.cmdline()) for p in cluster_watch.processes(keys))
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=60)
        deadline = time.monotonic() + 90
        while cluster_watch.processes(keys) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not [p.cmdline() for p in cluster_watch.processes(keys)]
        while Path(temp).exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not Path(temp).exists()
    finally:
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if keys:
            cluster_watch.kill(keys)
