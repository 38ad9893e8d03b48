"""An executor that answers from a tuning landscape instead of running anything.

Only the executor differs from a real search: the strategy, memory model, study and
records on top of it are the same code. Time is virtual: `workers` trials run at once,
each taking the seconds the landscape says it cost, so a replay measures the wall time
a search with that many GPUs would take.

A table of noise-free rates that says its devices' noise (`Landscape.fresh_noise`) is
measured as a device would: each measurement draws that noise afresh, so a search that
re-measures learns something and a lucky draw does not stay lucky.
"""

from __future__ import annotations

import copy
import heapq
import math
import zlib
from pathlib import Path

import numpy as np

from autotune.bench.landscape import Landscape, load_landscape
from autotune.config import TrialConfig
from autotune.records import ERROR, Outcome
from autotune.trials.executor import Executor


class ReplayExecutor(Executor):
    """Outcome, samples/s, peak memory and cost (wall seconds) from the landscape's table."""

    def __init__(self, landscape: Landscape | str | Path, workers: int = 1,
                 seed: int = 0) -> None:
        self.landscape = (landscape if isinstance(landscape, Landscape)
                          else load_landscape(landscape))
        # Each search of a landscape draws its own noise, the same for the same seed.
        self._noise = np.random.default_rng([seed, zlib.crc32(self.landscape.name.encode())])
        self.capacity = workers
        self.clock = 0.0  # virtual seconds since the search started
        self._running: list[tuple[float, int, Outcome]] = []  # (ends at, ticket, outcome)
        self._next = 0

    def _answer(self, config: TrialConfig) -> Outcome:
        found = self.landscape.table.get(config)
        if found is None:
            return Outcome(ERROR, wall_seconds=0.0,
                           error=f"{config.label()} is not in landscape {self.landscape.name}")
        outcome = copy.deepcopy(found)  # the search writes to what it is told
        if not outcome.ok:
            outcome.error = outcome.error or f"{outcome.status} (replayed)"
        elif self.landscape.fresh_noise:
            factor = math.exp(self._noise.normal(0.0, self.landscape.fresh_noise))
            outcome.samples_per_second = (outcome.samples_per_second or 0.0) * factor
            if outcome.tokens_per_second is not None:
                outcome.tokens_per_second *= factor
        return outcome

    def measure(self, config: TrialConfig) -> float | None:
        """`config`'s samples/s measured once more, off the clock (a confirmation run's
        figure: the bench does not charge the confirmation to the search's budget); None
        where it did not run to the end."""
        outcome = self._answer(config)
        return outcome.samples_per_second if outcome.ok else None

    def submit(self, config: TrialConfig, *, training_args: dict | None = None,
               steps: int | None = None) -> int:
        outcome = self._answer(config)
        ticket, self._next = self._next, self._next + 1
        heapq.heappush(self._running, (self.clock + (outcome.wall_seconds or 0.0), ticket,
                                       outcome))
        return ticket

    def wait(self, timeout: float | None = None) -> list[tuple[int, Outcome]]:
        """The next trial to end; the clock moves to its end."""
        if not self._running:
            return []
        ends, ticket, outcome = heapq.heappop(self._running)
        self.clock = max(self.clock, ends)
        return [(ticket, outcome)]
