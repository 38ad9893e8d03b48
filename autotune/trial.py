"""Launch one trial in a fresh process and turn whatever happened into an Outcome.

A crash, an OOM kill or a hang must never reach the study: the trial runs in its own
process session, is killed with its children past its time limit, and its exit status
is classified here.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from autotune.config import Outcome, TrialConfig
from autotune.device import node_cpus
from autotune.oom import is_oom_message, is_oom_signal

STDERR_TAIL_CHARS = 3000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(request_path: Path, result_path: Path, world_size: int) -> list[str]:
    worker = ["-m", "autotune.trial_worker", str(request_path), str(result_path)]
    if world_size == 1:
        return [sys.executable, *worker]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world_size}",
            f"--master_port={_free_port()}", *worker]


def extensions_dir() -> str:
    """Where DeepSpeed's JIT-built ops (CPU Adam, shm comm) go: inside this environment.
    torch's default cache is shared by every venv of the user, and its build flags name
    the venv, so two environments rebuild over each other and a build killed mid-way
    leaves a lock that stalls every later trial."""
    return str(Path(sys.prefix) / "torch_extensions")


def _environment(world_size: int, cpu_threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # The CPU threads a real run of this config gets: the trial's share of the node's cores,
    # split over its ranks. Set explicitly, because Ray sets OMP_NUM_THREADS to the task's
    # num_cpus and torch would otherwise inherit whatever the launching process had.
    per_rank = str(max(1, cpu_threads // world_size))
    env |= {"OMP_NUM_THREADS": per_rank, "MKL_NUM_THREADS": per_rank}
    # A single process still needs a process group for DeepSpeed; torchrun sets these
    # for several.
    if world_size == 1:
        env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "RANK": "0",
                "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", extensions_dir())
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.pop("AUTOTUNE_TRIAL_CONFIG", None)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_trial(
    spec: dict[str, Any],
    config: TrialConfig,
    *,
    shape: dict[str, Any] | None = None,
    memory_budget_bytes: int | None = None,
    timeout_s: float = 600.0,
    seed: int = 0,
    world_size: int = 1,
    cpu_threads: int | None = None,
) -> Outcome:
    """Run `config` as a short real training run in a new process; never raises for a
    trial that failed. `cpu_threads`: the trial's share of the node's cores (default all)."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="autotune-trial-") as tmp:
        tmpdir = Path(tmp)
        request = {"spec": spec, "config": config.to_dict(), "shape": shape or {},
                   "memory_budget_bytes": memory_budget_bytes, "seed": seed,
                   "workdir": str(tmpdir / "out"), "import_path": os.getcwd()}
        (tmpdir / "request.json").write_text(json.dumps(request))
        result_path, log_path = tmpdir / "result.json", tmpdir / "stderr.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(_command(tmpdir / "request.json", result_path, world_size),
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=_environment(world_size, cpu_threads or node_cpus()),
                                    cwd=tmp)
            timed_out = False
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BaseException:  # Ctrl-C in the driver: take the trial down with us
                _kill_group(proc)
                raise
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        log_tail = log_path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
        outcome = _classify(proc.returncode, timed_out, result_path, log_tail, timeout_s)
        shape_path = result_path.with_name("shape.json")
        if shape_path.is_file():
            outcome.extra["shape"] = json.loads(shape_path.read_text())
    outcome.wall_seconds = time.time() - started
    return outcome


def _classify(returncode: int, timed_out: bool, result_path: Path, log_tail: str,
              timeout_s: float) -> Outcome:
    if result_path.is_file():
        raw = json.loads(result_path.read_text())
        extra = raw.pop("extra", None) or {}
        extra |= raw.pop("extra_gpu", None) or {}
        outcome = Outcome.from_dict(raw)
        outcome.extra = extra
        return outcome
    if timed_out:
        return Outcome("timeout", error=f"killed after the trial time limit of {timeout_s:.0f} s"
                       f"\n{log_tail}")
    if returncode < 0:
        sig = signal.Signals(-returncode).name
        if is_oom_signal(returncode):
            return Outcome("oom", error=f"killed by {sig} (the kernel's OOM killer sends it)"
                           f"\n{log_tail}")
        return Outcome("crashed", error=f"killed by {sig}\n{log_tail}")
    status = "oom" if is_oom_message(log_tail) else "crashed"
    return Outcome(status, error=f"exited with status {returncode} before reporting"
                   f"\n{log_tail}")
