"""Real trial processes: every way a trial can end becomes an Outcome, never an exception."""

from __future__ import annotations

import pytest

from autotune.config import TrialConfig
from autotune.records import RanWith
from autotune.trials.host_malloc import THRESHOLD
from autotune.trials.launch import run_trial
from tests.conftest import trial_request
from tests.test_host_malloc import GLIBC

pytestmark = pytest.mark.slow


def _spec(tiny_spec, **model):
    if model:
        tiny_spec["model"] = model
    return tiny_spec


def _run(spec, config, **kw):
    return run_trial(trial_request(spec, config, **kw))


def test_ok_trial_measures_throughput_and_memory(tiny_spec):
    out = _run(_spec(tiny_spec), TrialConfig(4, 4))
    assert out.status == "ok", out.error
    assert out.samples_per_second > 0
    assert out.tokens_per_second == pytest.approx(out.samples_per_second * 32)
    assert len(out.step_seconds) == 3  # 1 warm-up + 2 timed
    assert out.timed_seconds == pytest.approx(sum(out.step_seconds[1:]))
    assert out.peak_memory_bytes > 0
    assert out.wall_seconds > out.timed_seconds
    # where its seconds went, and what it really ran with
    phases = out.phases.seconds()
    assert list(phases) == ["launch", "model", "engine", "warmup", "steps"]
    assert phases["steps"] == pytest.approx(out.timed_seconds, abs=1e-3)
    assert sum(phases.values()) < out.wall_seconds
    assert out.ran_with == RanWith(
        tf32=False, compiled=False, compile_mode=None, compiled_graphs=0, liger=False,
        # One rank on a CPU: Trainer wraps the model in nothing (no DDP, engine or FSDP).
        attn_implementation="sdpa", wrapped_as="GPT2LMHeadModel")
    assert out.phases.model_build.weights == "random"
    # its peak is its tensors', not malloc's high-water (trials/host_malloc.py)
    assert out.measured.mmap_threshold == (THRESHOLD if GLIBC else None)


def test_budget_exceeded_is_oom(tiny_spec):
    out = _run(_spec(tiny_spec), TrialConfig(16, 1), budget=2 * 2**20)
    assert out.status == "oom"
    assert "memory budget exceeded" in out.error


def test_crash_by_signal_is_recorded(tiny_spec):
    out = _run(_spec(tiny_spec, factory="tests.factories:crashes_at_batch_8"),
               TrialConfig(8, 2))
    assert out.status == "crashed"
    assert "SIGSEGV" in out.error


def test_hang_is_killed_at_the_time_limit(tiny_spec, tmp_path, monkeypatch):
    # Its own devices: a trial of another test holding the shared cores past this one's
    # 10 s would make it `lost` (the machine's failure), not the hang this test kills.
    monkeypatch.setenv("AUTOTUNE_LEASE_DIR", str(tmp_path / "leases"))
    out = _run(_spec(tiny_spec, factory="tests.factories:hangs_at_batch_8"),
               TrialConfig(8, 2), timeout_s=10)
    assert out.status == "timeout"
    assert 10 <= out.wall_seconds < 45


def test_non_finite_loss_is_nan(tiny_spec):
    out = _run(_spec(tiny_spec, factory="tests.factories:nan_loss"), TrialConfig(4, 4))
    assert out.status == "nan", out.error


def test_a_really_diverging_run_is_nan(tiny_spec):
    request = trial_request(_spec(tiny_spec), TrialConfig(4, 4))
    request.training_args["learning_rate"] = 1e30  # weights blow up on the first update
    out = run_trial(request)
    assert out.status == "nan" and "non-finite loss" in out.error


def test_trials_record_their_losses_from_one_seed(tiny_spec):
    """Same seed, same effective batch: the same weights and data in the same order, so
    two splits of the batch log the same losses (what the numerics check relies on)."""
    a, b = _run(_spec(tiny_spec), TrialConfig(4, 4)), _run(_spec(tiny_spec), TrialConfig(8, 2))
    assert a.ok and b.ok
    assert a.measured.losses == pytest.approx(b.measured.losses, rel=1e-3)


def test_a_classifier_logs_its_loss_summed_over_micro_batches_and_is_still_reviewed(
        tiny_spec):
    """Transformers' Trainer leaves the loss unscaled for accumulation where the model
    takes loss kwargs; BERT's classifier takes them and ignores `num_items_in_batch`, so
    a b4x2 trial logs twice the b8x1 loss (seen on an H200 with BERT-large, where the
    numerics review then rejected every accumulated config). The review reads it at that
    scale."""
    from autotune.records import Record
    from autotune.tuning import numerics

    tiny_spec["model"] = {"config": {"model_type": "bert", "num_hidden_layers": 2,
                                     "hidden_size": 64, "num_attention_heads": 2,
                                     "intermediate_size": 128, "vocab_size": 512,
                                     "max_position_embeddings": 64},
                          "task": "sequence-classification"}
    tiny_spec["target_batch_size"] = 8
    whole, split = _run(tiny_spec, TrialConfig(8, 1)), _run(tiny_spec, TrialConfig(4, 2))
    assert whole.ok and split.ok, (whole.error, split.error)
    ratio = split.measured.losses[0] / whole.measured.losses[0]
    assert ratio == pytest.approx(2, rel=0.01)  # transformers' behaviour, if it changes
    ref = Record(TrialConfig(8, 1), whole, "baseline", 0)
    rec = Record(TrialConfig.of(4, 2, precision="bf16"), split, "model", 1)
    numerics.review(rec, [ref], 8, 1, 0.05)
    assert rec.outcome.ok and rec.outcome.measured.loss_accumulation_scale == 2


def test_model_error_keeps_the_tail(tiny_spec):
    tiny_spec["data"]["seq_len"] = 128  # longer than the model's 64 positions
    out = _run(_spec(tiny_spec), TrialConfig(4, 4))
    assert out.status == "error"
    assert "data.seq_len: 128 exceeds" in out.error
    assert out.failure.setup_field == "data.seq_len"  # no config avoids it


def test_mfu_needs_a_known_peak_and_shape_and_never_fails_a_trial():
    """On an H100 every trial without a shape (no `shape=` passed, a factory model) once
    crashed after training while computing MFU; the GPU's peak table is faked here."""
    from autotune.device import KNOWN_DEVICES, DeviceSpec
    from autotune.records import Measurement, Outcome
    from autotune.trials.worker import model_flops_utilisation

    h100 = DeviceSpec("H100", "cuda", 80 * 2**30, (9, 0), 1, KNOWN_DEVICES["H100-80GB"][2])
    result = Outcome("ok", tokens_per_second=1e5, measured=Measurement(
        flop_parameters=124_000_000, flop_trainable_parameters=124_000_000))
    shape = {"num_layers": 12, "hidden_size": 768, "seq_len": 1024}
    mfu = model_flops_utilisation(result, shape, h100, "bf16", 1)
    assert mfu == pytest.approx((6 * 124e6 + 12 * 12 * 768 * 1024) * 1e5 / 989e12)
    assert model_flops_utilisation(result, {}, h100, "bf16", 1) is None
    assert model_flops_utilisation(result, None, h100, "bf16", 1) is None
    cpu = DeviceSpec("cpu", "cpu", 2**30)
    assert model_flops_utilisation(result, shape, cpu, "fp32", 1) is None


def test_warm_launcher_outlives_the_thread_that_started_it(tiny_spec):
    """A launcher started from a pool thread once died with that thread (Linux ties
    PR_SET_PDEATHSIG to the thread), and the next trial hit a broken pipe."""
    from concurrent.futures import ThreadPoolExecutor

    for _ in range(2):
        with ThreadPoolExecutor(1) as pool:
            out = pool.submit(_run, _spec(tiny_spec), TrialConfig(4, 4)).result()
        assert out.status == "ok" and out.launch.kind == "warm", out.error


def test_warm_launcher_dies_with_what_launched_it():
    import subprocess
    import sys
    import time

    import psutil

    code = ("import os, time; from autotune.trials import forkserver\n"
            "with forkserver.borrowed(dict(os.environ)) as s:\n"
            "    print(s.proc.pid, flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    pid = int(proc.stdout.readline())
    proc.kill()
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and psutil.pid_exists(pid) and (
            psutil.Process(pid).status() != psutil.STATUS_ZOMBIE):
        time.sleep(0.2)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_the_warm_launcher_imports_what_each_trial_would_import_after_the_fork():
    """What a forked trial imports itself, each trial pays in its launch: the worker's
    own modules (0.4 s of 0.5 s until 2026-11-29) and TRL under its trainers (0.4 s).
    The launcher imports them once, the trainer's `preload` as the launcher is told; a
    module that fails to import is the trial's to report, not the launcher's."""
    import subprocess
    import sys

    from autotune.tasks import TRAINERS

    assert {name: t.preload for name, t in TRAINERS.items() if t.preload} == {
        "sft": ("trl.trainer.sft_trainer",), "dpo": ("trl.trainer.dpo_trainer",),
        "grpo": ("trl.trainer.grpo_trainer",)}
    code = ("import os, sys\n"
            "from autotune.trials import forkserver\n"
            "os.environ[forkserver.PRELOAD_MODULES] = 'no_such_module,trl.trainer.sft_trainer'\n"
            "forkserver._preload()\n"
            "print(' '.join(m for m in ('autotune.spec', 'autotune.tasks',\n"
            "    'autotune.trials.long_context', 'trl.trainer.sft_trainer', 'no_such_module')\n"
            "    if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1].split() == [
        "autotune.spec", "autotune.tasks", "autotune.trials.long_context",
        "trl.trainer.sft_trainer"]


@pytest.mark.timeout(300)
def test_trials_run_at_once_from_several_threads_each_get_a_warm_launcher(tiny_spec,
                                                                        monkeypatch):
    """The memory benchmark runs four trials at a time from a thread pool on a GPU. They
    once shared this process's one launcher, which runs one trial at a time and answers
    whoever reads its pipe: a thread took another's trial and hung waiting for its own."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from autotune.trials import forkserver

    monkeypatch.setenv("AUTOTUNE_LEASE_DIR", "off")  # both at once, as that benchmark does
    while forkserver._IDLE:  # earlier tests' launchers: this test counts its own
        forkserver._IDLE.pop().close()

    def one(_: int):
        started = time.monotonic()
        out = _run(_spec(tiny_spec), TrialConfig(4, 4), timeout_s=120)
        return out, started, time.monotonic()

    with ThreadPoolExecutor(2) as pool:
        (a, a0, a1), (b, b0, b1) = pool.map(one, range(2))
    for out in (a, b):
        assert out.status == "ok" and out.launch.kind == "warm", out.error
        # Each started its launcher: a cost the next trials of the process do not pay.
        assert 0 < out.launch.launcher_start_s < out.wall_seconds
        assert out.repeat_seconds == pytest.approx(out.wall_seconds
                                                   - out.launch.launcher_start_s)
    assert max(a0, b0) < min(a1, b1)  # they overlapped
    assert len(forkserver._IDLE) == 2  # each held a launcher of its own, now idle
    again, _, _ = one(2)  # an idle launcher serves it, started already
    assert again.launch.kind == "warm" and again.launch.launcher_start_s is None
    assert again.repeat_seconds == again.wall_seconds


def test_a_launcher_whose_imports_made_a_cuda_context_is_refused_and_trials_go_cold(
        tiny_spec, tmp_path):
    """A library that makes a CUDA context as it is imported (bitsandbytes asks for the
    device's capability) would leave every forked trial unable to use the GPU, each a
    "crashed" config. The launcher refuses to serve then; the trials run cold, say why,
    and the process does not start another launcher for each. (No GPU here: a
    sitecustomize marks CUDA initialised in the launcher, as that import would.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    starts = tmp_path / "launcher-starts"
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "if 'autotune.trials.forkserver' in sys.orig_argv:\n"
        f"    open({str(starts)!r}, 'a').write('started\\n')\n"
        "    import torch\n"
        "    torch.cuda._initialized = True\n")
    code = ("import json, sys\n"
            "from autotune.config import TrialConfig\n"
            "from autotune.trials.launch import run_trial\n"
            "from tests.conftest import trial_request\n"
            "spec = json.loads(sys.argv[1])\n"
            "outs = [run_trial(trial_request(spec, TrialConfig(4, 4))) for _ in range(2)]\n"
            "print(json.dumps([[o.status, o.launch.kind, o.launch.cold_because,"
            " o.error, o.launch.launcher_start_s] for o in outs]))\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{root}")
    done = subprocess.run([sys.executable, "-c", code, json.dumps(_spec(tiny_spec))],
                          capture_output=True, text=True, timeout=240, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    outs = json.loads(done.stdout.strip().splitlines()[-1])
    for status, launch, because, error, _ in outs:
        assert (status, launch) == ("ok", "cold"), error
        assert "initialised CUDA" in because
    assert starts.read_text().count("started") == 1
    # The refused launcher's start was the first trial's cost alone.
    assert outs[0][4] > 0 and outs[1][4] is None


def test_a_trial_that_ends_at_once_is_not_waited_for_past_its_end():
    """The server's two lines for a trial that ends at once (its pid, its return code) can
    come in one read. Read through a buffered file, the second sat where select() could
    not see it: the wait ran to the trial's time limit, then waited for ever. (A scripted
    server: the protocol's peer, writing both lines at once.)"""
    import json
    import subprocess
    import sys
    import time

    from autotune.trials.forkserver import ForkServer

    lines = json.dumps({"pid": 7}) + "\n" + json.dumps({"pid": 7, "returncode": 3}) + "\n"
    both = f"import sys, time; sys.stdout.write({lines!r}); sys.stdout.flush(); time.sleep(30)"
    server = ForkServer.__new__(ForkServer)
    server._pending = b""
    server.proc = subprocess.Popen([sys.executable, "-c", both], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True)
    try:
        assert server._read(20) == {"pid": 7}
        started = time.monotonic()
        assert server.wait(7, 10) == 3
        assert time.monotonic() - started < 5
    finally:
        server.close()


def test_a_dead_launchers_trial_folders_are_swept_and_a_live_ones_never(tmp_path):
    """A launcher SIGKILLed mid-trial leaves its folder (its TemporaryDirectory never
    cleans up); the next trial removes such folders once their launcher is gone and they
    went quiet, and never one whose launcher lives or that is still being written."""
    import os
    import subprocess
    import sys
    import time

    from autotune.trials.launch import (
        LEGACY_AFTER_S,
        ORPHAN_AFTER_S,
        TRIAL_DIR_PREFIX,
        sweep_orphans,
    )

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead, fresh, live, other, huge = (tmp_path / f"{TRIAL_DIR_PREFIX}{name}" for name in (
        f"{gone.pid}-abc", f"{gone.pid}-def", f"{os.getpid()}-ghi", "xyz-123",
        "99999999999999999999-jkl"))
    for folder in (dead, fresh, live, other, huge):
        folder.mkdir()
        (folder / "stderr.log").write_text("trial log")
    link = tmp_path / f"{TRIAL_DIR_PREFIX}{gone.pid}-lnk"
    link.symlink_to(live)  # a link is no trial folder: neither it nor what it points to goes
    old = time.time() - ORPHAN_AFTER_S - 60
    for folder in (dead, live, other, huge):
        for p in (folder, folder / "stderr.log"):
            os.utime(p, (old, old))
    os.utime(fresh, (old, old))  # its log is fresh: it may be a live trial's elsewhere
    # Earlier versions named no PID: such a folder goes after a day's quiet, not an hour's.
    legacy, recent = (tmp_path / f"{TRIAL_DIR_PREFIX}{name}" for name in ("ab3d_9xy",
                                                                          "zz12q7_k"))
    for folder, age in ((legacy, LEGACY_AFTER_S + 60), (recent, ORPHAN_AFTER_S + 60)):
        folder.mkdir()
        os.utime(folder, (time.time() - age, time.time() - age))
    assert sorted(sweep_orphans(tmp_path)) == sorted([dead, legacy])
    assert not dead.exists() and not legacy.exists()
    assert all(p.exists() for p in (fresh, live, other, huge, link, recent))


def test_an_exceeded_budget_is_said_with_the_digits_that_tell_the_two_apart():
    """Found by a newcomer run: "0.59 GiB > 0.59 GiB"."""
    from autotune.trials.worker import exceeded

    gib = 2**30
    assert exceeded(int(1.5 * gib), gib) == "1.50 GiB > 1.00 GiB"
    assert exceeded(int(0.5904 * gib), int(0.5900 * gib)) == "0.5904 GiB > 0.5900 GiB"
    assert exceeded(600 * 2**20 + 1, 600 * 2**20) == "629145601 bytes > 629145600 bytes"


def test_a_recompile_is_paid_once_and_one_every_step_is_no_speed():
    """compile's warm-up and any recompile in the timed steps are a one-time cost, not the
    config's speed; a graph that recompiles in most timed steps measures compilation."""
    from autotune.trials.worker import recompiles

    # Two warm-up steps (the first compiles), four timed: the third recompiles (2.5 s).
    assert recompiles([9.0, 0.5, 0.5, 0.5, 3.0, 0.5], [1, 1, 1, 1, 2, 2], 2) == ([2], 2.5)
    assert recompiles([9.0, 0.5, 0.5, 0.5], [1, 1, 1, 1], 2) == ([], 0)
    hit, _ = recompiles([9.0, 2.0, 2.0, 2.0, 2.0], [1, 2, 3, 4, 5], 1)
    assert hit == [0, 1, 2, 3]


def test_compile_is_charged_once_against_the_long_run():
    """The objective of a compiled trial is its throughput over the whole run, its
    compilation paid once in it; the projected run time holds it exactly once."""
    from autotune.records import SAMPLES_PER_SECOND, Compile, Outcome

    # The spec's run: 900 steps of 64 samples, 576 s at 100 samples/s.
    steady = Outcome("ok", samples_per_second=100.0,
                     compile=Compile(charged_seconds=60.0, run_seconds=576.0))
    assert steady.score_for(SAMPLES_PER_SECOND) == pytest.approx(100.0 * 576 / 636)
    assert Outcome("ok", samples_per_second=100.0, compile=Compile(
        charged_seconds=60.0)).score_for(SAMPLES_PER_SECOND) == (
        100.0)  # no long run given: nothing to amortise against
    from autotune.outputs.report import projected_seconds
    from autotune.records import Record
    from autotune.summary import Summary

    rec = Record(TrialConfig.of(8, 8, torch_compile=True), steady, "model", 1)
    summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=64,
                      seq_len=128, trials=[rec], projection={"steps": 900})
    assert projected_seconds(summary, rec) == pytest.approx(576 + 60)
