"""The search loop, shared by real searches and landscape replays.

Only the executor differs between the two: the strategy, the memory model, the study
and the records are the same code either way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from threadpoolctl import threadpool_limits

from autotune.records import Record
from autotune.tuning.study import HEARTBEAT_SECONDS

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.trials.executor import Executor
    from autotune.tuning.strategies.base import Proposal, Strategy
    from autotune.tuning.study import StudyLog

# Proposals in a row that were pruned on a prediction before the loop takes the strategy
# to be going nowhere (an Optuna sampler can keep proposing what does not fit).
MAX_PRUNED_IN_A_ROW = 200


@dataclass
class Limits:
    """When to stop starting trials. `max_trials` counts trials that ran (not configs
    pruned on a prediction); `budget_seconds` caps their summed cost: no trial starts that
    would cross it if it cost as much as the costliest so far."""

    max_trials: int | None = None
    deadline: float | None = None
    budget_seconds: float | None = None  # against the trials' wall time (`spent`)
    # Seconds to leave before the deadline for what follows the search (the confirmation
    # of the contenders so far: none before a config at the target succeeded, or a short
    # search would stop after its first trial to keep time for confirming nothing).
    reserve: Callable[[], float] | None = None
    # What a trial now waits for the devices another search holds, which a trial's wall
    # time (its cost) leaves out: each trial still to start pays it (those in flight hold
    # their devices already), in the reserve's check and in the trials left.
    wait: Callable[[], float] | None = None

    def exhausted(self, costs: list[float], in_flight: int,
                  spent: float | None = None) -> bool:
        """Whether to start no more trials: `costs` what each trial so far would cost to
        run again (Outcome.repeat_seconds), projected onto the next ones; `spent` what they
        took in all (their wall times; by default the costs' sum)."""
        spent = sum(costs) if spent is None else spent
        if self.max_trials is not None and len(costs) + in_flight >= self.max_trials:
            return True
        reserve = self.reserve() if self.reserve is not None else 0.0
        if reserve and costs:  # the next trial and those in flight end before it starts
            reserve += (in_flight + 1) * statistics.median(costs) + self._wait()
        if self.deadline is not None and time.time() + reserve >= self.deadline:
            return True
        # Trials in flight will cost about the median each; the next, up to the costliest.
        committed = in_flight * statistics.median(costs) if costs else 0.0
        return self.budget_seconds is not None and bool(costs) and (
            spent + committed + max(costs) > self.budget_seconds)

    def trials_left(self, costs: list[float], in_flight: int,
                    spent: float | None = None) -> float | None:
        """About how many more trials of the median cost so far the limits leave room for
        (None: no limit bounds them yet), for a strategy that spends its last trials
        differently from its first."""
        left, spent = [], sum(costs) if spent is None else spent
        if self.max_trials is not None:
            left.append(float(self.max_trials - len(costs) - in_flight))
        if costs and (typical := statistics.median(costs)) > 0:
            committed = in_flight * typical
            if self.budget_seconds is not None:
                left.append((self.budget_seconds - spent - committed) / typical)
            if self.deadline is not None:
                reserve = self.reserve() if self.reserve is not None else 0.0
                left.append((self.deadline - time.time() - reserve - committed)
                            / (typical + self._wait()))
        return max(0.0, min(left)) if left else None

    def _wait(self) -> float:
        return self.wait() if self.wait is not None else 0.0


def drive(
    strategy: Strategy,
    executor: Executor,
    log: StudyLog,
    limits: Limits,
    *,
    history: list[Record] | None = None,
    on_start: Callable[[Proposal], None] | None = None,
    on_record: Callable[[Record], None] | None = None,
    review: Callable[[Record, list[Record]], None] | None = None,
) -> list[Record]:
    """Ask, run, record until the strategy has nothing more or a limit is reached; trials
    in flight then finish. `history` (default: the study's records) is extended in place,
    so a caller keeps what finished even when the loop is interrupted. `review` may
    reject a finished trial's outcome before the study is told (numerics)."""
    history = log.history() if history is None else history
    # What ran so far, for the limits: a resumed study's confirmation runs are not trials
    # of the search (search.n_trials counts those), nor priced like them.
    costs = [r.outcome.repeat_seconds for r in history if r.counted]
    spent = sum(r.outcome.wall_seconds or 0.0 for r in history if r.counted)
    in_flight: dict[int, tuple[int, Proposal]] = {}  # ticket -> (trial number, proposal)
    claimed: list[TrialConfig] = []  # configs another driver took first
    asking, pruned_in_a_row = True, 0

    def record(r: Record) -> None:
        history.append(r)
        if on_record is not None:
            on_record(r)

    # The strategy's linear algebra is small: BLAS's threads would only spin on the cores
    # the trials run on (and on 2 busy cores made a 108-column inverse 100x slower).
    blas = threadpool_limits(1)
    try:
        while True:
            while asking and len(in_flight) < executor.capacity and not limits.exhausted(
                    costs, len(in_flight), spent):
                pending = ([p.config for _, p in in_flight.values()] + log.running_elsewhere()
                           + claimed)
                strategy.ctx.trials_left = limits.trials_left(costs, len(in_flight), spent)
                proposal = strategy.ask(history, pending)
                if proposal is None or pruned_in_a_row >= MAX_PRUNED_IN_A_ROW:
                    asking = False
                    break
                if not proposal.run:
                    pruned_in_a_row += 1
                    record(log.prune(proposal))
                    continue
                number = log.start(proposal)
                if number is None:  # another driver took this config first
                    claimed.append(proposal.config)
                    continue
                pruned_in_a_row = 0
                if on_start is not None:
                    on_start(proposal)
                in_flight[executor.submit(proposal.config, **proposal.overrides)] = (
                    number, proposal)
            if not in_flight:
                break
            for ticket, outcome in executor.wait(timeout=HEARTBEAT_SECONDS):
                number, proposal = in_flight.pop(ticket)
                costs.append(outcome.repeat_seconds)
                spent += outcome.wall_seconds or 0.0
                if review is not None:
                    review(log.record(proposal, outcome, number), history)
                record(log.finish(number, proposal, outcome))
                asking = True  # new evidence: the strategy may have more to ask
            log.heartbeat()
    except BaseException:
        log.abandon("the search was interrupted while it ran")
        raise
    finally:
        blas.restore_original_limits()
    return history
