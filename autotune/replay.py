"""An executor that answers from a tuning landscape instead of running anything.

Only the executor differs from a real search: the strategy, memory model, study and
exports on top of it are the same code.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from autotune.config import Outcome, TrialConfig
from autotune.landscape import Landscape, load_landscape
from autotune.loop import Executor


class ReplayExecutor(Executor):
    """Outcome, samples/s, peak memory and cost (wall seconds) from the landscape's table."""

    def __init__(self, landscape: Landscape | str | Path) -> None:
        self.landscape = (landscape if isinstance(landscape, Landscape)
                          else load_landscape(landscape))

    def run(self, config: TrialConfig) -> Outcome:
        found = self.landscape.table.get(config)
        if found is None:
            return Outcome(status="error", wall_seconds=0.0,
                           error=f"{config.label()} is not in landscape {self.landscape.name}")
        outcome = dataclasses.replace(found, extra=dict(found.extra))
        if not outcome.ok:
            outcome.error = outcome.error or f"{outcome.status} (replayed)"
        return outcome
