"""Launch one trial in a fresh process and turn whatever happened into an Outcome.

A crash, an OOM kill or a hang must never reach the study: the trial runs in its own
process session, is killed with its children past its time limit, and its exit status
is classified here.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.records import CRASHED, OOM, TIMEOUT, Outcome
from autotune.trials.oom import is_oom_message, is_oom_signal
from autotune.trials.protocol import TrialRequest, read_result

STDERR_TAIL_CHARS = 3000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _command(request_path: Path, result_path: Path, world_size: int) -> list[str]:
    worker = ["-m", "autotune.trials.worker", str(request_path), str(result_path)]
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
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_trial(request: TrialRequest) -> Outcome:
    """Run the request's config as a short real training run in a new process; never
    raises for a trial that failed."""
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="autotune-trial-") as tmp:
        tmpdir = Path(tmp)
        (tmpdir / "request.json").write_text(request.to_json())
        result_path, log_path = tmpdir / "result.json", tmpdir / "stderr.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                _command(tmpdir / "request.json", result_path, request.world_size),
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env=_environment(request.world_size, request.cpu_threads), cwd=tmp)
            timed_out = False
            try:
                proc.wait(timeout=request.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            except BaseException:  # Ctrl-C in the driver: take the trial down with us
                _kill_group(proc)
                raise
            finally:
                if proc.poll() is None:
                    _kill_group(proc)
        log_tail = log_path.read_text(errors="replace")[-STDERR_TAIL_CHARS:]
        outcome = _classify(proc.returncode, timed_out, result_path, log_tail,
                            request.timeout_s)
    outcome.wall_seconds = time.time() - started
    return outcome


def _classify(returncode: int, timed_out: bool, result_path: Path, log_tail: str,
              timeout_s: float) -> Outcome:
    if result_path.is_file():
        return read_result(result_path)
    if timed_out:
        return Outcome(TIMEOUT, error=f"killed after the trial time limit of {timeout_s:.0f} s"
                       f"\n{log_tail}")
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
