"""Launch one trial in a fresh process and turn whatever happened into an Outcome.

A crash, an OOM kill or a hang must never reach the study: the trial runs in its own
process session, is killed with its children past its time limit, dies with whatever
launched it, and its exit status is classified here. A trial is forked from a warm
launcher that has its imports done (forkserver.py), its ranks too. Cold, it starts as a
new interpreter (torchrun for ranks), as it does when the warm launcher cannot start and
for every trial under AUTOTUNE_COLD_TRIALS=1.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from autotune.config import TrialConfig
from autotune.records import CRASHED, ERROR, LOST, NAN, OOM, TIMEOUT, Outcome
from autotune.trials import compile_clock, forkserver
from autotune.trials.lease import LeaseTimeout, lease, trial_want
from autotune.trials.oom import is_oom_message, is_oom_signal
from autotune.trials.protocol import (
    SPAWNED_AT,
    TrialRequest,
    rank_result_path,
    read_result,
    rss_path,
)
from autotune.trials.reaper import die_with_parent

STDERR_TAIL_CHARS = 3000
# A trial SIGKILLed below this share of its host memory (a CPU trial's budget, a GPU
# trial's share of the host's RAM) was killed for the host's sake.
HOST_PRESSURE_FRACTION = 0.8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(request_path: Path, result_path: Path, world_size: int,
             master_port: str, node: tuple[int, int, str] | None = None) -> list[str]:
    """The cold command: the worker, or torchrun for ranks; `node`: (node rank, nodes,
    rank 0's node's address) of a trial whose ranks span nodes."""
    worker = ["-m", "autotune.trials.worker", str(request_path), str(result_path)]
    if world_size == 1:
        return [sys.executable, *worker]
    if node is None:
        return [sys.executable, "-m", "torch.distributed.run",
                f"--nproc_per_node={world_size}", f"--master_port={master_port}", *worker]
    node_rank, nodes, master = node
    return [sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={world_size // nodes}", f"--nnodes={nodes}",
            f"--node_rank={node_rank}", f"--master_addr={master}",
            f"--master_port={master_port}", *worker]


def extensions_dir() -> str:
    """Where DeepSpeed's JIT-built ops (CPU Adam, shm comm) go: inside this environment.
    torch's default cache is shared by every venv of the user, and its build flags name
    the venv, so two environments rebuild over each other and a build killed mid-way
    leaves a lock that stalls every later trial."""
    return str(Path(sys.prefix) / "torch_extensions")


def _environment(world_size: int, cpu_threads: int,
                 master: tuple[str, int] | None = None,
                 deepspeed: bool = False) -> dict[str, str]:
    """The trial's environment; `master`: rank 0's node's address and port, where the
    ranks span nodes (`world_size` is then this node's share); `deepspeed`: its config
    runs DeepSpeed's engine, whose process group wants a local rank even alone."""
    env = dict(os.environ)
    # The CPU threads a real run of this config gets: the trial's share of the node's cores,
    # split over its ranks. Set explicitly, because Ray sets OMP_NUM_THREADS to the task's
    # num_cpus and torch would otherwise inherit whatever the launching process had.
    per_rank = str(max(1, cpu_threads // world_size))
    env |= {"OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank}
    # A single process still needs a process group for DeepSpeed; the ranks of several
    # get theirs from torchrun or the warm launcher, which rendezvous at this address.
    host, port = master or ("127.0.0.1", _free_port())
    env |= {"MASTER_ADDR": host, "MASTER_PORT": str(port)}
    if world_size == 1:
        env |= {"RANK": "0", "WORLD_SIZE": "1"}
        # LOCAL_RANK only for DeepSpeed: with it accelerate wraps a lone CPU process in DDP,
        # which a run on one device does not have (at 0.5B, 1.6 s broadcasting every
        # weight to itself at the start, and a bucket copy of the gradients every step).
        env.pop("LOCAL_RANK", None)
        if deepspeed:
            env["LOCAL_RANK"] = "0"
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_within_limit(wait: Callable[[float], int | None], request: TrialRequest,
                       tmpdir: Path) -> int | None:
    """The trial's return code from `wait(seconds)` (None: not ended in them), or None
    once it is past its time limit. A compiled trial's compilation, which its ranks' clocks
    report as it goes, is not counted, up to its allowance (compile_clock.py): the limit
    is the same whether Inductor's cache was cold or warm."""
    begun, allowance = time.time(), request.compile_allowance_s()
    while True:
        compiled = compile_clock.spent(list(tmpdir.glob("result.json*.compile"))) if (
            allowance) else 0.0
        left = compile_clock.deadline(begun, request.timeout_s, allowance, compiled) - (
            time.time())
        if left <= 0:
            return None
        code = wait(left)
        if code is not None:
            return code


def _run_cold(request: TrialRequest, tmpdir: Path, env: dict[str, str],
              node_rank: int = 0) -> tuple[int, bool]:
    """(return code, timed out) of the trial as a new interpreter (torchrun for ranks)."""
    node = (node_rank, request.nodes, env["MASTER_ADDR"]) if request.nodes > 1 else None
    with (tmpdir / "stderr.log").open("w") as log:
        proc = subprocess.Popen(
            _command(tmpdir / "request.json", tmpdir / "result.json", request.world_size,
                     env["MASTER_PORT"], node),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=tmpdir,
            preexec_fn=die_with_parent)
        def waited(seconds: float) -> int | None:
            try:
                return proc.wait(timeout=seconds)
            except subprocess.TimeoutExpired:
                return None

        try:
            timed_out = _wait_within_limit(waited, request, tmpdir) is None
        except BaseException:  # Ctrl-C in the driver: take the trial down with us
            _kill_group(proc)
            raise
        finally:
            if proc.poll() is None:
                _kill_group(proc)
    return proc.returncode, timed_out


def _run_warm(request: TrialRequest, tmpdir: Path, env: dict[str, str],
              node_rank: int = 0) -> tuple[int, bool, float]:
    """(return code, timed out, seconds the warm launcher took to start where this trial
    started it) of the trial forked from this process's warm launcher (of this node's
    ranks, where they span nodes)."""
    from autotune.tasks import trainer

    model = {forkserver.PRELOAD_MODEL: json.dumps(request.spec.get("model") or {}),
             forkserver.PRELOAD_MODULES: ",".join(trainer(request.spec.get("trainer")).preload),
             forkserver.PROBE_DEVICES: str(request.world_size // request.nodes)}
    with forkserver.borrowed(dict(os.environ) | model) as server:
        started_it = server.take_start()
        pid = server.start({"request": str(tmpdir / "request.json"),
                            "result": str(tmpdir / "result.json"),
                            "log": str(tmpdir / "stderr.log"), "cwd": str(tmpdir),
                            "env": env, "world_size": request.world_size,
                            "local_world": request.world_size // request.nodes,
                            "node_rank": node_rank})
        try:
            code = _wait_within_limit(lambda seconds: server.wait(pid, seconds), request,
                                      tmpdir)
            if code is not None:
                return code, False, started_it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)  # its own session: the trial and its children
            code = server.wait(pid, None)
            return (code if code is not None else -signal.SIGKILL), True, started_it
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            raise


def run_trial(request: TrialRequest) -> Outcome:
    """Run the request's config as a short real training run in a new process, holding
    its devices against other searches on the machine (lease.py) while it runs; never
    raises for a trial that failed. Devices that stay busy past the trial's own time
    limit make it `lost`: the machine's failure, not the config's."""
    want = trial_want(request.on_cpu, request.cpu_threads, request.world_size)
    label = (f"autotune trial {TrialConfig.from_dict(request.config).label()} "
             f"(pid {os.getpid()})")
    try:
        with lease(want, timeout_s=request.timeout_s, label=label) as waited:
            outcome = _run_trial(request)
    except LeaseTimeout as exc:
        return Outcome(LOST, error=str(exc))
    outcome.launch.lease_wait_s = round(waited, 3)
    return outcome


TRIAL_DIR_PREFIX = "autotune-trial-"
# A trial folder is swept only this long after it and everything in it last changed, and
# only where the process named in it is gone: a trial in another PID namespace that
# shares /tmp writes its folder as it starts and its log as it trains.
ORPHAN_AFTER_S = 3600
# Folders of versions that named no PID (tempfile's 8 random characters): their launcher
# cannot be asked, so only a day's quiet says they are left over.
LEGACY_NAME = re.compile(r"[a-z0-9_]{8}")
LEGACY_AFTER_S = 24 * 3600


def sweep_orphans(root: Path | None = None, now: float | None = None) -> list[Path]:
    """Remove the trial folders of launchers that died without cleaning up (SIGKILL gives
    `TemporaryDirectory` no chance): each is named after its launcher's PID, and goes once
    that process is gone and the folder has been quiet an hour (those of earlier versions,
    named without a PID, after a day). Another search's folders, whose launcher lives, are
    never touched; nothing here fails a trial."""
    root = Path(root or tempfile.gettempdir())
    now = time.time() if now is None else now
    removed = []
    for folder in root.glob(f"{TRIAL_DIR_PREFIX}*"):
        name = folder.name[len(TRIAL_DIR_PREFIX):]
        pid = re.fullmatch(r"(\d{1,9})-.*", name)
        quiet = ORPHAN_AFTER_S if pid else LEGACY_AFTER_S
        try:
            st = folder.lstat()
            if (not (pid or LEGACY_NAME.fullmatch(name)) or not stat.S_ISDIR(st.st_mode)
                    or st.st_uid != os.getuid()
                    or (pid and psutil.pid_exists(int(pid.group(1))))):
                continue
            newest = max((p.lstat().st_mtime for p in folder.rglob("*")), default=0.0)
            if now - max(newest, st.st_mtime) < quiet:
                continue
            shutil.rmtree(folder, ignore_errors=True)
        except Exception:  # noqa: BLE001, S112 - housekeeping: a folder left is no failure
            continue
        if not folder.exists():
            removed.append(folder)
    return removed


@functools.cache
def _sweep_once() -> None:
    """`sweep_orphans` once per launching process: not before every trial."""
    sweep_orphans()


@dataclass
class _Ran:
    """What one launch of a trial's ranks (all of them, or one node's) left behind."""
    code: int
    timed_out: bool
    log_tail: str
    ranks: dict[int, Outcome]
    warm: bool
    cold_because: str | None
    compiled_s: float = 0.0  # the most seconds a rank spent compiling (compile_clock.py)
    launcher_s: float = 0.0  # starting the warm launcher, where this trial started it


def _spawning(env: dict[str, str]) -> dict[str, str]:
    """`env` stamped with the moment the trial's process is started, from which the worker
    counts its `launch` phase (interpreter or fork, imports)."""
    return env | {SPAWNED_AT: repr(time.time())}


def _launch_ranks(request: TrialRequest, tmpdir: Path, env: dict[str, str],
                  node_rank: int = 0) -> _Ran:
    """Start the ranks (this node's, where they span nodes) from the warm launcher, cold
    where it cannot start or fork, wait, and read what they wrote into `tmpdir`."""
    (tmpdir / "request.json").write_text(request.to_json())
    warm = os.environ.get("AUTOTUNE_COLD_TRIALS") != "1"
    cold_because, launcher_s = None, 0.0
    try:
        if warm:
            code, timed_out, launcher_s = _run_warm(request, tmpdir, _spawning(env),
                                                    node_rank)
        else:
            code, timed_out = _run_cold(request, tmpdir, _spawning(env), node_rank)
    except RuntimeError as exc:  # the warm launcher could not start or fork: go cold
        warm, cold_because = False, str(exc)[:200]
        # Refused, it is not started again for this process's trials: this one paid its
        # start alone. (One that did not start is tried, and paid, by every trial.)
        launcher_s = getattr(exc, "start_seconds", 0.0)
        code, timed_out = _run_cold(request, tmpdir, _spawning(env), node_rank)
    log_path = tmpdir / "stderr.log"
    log_tail = log_path.read_text(errors="replace")[-STDERR_TAIL_CHARS:] if (
        log_path.is_file()) else ""
    if not warm and request.world_size > 1 and code > 0:
        code = _torchrun_root_cause(log_tail) or code
    ranks = _rank_results(tmpdir / "result.json", request.world_size)
    compiled = compile_clock.spent(list(tmpdir.glob("result.json*.compile")))
    return _Ran(code, timed_out, log_tail, ranks, warm, cold_because, compiled, launcher_s)


def _run_trial(request: TrialRequest) -> Outcome:
    started = time.time()
    host_share = _host_share(request)
    _sweep_once()
    with tempfile.TemporaryDirectory(prefix=f"{TRIAL_DIR_PREFIX}{os.getpid()}-") as tmp:
        tmpdir = Path(tmp)
        ran = _launch_ranks(request, tmpdir, _environment(
            request.world_size, request.cpu_threads,
            deepspeed=bool(request.config.get("zero_stage"))))
        code, ranks = ran.code, ran.ranks
        if code < 0 and not ran.timed_out and len(ranks) < request.world_size:
            # A rank killed by a signal failed first: the others' errors (a collective
            # torn down under them) follow from it and say nothing of the config.
            ranks = {}
        outcome = _classify(code, ran.timed_out, ranks, ran.log_tail, request.timeout_s,
                            request.world_size, _not_counted(request, ran.compiled_s))
        if outcome.status == OOM and is_oom_signal(code) and not ranks:
            outcome = _host_pressure(outcome, _rss_growth(tmpdir / "result.json",
                                                          request.world_size),
                                     host_share, on_gpu=not request.on_cpu)
    outcome.wall_seconds = time.time() - started
    launched = outcome.launch
    launched.kind = "warm" if ran.warm else "cold"
    launched.time_limit_s = request.timeout_s
    launched.compile_allowance_s = request.compile_allowance_s()
    launched.compile_not_counted_s = round(_not_counted(request, ran.compiled_s), 3)
    if ran.cold_because:
        launched.cold_because = ran.cold_because
    if ran.launcher_s:
        launched.launcher_start_s = round(ran.launcher_s, 3)
    return outcome


@dataclass
class NodeReport:
    """One node's share of a trial whose ranks span nodes, as its Ray task sends it to the
    driver: what its ranks reported, their exit status and the log's tail; or, `lost`,
    why they never ran (the node's devices stayed held by another search)."""

    node_rank: int
    code: int = 0
    timed_out: bool = False
    ranks: dict[int, Outcome] = field(default_factory=dict)
    log_tail: str = ""
    launch: str = "cold"  # through the node's warm launcher, or cold
    lost: str | None = None
    node: str | None = None  # the Ray node it ran on, set by its task

    @property
    def failed(self) -> bool:
        return self.code != 0 or any(not o.ok for o in self.ranks.values())

    def to_dict(self) -> dict[str, Any]:
        return {"node_rank": self.node_rank, "code": self.code, "timed_out": self.timed_out,
                "ranks": {r: o.to_dict() for r, o in self.ranks.items()},
                "log_tail": self.log_tail, "launch": self.launch, "lost": self.lost,
                "node": self.node}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeReport:
        return cls(int(d["node_rank"]), int(d.get("code", 0)), bool(d.get("timed_out")),
                   {int(r): Outcome.from_dict(o) for r, o in (d.get("ranks") or {}).items()},
                   str(d.get("log_tail") or ""), str(d.get("launch") or "cold"),
                   d.get("lost"), d.get("node"))


def run_node(request: TrialRequest, node_rank: int, master: tuple[str, int]) -> NodeReport:
    """One node's ranks of a trial whose ranks span nodes (the Ray task on that node runs
    this), holding this node's share of the devices, for the driver to merge with the
    other nodes' reports (merge_nodes)."""
    local = request.world_size // request.nodes
    want = trial_want(request.on_cpu, request.cpu_threads, local)
    label = (f"autotune trial {TrialConfig.from_dict(request.config).label()} node "
             f"{node_rank} (pid {os.getpid()})")
    try:
        with lease(want, timeout_s=request.timeout_s, label=label):
            return _run_node(request, node_rank, master)
    except LeaseTimeout as exc:
        return NodeReport(node_rank, lost=str(exc))


def _run_node(request: TrialRequest, node_rank: int, master: tuple[str, int]) -> NodeReport:
    _sweep_once()
    local = request.world_size // request.nodes
    with tempfile.TemporaryDirectory(prefix=f"{TRIAL_DIR_PREFIX}{os.getpid()}-") as tmp:
        ran = _launch_ranks(request, Path(tmp),
                            _environment(local, request.cpu_threads, master), node_rank)
    return NodeReport(node_rank, ran.code, ran.timed_out, ran.ranks, ran.log_tail,
                      "warm" if ran.warm else "cold")


def merge_nodes(request: TrialRequest, nodes: list[NodeReport]) -> Outcome:
    """The trial's outcome from its nodes' reports: every rank's outcome merged as one
    node's are (a failure on any rank is the trial's), a node whose rank was killed by a
    signal before it reported naming the trial's, the logs' tails side by side."""
    ranks = {r: o for n in nodes for r, o in n.ranks.items()}
    codes = [n.code for n in nodes]
    code = next((c for c in codes if c < 0), next((c for c in codes if c), 0))
    timed_out = any(n.timed_out for n in nodes)
    tail = "\n".join(f"[node {n.node_rank}] {n.log_tail[-STDERR_TAIL_CHARS // 2:]}"
                     for n in nodes if n.log_tail)
    if code < 0 and not timed_out and len(ranks) < request.world_size:
        ranks = {}  # a rank killed first: the others' errors follow from it
    outcome = _classify(code, timed_out, ranks, tail, request.timeout_s, request.world_size)
    outcome.launch.kind = ",".join(sorted({n.launch for n in nodes}))
    outcome.launch.nodes = len(nodes)
    return outcome


def _torchrun_root_cause(log_tail: str) -> int | None:
    """The signal that killed the rank torchrun names as the root cause, as a negative
    return code (torchrun itself exits 1): a rank the kernel killed is judged as a killed
    trial, as the warm launcher reports it."""
    found = re.search(r"Root Cause.*?exitcode\s*:\s*(-\d+)", log_tail, re.DOTALL)
    return int(found.group(1)) if found else None


def _host_share(request: TrialRequest) -> int | None:
    """The host memory each rank of a trial may count on. A CPU trial's is its budget (per
    rank). A GPU trial's is the RAM available as it starts, shared among the ranks of the
    trials its node runs at once: under that it cannot have run the host out of memory on
    its own."""
    if request.on_cpu:
        return request.memory_budget_bytes
    import psutil

    ranks = max(1, request.node_trials) * max(1, request.world_size)
    return psutil.virtual_memory().available // ranks


def _rss_growth(result_path: Path, world_size: int) -> int | None:
    """The largest RSS growth the ranks' host watches last wrote."""
    seen = []
    for r in range(world_size):
        with contextlib.suppress(OSError, ValueError):
            seen.append(int(Path(rss_path(rank_result_path(result_path, r,
                                                            world_size))).read_text()))
    return max(seen) if seen else None


def _host_pressure(outcome: Outcome, grown: int | None, share: int | None, *,
                   on_gpu: bool = False) -> Outcome:
    """A SIGKILL is the kernel's OOM killer's, but it kills for the whole host (and Ray
    marks its workers, whose children trials are, to go first): a trial killed while it
    held well under its share of the host was killed for what others used (another
    search, a benchmark, a browser), which says nothing of the config. That is `lost`
    (run again), not an OOM the memory model would learn from. A GPU trial killed at its
    share stays an OOM, of host memory (offloaded states), which says nothing of the GPU's."""
    kind = "budget" if not on_gpu else "share of the host's RAM"
    if grown is None or not share or grown >= HOST_PRESSURE_FRACTION * share:
        if on_gpu:
            outcome.failure.host_memory = True
            said = (f"host memory ran out (SIGKILL) while the trial held {grown / 2**30:.2f}"
                    f" GiB of its {share / 2**30:.2f} GiB {kind}" if grown is not None and share
                    else "killed by SIGKILL, the host's OOM killer's signal: host memory")
            outcome.error = f"{said}\n{(outcome.error or '')[-STDERR_TAIL_CHARS:]}"
        return outcome
    return Outcome(LOST, error=(
        f"killed by SIGKILL while it held {grown / 2**30:.2f} GiB of its "
        f"{share / 2**30:.2f} GiB {kind}: the host ran out of memory for other processes' "
        f"use, not the config's\n{(outcome.error or '')[-STDERR_TAIL_CHARS:]}"))


def _rank_results(result_path: Path, world_size: int) -> dict[int, Outcome]:
    return {r: read_result(f) for r in range(world_size)
            if (f := Path(rank_result_path(result_path, r, world_size))).is_file()}


# Which rank's failure names the trial's: running out of memory is the cause the others'
# errors (a collective torn down, a rank killed by torchrun) follow from.
_FAILURE_ORDER = (OOM, NAN, ERROR)


def merge_ranks(ranks: dict[int, Outcome], world_size: int) -> Outcome | None:
    """One outcome for the trial from its ranks' own: a failure on any rank is the
    trial's (the rank named), peak memory is the maximum over ranks, and throughput is
    rank 0's, which already counts every rank's samples. None when no rank failed and
    one is missing (killed before it could say why): the exit status tells then."""
    if not ranks:
        return None
    peaks = [o.peak_memory_bytes for o in ranks.values() if o.peak_memory_bytes is not None]
    failed = sorted((r, o) for r, o in ranks.items() if not o.ok)
    if failed:
        rank, outcome = min(failed, key=lambda ro: _FAILURE_ORDER.index(ro[1].status)
                            if ro[1].status in _FAILURE_ORDER else len(_FAILURE_ORDER))
        if world_size > 1:
            outcome.error = f"rank {rank}: {outcome.error}"
    elif len(ranks) < world_size:
        return None
    else:
        outcome = ranks[0]
    if world_size > 1:
        outcome.measured.peak_memory_by_rank = {r: o.peak_memory_bytes
                                                for r, o in ranks.items()}
        outcome.measured.micro_batches_by_rank = {r: o.measured.micro_batches
                                                  for r, o in ranks.items()}
    outcome.peak_memory_bytes = max(peaks) if peaks else None
    return outcome


def _not_counted(request: TrialRequest, compiled_s: float) -> float:
    """The compile seconds the trial's time limit did not count."""
    return min(compiled_s, request.compile_allowance_s())


def _classify(returncode: int, timed_out: bool, ranks: dict[int, Outcome], log_tail: str,
              timeout_s: float, world_size: int = 1, compiled_s: float = 0.0) -> Outcome:
    merged = merge_ranks(ranks, world_size)
    if merged is not None:
        return merged
    if timed_out:
        besides = (f" (besides {compiled_s:.0f} s of torch.compile, not counted)"
                   if compiled_s >= 0.5 else "")
        return Outcome(TIMEOUT, error=f"killed after the trial time limit of {timeout_s:.0f} s"
                       f"{besides}\n{log_tail}")
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if is_oom_message(log_tail):  # e.g. SIGABRT after a C++ std::bad_alloc
            return Outcome(OOM, error=f"killed by {sig} after running out of memory\n{log_tail}")
        if is_oom_signal(returncode):
            return Outcome(OOM, error=f"killed by {sig} (the kernel's OOM killer sends it)"
                           f"\n{log_tail}")
        return Outcome(CRASHED, error=f"killed by {sig}\n{log_tail}")
    status = OOM if is_oom_message(log_tail) else CRASHED
    return Outcome(status, error=f"exited with status {returncode} before reporting"
                   f"\n{log_tail}")
