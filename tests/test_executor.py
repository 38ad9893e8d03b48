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


def test_a_search_keeps_the_callers_sigterm_handler_and_the_default_gets_it_back(
        tiny_spec):
    """ray.init sets a SIGTERM handler that exits, and leaves it past its shutdown. A
    caller's own handler (the suite's teardown, a program's clean-up) is its own again as
    soon as Ray has started, for the whole search; where the caller had the default, Ray's
    holds while its Ray runs (its exit lets the search close it) and the default is back
    after."""
    import signal

    from autotune.trials.executor import RayExecutor

    def callers(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, callers)
    try:
        for handler in (callers, signal.SIG_DFL):
            signal.signal(signal.SIGTERM, handler)
            executor = RayExecutor(load_spec(tiny_spec), timeout_s=120)
            try:
                executor._init()
                during = signal.getsignal(signal.SIGTERM)
            finally:
                executor.close()
            assert (during is callers) == (handler is callers), during
            assert callable(during)  # the default's place: Ray's, which exits
            assert signal.getsignal(signal.SIGTERM) is handler
    finally:
        signal.signal(signal.SIGTERM, previous)
