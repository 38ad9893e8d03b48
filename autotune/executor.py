"""Where trials run: a Ray task per trial, on an embedded local Ray or a cluster.

Each task launches the trial process (autotune.trial) on the node Ray picked, with the
GPUs Ray reserved for it, so a trial never shares a GPU and its timings are its own.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from autotune.config import Outcome, TrialConfig
from autotune.device import node_cpus
from autotune.loop import Executor
from autotune.trial import run_trial

log = logging.getLogger(__name__)


@ray.remote(max_retries=0)
def _trial_task(spec: dict, config: dict, kwargs: dict) -> dict:
    return run_trial(spec, TrialConfig.from_dict(config), **kwargs).to_dict()


class RayExecutor(Executor):
    """Runs each trial as a Ray task (`num_gpus` = GPUs per trial, one trial at a time)."""

    def __init__(self, spec: dict[str, Any], *, address: str | None = None,
                 gpus_per_trial: int = 0, trial_kwargs: dict[str, Any] | None = None) -> None:
        self.spec, self.gpus, self.kwargs = spec, gpus_per_trial, trial_kwargs or {}
        self.address = address
        self._owns_ray = False

    def _connect(self) -> None:
        """Ray starts (or is joined) at the first trial, so a resumed search with nothing
        left to run, or one that stops at once, does not pay for it."""
        if ray.is_initialized():
            return
        init: dict[str, Any] = {"address": self.address, "include_dashboard": False,
                                "log_to_driver": False, "logging_level": logging.WARNING}
        if self.address is None:  # embedded: this search's own Ray, never another's
            init |= {"address": "local", "num_cpus": node_cpus()}
        ray.init(**init)
        self._owns_ray = True

    def run(self, config: TrialConfig) -> Outcome:
        self._connect()
        # One trial at a time: it gets every core of the node, as the real run would.
        threads = node_cpus()
        task = _trial_task.options(num_cpus=threads, num_gpus=self.gpus)
        ref = task.remote(self.spec, config.to_dict(), self.kwargs | {"cpu_threads": threads})
        try:
            return Outcome.from_dict(ray.get(ref))
        except KeyboardInterrupt:
            # The task's own handler kills the trial's process group on interrupt.
            ray.cancel(ref, force=False)
            raise
        except ray.exceptions.RayError as exc:  # the worker died under the trial
            return Outcome("crashed", error=f"Ray worker failed: {exc}"[-3000:])

    def close(self) -> None:
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
