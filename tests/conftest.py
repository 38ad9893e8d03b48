from __future__ import annotations

import contextlib
import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from autotune.tasks.model_cache import ENV as MODEL_CACHE  # noqa: E402

TINY_SPEC = {
    "model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
                         "vocab_size": 512, "n_positions": 64}},
    "data": {"seq_len": 32},
    "target_batch_size": 16,
    "measure": {"warmup_steps": 1, "steps": 2},
    "search": {"trial_timeout": "2m"},
}


# Under pytest-xdist, the lease folder the controller made for its workers.
SHARED_LEASES = "AUTOTUNE_TEST_SHARED_LEASES"


@pytest.fixture(autouse=True, scope="session")
def _own_device_leases(tmp_path_factory):
    """The suite's trials lease devices among themselves (two searches of one test take
    turns), not against searches a developer runs on the same machine meanwhile, which
    would stall them past their time limits. Under pytest-xdist the workers share one
    folder: two workers' tests are two searches on one machine, whose timed trials take
    turns on its cores as any two users' do."""
    shared = os.environ.get(SHARED_LEASES)
    os.environ["AUTOTUNE_LEASE_DIR"] = shared or str(tmp_path_factory.mktemp("leases"))
    os.environ[SESSION_MARK] = uuid.uuid4().hex


def pytest_configure(config):
    """pytest-xdist's controller makes the workers' shared lease folder before they start
    (they inherit its environment) and removes it when they are done; so too the suite's
    own cache of model facts (tasks/model_cache.py: never the user's, and a model one test
    read is not imported again by the next). Each worker drops the COLUMNS=80 xdist sets,
    before the CLI's consoles are made on import: its output is as wide as a serial run's
    (160 where no terminal is attached)."""
    worker = getattr(config, "workerinput", None) is not None
    controller = bool(getattr(config.option, "numprocesses", None)) and not worker
    _terminate_as_interrupt(workers=controller)
    if worker:
        os.environ.pop("COLUMNS", None)
        return
    if controller:
        os.environ[SHARED_LEASES] = tempfile.mkdtemp(prefix="autotune-test-leases-")
    os.environ[MODEL_CACHE] = tempfile.mkdtemp(prefix="autotune-test-models-")


def _terminate_as_interrupt(workers: bool) -> None:
    """SIGTERM (a CI's cancel, `kill` of the suite or of its process group) ends a pytest
    process as Ctrl-C does, with its fixtures' teardown: by default it died at once, and
    left what its fixtures had started and would have stopped (the session's PostgreSQL,
    which pg_ctl detaches; a test's Ray cluster). Once: a second SIGTERM (a group's kill
    reaches a worker twice, once passed on) or SIGINT would break off the teardown, whose
    later finalizers a KeyboardInterrupt skips. pytest-xdist's controller (`workers`)
    passes it on to its workers at once: xdist sends them its own SIGINT only 5 s after
    it asks them to stop, and kills them 10 s after asking. A process forked from this one
    without an exec keeps the default: it is not a pytest process."""
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return
    owner = os.getpid()

    def interrupt(signum, frame):
        if os.getpid() != owner:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if not workers:  # the controller's own Ctrl-C still ends its wait for them
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:
            for child in psutil.Process().children():
                with contextlib.suppress(psutil.Error):
                    child.send_signal(signum)
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_unconfigure(config):
    if getattr(config, "workerinput", None) is not None:
        return
    for name in (SHARED_LEASES, MODEL_CACHE):
        if name in os.environ:
            shutil.rmtree(os.environ.pop(name), ignore_errors=True)


@pytest.fixture(autouse=True)
def _own_results_store(tmp_path, monkeypatch):
    """Each test's searches remember into a store of its own, never the user's cache (a
    search the suite ran would answer a developer's, and one test's another's)."""
    monkeypatch.setenv("AUTOTUNE_STORE", f"sqlite:///{tmp_path / 'results.db'}")


# Every process the suite starts inherits this variable (through Ray's daemons and the
# trial launchers too, and keeps it when orphaned), so tests that look for, or kill,
# trial processes touch only their own: never a search a developer runs beside the suite.
# (A Ray worker that retitles itself can blank its /proc environ: its children keep it.)
SESSION_MARK = "AUTOTUNE_TEST_SESSION"


def ours(process: psutil.Process) -> bool:
    """Whether `process` was started by this test session (see SESSION_MARK)."""
    with contextlib.suppress(psutil.Error):
        return process.environ().get(SESSION_MARK) == os.environ[SESSION_MARK]
    return False


def trial_processes() -> list[psutil.Process]:
    """The suite's trial processes and launchers, less this test process's own warm
    launcher (started by a test that ran a trial in-process; it lives as long as pytest,
    its trials are still counted)."""
    out = []
    for p in psutil.process_iter(["cmdline", "ppid"]):
        with contextlib.suppress(psutil.Error):
            cmd = " ".join(p.info["cmdline"] or [])
            mine = p.info["ppid"] == os.getpid() and "autotune.trials.forkserver" in cmd
            if ("autotune.trials.forkserver" in cmd or "autotune.trials.worker" in cmd) and ours(
                    p) and not mine:
                out.append(p)
    return out


@pytest.fixture
def tiny_spec(tmp_path) -> dict:
    spec = copy.deepcopy(TINY_SPEC)
    spec["output"] = str(tmp_path / "out")
    return spec


def trial_request(spec, config, *, timeout_s: float = 120, budget: int | None = None,
                  shape: dict | None = None):
    """The request a search would send for `config` of `spec` (a dict or a Spec)."""
    from autotune.device import local_device, node_cpus
    from autotune.spec import load_spec
    from autotune.trials.protocol import make_request

    return make_request(load_spec(spec), config, on_cpu=not local_device().is_cuda,
                        shape=shape, memory_budget_bytes=budget, timeout_s=timeout_s,
                        cpu_threads=node_cpus())


def accelerate_launch(args: list[str], cwd: Path, timeout: float = 300,
                      ) -> subprocess.CompletedProcess:
    """`accelerate launch ARGS` as a user runs it on the exports, with the DeepSpeed ops
    set-up built for this environment: torch's default extensions folder is shared by
    every venv of the user, whose build flags differ, so a run there rebuilt the shm op,
    and a build killed mid-way (another checkout's suite stopped by hand) left a lock
    that stalled the run past its 5 minutes. Past `timeout` its whole process group is
    killed: the launcher's ranks are not left running."""
    from autotune.trials.launch import extensions_dir

    accelerate = str(Path(sys.executable).with_name("accelerate"))
    proc = subprocess.Popen([accelerate, "launch", *args], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=dict(os.environ, TORCH_EXTENSIONS_DIR=extensions_dir()),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA; without it they are skipped, and say so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def study_names(storage: str) -> list[str]:
    """The studies in a search's storage; none while the search is still creating its
    schema (a reader creating it at the same moment fails on the search's version row)."""
    import optuna
    import sqlalchemy.exc

    try:
        return optuna.get_all_study_names(storage)
    except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
        return []


@pytest.fixture(scope="session")
def postgres_server():
    """One real PostgreSQL server for the session (tests/postgres.py); skipped where none
    is installed, unless AUTOTUNE_REQUIRE_POSTGRES is set (CI), where that fails."""
    from tests.postgres import session_server

    for server in session_server():
        if server is None:
            pytest.skip("PostgreSQL is not installed (set AUTOTUNE_PG_BIN to its bin folder)")
        yield server


@pytest.fixture
def postgres_url(postgres_server) -> str:
    """A fresh, empty database on the session's server."""
    return postgres_server.new_database()


def cli_search(raw: dict, tmp_path) -> tuple[Path, list[dict]]:
    """`autotune search` of the spec `raw` as a user runs it (a model.yaml, the CLI in its
    own process); its output folder and the trials that ran, each asserted ok."""
    import json
    import subprocess
    import sys

    import yaml

    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = subprocess.run([sys.executable, "-m", "autotune", "search", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = Path(raw["output"])
    summary = json.loads((out / "summary.json").read_text())
    ran = [t for t in summary["trials"] if t["outcome"]["status"] != "pruned"]
    assert ran and all(t["outcome"]["status"] == "ok" for t in ran), [
        (t["config"], t["outcome"]["error"]) for t in ran]
    return out, ran
