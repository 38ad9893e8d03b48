"""The search loop, shared by real searches and landscape replays.

Only the executor differs between the two: the strategy, the memory model, the study
records and the exports are the same code either way.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

from autotune.config import Outcome, TrialConfig
from autotune.strategies.base import Record

if TYPE_CHECKING:
    from autotune.strategies.base import Proposal, Strategy


class Executor(ABC):
    """Runs one trial and says what happened.

    Call order: run() once per proposal, in sequence; close() once at the end.
    """

    @abstractmethod
    def run(self, config: TrialConfig) -> Outcome:
        """Run (or look up) one trial. Never raises for a trial that failed: that is an Outcome."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release workers; the default has none."""


def pruned_outcome(proposal: Proposal) -> Outcome:
    return Outcome(status="pruned", predicted_memory_bytes=proposal.predicted_memory_bytes,
                   error=f"not run: {proposal.reason}", wall_seconds=0.0)


def drive(
    strategy: Strategy,
    executor: Executor,
    history: list[Record],
    *,
    max_trials: int | None = None,
    deadline: float | None = None,
    budget_seconds: float | None = None,
    on_record: Callable[[Record, Proposal], None] | None = None,
    on_start: Callable[[Proposal], None] | None = None,
) -> list[Record]:
    """Ask, run, record until the strategy stops, `max_trials` trials ran, or `deadline`.

    `history` is extended in place (it may hold records of an earlier, resumed search).
    `max_trials` counts trials that ran, not configs pruned by prediction.
    `budget_seconds` caps the summed trial cost (Outcome.wall_seconds): no trial starts
    that would cross it if it cost as much as the costliest trial so far.
    """
    costs = [r.outcome.wall_seconds or 0.0 for r in history if r.outcome.status != "pruned"]
    while max_trials is None or len(costs) < max_trials:
        if deadline is not None and time.time() >= deadline:
            break
        if budget_seconds is not None and costs and (
                sum(costs) + max(costs) > budget_seconds):
            break
        proposal = strategy.ask(history)
        if proposal is None:
            break
        if proposal.run:
            if on_start is not None:
                on_start(proposal)
            outcome = executor.run(proposal.config)
            if outcome.predicted_memory_bytes is None:
                outcome.predicted_memory_bytes = proposal.predicted_memory_bytes
            costs.append(outcome.wall_seconds or 0.0)
        else:
            outcome = pruned_outcome(proposal)
        record = Record(proposal.config, outcome, proposal.reason)
        history.append(record)
        if on_record is not None:
            on_record(record, proposal)
    return history
