"""The GPU proof's time boxes (benchmarks/gpu_proof.py): a device call is rare and ends at
its limit, so a step past its box must still leave what it measured. The whole proof is
rehearsed on CPU by CI (.ci/run); these hold the boxes themselves, in seconds."""

from __future__ import annotations

import os
import subprocess
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
                                      str(tmp_path / "summary")], 4, tmp_path, log, grace=2)
    assert code is None and log[0]["exit"] is None
    assert (tmp_path / "summary").read_text() == "written"
    assert time.time() - started < 4


def test_a_step_takes_the_interrupt_where_the_proof_was_started_with_it_ignored(tmp_path):
    """Found in a fresh clone's CI started as a background job, whose SIGINT is ignored
    and inherited: Python then installs no KeyboardInterrupt handler, so the step wrote
    nothing and was killed at its box."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        log: list[dict] = []
        gpu_proof._step("search", [sys.executable, "-c", WRITES_ON_CTRL_C,
                                   str(tmp_path / "summary")], 4, tmp_path, log, grace=2)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert (tmp_path / "summary").read_text() == "written"


def test_a_step_that_ignores_the_interrupt_is_killed_at_its_box(tmp_path):
    log: list[dict] = []
    started = time.time()
    assert gpu_proof._step("stuck", [sys.executable, "-c", IGNORES_CTRL_C], 4, tmp_path,
                           log, grace=2) is None
    assert 4 <= time.time() - started < 4 + 5


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


def test_only_some_steps_run_and_the_summary_says_which_were_left(tmp_path):
    """A second device call redoes some steps: --only names them, a typo is refused."""
    proof = [sys.executable, str(ROOT / "benchmarks" / "gpu_proof.py"), "--rehearse"]
    bad = subprocess.run([*proof, "--only", "bert,memroy", str(tmp_path)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "memroy is no step" in bad.stderr
    done = subprocess.run([*proof, "--only", "gpu_tests", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (tmp_path / "summary.md").read_text()
    assert "bert_search: not asked for (--only)" in summary and "| bert_search |" not in summary
    assert "gpu_tests: no CUDA device" in summary


def test_the_boxes_fit_the_call_with_the_install_as_an_h200_took_it():
    # 25 s: the wheels' install, versions and pip check in the H200's first call.
    assert sum(gpu_proof.GPU_BOXES.values()) + 25 <= gpu_proof.GPU_BUDGET_S


def test_steps_asked_for_alone_take_the_time_of_those_left_out():
    """`--only memory` gets the default steps' whole time (its offload rows at batches 8
    and 16 ran about 90 s beside each other, close to its two-minute box); the default
    steps keep their boxes; two share the call in proportion."""
    boxes, steps = gpu_proof.GPU_BOXES, gpu_proof.STEPS
    total = sum(boxes.values())
    assert gpu_proof.boxes_for(set(boxes), steps) == boxes
    assert gpu_proof.boxes_for({"memory"}, steps) == {"memory": total}
    two = gpu_proof.boxes_for({"bert_vanilla", "memory"}, steps)
    assert sum(two.values()) <= total and two["memory"] > steps["memory"]
    assert abs(two["memory"] / two["bert_vanilla"] - steps["memory"] / steps["bert_vanilla"]
               ) < 0.01


def test_a_search_step_keeps_its_own_time_inside_its_box():
    """Each search's timeout leaves its process's start and the interrupt's grace inside
    the box, so the search ends (confirmation and exports) before it is interrupted."""
    for name, box in gpu_proof.GPU_BOXES.items():
        timeout = gpu_proof.search_timeout(box, rehearse=False)
        assert timeout >= 190, name  # over three minutes of its own
        assert timeout + gpu_proof.STARTUP_S + gpu_proof.GRACE_S <= box
    assert gpu_proof.search_timeout(60, rehearse=False) == 60 - 8 - 12


def test_the_smoke_call_and_the_full_proof_fit_a_sessions_device_time():
    """15 minutes in all, a machine's start (up to two minutes) among them: a smoke call
    of at most 4 minutes, then the full proof on the still warm machine."""
    assert gpu_proof.SMOKE_BOX_S + 25 <= gpu_proof.SMOKE_BUDGET_S <= 240
    assert sum(gpu_proof.GPU_BOXES.values()) + 25 + gpu_proof.FINISH_S <= gpu_proof.GPU_BUDGET_S
    assert gpu_proof.SMOKE_BUDGET_S + gpu_proof.GPU_BUDGET_S + 120 <= 15 * 60
    names = [t["name"] for t in gpu_proof.smoke_trials(True, 1, set())]
    assert sorted(names) == ["attention", "compile", "compile_zero1", "liger", "nf4", "ranks",
                             "tf32"]


def test_the_landscape_folds_confirmation_runs_into_one_row_per_config(tmp_path):
    """The H200's GPT-2 search (reports/gpt2-h200): 10 measured runs of 4 configs, three
    of them the baseline's probes at other effective batches than the target's 64."""
    import csv
    import json
    import shutil

    (tmp_path / "gpt2-search").mkdir()
    shutil.copy(ROOT / "reports" / "gpt2-h200" / "summary.json", tmp_path / "gpt2-search")
    folder = gpu_proof.landscape(tmp_path, rehearse=False)
    rows = list(csv.DictReader((folder / "trials.csv").open()))
    assert [(r["per_device_train_batch_size"], r["status"]) for r in rows] == [("32", "ok")]
    assert float(rows[0]["samples_per_second"]) == 124.6115  # median of its 4 runs
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["device"]["memory_gib"] == 40 and meta["simulated"] is False
    from autotune.bench.landscape import load_landscape

    assert load_landscape(folder).best()[1].samples_per_second == 124.6115
