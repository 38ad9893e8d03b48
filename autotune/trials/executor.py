"""Where trials run: the Executor seam, and Ray tasks on an embedded local Ray or a cluster.

Each Ray task launches the trial process (trials.launch) on the node Ray picked, with the
GPUs Ray reserved for it, so a trial never shares a GPU and its timings are its own.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from autotune.plan.device import node_cpus
from autotune.records import CRASHED, Outcome
from autotune.trials.launch import run_trial
from autotune.trials.protocol import TrialRequest, make_request

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.spec import Spec

log = logging.getLogger("autotune")
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"


class Executor(ABC):
    """Runs trials and says what happened.

    Call order: submit() up to `capacity` trials, each returning a ticket; wait() blocks
    until at least one of them ends (or `timeout` seconds pass) and returns (ticket,
    Outcome) pairs; submit more as tickets come back; close() once at the end.
    """

    capacity: int = 1

    @abstractmethod
    def submit(self, config: TrialConfig, *, training_args: dict | None = None,
               steps: int | None = None) -> int:
        """Start one trial; never raises for a trial that fails (that is an Outcome).
        `training_args` replace the kwargs built from the config (an exported file's),
        `steps` the spec's timed steps."""

    @abstractmethod
    def wait(self, timeout: float | None = None) -> list[tuple[int, Outcome]]:
        """Trials that ended since the last call; [] when `timeout` passed first."""

    def run(self, config: TrialConfig) -> Outcome:
        """One trial, start to end."""
        ticket = self.submit(config)
        while True:
            for done, outcome in self.wait():
                if done == ticket:
                    return outcome

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers; the default has none."""


def _trial_task(request: dict) -> dict:
    return run_trial(TrialRequest(**request)).to_dict()


class RayExecutor(Executor):
    """Each trial a Ray task, with the GPUs it needs and its share of the node's cores."""

    def __init__(self, spec: Spec, *, on_cpu: bool, address: str | None = None,
                 shape: dict | None = None, memory_budget_bytes: int | None = None,
                 timeout_s: float = 600.0) -> None:
        self.spec, self.on_cpu, self.address = spec, on_cpu, address
        self.shape, self.budget, self.timeout_s = shape, memory_budget_bytes, timeout_s
        self.gpus = 0 if on_cpu else spec.world_size
        self._owns_ray = False
        self._remote: Any = None
        self._refs: dict[Any, int] = {}
        self._next = 0

    def _connect(self) -> None:
        """Ray starts (or is joined) at the first trial, so a resumed search with nothing
        left to run, or one that stops at once, does not pay for it."""
        import ray

        if self._remote is None:
            self._remote = ray.remote(max_retries=0)(_trial_task)
        if ray.is_initialized():
            return
        init: dict[str, Any] = {"address": self.address, "include_dashboard": False,
                                "log_to_driver": False, "logging_level": logging.WARNING}
        if self.address is None:  # embedded: this search's own Ray, never another's
            init |= {"address": "local", "num_cpus": node_cpus()}
            # Ray turns token authentication on for a new local cluster and warns so at
            # every start; that is the default we want, so the notice is not shown.
            logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
        ray.init(**init)
        self._owns_ray = True

    def submit(self, config: TrialConfig, *, training_args: dict | None = None,
               steps: int | None = None) -> int:
        self._connect()
        # One trial at a time: it gets every core of the node, as the real run would.
        threads = node_cpus()
        request = make_request(self.spec, config, on_cpu=self.on_cpu, shape=self.shape,
                               memory_budget_bytes=self.budget, timeout_s=self.timeout_s,
                               cpu_threads=threads, steps=steps)
        if training_args is not None:
            request.training_args = training_args
        task = self._remote.options(num_cpus=threads, num_gpus=self.gpus)
        ticket, self._next = self._next, self._next + 1
        self._refs[task.remote(vars(request))] = ticket
        return ticket

    def wait(self, timeout: float | None = None) -> list[tuple[int, Outcome]]:
        import ray

        if not self._refs:
            return []
        try:
            ready, _ = ray.wait(list(self._refs), num_returns=1, timeout=timeout)
        except KeyboardInterrupt:
            # The task's own handler kills the trial's process group on interrupt.
            for ref in self._refs:
                ray.cancel(ref, force=False)
            raise
        done = []
        for ref in ready:
            ticket = self._refs.pop(ref)
            try:
                done.append((ticket, Outcome.from_dict(ray.get(ref))))
            except ray.exceptions.RayError as exc:  # the worker died under the trial
                done.append((ticket, Outcome(CRASHED, error=f"Ray worker failed: {exc}"[-3000:])))
        return done

    def close(self) -> None:
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
