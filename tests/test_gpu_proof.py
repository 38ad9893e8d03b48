"""The GPU proof's time boxes (benchmarks/gpu_proof.py): a device call is rare and ends at
its limit, so a step past its box must still leave what it measured. The whole proof is
rehearsed on CPU by CI (.ci/run); these hold the boxes themselves, in seconds."""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_proof  # noqa: E402

# A step that, as the search CLI does, writes what it has when interrupted.
WRITES_ON_CTRL_C = ("import sys, time\n"
                    "try:\n"
                    "    time.sleep(60)\n"
                    "except KeyboardInterrupt:\n"
                    "    open(sys.argv[1], 'w').write('written')\n"
                    "    sys.exit(130)\n")
IGNORES_CTRL_C = "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(60)"


def test_a_step_past_its_box_is_interrupted_first_so_it_writes_what_it_has(tmp_path):
    log: list[dict] = []
    started = time.time()
    code = gpu_proof._step("search", [sys.executable, "-c", WRITES_ON_CTRL_C,
                                      str(tmp_path / "summary")], 10, tmp_path, log, grace=5)
    assert code is None and log[0]["exit"] is None
    assert (tmp_path / "summary").read_text() == "written"
    assert time.time() - started < 10


def test_a_step_takes_the_interrupt_where_the_proof_was_started_with_it_ignored(tmp_path):
    """Found in a fresh clone's CI started as a background job, whose SIGINT is ignored
    and inherited: Python then installs no KeyboardInterrupt handler, so the step wrote
    nothing and was killed at its box."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        log: list[dict] = []
        gpu_proof._step("search", [sys.executable, "-c", WRITES_ON_CTRL_C,
                                   str(tmp_path / "summary")], 10, tmp_path, log, grace=5)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (tmp_path / "summary").read_text() == "written"


def test_a_step_that_ignores_the_interrupt_is_killed_at_its_box(tmp_path):
    log: list[dict] = []
    started = time.time()
    assert gpu_proof._step("stuck", [sys.executable, "-c", IGNORES_CTRL_C], 10, tmp_path,
                           log, grace=5) is None
    assert 10 <= time.time() - started < 10 + 5


def test_a_box_is_cut_to_the_calls_end_and_a_step_without_time_is_skipped(tmp_path):
    log: list[dict] = []
    soon = time.time() + gpu_proof.FINISH_S + 5  # 5 s left: less than two graces
    assert gpu_proof._step("late", [sys.executable, "-c", "pass"], 100, tmp_path, log,
                           deadline=soon, grace=3) is None
    assert log[0]["exit"] == "no time left"
    log.clear()
    later = time.time() + gpu_proof.FINISH_S + 30
    assert gpu_proof._step("fits", [sys.executable, "-c", "pass"], 100, tmp_path, log,
                           deadline=later, grace=3) == 0
    assert log[0]["box"] <= 30


def test_a_step_without_grace_is_killed_at_its_box(tmp_path):
    """The memory step: no Ctrl-C first (its launchers would die of it), killed at the box."""
    log: list[dict] = []
    started = time.time()
    assert gpu_proof._step("memory", [sys.executable, "-c", "import time; time.sleep(60)"],
                           3, tmp_path, log, grace=0) is None
    assert 3 <= time.time() - started < 3 + 5
    assert log[0]["exit"] is None
