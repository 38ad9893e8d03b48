"""Scale-out on real Ray: a head and a second node on this machine, parallel trials, the
device found where trials run, requests no node can place, token authentication, and the
faults that must cost nothing (a killed worker, a killed driver)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
import yaml

from autotune.config import TrialConfig
from autotune.errors import ClusterError
from autotune.records import Outcome
from autotune.space import build_space
from autotune.spec import load_spec
from autotune.summary import load_summary
from autotune.trials.executor import CLIENT_INIT_ATTEMPTS, RayExecutor
from tests import cluster_watch
from tests.conftest import ours, study_names, trial_processes

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port(*taken: int) -> int:
    """A port free now, none of `taken`, and outside both the kernel's ephemeral range and
    Ray's worker ports (10002-19999): the kernel may hand back a port just released (CI
    once gave the head's GCS and Ray Client the same one), and any outgoing connection,
    another test's Ray say, may take an ephemeral one before `ray start` binds it (CI
    once lost the head's GCS port so, 2026-11-29)."""
    import random
    import socket

    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range")
    low = int(ephemeral.read_text().split()[0]) if ephemeral.is_file() else 32768
    pick = random.Random()
    while True:
        port = pick.randrange(20000, low if low > 20001 else 65536)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port


class Cluster:
    """`ray start` head and workers on localhost, stopped (with their processes) at exit."""

    def __init__(self, tmp: Path, env: dict[str, str]) -> None:
        self.port, self.env = _free_port(), env
        self.address = f"127.0.0.1:{self.port}"
        # Ray's socket paths live under its temp dir and must fit in 107 bytes: pytest's
        # tmp_path is too deep.
        self.temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
        self.raylets: list[int] = []  # the worker nodes' raylets' ports
        self.watch: subprocess.Popen | None = None  # stops it if this process is killed

    def start(self, *, head_cpus: int = 0, workers: list[dict] | None = None) -> Cluster:
        self.client_port = _free_port(self.port)  # Ray Client (ray://) listens here
        self.watch = cluster_watch.start(self.temp, self.keys())
        self._ray("start", "--head", f"--port={self.port}", f"--num-cpus={head_cpus}",
                  "--num-gpus=0", "--include-dashboard=false", f"--temp-dir={self.temp}",
                  f"--ray-client-server-port={self.client_port}")
        for node in workers or []:
            self.add_worker(**node)
        return self

    def add_worker(self, cpus: int, gpus: int = 0) -> None:
        """A worker node, its raylet on a port of its own (to find it by)."""
        port = _free_port(self.port, self.client_port, *self.raylets)
        self._ray("start", f"--address={self.address}", f"--num-cpus={cpus}",
                  f"--num-gpus={gpus}", f"--node-manager-port={port}")
        self.raylets.append(port)

    def raylet_of_worker(self, index: int = 0) -> psutil.Process:
        """The raylet of the `index`th worker node started."""
        flag = f"--node_manager_port={self.raylets[index]}"
        for p in psutil.process_iter(["name", "cmdline"]):
            with contextlib.suppress(psutil.Error):
                if "raylet" in (p.info["name"] or "") and flag in (p.info["cmdline"] or []):
                    return p
        raise AssertionError(f"no raylet with {flag}")

    def _ray(self, *args: str) -> None:
        proc = subprocess.run([RAY, *args], env=self.env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-1500:]

    def keys(self) -> tuple[str, ...]:
        """What names this cluster's processes: every node's daemons name its temp folder
        or its head's address, Ray Client's proxy its port and the head's GCS port (at the
        node's own IP, not 127.0.0.1); Ray's workers and the proxy's servers are their
        descendants."""
        keys = (str(self.temp), self.address, f":{self.port} ")
        if hasattr(self, "client_port"):
            keys += (f"--port={self.client_port} ",)
        return keys

    def processes(self) -> list[psutil.Process]:
        return cluster_watch.processes(self.keys())

    def client_server_logs(self, tail: int = 1500) -> str:
        """The end of each Ray Client server's error log on the head: why a client's server
        died is written there and nowhere else."""
        logs = sorted((self.temp / "session_latest" / "logs").glob("ray_client_server*.err"))
        return "\n".join(f"== {f.name}\n{f.read_text(errors='replace')[-tail:]}"
                         for f in logs) or f"no ray_client_server*.err under {self.temp}"

    def stop(self) -> None:
        """This cluster only: `ray stop` would stop every Ray of the user on the machine,
        a search someone runs beside the tests included."""
        if self.watch is not None:
            self.watch.kill()
            self.watch.wait()
        left = cluster_watch.kill(self.keys())
        assert not left, [p.cmdline() for p in left]
        shutil.rmtree(self.temp, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _nodes_lease_apart(tmp_path_factory):
    """This module's trials lease the machine's cores in a folder of their own. Its
    clusters' nodes share one host, and a trial whose ranks span two of them leases each
    node's core apart: beside another pytest-xdist worker's trial, which asks for both
    cores, the two ranks each waited on the other's lease for minutes. (Real nodes lease
    their own machines' cores.)"""
    kept = os.environ["AUTOTUNE_LEASE_DIR"]
    os.environ["AUTOTUNE_LEASE_DIR"] = str(tmp_path_factory.mktemp("cluster-leases"))
    yield
    os.environ["AUTOTUNE_LEASE_DIR"] = kept


@pytest.fixture
def open_cluster(tmp_path):
    """A cluster without token authentication (scheduling is what these tests test)."""
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    cluster = Cluster(tmp_path, env)
    # Left set for the rest of the session: Ray reads the mode once per process, and an
    # embedded Ray a later test starts in this process must start its GCS in the mode
    # this process's clients speak (with the variable gone, its GCS asked for a token the
    # test process never sent: "Failed to start GCS").
    os.environ["RAY_AUTH_MODE"] = "disabled"
    yield cluster
    import ray

    if ray.is_initialized():
        ray.shutdown()
    cluster.stop()


@pytest.fixture(scope="class")
def two_nodes(tmp_path_factory):
    """A head and a worker node of a core each, shared by the tests that only run trials
    whose ranks span them (none kills a node or its driver): a cluster's start and stop
    take about 7 s."""
    env = os.environ | {"RAY_AUTH_MODE": "disabled"}
    os.environ["RAY_AUTH_MODE"] = "disabled"  # as open_cluster leaves it
    cluster = Cluster(tmp_path_factory.mktemp("two_nodes"), env)
    try:
        yield cluster.start(head_cpus=1, workers=[{"cpus": 1}])
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        cluster.stop()


def _spec(tiny_spec, **hardware):
    tiny_spec["hardware"] = hardware
    return load_spec(tiny_spec)


def test_two_trials_overlap_on_two_nodes_one_slot_each(open_cluster, tiny_spec, tmp_path):
    cluster = open_cluster.start(head_cpus=0, workers=[{"cpus": 1}, {"cpus": 1}])
    # Each trial's model is built only once the other trial is building one too, so the
    # trials overlap however long each node's launcher takes to start (2 busy cores).
    meet = tmp_path / "meet"
    meet.mkdir()
    tiny_spec["model"] = {"factory": "tests.factories:rendezvous_gpt2", "config": {
        **tiny_spec["model"]["config"], "rendezvous_dir": str(meet)}}
    executor = RayExecutor(_spec(tiny_spec), address=cluster.address, timeout_s=180)
    try:
        device = executor.discover()
        assert device.kind == "cpu" and executor.capacity == 2 and executor.threads == 1
        tickets = [executor.submit(TrialConfig(4, 4)), executor.submit(TrialConfig(8, 2))]
        done = {}
        while len(done) < 2:
            done |= dict(executor.wait(timeout=60))
    finally:
        executor.close()
    a, b = (done[t] for t in tickets)
    assert a.ok and b.ok, (a.error, b.error)
    assert a.launch.node != b.launch.node  # never two trials in one slot
    assert len(list(meet.iterdir())) == 2
    assert a.launch.started_at < b.launch.ended_at and b.launch.started_at < (
        a.launch.ended_at)  # in flight at the same time
    assert a.measured.cpu_threads == b.measured.cpu_threads == 1  # each its node's cores


def test_the_device_is_found_on_a_worker_node_and_trials_run_there_via_ray_client(
        open_cluster, tiny_spec, monkeypatch):
    cluster = open_cluster.start(head_cpus=0, workers=[{"cpus": 2}])
    executor = RayExecutor(_spec(tiny_spec), address=cluster.address)
    try:
        executor.discover()
        import ray

        head = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("CPU", 0) == 0)
        workers = {n["NodeID"] for n in ray.nodes() if n["Resources"].get("CPU", 0) == 2}
        assert executor.probe_node in workers and executor.probe_node != head
        assert executor.threads == 2
    finally:
        executor.close()
    # `--address ray://host:port`: the driver a Ray Client, the trial on the worker node
    # with that node's cores. The first connection fails as a busy head's did in one CI
    # run (its proxy could not start this client's server): it is tried again, not given
    # up. (The fault is injected here; killing the head's server for the client does the
    # same for real, but each failed attempt then costs the head's 41 s of waits.)
    attempts = _fail_first_client_init(monkeypatch)
    executor = RayExecutor(_spec(tiny_spec), address=f"ray://127.0.0.1:{cluster.client_port}",
                           timeout_s=180)
    try:
        out = executor.run(TrialConfig(4, 4))
    except ClusterError as exc:  # the head's own words on why its servers died, for CI's log
        raise AssertionError(f"{exc}\n{cluster.client_server_logs()}") from exc
    finally:
        executor.close()
    # The injected failure and the connection that worked; a busy head's real failures in
    # between (one CI run met one, another two in a row) are what the retries are for.
    assert set(attempts) == {f"ray://127.0.0.1:{cluster.client_port}"}
    assert 2 <= len(attempts) <= CLIENT_INIT_ATTEMPTS
    assert out.ok, out.error
    assert out.launch.node in workers and out.measured.cpu_threads == 2


def _fail_first_client_init(monkeypatch) -> list[str]:
    """Ray's own `ray.init`, but its first Ray Client connection fails with Ray Client's
    words for a head that could not start the client's server. Returns the address
    each call was given."""
    import ray

    real, calls = ray.init, []

    def init(*args, **kwargs):
        calls.append(kwargs.get("address", args[0] if args else None))
        if len(calls) == 1:
            raise ConnectionAbortedError(
                "Initialization failure from server:\nTraceback (most recent call last):\n"
                "RuntimeError: Starting Ray client server failed. See "
                "ray_client_server_23000.err for detailed logs.")
        return real(*args, **kwargs)

    monkeypatch.setattr(ray, "init", init)
    return calls


def test_a_request_no_node_can_place_fails_at_once(open_cluster, tiny_spec):
    cluster = open_cluster.start(head_cpus=1, workers=[{"cpus": 1, "gpus": 1}])
    executor = RayExecutor(_spec(tiny_spec, gpus_per_trial=2), address=cluster.address)
    started = time.time()
    with pytest.raises(ClusterError, match="a trial needs 2 GPUs, and the cluster.s nodes"):
        executor.discover()
    executor.close()
    assert time.time() - started < 60


def test_an_address_where_nothing_listens_fails_at_once_in_one_line(tiny_spec, tmp_path):
    """Found by a newcomer run: `--address 127.0.0.1:1` was still retrying (Ray's own
    warnings, naming another IP) after 150 s. Nothing listening there is one line, exit 2,
    in seconds."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    started = time.time()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        proc = subprocess.run([sys.executable, "-m", "autotune", "search", str(spec),
                               "--address", address], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert f"nothing answers at 127.0.0.1:{port}" in proc.stdout + proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
    assert time.time() - started < 100


def test_a_head_that_fails_to_start_a_client_server_is_named_with_its_reason():
    # Ray Client's own words when the head's proxy cannot start this client's server
    # (ray/util/client/worker.py): the head's traceback follows the first line.
    from autotune.trials.executor import _client_server_failed, _connection_error

    failed = ConnectionAbortedError(
        "Initialization failure from server:\nTraceback (most recent call last):\n"
        '  File "proxier.py", line 780, in Datapath\n'
        "RuntimeError: Proxy failed to Connect to backend! Check `ray_client_server.err`")
    assert _client_server_failed(failed)
    assert not _client_server_failed(ConnectionError("Failed to connect within 30 seconds"))
    message = _connection_error("ray://head:10001", failed)
    assert "could not start a Ray Client server" in message
    assert "RuntimeError: Proxy failed to Connect to backend!" in message
    assert "\n" not in message


def test_token_authentication_is_one_line_and_the_token_joins(tmp_path, tiny_spec):
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"} | {
        "HOME": str(home), "RAY_AUTH_MODE": "token"}
    cluster = Cluster(tmp_path, env)
    try:
        cluster._ray("get-auth-token", "--generate")  # as Ray documents for a new cluster
        cluster.start(head_cpus=1)
        token = (home / ".ray" / "auth_token").read_text().strip()
        spec = tmp_path / "model.yaml"
        spec.write_text(yaml.safe_dump(tiny_spec | {"search": {"n_trials": 1}}))
        stranger = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")} | {
            "HOME": str(tmp_path / "elsewhere")}
        refused = subprocess.run([sys.executable, "-m", "autotune", "search", str(spec),
                                  "--address", cluster.address], env=stranger,
                                 capture_output=True, text=True, timeout=300)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        lines = [ln for ln in refused.stderr.splitlines() if ln.startswith("error:")]
        assert len(lines) == 1 and "RAY_AUTH_TOKEN" in lines[0], refused.stderr
        assert "Traceback" not in refused.stderr
        joined = subprocess.run([sys.executable, "-c", (
            "from autotune.trials.executor import RayExecutor; from autotune.spec import "
            f"load_spec; e = RayExecutor(load_spec({str(spec)!r}), address="
            f"{cluster.address!r}); print(e.discover().kind); e.close()")],
            env=stranger | {"RAY_AUTH_TOKEN": token}, capture_output=True, text=True,
            timeout=300)
        assert joined.returncode == 0 and joined.stdout.strip().endswith("cpu"), joined.stderr
    finally:
        cluster.stop()


def _left_after(seconds: float) -> list[psutil.Process]:
    """Trial processes (and warm launchers) still here after up to `seconds`: on a cluster
    the launchers go with their Ray workers, which Ray ends a few seconds after the driver
    leaves (longer on a busy machine), the trials with them."""
    deadline = time.time() + seconds
    while (left := trial_processes()) and time.time() < deadline:
        time.sleep(0.5)
    return left


def _ray_worker_of_trial() -> psutil.Process | None:
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            children = p.children()  # Ray's retitled worker may show a blank environ:
            if ("ray::_trial_task" in " ".join(p.info["cmdline"] or []) and children
                    and (ours(p) or any(ours(c) for c in children))):  # its trial's is whole
                return p
    return None


def _stalling_trial_hit_by(tiny_spec, tmp_path, hit, budget: int | None = None):
    """One trial through Ray whose first attempt stalls mid-run; `hit` runs (in a thread)
    once it stalls. Returns the trial's outcome."""
    tiny_spec["model"] = {"factory": "tests.factories:stalls_the_first_time", "config": {
        **tiny_spec["model"]["config"], "stall_marker": str(tmp_path / "stalled")}}
    executor = RayExecutor(_spec(tiny_spec), timeout_s=180)
    executor.budget = budget  # as run_search sets it

    def when_stalled() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "stalled").exists():
            time.sleep(0.2)  # the trial has built its model and is stalling in its step
        hit()

    try:
        executor.discover()
        threading.Thread(target=when_stalled, daemon=True).start()
        return executor.run(TrialConfig(4, 4))
    finally:
        executor.close()


def test_killing_a_trials_ray_worker_is_retried_once_and_leaves_no_orphan(tiny_spec,
                                                                         tmp_path):
    """As Ray's memory monitor or a lost node would: the infrastructure, not the config.
    The first attempt stalls mid-run, so its trial is surely alive when its Ray worker is
    killed; every process under that worker must be gone within seconds, and the retry
    (which trains) measures the config."""
    killed: list[int] = []
    left: list[psutil.Process] = []

    def kill_first_worker() -> None:
        worker = _ray_worker_of_trial()
        if worker is not None:
            descendants = worker.children(recursive=True)
            worker.kill()
            killed.append(worker.pid)
            _, alive = psutil.wait_procs(descendants, timeout=10)
            left.extend(p for p in alive if p.is_running())

    out = _stalling_trial_hit_by(tiny_spec, tmp_path, kill_first_worker)
    assert killed, "no trial's worker was found to kill"
    assert not left, [p.cmdline() for p in left]  # the stalled trial died with its worker
    assert out.ok, out.error  # run again after the worker was lost, and measured
    time.sleep(3)
    assert not trial_processes()


def test_a_trial_the_host_kills_well_under_its_budget_is_run_again_not_an_oom(tiny_spec,
                                                                              tmp_path):
    """The kernel's OOM killer ends a trial for the whole host's sake; one killed while it
    held a fraction of its budget was killed for what others used: `lost`, run again, and
    the retry's figure stands with the failure recorded beside it. (A SIGKILL stands in for
    the kernel: no test may run the machine out of memory.)"""
    killed: list[int] = []

    def kill_the_trial() -> None:
        time.sleep(1.0)  # its budget watch has written what it holds
        for p in trial_processes():  # the trial: forked by the warm launcher
            with contextlib.suppress(psutil.Error):
                if "autotune.trials.forkserver" in " ".join(p.parent().cmdline()):
                    p.send_signal(signal.SIGKILL)
                    killed.append(p.pid)

    out = _stalling_trial_hit_by(tiny_spec, tmp_path, kill_the_trial, budget=4 * 2**30)
    assert killed, "no trial was found to kill"
    assert out.ok, out.error
    failures = out.launch.infrastructure_failures
    assert len(failures) == 1 and "the host ran out of memory" in failures[0], failures
    assert "GiB of its 4.00 GiB budget" in failures[0]


def test_a_sigkill_near_the_budget_stays_the_configs_oom():
    from autotune.records import OOM, Outcome
    from autotune.trials.launch import _host_pressure

    killed = Outcome(OOM, error="killed by SIGKILL (the kernel's OOM killer sends it)")
    assert _host_pressure(killed, int(3.5 * 2**30), 4 * 2**30) is killed
    assert _host_pressure(killed, None, 4 * 2**30) is killed  # nothing known: as before
    assert _host_pressure(killed, 2**30, 4 * 2**30).status == "lost"
    # A GPU trial with nothing known of its host memory: an OOM of the host, not the GPU.
    gpu = _host_pressure(Outcome(OOM, error="killed"), None, 4 * 2**30, on_gpu=True)
    assert gpu.status == OOM and gpu.failure.host_memory
    assert gpu.error.startswith("killed by SIGKILL, the host's OOM killer's signal")


@pytest.mark.parametrize("node_trials", [1, 10**6])
def test_a_gpu_trial_the_host_kills_is_lost_under_its_share_and_a_host_oom_at_it(
        tiny_spec, tmp_path, node_trials, monkeypatch):
    """A GPU trial's own budget is its GPU's; the host's OOM killer (which takes Ray's
    workers' children first) says something of the config only when the trial held its
    share of the host's RAM. Under it: `lost`. At it: an OOM of host memory, which the GPU
    memory model does not learn. The real launcher and worker run a GPU trial's request
    (no budget on the host, the node's RAM shared among `node_trials`); only the GPU is
    missing, and a SIGKILL stands in for the kernel. The stalled trial holds 96 MiB more
    than it started with, past its host watch's 64 MiB step (a tiny model alone may not
    move the figure from its first reading, which can be at or under nothing: `lost` at
    any share, as a loaded machine once showed)."""
    from autotune.config import Family
    from autotune.device import named_device
    from autotune.plan.calibration import MemoryModel
    from autotune.plan.shape import ModelShape
    from autotune.records import Record
    from autotune.trials.launch import run_trial
    from autotune.trials.worker import HOST_STANDS_IN_FOR_GPU
    from tests.conftest import trial_request

    tiny_spec["model"] = {"factory": "tests.factories:stalls_the_first_time", "config": {
        **tiny_spec["model"]["config"], "stall_marker": str(tmp_path / "stalled"),
        "stall_ballast": 96 << 20}}
    request = trial_request(tiny_spec, TrialConfig(4, 4))
    request.on_cpu, request.node_trials = False, node_trials  # as a GPU node sends it
    monkeypatch.setenv(HOST_STANDS_IN_FOR_GPU, "1")  # the GPU that is not here

    def kill_when_stalled() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "stalled").exists():
            time.sleep(0.2)
        time.sleep(1.0)  # its host watch has written what it holds
        for p in trial_processes():
            with contextlib.suppress(psutil.Error):
                if "autotune.trials.forkserver" in " ".join(p.parent().cmdline()):
                    p.send_signal(signal.SIGKILL)

    threading.Thread(target=kill_when_stalled, daemon=True).start()
    out = run_trial(request)
    if node_trials == 1:  # a tiny model against the whole host's RAM
        assert out.status == "lost", (out.status, out.error)
        assert "of its" in out.error and "share of the host's RAM" in out.error, out.error
        return
    assert out.status == "oom" and out.failure.host_memory, (out.status, out.failure)
    assert out.error.startswith("host memory ran out"), out.error
    model = MemoryModel(ModelShape(num_parameters=10**6, hidden_size=32, num_layers=2,
                                   num_attention_heads=2, vocab_size=512, seq_len=32),
                        named_device("A100-80GB"))
    model.learn(Record(TrialConfig(4, 4, Family.of()), out), 80 * 2**30)
    assert not model.known_oom(TrialConfig(8, 2)), "a host OOM taught the GPU's model"


def test_sigkill_of_the_driver_leaves_nothing_and_the_rerun_keeps_what_finished(tmp_path,
                                                                              tiny_spec):
    tiny_spec["search"] |= {"n_trials": 4, "confirm_repeats": 0}
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    out = Path(tiny_spec["output"])
    storage = f"sqlite:///{(out / 'study.db').resolve()}"
    driver = subprocess.Popen([sys.executable, "-m", "autotune", "search", str(spec)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import optuna

    finished: list = []
    deadline = time.time() + 300
    while time.time() < deadline and len(finished) < 2:
        time.sleep(1)
        if (out / "study.db").exists() and study_names(storage):
            study = optuna.load_study(study_name=study_names(storage)[0],
                                      storage=storage)
            finished = [(t.number, t.user_attrs["config"]) for t in study.trials
                        if "outcome" in t.user_attrs]
    assert len(finished) >= 2
    tree = psutil.Process(driver.pid).children(recursive=True)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    gone, alive = psutil.wait_procs(tree, timeout=30)
    assert not [p for p in alive if p.is_running()], [p.cmdline() for p in alive]
    rerun = subprocess.run([sys.executable, "-m", "autotune", "search", str(spec)],
                           capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    trials = json.loads((out / "summary.json").read_text())["trials"]
    kept = [(t["number"], t["config"]) for t in trials]
    assert all(f in kept for f in finished)  # every finished trial kept, same number
    configs = [json.dumps(c, sort_keys=True) for _, c in kept]
    assert len(configs) == len(set(configs))  # none ran twice


# --- trials whose ranks span nodes ------------------------------------------------------


def _cli_search(cluster: Cluster, tiny_spec: dict, tmp_path: Path,
                timeout: int = 600) -> Path:
    """`autotune search` of `tiny_spec` (two trials, no confirmation) through `cluster`,
    which must succeed; its output folder."""
    tiny_spec["search"] |= {"n_trials": 2, "confirm_repeats": 0}
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    proc = subprocess.run([sys.executable, "-m", "autotune", "search", str(spec),
                           "--address", cluster.address], capture_output=True, text=True,
                          timeout=timeout, env=cluster.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Path(tiny_spec["output"])


def _two_node_spec(tiny_spec, **model):
    """Two ranks on a cluster of two one-core nodes: a rank on each (a core per rank)."""
    if model:
        tiny_spec["model"] = model
    return _spec(tiny_spec, gpus_per_trial=2)


class TestOnTwoNodes:
    """Trials whose ranks span the class's two nodes (two_nodes), none killing either."""

    def test_a_two_rank_trial_spans_two_nodes_one_rank_on_each(self, two_nodes, tiny_spec):
        cluster = two_nodes
        executor = RayExecutor(_two_node_spec(tiny_spec), address=cluster.address, timeout_s=240)
        try:
            device = executor.discover()
            assert executor.nodes == 2 and device.count == 2 and executor.capacity == 1
            import ray

            node_ids = {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
            out = executor.run(TrialConfig(2, 4))
            groups = ray.util.placement_group_table()
        finally:
            executor.close()
        assert out.ok, out.error
        placed = out.launch.rank_nodes  # node rank -> the Ray node its ranks ran on
        assert sorted(placed) == [0, 1] and set(placed.values()) == node_ids
        by_rank = out.measured.micro_batches_by_rank
        assert sorted(by_rank) == [0, 1]
        steps = 3  # 1 warm-up + 2 timed: every micro-batch full, gas of them per step
        assert all(sizes == [2] * (4 * steps) for sizes in by_rank.values()), by_rank
        # Throughput counts both nodes' samples: b x gas x world per timed step.
        assert out.samples_per_second * out.timed_seconds == pytest.approx(2 * 4 * 2 * 2)
        assert out.launch.nodes == 2
        assert all(g["state"] == "REMOVED" for g in groups.values()), groups
        left = _left_after(15)
        assert not left, [p.cmdline() for p in left]


    def test_rank_1s_oom_on_the_other_node_is_the_trials_oom(self, two_nodes, tiny_spec):
        cluster = two_nodes
        spec = _two_node_spec(tiny_spec, factory="tests.factories:oom_on_rank_1")
        executor = RayExecutor(spec, address=cluster.address, timeout_s=240)
        try:
            executor.discover()
            started = time.time()
            out = executor.run(TrialConfig(2, 4))
            took = time.time() - started
        finally:
            executor.close()
        assert out.status == "oom" and out.error.startswith("rank 1:"), (out.status, out.error)
        assert took < 200  # rank 0, blocked on its peer, ended with the trial, not timed out
        left = _left_after(15)
        assert not left, [p.cmdline() for p in left]


    def test_autotune_search_on_two_nodes_exports_a_two_machine_accelerate_config(
            self, two_nodes, tiny_spec, tmp_path):
        tiny_spec["hardware"] = {"gpus_per_trial": 2}
        out = _cli_search(two_nodes, tiny_spec, tmp_path, timeout=900)
        summary = json.loads((out / "summary.json").read_text())
        assert summary["device"]["nodes"] == 2 and summary["device"]["count"] == 2
        ran = [o for t in summary["trials"] if (o := Outcome.from_dict(t["outcome"])).ok]
        assert ran, [t["outcome"]["error"] for t in summary["trials"]]
        for outcome in ran:  # one rank on each node
            assert len(set(outcome.launch.rank_nodes.values())) == 2, outcome.launch
        accelerate = yaml.safe_load((out / "accelerate_config.yaml").read_text())
        assert accelerate["num_machines"] == 2 and accelerate["num_processes"] == 2
        assert accelerate["machine_rank"] == 0 and accelerate["main_process_ip"]
        report = (out / "report.md").read_text()
        assert "--machine_rank 1" in report and "--nnodes 2" in report


def test_killing_a_node_mid_trial_leaves_nothing_and_the_trial_is_lost_then_retried(
        open_cluster, tiny_spec, tmp_path):
    """The worker node's raylet killed while both ranks stall in their first step: Ray
    loses that node (its workers die with their raylet, the trial's rank with them), the
    rank on the head is ended with its task, the placement group is removed, and the
    trial is run again on the node that replaced the lost one."""
    cluster = open_cluster.start(head_cpus=1, workers=[{"cpus": 1}])
    spec = _two_node_spec(tiny_spec, factory="tests.factories:stalls_the_first_time",
                          config={**tiny_spec["model"]["config"],
                                  "stall_marker": str(tmp_path / "stalled")})
    executor = RayExecutor(spec, address=cluster.address, timeout_s=240)
    import ray

    left: list[psutil.Process] = []
    replaced: list[bool] = []

    def kill_the_worker_node() -> None:
        deadline = time.time() + 180
        while time.time() < deadline and not (tmp_path / "stalled").exists():
            time.sleep(0.2)
        time.sleep(1.0)
        trial = trial_processes()
        raylet = cluster.raylet_of_worker()
        raylet.kill()
        _, alive = psutil.wait_procs(trial, timeout=20)
        left.extend(p for p in alive if p.is_running())
        cluster.add_worker(cpus=1)  # a node to run the retry on
        replaced.append(True)

    try:
        executor.discover()
        threading.Thread(target=kill_the_worker_node, daemon=True).start()
        out = executor.run(TrialConfig(4, 2))  # 4: the stalling batch
        groups = ray.util.placement_group_table()
    finally:
        executor.close()
    assert replaced, ("the worker node was not killed", out.status, out.error, out.launch)
    assert not left, [p.cmdline() for p in left]  # every rank, on both nodes, gone
    failures = out.launch.infrastructure_failures or []
    assert len(failures) == 1 and "Ray lost a node of the trial" in failures[0], (
        out.status, out.error, failures)
    assert out.ok, out.error  # the retry on the replacement node measured the config
    assert all(g["state"] == "REMOVED" for g in groups.values()), groups
    left = _left_after(15)
    assert not left, [p.cmdline() for p in left]


def test_sigkill_of_a_two_node_searchs_driver_leaves_no_rank_on_either_node(
        open_cluster, tiny_spec, tmp_path):
    """The driver of a search on a cluster killed while a trial's two ranks, one on each
    node, stall in their first step: Ray ends the job's workers on both nodes, each
    node's warm launcher goes with its worker and takes its ranks' session down."""
    cluster = open_cluster.start(head_cpus=1, workers=[{"cpus": 1}])
    marker = tmp_path / "stalled"
    tiny_spec["model"] = {"factory": "tests.factories:stalls_the_first_time",
                          "config": {**tiny_spec["model"]["config"],
                                     "stall_marker": str(marker), "stall_batch": 0}}
    tiny_spec["hardware"] = {"gpus_per_trial": 2}
    tiny_spec["search"] |= {"n_trials": 2, "confirm_repeats": 0}
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    driver = subprocess.Popen([sys.executable, "-m", "autotune", "search", str(spec),
                               "--address", cluster.address], env=cluster.env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not marker.exists() and driver.poll() is None:
            time.sleep(0.2)
        assert marker.exists(), "no rank reached its first step"
        time.sleep(1.0)
        ranks = [p for p in trial_processes() if p.ppid() in
                 {q.pid for q in trial_processes()}]  # forked by a launcher: the ranks
        assert len(ranks) >= 2, [p.cmdline() for p in trial_processes()]
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    left = _left_after(30)
    assert not left, [p.cmdline() for p in left]


def test_a_search_through_a_cluster_has_the_embedded_searchs_device_space_and_recipe(
        open_cluster, tiny_spec, tmp_path):
    """Found trying the cluster path: the probe copied the device field by field and
    dropped its native bf16 (and a GPU's peak FLOP/s), so through `--address` the recipe
    ran in fp32 on a CPU where an embedded search runs it in bf16."""
    _cli_search(open_cluster.start(head_cpus=2), tiny_spec, tmp_path)
    summary = load_summary(tiny_spec["output"])
    spec = load_spec(tmp_path / "model.yaml")
    embedded = RayExecutor(spec).discover()  # an embedded search's device (Ray not started)
    assert summary.device.to_dict() == embedded.to_dict()  # every field, not only compared ones
    assert summary.pruned_by_rules == build_space(spec, embedded).pruned
    recipe = summary.recipe
    assert recipe is not None, [(t.reason, t.outcome.error) for t in summary.trials]
    assert recipe.config.precision == ("bf16" if embedded.native_bf16 else "fp32")


def test_an_embedded_ray_refused_for_its_token_says_why_in_one_line():
    """Found by the suite: a process that had joined a cluster with RAY_AUTH_MODE=disabled
    could not start its own Ray once the variable was gone; Ray's message begins with
    "Failed to start GCS" and hides the reason on a later line."""
    from autotune.trials.executor import _connection_error

    exc = RuntimeError("Failed to start GCS.  Last 0 lines of error files:\n\n.Please check "
                       "gcs_server.out for details. Last connection error: Traceback ...\n"
                       "ray.exceptions.AuthenticationError: RPC error: InvalidAuthToken: "
                       "Authentication token is missing or incorrect.")
    message = _connection_error(None, exc)
    assert "\n" not in message and "RAY_AUTH_MODE once per process" in message
