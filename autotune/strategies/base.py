"""The seam between a search strategy and whatever runs its trials (real or replayed).

Call order: the driver builds a strategy with a SearchContext, then loops
    proposal = strategy.ask(history)   # None: the strategy is done
    outcome  = run or skip proposal    # skip when proposal.run is False (pruned)
    history.append(Record(proposal.config, outcome, proposal.reason))
A strategy must be able to resume from any history (a restarted search replays the
study's records into `ask`), so it keeps no state that the history cannot rebuild
other than its random seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from autotune.config import Outcome, TrialConfig

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.shape import ModelShape


@dataclass
class SearchContext:
    candidates: list[TrialConfig]  # every config the device rules allow
    device: DeviceSpec
    world_size: int
    target_batch_size: int
    memory_limit_bytes: int  # per rank: device memory or the user's budget
    shape: ModelShape | None = None
    max_trials: int | None = None
    seed: int = 0
    # Free-form notes of what the device rules removed, for the report.
    pruned_by_rules: dict[str, str] = field(default_factory=dict)


@dataclass
class Proposal:
    config: TrialConfig
    reason: str  # "baseline", "frontier", "sampler", "predicted-oom", ...
    run: bool = True  # False: record as pruned without running (predicted not to fit)
    predicted_memory_bytes: int | None = None


@dataclass
class Record:
    config: TrialConfig
    outcome: Outcome
    reason: str = ""


class Strategy(ABC):
    name: str = "strategy"

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def ask(self, history: Sequence[Record]) -> Proposal | None:
        """The next config to try given everything recorded so far, or None when done."""
