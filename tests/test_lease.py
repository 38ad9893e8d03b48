"""Device leases: trials of two searches on one machine take turns, never overlap."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from autotune.device import node_cpus
from autotune.trials.lease import LeaseTimeout, Want, lease

ALL_CORES = Want(cpu_slots=node_cpus())

HOLDER = """
import os, sys, time
if os.environ.get("HOLDER_CORES"):
    os.sched_setaffinity(0, {int(c) for c in os.environ["HOLDER_CORES"].split(",")})
from autotune.trials.lease import Want, lease
gpus, slots, hold, log = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
want = Want(gpus=tuple(g for g in gpus.split(",") if g), cpu_slots=slots)
with lease(want, timeout_s=60, label=f"holder {log}") as waited:
    open(log, "a").write(f"got {time.time()}\\n")
    time.sleep(hold)
    open(log, "a").write(f"done {time.time()}\\n")
"""


@pytest.fixture
def lease_dir(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "leases"
    monkeypatch.setenv("AUTOTUNE_LEASE_DIR", str(folder))
    return folder


def _holder(tmp_path: Path, name: str, hold: float, want: Want = ALL_CORES,
            cores: str = ""):
    log = tmp_path / f"{name}.log"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, ",".join(want.gpus),
                             str(want.cpu_slots), str(hold), str(log)],
                            env=dict(os.environ) | {"HOLDER_CORES": cores})
    return proc, log


def _wait_for(log: Path, word: str, timeout: float = 30.0) -> float:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for line in (log.read_text().splitlines() if log.exists() else []):
            if line.startswith(word):
                return float(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(f"{log.name}: no {word!r} within {timeout} s")


def test_a_lease_waits_for_the_holder_and_names_it(tmp_path, lease_dir, caplog):
    proc, log = _holder(tmp_path, "a", hold=2.0)
    _wait_for(log, "got")
    with pytest.raises(LeaseTimeout, match="held by holder"), lease(ALL_CORES, timeout_s=0.5,
                                                                    label="second"):
        pass
    with lease(ALL_CORES, timeout_s=30, label="second") as waited:
        got = time.time()
    assert got >= _wait_for(log, "done") and waited > 0.5
    assert "waiting for" in caplog.text and "held by holder" in caplog.text
    proc.wait()


def test_a_killed_holder_releases_at_once(tmp_path, lease_dir):
    proc, log = _holder(tmp_path, "a", hold=60.0)
    _wait_for(log, "got")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    with lease(ALL_CORES, timeout_s=5, label="after") as waited:
        assert waited < 1.0


def _queued(folder: Path, n: int, timeout: float = 60.0) -> None:
    """Wait until `n` waiters are queued (however slowly their interpreters start)."""
    deadline = time.time() + timeout
    while len(list((folder / "queue").glob("*.json"))) < n:
        assert time.time() < deadline, f"fewer than {n} waiters queued"
        time.sleep(0.05)


def test_waiters_are_served_in_arrival_order(tmp_path, lease_dir):
    """A search whose trial waited is not overtaken by one that asked later."""
    first, first_log = _holder(tmp_path, "first", hold=60.0)
    _wait_for(first_log, "got")
    early, early_log = _holder(tmp_path, "early", hold=1.0)
    _queued(lease_dir, 1)
    late, late_log = _holder(tmp_path, "late", hold=0.1)
    _queued(lease_dir, 2)
    first.kill()
    first.wait()
    for p in (early, late):
        assert p.wait(timeout=60) == 0
    assert _wait_for(late_log, "got") >= _wait_for(early_log, "done")


def test_gpus_are_leased_one_by_one(tmp_path, lease_dir):
    proc, log = _holder(tmp_path, "gpu0", hold=30.0, want=Want(gpus=("0",)))
    _wait_for(log, "got")
    try:
        with lease(Want(gpus=("1",)), timeout_s=1, label="other gpu") as waited:
            assert waited < 1.0
        with lease(Want(cpu_slots=1), timeout_s=1, label="cpu"):
            pass
        with pytest.raises(LeaseTimeout, match="GPU 0, 1"), lease(
                Want(gpus=("0", "1")), timeout_s=0.5, label="both"):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_cpu_slots_are_counted(tmp_path, lease_dir):
    if node_cpus() < 2:
        pytest.skip("needs two cores")
    proc, log = _holder(tmp_path, "one", hold=30.0, want=Want(cpu_slots=1))
    _wait_for(log, "got")
    try:
        with lease(Want(cpu_slots=node_cpus() - 1), timeout_s=1, label="rest") as waited:
            assert waited < 1.0
        with pytest.raises(LeaseTimeout), lease(ALL_CORES, timeout_s=0.5, label="all"):
            pass
    finally:
        proc.kill()
        proc.wait()


def test_searches_on_disjoint_cores_do_not_wait_for_each_other(tmp_path, lease_dir):
    """Slots are the cores a process may run on, by number (taskset, cgroups)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two cores")
    first, second = sorted(os.sched_getaffinity(0))[:2]
    one = Want(cpu_slots=1)
    a, a_log = _holder(tmp_path, "a", hold=60.0, want=one, cores=str(second))
    _wait_for(a_log, "got")
    try:
        b, _ = _holder(tmp_path, "b", hold=0.1, want=one, cores=str(first))
        assert b.wait(timeout=60) == 0  # its own core: done while `a` holds the other
        same, same_log = _holder(tmp_path, "same", hold=0.1, want=one, cores=str(second))
        _queued(lease_dir, 1)  # `a`'s core: it waits
        assert a.poll() is None and not same_log.exists()
    finally:
        a.kill()
        a.wait()
    assert same.wait(timeout=60) == 0


STARTS_RAY = """
import sys, time
from autotune.spec import load_spec
from autotune.trials.executor import RayExecutor
executor = RayExecutor(load_spec(sys.argv[1]), timeout_s=60)
executor.discover()
executor._init()  # what the first trial does
print("ray started", time.time())
executor.close()
"""


def _started_while_held(lease_dir: Path, args: list[str], waits_for: str,
                        ) -> subprocess.Popen:
    """`args` started while a trial of another search holds every core (the caller's
    lease), once it queues for the cores naming `waits_for`, a second later."""
    proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not any(waits_for in p.read_text() for p in (lease_dir / "queue").glob("*.json")):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.2)
    time.sleep(1)
    return proc


def test_a_search_starts_its_ray_only_between_the_trials_of_another(tmp_path, lease_dir,
                                                                     tiny_spec):
    """Starting Ray takes seconds of CPU: while another search's trial holds the cores, a
    search waits to start its embedded Ray (no Ray process appears), then starts it."""
    import psutil
    import yaml

    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    with lease(ALL_CORES, timeout_s=5, label="a trial of another search"):
        proc = _started_while_held(lease_dir, ["-c", STARTS_RAY, str(spec)], "starting Ray")
        assert not psutil.Process(proc.pid).children(recursive=True)  # no Ray yet
        released = time.time()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert float(out.split()[-1]) > released
    assert "held by a trial of another search" in err


def test_a_search_reads_its_model_only_between_the_trials_of_another(tmp_path, lease_dir,
                                                                       tiny_spec):
    """Reading the model imports transformers and torch (seconds of CPU; beside another
    search's timed trial it made that trial 40% slower), and the search's own Ray starts
    beside it: while another search's trial holds the cores, a search on a CPU machine
    waits to do either (no Ray process appears), then searches."""
    import psutil
    import yaml

    tiny_spec["search"] |= {"n_trials": 1, "confirm_repeats": 0}
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    with lease(ALL_CORES, timeout_s=5, label="a trial of another search"):
        proc = _started_while_held(lease_dir, ["-m", "autotune", "search", str(spec)],
                                   "reading the model")
        assert proc.poll() is None  # still waiting: nothing read, no trial
        assert not psutil.Process(proc.pid).children(recursive=True)  # no Ray yet
        assert not (Path(tiny_spec["output"]) / "study.db").exists()
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    said = " ".join(err.split())
    assert "reading the model (Ray starting beside it): waiting for" in said
    assert "held by a trial of another search" in said
    assert json.loads((Path(tiny_spec["output"]) / "summary.json").read_text())["trials"]


NOBODY = 65534


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def _python_for_nobody(env: dict[str, str]) -> str | None:
    """An interpreter another user can run that imports this checkout's lease module (the
    venv's may live under root's home)."""
    for python in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        try:
            ok = subprocess.run([python, "-c", "import autotune.trials.lease"], env=env,
                                preexec_fn=_as_nobody, cwd="/", capture_output=True,
                                timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
        if ok:
            return python
    return None


ROOT_ONLY = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                               reason="acting as a second user needs root")


@pytest.fixture
def nobody(monkeypatch):
    """A lease folder in a sticky world-writable folder (as /tmp), and `hold(name, hold)`,
    which starts a holder as user nobody: (process, its log). Holders still running at
    the end are killed, and the folder goes."""
    shared = Path(tempfile.mkdtemp(prefix="autotune-two-users-", dir="/tmp"))
    procs: list[subprocess.Popen] = []
    try:
        shared.chmod(0o1777)  # as /tmp itself
        folder = shared / "autotune-leases"
        monkeypatch.setenv("AUTOTUNE_LEASE_DIR", str(folder))
        env = dict(os.environ) | {"PYTHONPATH": str(Path(__file__).resolve().parents[1]),
                                  "AUTOTUNE_LEASE_DIR": str(folder)}
        python = _python_for_nobody(env)
        if python is None:
            pytest.skip("no interpreter user nobody may run imports this checkout")

        def hold(name: str, hold: float):
            log = shared / f"{name}.log"
            procs.append(subprocess.Popen(
                [python, "-c", HOLDER, "", str(node_cpus()), str(hold), str(log)], env=env,
                preexec_fn=_as_nobody, cwd="/", stderr=subprocess.PIPE, text=True))
            return procs[-1], log

        hold.folder = folder
        yield hold
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.communicate(timeout=30)
        shutil.rmtree(shared, ignore_errors=True)


def _failed(proc: subprocess.Popen) -> str:
    """What a holder printed, once it is stopped."""
    if proc.poll() is None:
        proc.kill()
    return f"the other user's lease failed: {proc.communicate(timeout=30)[1]}"


@ROOT_ONLY
def test_two_users_share_the_machines_leases(nobody):
    """The lease folder is the machine's: the first user to lease creates it, and the
    next user's searches must queue behind the first's trials, and theirs behind it, on
    files another user created (not fail on a permission, nor skip the wait)."""
    # Root leases first: the folder and the core files are root's, and the other
    # user's trial queues behind root's.
    with lease(ALL_CORES, timeout_s=30, label="root's trial"):
        proc, log = nobody("first", hold=2.0)
        time.sleep(2.0)
        assert not log.exists(), "the other user's trial ran beside root's"
        released = time.time()
    assert nobody.folder.stat().st_uid == 0
    assert _wait_for(log, "got") >= released
    # Now the other user holds the cores, and root's trial queues behind theirs.
    with lease(ALL_CORES, timeout_s=30, label="root's trial") as waited:
        got = time.time()
    assert proc.wait(timeout=30) == 0, _failed(proc)
    assert got >= _wait_for(log, "done") and waited > 0.5


@ROOT_ONLY
def test_a_lock_file_the_user_may_not_write_is_locked_read_only(nobody):
    """Where another user's lock files cannot be opened for writing (a umask that kept
    them 0644, or fs.protected_regular refusing O_CREAT on another user's file in a
    sticky folder), a lease still takes them: flock needs only a read-only descriptor,
    and the exclusion holds both ways."""
    with lease(ALL_CORES, timeout_s=30, label="root's trial"):
        pass
    locks = sorted(nobody.folder.glob("cpu-*"))
    assert locks
    for path in locks:
        path.chmod(0o644)  # root's, and not writable by anyone else
    proc, log = nobody("read-only", hold=2.0)
    try:
        _wait_for(log, "got")
    except AssertionError:
        raise AssertionError(_failed(proc)) from None
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in locks)  # still unwritable
    with lease(ALL_CORES, timeout_s=30, label="root's trial") as waited:
        got = time.time()
    assert proc.wait(timeout=30) == 0, _failed(proc)
    assert got >= _wait_for(log, "done") and waited > 0.5
