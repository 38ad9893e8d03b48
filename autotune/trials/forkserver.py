"""A warm launcher: a process that imports torch, transformers and the trial worker once,
then forks each trial from that state, so a trial starts in milliseconds instead of the
seconds its imports take.

Each forked trial is still its own process with its own limits: its own session (the
launcher kills its group past the time limit), its own environment and thread count, its
own log, and it dies with the server (which dies with its launcher). CUDA is never touched
before the fork (a forked CUDA context is unusable), only imported. A trial of several
ranks is forked as a leader that forks its ranks and does what torchrun does for one
node: each rank's environment, and the first rank to fail takes the others down.

Protocol, one JSON object per line: the server first says {"ready"}, or {"refused"} with
why it cannot fork usable trials (a preloaded library made a CUDA context), then exits;
the launcher writes {"request", "result", "log", "cwd", "env"}; the server answers {"pid"}
once the trial runs, then {"pid", "returncode"} when it has ended (negative: killed by
that signal).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NoReturn

from autotune.trials.cpu_info import remember_cpu_info
from autotune.trials.reaper import die_with_parent

# What every trial imports; the optional ones only where installed. Importing them is
# most of a cold trial's overhead (about 4-8 s on the development machine).
PRELOAD = ("torch", "transformers", "transformers.trainer", "autotune.trials.worker",
           "autotune.trials.model_builder",
           # what the worker's run() imports itself (0.4 s of each forked trial's launch)
           "autotune.spec", "autotune.tasks", "autotune.trials.long_context")
PRELOAD_IF_INSTALLED = ("deepspeed", "bitsandbytes", "peft")
START_TIMEOUT_S = 300.0


# --- the server -----------------------------------------------------------------------

def _fork_unsafe() -> str | None:
    """Why this server's forks could not use the GPU, if they could not: a CUDA context
    made before the fork (by a preloaded library) leaves every forked trial failing with
    "Cannot re-initialize CUDA in forked subprocess", which would read as the config's
    crash. A state broken some other way (a failed device_count() falls back to a state
    forks inherit) shows only in a fork, so one is tried: it must reach the GPU."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "a preloaded library initialised CUDA, which a forked trial cannot use"
    failed = fork_check(_cuda_usable)
    return f"a forked process could not use the GPU ({failed})" if failed else None


# How many GPUs a trial forked from this server runs on (its ranks on this node), set by
# the launcher that starts it: its fork check touches those, cuda:0 up, and no other.
PROBE_DEVICES = "AUTOTUNE_FORK_PROBE_DEVICES"


def probe_devices(visible: int, env: dict[str, str] | None = None) -> list[int]:
    """The devices the fork check touches, of the `visible` ones (CUDA_VISIBLE_DEVICES,
    which Ray narrows to a task's GPUs): a trial's ranks use cuda:0 to cuda:local-1, so
    those, and never the node's others (on a busy node another job's GPU could refuse,
    and every trial would start cold, or lose memory to the check). One where the
    launcher did not say."""
    said = (env if env is not None else os.environ).get(PROBE_DEVICES, "1")
    try:
        wanted = max(1, int(said))
    except ValueError:
        wanted = 1
    return list(range(min(wanted, visible)))


def _cuda_usable(touch: Callable[[int], None] | None = None,
                 visible: Callable[[], int] | None = None) -> None:
    """In a forked child: a tensor on each of the trial's GPUs (probe_devices; none on a
    CPU host). `touch` and `visible` stand in for torch's CUDA calls in a test."""
    import torch

    def on_device(i: int) -> None:
        torch.zeros(1, device=f"cuda:{i}").add_(1)
        torch.cuda.synchronize(i)

    for i in probe_devices((visible or torch.cuda.device_count)()):
        (touch or on_device)(i)


FORK_CHECK_TIMEOUT_S = 120.0


def fork_check(probe: Callable[[], None], timeout_s: float = FORK_CHECK_TIMEOUT_S) -> str | None:
    """Run `probe` in a forked child; why it failed (its exception, a signal, no answer in
    `timeout_s`), or None where it returned."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)

        def body() -> int:
            try:
                probe()
            except BaseException as exc:  # noqa: BLE001 - said to the parent
                os.write(write, f"{type(exc).__name__}: {exc}"[:300].encode())
                return 1
            return 0

        _exit_with(body)
    os.close(write)
    deadline = time.monotonic() + timeout_s
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return f"no answer in {timeout_s:.0f} s"
        time.sleep(0.01)
    said = os.read(read, 4096).decode(errors="replace")
    os.close(read)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return None
    return said or (f"killed by {signal.Signals(-code).name}" if code < 0
                    else f"exit status {code}")


@contextlib.contextmanager
def _capability_from_nvml() -> Iterator[None]:
    """`torch.cuda.get_device_capability` answered by NVML while the libraries preload:
    bitsandbytes asks it as it is imported, to pick its CUDA library, and torch's answer
    makes a CUDA context, after which every forked trial would start cold (NVML makes
    none). Hiding the GPUs instead would lock bitsandbytes to its CPU library."""
    import torch

    asked = torch.cuda.get_device_capability

    def capability(device=None) -> tuple[int, int]:
        try:
            return nvml_capability(_device_index(device))
        except Exception:  # noqa: BLE001 - no NVML here: torch's own answer
            return asked(device)

    torch.cuda.get_device_capability = capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = asked


def nvml_capability(index: int) -> tuple[int, int]:
    """A GPU's compute capability as NVML reads it (no CUDA context)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
        return int(major), int(minor)
    finally:
        pynvml.nvmlShutdown()


def _device_index(device: Any) -> int:
    """The index a `get_device_capability` argument names: an int, a torch.device, a
    `torch.cuda.device` context object, or None (the current one, 0 before any)."""
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    for name in ("idx", "index"):
        value = getattr(device, name, None)
        if isinstance(value, int):
            return value
    return 0


# The spec's model section (JSON), whose transformers modeling module the server imports
# too: a search's trials all build that class (a 0.5B Qwen's module took 1.5 s a trial).
PRELOAD_MODEL = "AUTOTUNE_PRELOAD_MODEL"
# The modules the search's trainer imports beyond Trainer's (TrainerKind.preload), by comma.
PRELOAD_MODULES = "AUTOTUNE_PRELOAD_MODULES"


def _preload() -> None:
    remember_cpu_info()
    importlib.import_module("torch")
    with _capability_from_nvml():
        for name in PRELOAD:
            importlib.import_module(name)
        import_extras(())
    import_extras(filter(None, os.environ.get(PRELOAD_MODULES, "").split(",")))
    model = os.environ.get(PRELOAD_MODEL)
    if model:
        from autotune.tasks.models import model_class

        with contextlib.suppress(Exception):  # the trial itself says what is wrong with it
            model_class(json.loads(model))


def import_extras(trainer_modules: Iterable[str]) -> None:
    """The optional libraries a launcher preloads, and a trainer's own (TrainerKind.preload).
    A trial imports them too before it reads its base RSS, so that what its launcher did
    not preload (a cold trial's, or an extra whose import failed there) is not counted as
    its peak: a cold CPU DPO trial read 153 MiB with them counted, 47 without, where the
    memory model predicts 74. One that fails is the trial's to report where it needs it."""
    for name in (*PRELOAD_IF_INSTALLED, *trainer_modules):
        if name in sys.modules or importlib.util.find_spec(name.split(".")[0]) is None:
            continue
        with contextlib.suppress(Exception):
            importlib.import_module(name)


def _child(job: dict[str, Any], channel: int) -> None:
    """In the forked process: become the trial, then exit with its status."""

    def become() -> int:
        os.close(channel)
        os.setsid()
        die_with_parent()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's pipes are not the trial's
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        world = int(job.get("world_size", 1))
        local = int(job.get("local_world", world))  # this node's share of a multi-node trial
        if world > 1:
            return _ranks(job, local, world, int(job.get("node_rank", 0)))
        return _worker(job)

    _exit_with(become)


def _exit_with(body: Callable[[], int]) -> NoReturn:
    """Run a forked process's body and exit with its status, never returning into the
    server's code: whatever it raises ends it (the traceback goes to the trial's log)."""
    code = 1
    try:
        code = body()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - the traceback goes to the trial's log
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _worker(job: dict[str, Any]) -> int:
    import torch

    torch.set_num_threads(int(job["env"].get("OMP_NUM_THREADS", "1")))
    from autotune.trials import worker

    return worker.main(["worker", job["request"], job["result"]])


def _rank(job: dict[str, Any], local_rank: int, local: int, world: int,
          node_rank: int) -> int:
    die_with_parent()
    rank = node_rank * local + local_rank
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank),
                       "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local),
                       "GROUP_RANK": str(node_rank), "ROLE_RANK": str(rank),
                       "ROLE_WORLD_SIZE": str(world)})
    return _worker(job)


def _ranks(job: dict[str, Any], local: int, world: int, node_rank: int = 0) -> int:
    """torchrun's part for one node, forked: the `local` ranks of node `node_rank` of a
    trial of `world` ranks (the rendezvous address is the launcher's, or rank 0's node's),
    then wait; a rank that fails (a rank's OOM exits non-zero so that the others, blocked
    in a collective, are ended) takes the rest down, and its status is the trial's: a rank
    killed by a signal, the leader dies of the same one."""
    ranks: dict[int, int] = {}
    for local_rank in range(local):
        pid = os.fork()
        if pid == 0:
            _exit_with(lambda r=local_rank: _rank(job, r, local, world, node_rank))
        ranks[pid] = local_rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        ranks.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code
            for other in ranks:
                with contextlib.suppress(OSError):
                    os.kill(other, signal.SIGKILL)
    if failed < 0:
        with contextlib.suppress(OSError, ValueError):  # SIGKILL's cannot be set, nor need be
            signal.signal(-failed, signal.SIG_DFL)
        os.kill(os.getpid(), -failed)
    return failed


_current: dict[str, int] = {}  # the trial running now, for the parent watch


def _watch_parent(parent: int) -> None:
    """Exit with the launching process, taking the running trial's session down. (Not
    PR_SET_PDEATHSIG: Linux ties that to the thread that started this process, and a
    launcher in a thread pool would kill the server when that thread ends.)"""
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            pid = _current.get("pid")
            if pid:
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            os._exit(1)


def serve() -> None:
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    # The protocol gets a private copy of stdout: libraries print to fd 1 on import
    # (DeepSpeed announces its accelerator), which must not reach the launcher.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    # torch.cuda.is_available() through NVML, so that asking makes no CUDA context here.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    _preload()
    refused = _fork_unsafe()
    if refused:  # the launcher runs its trials cold, and says why
        out.write(json.dumps({"refused": refused}) + "\n")
        out.flush()
        os._exit(3)
    out.write(json.dumps({"ready": os.getpid()}) + "\n")
    out.flush()
    for line in sys.stdin:
        job = json.loads(line)
        out.flush()
        pid = os.fork()
        if pid == 0:
            _child(job, out.fileno())
        _current["pid"] = pid
        out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()
        _, status = os.waitpid(pid, 0)
        _current.pop("pid", None)
        out.write(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)})
                  + "\n")
        out.flush()


# --- the client, in the launching process -------------------------------------------------

class LauncherRefused(RuntimeError):
    """The server said its forks could not use the GPU: so would any other of this process.
    `start_seconds`: what starting it took, which only the trial that started it paid."""

    start_seconds: float = 0.0


class ForkServer:
    """A server runs one trial at a time; `borrowed` lends each to one trial at a time."""

    def __init__(self, env: dict[str, str]) -> None:
        self._pending = b""
        started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.trials.forkserver"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
        try:
            hello = self._read(START_TIMEOUT_S)
        except BaseException:  # Ctrl-C or a cancelled task mid-start too: no stray server
            self.close()
            raise
        if hello is None or "ready" not in hello:
            self.close()
            if hello and "refused" in hello:
                refused = LauncherRefused(f"the warm launcher refused: {hello['refused']}")
                refused.start_seconds = time.monotonic() - started
                raise refused
            raise RuntimeError("the warm launcher did not start")
        # Its start, owed by the trial it is first lent to (`take_start`) and by no other.
        self._start_owed = time.monotonic() - started

    def take_start(self) -> float:
        """The seconds this server took to start, the first time asked; 0 after."""
        owed, self._start_owed = self._start_owed, 0.0
        return owed

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """The server's next line, or None when `timeout` passed first. Read from the pipe
        itself, not a buffered file: one read may bring two lines (a trial that ends at
        once), and the second must not sit in a buffer that select() cannot see."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the warm launcher exited")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def start(self, job: dict[str, Any]) -> int:
        """Fork the trial; returns its pid."""
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(job) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:  # it died between our check and the write: go cold
            raise RuntimeError(f"the warm launcher is gone ({exc})") from exc
        reply = self._read(START_TIMEOUT_S)
        if reply is None or "pid" not in reply:
            raise RuntimeError("the warm launcher did not fork the trial")
        return int(reply["pid"])

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The trial's return code, or None when `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self._read(left)
            if reply is None:
                return None
            if reply.get("pid") == pid and "returncode" in reply:
                return int(reply["returncode"])

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.kill()
            self.proc.wait(timeout=10)


_IDLE: list[ForkServer] = []
_LOCK = threading.Lock()
_REFUSED: list[str] = []  # why this process's servers refuse to serve (it will not change)


@contextlib.contextmanager
def borrowed(env: dict[str, str]) -> Iterator[ForkServer]:
    """A warm launcher of this process's for one trial: an idle one, else a new one. A
    server answers on one pipe whoever reads it, so trials run at once from several
    threads (the memory benchmark's pool) each hold their own; a Ray worker, one trial at
    a time, keeps reusing one. One that was left mid-trial (an exception, Ctrl-C) is
    closed, not lent again. Once one refused, this process's trials go cold
    (RuntimeError) rather than pay the imports again for each."""
    with _LOCK:
        if _REFUSED:
            raise LauncherRefused(_REFUSED[0])
        while _IDLE and not _IDLE[-1].alive():
            _IDLE.pop().close()
        lent = _IDLE.pop() if _IDLE else None
    if lent is None:
        try:
            lent = ForkServer(env)
        except LauncherRefused as exc:
            with _LOCK:
                _REFUSED.append(str(exc))
            raise
    try:
        yield lent
    except BaseException:
        lent.close()
        raise
    if lent.alive():
        with _LOCK:
            _IDLE.append(lent)


if __name__ == "__main__":
    serve()
