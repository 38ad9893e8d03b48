"""Where trials run: the Executor seam, and Ray tasks on an embedded local Ray or a cluster.

Each Ray task launches the trial process (trials.launch) on the node Ray picked, with the
GPUs Ray reserved for it and its share of that node's cores, so a trial never shares a GPU
and runs with the threads its real run would have. Trials run in parallel up to the slots
the nodes offer. A worker or node lost under a trial, or devices another search held past
the trial's limit, is the infrastructure's failure, not the config's: the trial runs once
more, and is recorded `lost` if that fails too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import psutil

from autotune.device import (
    DeviceSpec,
    local_device,
    network_link,
    node_cpus,
    nvidia_driver_present,
)
from autotune.errors import ClusterError
from autotune.records import LOST, Outcome
from autotune.trials import reaper
from autotune.trials.launch import NodeReport, run_trial
from autotune.trials.lease import driver_work
from autotune.trials.protocol import TrialRequest, make_request

if TYPE_CHECKING:
    import subprocess

    from autotune.config import TrialConfig
    from autotune.spec import Spec

log = logging.getLogger("autotune")
T = TypeVar("T")
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
GRACE_S = 120.0  # beyond a trial's own time limit (start-up, queueing) before it is lost
PROBE_TIMEOUT_S = 60.0
RETRIES = 1  # infrastructure failures are retried this many times
# Connections via Ray Client whose server the head failed to start: a busy head failed
# twice running in one CI run (2026-11-30), its servers dying as they started.
CLIENT_INIT_ATTEMPTS = 5


class Executor(ABC):
    """Runs trials and says what happened.

    Call order: submit() up to `capacity` trials, each returning a ticket; wait() blocks
    until at least one of them ends (or `timeout` seconds pass) and returns (ticket,
    Outcome) pairs; submit more as tickets come back; close() once at the end.
    """

    capacity: int = 1

    def use_spec(self, spec: Spec) -> None:  # noqa: B027 - a hook: most hold no spec
        """The spec its trials are made from, where the search settled one of its fields
        after this executor was made (`data.seq_len: longest`); nothing by default."""

    @abstractmethod
    def submit(self, config: TrialConfig, *, training_args: dict | None = None,
               steps: int | None = None) -> int:
        """Start one trial; never raises for a trial that fails (that is an Outcome).
        `training_args` replace the kwargs built from the config (an exported file's),
        `steps` the spec's timed steps."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> list[tuple[int, Outcome]]:
        """Trials that ended since the last call; [] when `timeout` passed first."""

    def run(self, config: TrialConfig) -> Outcome:
        """One trial, start to end."""
        ticket = self.submit(config)
        while True:
            for done, outcome in self.wait():
                if done == ticket:
                    return outcome

    def prepare(self, shape: dict | None, budget: int | None) -> None:  # noqa: B027
        """Told once the search knows them, before its first trial (a search's, or a
        remembered result's check): the model's shape (ModelShape.to_dict) and each
        trial's memory budget in bytes. The default runs trials that need neither."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers; the default has none."""

    def driver_work(self, what: str) -> contextlib.AbstractContextManager:
        """Held around the driver's own heavy work (`what`); the default holds nothing."""
        return contextlib.nullcontext()

    def read_while_starting(self, what: str, read: Callable[[], T]) -> T:
        """The driver's own heavy work `read` (`what`), under driver_work; an executor
        that starts something of its own may start it meanwhile."""
        with self.driver_work(what):
            return read()


def _trial_task(request: dict) -> dict:
    import ray

    outcome = run_trial(TrialRequest.from_dict(request))
    outcome.launch.node = ray.get_runtime_context().get_node_id()
    return outcome.to_dict()


def _address_task() -> tuple[str, int]:
    """On the node of a multi-node trial's rank 0: where the ranks meet."""
    import ray

    from autotune.trials.launch import _free_port

    return ray.util.get_node_ip_address(), _free_port()


def _node_task(request: dict, node_rank: int, master: tuple[str, int]) -> dict:
    """One node's ranks of a multi-node trial (launch.run_node), and which node it was."""
    import ray

    from autotune.trials.launch import run_node

    report = run_node(TrialRequest.from_dict(request), node_rank, tuple(master))
    report.node = ray.get_runtime_context().get_node_id()
    return report.to_dict()


@dataclass
class Probe:
    """What a probe task found on a node where trials will run: the Ray node, its cores
    and the device, whole (its bf16 and peak FLOP/s too: the space, the recipe and the
    report are the ones an embedded search on that node would have)."""

    node: str
    cpus: int
    device: DeviceSpec

    def to_dict(self) -> dict[str, Any]:
        return {"node": self.node, "cpus": self.cpus, "device": self.device.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Probe:
        return cls(str(d["node"]), int(d["cpus"]), DeviceSpec.from_dict(d["device"]))


def _probe_task(spans_nodes: bool) -> dict:
    """Runs on a node Ray picked for a trial: the device there as an embedded search reads
    it (local_device), and where a trial's ranks span nodes, the way off the node."""
    import ray

    dev = local_device()
    if spans_nodes and (inter := network_link()):
        dev = dataclasses.replace(dev, links=dev.links | {"inter": inter})
    return Probe(ray.get_runtime_context().get_node_id(), node_cpus(), dev).to_dict()


@dataclass
class _InFlight:
    ticket: int
    request: TrialRequest
    deadline: float
    tries: int = 1
    failures: list[str] = field(default_factory=list)  # infrastructure, before this try
    # A trial whose ranks span nodes: its placement group, its nodes' tasks, their
    # reports, and since when one of them has reported a failure.
    group: Any = None
    nodes: dict[Any, int] = field(default_factory=dict)  # task ref -> node rank
    reports: dict[int, NodeReport] = field(default_factory=dict)
    failing_since: float | None = None


def _holds(node: dict, share: int, on_gpus: bool, cpus: int) -> bool:
    """Whether a Ray node can hold one node's share of a trial: `share` GPUs, or on a
    cluster of CPUs `cpus` cores."""
    res = node["Resources"]
    return int(res.get("GPU", 0)) >= share if on_gpus else res.get("CPU", 0) >= cpus


# After one node of a multi-node trial reports a failure, the others' reports are awaited
# this long (their ranks fail within seconds of a peer's, and the root cause among them
# names the trial's: a rank's OOM over its peers' broken collectives), then cancelled.
NODE_FAILURE_GRACE_S = 10.0


class RayExecutor(Executor):
    """Each trial a Ray task with `gpus_per_trial` GPUs (none on CPU) and its node's cores
    shared among the trials that node runs at once.

    Call `discover()` first: it connects (an embedded Ray of this search's own, or the
    cluster at `address`) and finds the device where trials will run, never on the driver
    (which may have no GPU at all)."""

    def __init__(self, spec: Spec, *, address: str | None = None,
                 timeout_s: float = 600.0) -> None:
        self.spec, self.address, self.timeout_s = spec, address, timeout_s
        self.shape: dict | None = None  # prepare() sets them once the search knows them
        self.budget: int | None = None
        self.device: DeviceSpec | None = None
        self.probe_node: str | None = None  # the Ray node the device was read on
        self.capacity, self.threads = 1, node_cpus()
        self.per_node = 1  # trials one node runs at once
        self.nodes = 1  # nodes one trial's ranks span
        self._owns_ray = False
        self._sigterm: Any = None  # the caller's SIGTERM handler, which ray.init replaces
        self._ray_sigterm: Any = None  # ray.init's
        self._reaper: subprocess.Popen | None = None
        self._remote: Any = None
        self._refs: dict[Any, _InFlight] = {}
        self._next = 0

    def use_spec(self, spec: Spec) -> None:
        self.spec = spec

    def prepare(self, shape: dict | None, budget: int | None) -> None:
        """Each request carries them: the worker caps its allocator at the budget and
        skips reading the model's shape again."""
        self.shape, self.budget = shape, budget

    def driver_work(self, what: str) -> contextlib.AbstractContextManager:
        """Every core for the driver's own heavy work (`what`) in an embedded search on a
        machine without a GPU, so it waits for another search's CPU trial being timed:
        reading the model imports transformers and torch (2-4 CPU-seconds), which beside a
        trial of another search made its first run 40% slower."""
        on_gpus = self.device.is_cuda if self.device is not None else nvidia_driver_present()
        if self.address is not None or on_gpus:
            return contextlib.nullcontext()
        return driver_work(f"autotune search (pid {os.getpid()}) {what}",
                           timeout_s=self.timeout_s)

    def read_while_starting(self, what: str, read: Callable[[], T]) -> T:
        """`read` in a thread while the embedded Ray starts in this one: the read is this
        process's CPU (imports, the model's config), Ray's start its own processes', so
        together they take about what the longer takes (3-4 s of each search's fixed
        cost on 2 CPU cores). One lease of every core holds both on a CPU machine. A
        cluster's Ray, or one already up, is not started here. What the read raises (the
        spec's own error) comes first, then what the start raised."""
        if self.address is not None or self._remote is not None:
            return super().read_while_starting(what, read)
        got: dict[str, Any] = {}

        def reading() -> None:
            try:
                got["value"] = read()
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                got["error"] = exc

        with self.driver_work(f"{what} (Ray starting beside it)"):
            thread = threading.Thread(target=reading, name="autotune-read", daemon=True)
            thread.start()
            try:
                if self.device is None:
                    self.discover()
                self._init(leased=True)
            except BaseException:
                thread.join()
                if "error" in got:
                    raise got["error"] from None
                raise
            thread.join()
        if "error" in got:
            raise got["error"]
        return got["value"]

    # --- connecting ---------------------------------------------------------------------
    def _init(self, leased: bool = False) -> None:
        """Connect (`leased`: the caller holds the driver's lease already)."""
        if self.address is not None:
            # Ray's C++ client logs each failed attempt to stderr for its whole retry
            # period; the one line ClusterError gives says what went wrong.
            os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
            # A client sends its token only in token mode, read when ray is imported.
            if _have_token():
                os.environ.setdefault("RAY_AUTH_MODE", "token")
        import ray

        self._remote = ray.remote(max_retries=0)(_trial_task)
        if ray.is_initialized():
            return
        init: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False,
                                "logging_level": logging.WARNING}
        if self.address is None:  # embedded: this search's own Ray, never another's
            device = self.device or local_device()
            gpus = device.count if device.is_cuda else 0
            init |= {"address": "local", "num_cpus": node_cpus(), "num_gpus": gpus,
                     # Each trial's own budget watch ends a trial that grows too large;
                     # Ray's monitor would kill trials for what others on the host use.
                     "_system_config": {"memory_monitor_refresh_ms": 0}}
            # Ray turns token authentication on for a new local cluster and says so at
            # every start; that is the default we want, so the notice is not shown.
            logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
        else:
            init["address"] = self.address
            unreachable = _unreachable(self.address)
            if unreachable:  # Ray would retry it for minutes, saying little
                raise ClusterError(f"--address {self.address}: nothing answers at "
                                   f"{unreachable}; is `ray start --head` running there, "
                                   "and is the address host:port or ray://host:port?")
        # ray.init sets a SIGTERM handler of its own (one that exits) and leaves it past its
        # shutdown: a program that searches in-process (the Python API, a test suite) keeps
        # its own, and one with the default gets it back when the search's Ray closes.
        caller = (signal.getsignal(signal.SIGTERM)
                  if threading.current_thread() is threading.main_thread() else None)
        try:
            self._connect(init, leased)
        except BaseException:
            if caller is not None:
                signal.signal(signal.SIGTERM, caller)
            raise
        if caller is not None:
            self._sigterm, self._ray_sigterm = caller, signal.getsignal(signal.SIGTERM)
            if callable(caller):
                signal.signal(signal.SIGTERM, caller)
        self._owns_ray = True
        if self.address is None:
            self._reaper = reaper.start(os.getpid())

    def _connect(self, init: dict[str, Any], leased: bool) -> None:
        """ray.init, once more where a cluster's head could not start this client's server;
        any other failure is one ClusterError."""
        import ray

        for attempt in range(1, CLIENT_INIT_ATTEMPTS + 1):
            try:
                # Starting an embedded Ray on a CPU machine would slow another search's
                # trial being timed on the same cores; GPU trials are timed on their GPUs.
                with (contextlib.nullcontext() if leased
                      else self.driver_work("starting Ray")):
                    ray.init(**init)
                break
            except Exception as exc:  # noqa: BLE001 - every way of not connecting, one line
                if attempt < CLIENT_INIT_ATTEMPTS and _client_server_failed(exc):
                    # The head's proxy starts one server process per Ray Client; on a
                    # busy head that start can miss the proxy's wait. The cluster is
                    # there, so the connection is tried again, not written off.
                    log.warning("Ray Client: the head could not start this client's "
                                "server (%s); trying again (%d/%d)", _reason(exc), attempt,
                                CLIENT_INIT_ATTEMPTS)
                    with contextlib.suppress(Exception):
                        ray.shutdown()  # a failed client connect stays in client mode
                    time.sleep(2 * attempt)
                    continue
                if self.address is not None:
                    with contextlib.suppress(Exception):
                        ray.shutdown()
                raise ClusterError(_connection_error(self.address, exc, attempt)) from None

    def discover(self) -> DeviceSpec:
        """The device, the slots and the cores per trial: of this machine for an embedded
        Ray (started at the first trial, so a search with nothing to run never pays for
        it); for a cluster, connect and ask a node where trials will run."""
        gpus = self.spec.world_size
        if self.address is None:
            if self.device is not None:  # found once already (Ray started beside the read)
                return self.device
            if (self.spec.hardware.nodes_per_trial or 1) > 1:
                raise ClusterError(f"hardware.nodes_per_trial: "
                                   f"{self.spec.hardware.nodes_per_trial} nodes need a Ray "
                                   "cluster: start one and give its address (--address)")
            self.device = local_device()
            self.per_node = per_node = self._slots(self.device, node_cpus())
            self.capacity, self.threads = per_node, max(1, node_cpus() // per_node)
            return self.device
        self._init()
        self.nodes = self._nodes_per_trial()
        probe = self._probe(gpus // self.nodes)
        self.probe_node, self.device = probe.node, probe.device
        # The cores Ray gives the node, which its start may have set below what the
        # machine has (several nodes on one host, or cores kept for other work).
        cpus = self._node_cpus(probe.node) or probe.cpus
        if self.nodes > 1:  # one trial's share on each of its nodes, a trial at a time
            self.per_node, self.threads = 1, cpus
            self.capacity = max(1, self._spread_slots() // self.nodes)
            self.device = dataclasses.replace(self.device, count=self.spec.world_size,
                                              nodes=self.nodes)
            return self.device
        self.per_node = per_node = self._slots(self.device, cpus)
        self.threads = max(1, cpus // per_node)
        self.capacity = self._cluster_slots(per_node)
        return self.device

    def _nodes_per_trial(self) -> int:
        """The nodes a trial's ranks span: as said (hardware.nodes_per_trial), or the
        fewest whose equal shares fit the nodes' GPUs (on a cluster of CPUs, a core per
        rank); a request the cluster's nodes cannot hold fails here, naming what is
        missing."""
        import ray

        world = self.spec.world_size
        alive = [n for n in ray.nodes() if n.get("Alive")]
        said = self.spec.hardware.nodes_per_trial
        on_gpus = ray.cluster_resources().get("GPU", 0) > 0
        # What one node can hold: its GPUs, or on a cluster of CPUs a rank per core.
        held = sorted((int(n["Resources"].get("GPU" if on_gpus else "CPU", 0))
                       for n in alive), reverse=True)
        if said is None:
            if not held or held[0] >= world:
                return 1
            said = next((k for k in range(2, world + 1) if world % k == 0
                         and k <= len(held) and held[k - 1] >= world // k), None)
            if said is None:
                kind = "GPUs" if on_gpus else "ranks (a core each)"
                raise ClusterError(
                    f"hardware.gpus_per_trial: a trial needs {world} {kind}, and the "
                    f"cluster's nodes have {', '.join(map(str, held)) or 'none'}: no split "
                    "of its ranks into equal shares fits them")
        share = world // said
        fit = [n for n in alive if _holds(n, share, on_gpus, cpus=1)]
        if len(fit) < said:
            kind = f"{share} GPUs" if on_gpus else "a CPU"
            raise ClusterError(f"hardware.nodes_per_trial: a trial spans {said} nodes with "
                               f"{kind} each for its {share} ranks there, and the cluster has "
                               f"{len(fit)} such node{'s' * (len(fit) != 1)}")
        return said

    def _spread_slots(self) -> int:
        """Nodes that can hold one node's share of a multi-node trial."""
        import ray

        share = self.spec.world_size // self.nodes
        on_gpus = self.device is not None and self.device.is_cuda
        return sum(1 for n in ray.nodes() if n.get("Alive")
                   and _holds(n, share, on_gpus, cpus=self.threads))

    def _slots(self, device: DeviceSpec, cpus: int) -> int:
        """Trials one node runs at once: its GPUs / gpus_per_trial, never two on one GPU;
        on CPU hardware.parallel_trials (1 unless set)."""
        wanted = self.spec.hardware.parallel_trials
        if device.is_cuda:
            slots = max(1, device.count // self.spec.world_size)
            return min(slots, wanted) if wanted else slots
        return max(1, min(wanted or 1, cpus))

    @staticmethod
    def _node_cpus(node_id: str) -> int:
        import ray

        for n in ray.nodes():
            if n.get("NodeID") == node_id:
                return int(n["Resources"].get("CPU", 0))
        return 0

    def _cluster_slots(self, per_node: int) -> int:
        import ray

        alive = [n for n in ray.nodes() if n.get("Alive")]
        if self.device is not None and self.device.is_cuda:
            return max(1, sum(int(n["Resources"].get("GPU", 0)) // self.spec.world_size
                              for n in alive))
        return max(1, per_node * sum(1 for n in alive
                                     if n["Resources"].get("CPU", 0) >= self.threads))

    def _probe(self, gpus: int) -> Probe:
        """The device of a node that can run a trial, found by a task placed as a trial's."""
        import ray

        # A cluster with GPUs runs trials on GPUs; one without runs them on CPUs.
        if ray.cluster_resources().get("GPU", 0) == 0:
            gpus = 0
        best = max((n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")),
                   default=0)
        if best < gpus:
            raise ClusterError(
                f"hardware.gpus_per_trial: a trial needs {gpus} GPUs on one node, and no "
                f"node of the cluster at {self.address} has more than {best:g}")
        ref = ray.remote(_probe_task).options(num_cpus=1, num_gpus=gpus).remote(
            self.nodes > 1)
        ready, _ = ray.wait([ref], timeout=PROBE_TIMEOUT_S)
        if not ready:
            ray.cancel(ref, force=True)
            raise ClusterError(f"no node of the cluster at {self.address} took a probe task "
                               f"needing {gpus} GPU(s) and 1 CPU in {PROBE_TIMEOUT_S:.0f} s "
                               f"(free now: {ray.available_resources()})")
        return Probe.from_dict(ray.get(ref))

    # --- running ------------------------------------------------------------------------
    def _launch(self, flight: _InFlight) -> None:
        # A trial may first wait up to its own limit for devices another search holds, and
        # a compiled one compile for its allowance beyond the limit.
        flight.deadline = (time.time() + 2 * self.timeout_s
                           + flight.request.compile_allowance_s() + GRACE_S)
        if self.nodes > 1:
            self._launch_spread(flight)
            return
        gpus = self.spec.world_size if self.device and self.device.is_cuda else 0
        task = self._remote.options(num_cpus=self.threads, num_gpus=gpus)
        self._refs[task.remote(flight.request.to_dict())] = flight

    def _launch_spread(self, flight: _InFlight) -> None:
        """A trial whose ranks span nodes: a placement group of one bundle per node (its
        share of the GPUs and the node's cores), strictly spread; first the address its
        ranks meet at, from rank 0's node, then each node's ranks (`_collect`)."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = (self.spec.world_size // self.nodes) if self.device.is_cuda else 0
        bundle = {"CPU": self.threads} | ({"GPU": gpus} if gpus else {})
        flight.group = placement_group([bundle] * self.nodes, strategy="STRICT_SPREAD")
        flight.nodes, flight.reports, flight.failing_since = {}, {}, None
        at0 = PlacementGroupSchedulingStrategy(flight.group, placement_group_bundle_index=0)
        # Never retried: a retry into a removed group would wait for it for good.
        ref = ray.remote(max_retries=0)(_address_task).options(
            num_cpus=0, scheduling_strategy=at0).remote()
        flight.nodes[ref] = -1  # the address, not a node's ranks
        self._refs[ref] = flight

    def _start_nodes(self, flight: _InFlight, master: tuple[str, int]) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        gpus = (self.spec.world_size // self.nodes) if self.device.is_cuda else 0
        task = ray.remote(max_retries=0)(_node_task)
        for k in range(self.nodes):
            at = PlacementGroupSchedulingStrategy(flight.group, placement_group_bundle_index=k)
            ref = task.options(num_cpus=self.threads, num_gpus=gpus,
                               scheduling_strategy=at).remote(flight.request.to_dict(), k, master)
            flight.nodes[ref] = k
            self._refs[ref] = flight

    def _end(self, flight: _InFlight) -> None:
        """End what of a trial still runs (its ranks die with their tasks), however the
        trial ended. Where it spans nodes, removing its placement group kills its tasks on
        every node: no `ray.cancel`, which aborts Ray 2.60's driver when the task it
        cancels is completing (a node's report arriving just then, say)."""
        import ray

        refs = [r for r, f in self._refs.items() if f is flight]
        for ref in refs:
            del self._refs[ref]
        if flight.group is not None:
            for ref in refs:  # read when killed: else Ray logs each as an "Unhandled error"
                ref.future().add_done_callback(lambda done: done.exception())
            try:
                ray.util.remove_placement_group(flight.group)
            except Exception as exc:  # noqa: BLE001 - its tasks then run to their own limit
                log.warning("trial %s: its placement group was not removed (%s); its ranks "
                            "end at their own time limit", flight.ticket, exc)
            flight.group = None
            return
        for ref in refs:  # one node's trial past its deadline: hung, or still queued (the
            ray.cancel(ref, force=True)  # race above is possible then, rarely)

    def _collect(self, ref: Any, flight: _InFlight,
                 done: list[tuple[int, Outcome]]) -> None:
        """A multi-node trial's task ended: the address (start the nodes), or a node's
        report (merge once all are in, or soon after one failed)."""
        import ray


        node_rank = flight.nodes.pop(ref)
        try:
            value = ray.get(ref)
        except ray.exceptions.RayError as exc:  # a node, or its worker, died under it
            self._end(flight)
            self._infrastructure(flight, f"Ray lost a node of the trial: {exc}", done)
            return
        if node_rank < 0:
            self._start_nodes(flight, value)
            return
        report = NodeReport.from_dict(value)
        if report.lost is not None:  # its devices stayed held by another search
            self._end(flight)
            self._infrastructure(flight, report.lost, done)
            return
        flight.reports[node_rank] = report
        if report.failed and flight.failing_since is None:
            flight.failing_since = time.time()
        if len(flight.reports) == self.nodes:
            self._finish_spread(flight, done)

    def _finish_spread(self, flight: _InFlight, done: list[tuple[int, Outcome]]) -> None:
        from autotune.trials.launch import merge_nodes

        self._end(flight)
        reports = [flight.reports[k] for k in sorted(flight.reports)]
        outcome = merge_nodes(flight.request, reports)
        outcome.launch.rank_nodes = {r.node_rank: r.node for r in reports}
        if flight.failures:
            outcome.launch.infrastructure_failures = flight.failures
        done.append((flight.ticket, outcome))

    def submit(self, config: TrialConfig, *, training_args: dict | None = None,
               steps: int | None = None) -> int:
        if self.device is None:
            self.discover()
        if self._remote is None:
            self._init()
        device = self.device
        request = make_request(self.spec, config, on_cpu=not device.is_cuda, shape=self.shape,
                               memory_budget_bytes=self.budget, timeout_s=self.timeout_s,
                               cpu_threads=self.threads, steps=steps,
                               node_trials=self.per_node, nodes=self.nodes)
        if training_args is not None:
            request.training_args = training_args
        ticket, self._next = self._next, self._next + 1
        self._launch(_InFlight(ticket, request, 0.0))
        return ticket

    def wait(self, timeout: float | None = None) -> list[tuple[int, Outcome]]:
        import ray

        if not self._refs:
            return []
        try:
            ready, _ = ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        except KeyboardInterrupt:
            # The trials in flight are not cancelled one by one: Ray 2.60's driver aborts
            # (a failed check, "Tried to complete task that was not pending") when a task
            # is cancelled as its worker takes it, which a Ctrl-C just after a trial was
            # submitted hit once in six. close() ends them with this search's Ray.
            for flight in {id(f): f for f in self._refs.values()}.values():
                if flight.group is not None:
                    with contextlib.suppress(Exception):
                        ray.util.remove_placement_group(flight.group)
            raise
        done: list[tuple[int, Outcome]] = []
        for ref in ready:
            flight = self._refs.pop(ref, None)
            if flight is None:  # cancelled with its trial
                continue
            if flight.group is not None:
                self._collect(ref, flight, done)
                continue
            try:
                outcome = Outcome.from_dict(ray.get(ref))
            except ray.exceptions.RayError as exc:  # the worker or its node died under it
                self._infrastructure(flight, f"Ray lost the trial's worker: {exc}", done)
                continue
            if outcome.status == LOST:  # devices stayed busy, or the host's memory ran out
                self._infrastructure(flight, outcome.error or "lost", done)
                continue
            if flight.failures:  # recorded as what they were, beside the config's figure
                outcome.launch.infrastructure_failures = flight.failures
            done.append((flight.ticket, outcome))
        now = time.time()
        for flight in {id(f): f for f in self._refs.values()}.values():
            if flight.group is not None and flight.failing_since is not None and (
                    now > flight.failing_since + NODE_FAILURE_GRACE_S):
                self._finish_spread(flight, done)  # the nodes that did not report, cancelled
        for ref, flight in list(self._refs.items()):
            if ref in self._refs and now > flight.deadline:  # bounded, not forever
                self._end(flight)
                self._infrastructure(flight, "no answer from the cluster within the trial "
                                     f"limit plus {GRACE_S:.0f} s", done)
        return done

    def _infrastructure(self, flight: _InFlight, why: str,
                        done: list[tuple[int, Outcome]]) -> None:
        flight.failures.append(why.splitlines()[0][:300])
        if flight.tries <= RETRIES:
            log.warning("trial %s: %s; running it again", flight.ticket, why.splitlines()[0])
            flight.tries += 1
            self._launch(flight)
            return
        done.append((flight.ticket, Outcome(LOST, error=f"{why} (tried {flight.tries} times; "
                                            "an infrastructure failure, not the config's)"[
                                                -3000:])))

    def close(self) -> None:
        """End this search's Ray, and with it any trial still in flight (an interrupted
        search's): what of an embedded Ray's process trees outlives its shutdown is
        killed here, before close returns; a cluster's workers end with the driver's job."""
        if not self._owns_ray and self._reaper is None:
            return  # never started (a spec error before the first trial): nothing to end
        import ray

        trees: dict[int, float] = {}
        if self._refs and self._reaper is not None:
            reaper.note_ray_trees(psutil.Process(), trees)
        try:
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()
        finally:
            self._restore_sigterm()
        reaper.kill_survivors(trees)
        self._refs.clear()
        if self._reaper is not None:
            self._reaper.terminate()  # Ray closed: nothing to reap

    def _restore_sigterm(self) -> None:
        """The caller's SIGTERM handler again, where ray.init's is still the one set."""
        if (self._sigterm is not None
                and threading.current_thread() is threading.main_thread()):
            if signal.getsignal(signal.SIGTERM) is self._ray_sigterm:
                signal.signal(signal.SIGTERM, self._sigterm)
            self._sigterm = self._ray_sigterm = None


def _client_server_failed(exc: Exception) -> bool:
    """Ray Client's head proxy answered, but could not start the server for this client."""
    return isinstance(exc, ConnectionAbortedError) and "failure from server" in str(exc)


def _reason(exc: Exception) -> str:
    """One line for an exception. Ray Client's init failure carries the head's traceback
    after its first line; its last line is the reason."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if _client_server_failed(exc) and len(lines) > 1:
        return f"{lines[0]} {lines[-1]}"
    return lines[0]


REACH_TIMEOUT_S = 5.0


def _unreachable(address: str) -> str | None:
    """Why nothing can answer at a `host:port` or `ray://host:port` address (a refused or
    timed-out TCP connection, an unknown host), or None where something listens or the
    address is not of that form (`auto`, Ray's own lookup)."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), REACH_TIMEOUT_S):
            return None
    except OSError as exc:
        return f"{host}:{port} ({exc.strerror or type(exc).__name__})"


def _connection_error(address: str | None, exc: Exception, attempts: int = 1) -> str:
    text = _reason(exc)
    if address is None and "InvalidAuthToken" in str(exc):
        # Seen when one Python process joined a cluster with RAY_AUTH_MODE=disabled, then
        # started its own Ray (token authentication, Ray's default) with the variable gone.
        return ("could not start an embedded Ray: its GCS refused this process's token. "
                "Ray reads RAY_AUTH_MODE once per process: run the search in a new process, "
                "or keep RAY_AUTH_MODE as it was when this process first used Ray")
    if "auth" in text.lower() or "token" in text.lower():
        return (f"--address {address}: the Ray cluster refused the connection: it uses token "
                "authentication. Set RAY_AUTH_TOKEN to the cluster's token, or put it in "
                "~/.ray/auth_token (on the head node: `ray get-auth-token`)")
    if address is None:
        return f"could not start an embedded Ray: {text}"
    if _client_server_failed(exc):
        return (f"--address {address}: the head answered but could not start a Ray Client "
                f"server for this search ({attempts} attempt{'s' * (attempts > 1)}; "
                f"{text}); its "
                "ray_client_server*.err logs on the head node say why")
    hint = ""
    if not _have_token():  # a refused token shows only in Ray's log, not in the exception
        hint = ("; if it uses token authentication (Ray's default for clusters it starts), "
                "set RAY_AUTH_TOKEN to the cluster's token or put it in ~/.ray/auth_token "
                "(on the head node: `ray get-auth-token`)")
    return (f"--address {address}: could not join the Ray cluster ({text}); is `ray start "
            "--head` running there, and is the address host:port or ray://host:port"
            f"{hint}?")


def _have_token() -> bool:
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or any(
        Path(p).expanduser().is_file() for p in (os.environ.get("RAY_AUTH_TOKEN_PATH", ""),
                                                  "~/.ray/auth_token") if p)
