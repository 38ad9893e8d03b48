"""Trials of several ranks (forked by the warm launcher, or torchrun cold; gloo on CPU): the
data is split so every rank trains b x gas samples per step, a failure on any rank is the
trial's and ends every rank, and memory is the worst rank's."""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import psutil
import pytest

from autotune.config import TrialConfig
from autotune.trials.launch import run_trial
from tests.conftest import ours, trial_request

pytestmark = pytest.mark.slow


def _two_ranks(tiny_spec, **model):
    tiny_spec["hardware"] = {"gpus_per_trial": 2}
    if model:
        tiny_spec["model"] = model
    return tiny_spec


@pytest.mark.parametrize(("zero_stage", "launch"), [(0, "warm"), (2, "warm"), (2, "cold")])
def test_two_rank_trial_trains_b_gas_world_samples_per_step(tiny_spec, zero_stage, launch,
                                                            monkeypatch):
    if launch == "cold":  # torchrun, as when the warm launcher cannot start
        monkeypatch.setenv("AUTOTUNE_COLD_TRIALS", "1")
    spec = _two_ranks(tiny_spec)
    out = run_trial(trial_request(spec, TrialConfig.of(2, 4, zero_stage=zero_stage)))
    assert out.status == "ok", out.error
    assert out.launch.kind == launch
    assert out.ran_with.wrapped_as == ("DeepSpeedEngine" if zero_stage else
                                       "DistributedDataParallel")
    steps = 3  # 1 warm-up + 2 timed
    by_rank = out.measured.micro_batches_by_rank
    assert sorted(by_rank) == [0, 1]
    for sizes in by_rank.values():  # every micro-batch full, gas of them per step
        assert sizes == [2] * (4 * steps)
    # Throughput counts all ranks' samples: b x gas x world per timed step.
    assert out.samples_per_second * out.timed_seconds == pytest.approx(2 * 4 * 2 * 2)
    peaks = out.measured.peak_memory_by_rank
    assert out.peak_memory_bytes == max(peaks.values()) > 0


def test_oom_on_rank_1_is_the_trials_oom_and_ends_every_rank(tiny_spec):
    spec = _two_ranks(tiny_spec, factory="tests.factories:oom_on_rank_1")
    before = {p.pid for p in psutil.process_iter()}
    out = run_trial(trial_request(spec, TrialConfig(2, 4), timeout_s=120))
    assert out.status == "oom", out.error
    assert out.error.startswith("rank 1:")
    assert out.wall_seconds < 100  # taken down by torchrun, not by the time limit
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
            and "autotune.trials.worker" in " ".join(p.info["cmdline"] or []) and ours(p)]
    assert not left


@pytest.mark.parametrize("launch", ["warm", "cold"])
def test_a_rank_the_host_kills_ends_the_trial_as_the_hosts_failure(tiny_spec, tmp_path,
                                                                   launch, monkeypatch):
    """A rank killed by SIGKILL (standing in for the kernel's OOM killer) while its
    partner waits for it in a collective: the warm launcher's leader (or torchrun, cold)
    ends the other rank at once, and the trial is judged as a killed one (here `lost`,
    well under its budget), not hung until its time limit nor blamed on the config."""
    cold = launch == "cold"
    if cold:
        monkeypatch.setenv("AUTOTUNE_COLD_TRIALS", "1")
    spec = _two_ranks(tiny_spec, factory="tests.factories:stalls_the_first_time",
                      config={**tiny_spec["model"]["config"],
                              "stall_marker": str(tmp_path / "stalled")})
    killed: list[int] = []

    def kill_a_rank() -> None:
        deadline = time.time() + 120
        while time.time() < deadline and not (tmp_path / "stalled").exists():
            time.sleep(0.2)
        time.sleep(1.0)  # its host watch has written what it holds
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                parents = p.parents()  # a rank: torchrun's child, or its leader's
                launcher = " ".join(parents[0 if cold else 1].cmdline()) if len(
                    parents) > 1 else ""
                if not killed and ours(p) and ("torch.distributed.run" in launcher if cold
                                               else "autotune.trials.forkserver" in launcher):
                    p.send_signal(signal.SIGKILL)
                    killed.append(p.pid)

    threading.Thread(target=kill_a_rank, daemon=True).start()
    out = run_trial(trial_request(spec, TrialConfig(4, 2), budget=4 * 2**30, timeout_s=120))
    assert killed, "no rank was found to kill"
    assert out.status == "lost", (out.status, out.error)
    assert out.wall_seconds < 60  # taken down by the leader, not by the time limit
    assert out.launch.kind == launch
    servers = [p for p in psutil.Process().children()
               if "autotune.trials.forkserver" in " ".join(p.cmdline())]
    assert not [c for p in servers for c in p.children(recursive=True)]
    assert not [p for p in psutil.Process().children(recursive=True)
                if "autotune.trials.worker" in " ".join(p.cmdline())]
