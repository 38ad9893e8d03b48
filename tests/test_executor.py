"""Trials launched through Ray run as the real run would: with the node's cores."""

from __future__ import annotations

import pytest

from autotune.config import TrialConfig
from autotune.device import node_cpus
from autotune.spec import load_spec

pytestmark = pytest.mark.slow


def test_trial_through_ray_gets_its_share_of_the_cores_and_busy_cores_are_not_its_fault(
        tiny_spec, tmp_path, monkeypatch):
    """Ray sets OMP_NUM_THREADS to a task's num_cpus (1 by default), which the trial
    process inherited: every trial ran on one thread while a real run gets them all.
    Then, on the same Ray: a trial whose cores stay leased by another search past its
    limit is the machine's failure: run once more, then recorded `lost`, never charged
    to the config."""
    from autotune.trials.executor import RayExecutor
    from tests.test_lease import ALL_CORES, _holder, _wait_for

    monkeypatch.setenv("AUTOTUNE_LEASE_DIR", str(tmp_path / "leases"))
    executor = RayExecutor(load_spec(tiny_spec), timeout_s=120)
    proc = None
    try:
        out = executor.run(TrialConfig(4, 4))
        assert out.status == "ok", out.error
        assert out.measured.cpu_threads == node_cpus()
        proc, log = _holder(tmp_path, "other-search", hold=120.0, want=ALL_CORES)
        _wait_for(log, "got")
        executor.timeout_s = 2  # the trial's own limit, which bounds its wait
        out = executor.run(TrialConfig(4, 4))
    finally:
        executor.close()
        if proc is not None:
            proc.kill()
            proc.wait()
    assert out.status == "lost", out.error
    assert "tried 2 times" in out.error and "not the config" in out.error
