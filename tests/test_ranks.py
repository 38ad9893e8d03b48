"""Trials of several ranks (torchrun, gloo on CPU): the data is split so every rank trains
b x gas samples per step, a failure on any rank is the trial's, and memory is the worst
rank's."""

from __future__ import annotations

import psutil
import pytest

from autotune.config import TrialConfig
from autotune.trials.launch import run_trial
from tests.conftest import trial_request

pytestmark = pytest.mark.slow


def _two_ranks(tiny_spec, **model):
    tiny_spec["hardware"] = {"gpus_per_trial": 2}
    if model:
        tiny_spec["model"] = model
    return tiny_spec


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_two_rank_trial_trains_b_gas_world_samples_per_step(tiny_spec, zero_stage):
    spec = _two_ranks(tiny_spec)
    out = run_trial(trial_request(spec, TrialConfig.of(2, 4, zero_stage=zero_stage)))
    assert out.status == "ok", out.error
    assert out.extra["wrapped_as"] == ("DeepSpeedEngine" if zero_stage else
                                       "DistributedDataParallel")
    steps = 3  # 1 warm-up + 2 timed
    by_rank = out.extra["micro_batches_by_rank"]
    assert sorted(by_rank) == [0, 1]
    for sizes in by_rank.values():  # every micro-batch full, gas of them per step
        assert sizes == [2] * (4 * steps)
    # Throughput counts all ranks' samples: b x gas x world per timed step.
    assert out.samples_per_second * out.timed_seconds == pytest.approx(2 * 4 * 2 * 2)
    peaks = out.extra["peak_memory_by_rank"]
    assert out.peak_memory_bytes == max(peaks.values()) > 0


def test_oom_on_rank_1_is_the_trials_oom_and_ends_every_rank(tiny_spec):
    spec = _two_ranks(tiny_spec, factory="tests.factories:oom_on_rank_1")
    before = {p.pid for p in psutil.process_iter()}
    out = run_trial(trial_request(spec, TrialConfig(2, 4), timeout_s=120))
    assert out.status == "oom", out.error
    assert out.error.startswith("rank 1:")
    assert out.wall_seconds < 100  # taken down by torchrun, not by the time limit
    left = [p for p in psutil.process_iter(["cmdline"]) if p.pid not in before
            and "autotune.trials.worker" in " ".join(p.info["cmdline"] or [])]
    assert not left
