"""An executor that answers from a tuning landscape instead of running anything.

Only the executor differs from a real search: the strategy, memory model, study and
records on top of it are the same code. Time is virtual: `workers` trials run at once,
each taking the seconds the landscape says it cost, so a replay measures the wall time
a search with that many GPUs would take.
"""

from __future__ import annotations

import copy
import heapq
from pathlib import Path

from autotune.bench.landscape import Landscape, load_landscape
from autotune.config import TrialConfig
from autotune.records import ERROR, Outcome
from autotune.trials.executor import Executor


class ReplayExecutor(Executor):
    """Outcome, samples/s, peak memory and cost (wall seconds) from the landscape's table."""

    def __init__(self, landscape: Landscape | str | Path, workers: int = 1) -> None:
        self.landscape = (landscape if isinstance(landscape, Landscape)
                          else load_landscape(landscape))
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
        return outcome

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
