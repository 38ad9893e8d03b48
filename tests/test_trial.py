"""Real trial processes: every way a trial can end becomes an Outcome, never an exception."""

from __future__ import annotations

import pytest

from autotune.config import TrialConfig
from autotune.spec import load_spec
from autotune.trial import run_trial

pytestmark = pytest.mark.slow


def _spec(tiny_spec, **model):
    if model:
        tiny_spec["model"] = model
    return load_spec(tiny_spec).model_dump()


def test_ok_trial_measures_throughput_and_memory(tiny_spec):
    out = run_trial(_spec(tiny_spec), TrialConfig(4, 4), timeout_s=120)
    assert out.status == "ok", out.error
    assert out.samples_per_second > 0
    assert out.tokens_per_second == pytest.approx(out.samples_per_second * 32)
    assert len(out.step_seconds) == 3  # 1 warm-up + 2 timed
    assert out.timed_seconds == pytest.approx(sum(out.step_seconds[1:]))
    assert out.peak_memory_bytes > 0
    assert out.wall_seconds > out.timed_seconds


def test_budget_exceeded_is_oom(tiny_spec):
    out = run_trial(_spec(tiny_spec), TrialConfig(16, 1), memory_budget_bytes=2 * 2**20,
                    timeout_s=120)
    assert out.status == "oom"
    assert "memory budget exceeded" in out.error


def test_crash_by_signal_is_recorded(tiny_spec):
    out = run_trial(_spec(tiny_spec, factory="tests.factories:crashes_at_batch_8"),
                    TrialConfig(8, 2), timeout_s=120)
    assert out.status == "crashed"
    assert "SIGSEGV" in out.error


def test_hang_is_killed_at_the_time_limit(tiny_spec):
    out = run_trial(_spec(tiny_spec, factory="tests.factories:hangs_at_batch_8"),
                    TrialConfig(8, 2), timeout_s=25)
    assert out.status == "timeout"
    assert 25 <= out.wall_seconds < 60


def test_non_finite_loss_is_nan(tiny_spec):
    out = run_trial(_spec(tiny_spec, factory="tests.factories:nan_loss"), TrialConfig(4, 4),
                    timeout_s=120)
    assert out.status == "nan", out.error


def test_model_error_keeps_the_tail(tiny_spec):
    tiny_spec["data"]["seq_len"] = 128  # longer than the model's 64 positions
    out = run_trial(_spec(tiny_spec), TrialConfig(4, 4), timeout_s=120)
    assert out.status == "error"
    assert "seq_len 128 exceeds" in out.error
