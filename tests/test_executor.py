"""Trials launched through Ray run as the real run would: with the node's cores."""

from __future__ import annotations

import pytest

from autotune.config import TrialConfig
from autotune.plan.device import node_cpus
from autotune.spec import load_spec

pytestmark = pytest.mark.slow


def test_trial_through_ray_gets_its_share_of_the_cores(tiny_spec):
    """Ray sets OMP_NUM_THREADS to a task's num_cpus (1 by default), which the trial
    process inherited: every trial ran on one thread while a real run gets them all."""
    from autotune.trials.executor import RayExecutor

    executor = RayExecutor(load_spec(tiny_spec), timeout_s=120)
    try:
        out = executor.run(TrialConfig(4, 4))
    finally:
        executor.close()
    assert out.status == "ok", out.error
    assert out.extra["cpu_threads"] == node_cpus()
