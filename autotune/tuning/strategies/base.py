"""The seam between a search strategy and the loop that runs its trials (real or replayed).

Call order: the loop builds a strategy with a SearchContext (and the study log, for the
strategies that are Optuna samplers), then repeatedly
    proposal = strategy.ask(history, pending)   # None: nothing to start now
    the loop records the proposal (pruned when proposal.run is False) or runs it
while `pending` holds the configs in flight. A strategy must be able to resume from any
history (a restarted search replays the study's records into `ask`), so it keeps no
state that the history cannot rebuild other than its random seed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from autotune.config import Family, TrialConfig
from autotune.records import Record
from autotune.tuning.numerics import twin_family

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.plan.shape import ModelShape


@dataclass
class SearchContext:
    candidates: list[TrialConfig]  # every config the device rules allow
    device: DeviceSpec
    world_size: int
    target_batch_size: int
    memory_limit_bytes: int  # per rank: device memory or the user's budget
    shape: ModelShape | None = None
    seed: int = 0
    # The configs auto_find_batch_size would try, largest first (probe.py); None: the
    # halving chain among the candidates (a landscape holds nothing else).
    baseline_chain: list[TrialConfig] | None = None
    # Trainer's defaults: the table's baseline family, or where a landscape measured the
    # model's default attention kernel under its name, that family with the name.
    baseline_family: Family = field(default_factory=Family.baseline)
    # The guide's recipe and its memory fallbacks, each a chain of batches, largest first
    # (probe.py); None: no recipe reference.
    recipe_chains: list[list[TrialConfig]] | None = None
    # The memory model's term scales from a similar search (plan/calibration.py
    # `term_scales`), its prior's centre; None: the physics' own (1).
    memory_prior: dict[str, float] | None = None
    # About how many more trials the search's limits allow (`Limits.trials_left`), set
    # by the loop before each ask; None: not bounded.
    trials_left: float | None = None
    # The records a resumed study held when this run began (none in a fresh one): what
    # failed before the user's rerun, often after a fix, does not stop it (`_failing`).
    resumed_records: int = 0


@dataclass
class Proposal:
    config: TrialConfig
    reason: str  # "baseline", "model", "tpe", "predicted-oom: ...", ...
    run: bool = True  # False: record as pruned without running (predicted not to fit)
    # Why a proposal is not run, where `reason` must stay the role it was proposed for (a
    # baseline probe's config that cannot fit is still the baseline's).
    why: str = ""
    predicted_memory_bytes: int | None = None
    trial_number: int | None = None  # set when a sampler already asked the study
    # A deliberate re-measurement of a config that ran (confirmation): not refused as a
    # duplicate. `overrides` go to the executor (exported TrainingArguments, steps).
    repeat: bool = False
    overrides: dict[str, Any] = field(default_factory=dict)


class Strategy(ABC):
    name: str = "strategy"

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        """The next config to try given everything recorded and everything in flight, or
        None when there is nothing worth starting now."""


class Resume(Strategy):
    """A resumed search first runs again what its last session left in flight, under the
    reason it was proposed for (a baseline probe stays one), then asks `inner`."""

    def __init__(self, inner: Strategy, owed: Sequence[tuple[TrialConfig, str]]) -> None:
        super().__init__(inner.ctx)
        self.inner, self.owed, self.name = inner, list(owed), inner.name

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        taken = {r.config for r in history if r.outcome.ran} | set(pending)
        for config, reason in self.owed:
            if config not in taken:
                return Proposal(config, reason)
        return self.inner.ask(history, pending)


TWIN = "twin"  # the reason of a trial run to check a lever against (tuning/numerics.py)


class Twins(Strategy):
    """Before the first config of a family with a lever that must not change the maths
    (a sequence split, tiled compute, a checkpointing variant), its twin without the
    levers runs, at the smallest batch the space holds for it: the driver's parity check
    compares their first steps. A twin that cannot run (out of memory, what such levers
    are for) leaves the lever unchecked, and the report says so."""

    def __init__(self, inner: Strategy) -> None:
        super().__init__(inner.ctx)
        self.inner, self.name = inner, inner.name
        self.by_family: dict[Family, list[TrialConfig]] = {}
        for c in sorted(inner.ctx.candidates, key=lambda c: c.per_device_train_batch_size):
            self.by_family.setdefault(c.family, []).append(c)

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        proposal = self.inner.ask(history, pending)
        if proposal is None or not proposal.run or proposal.repeat:
            return proposal
        family = twin_family(proposal.config)
        if family is None or family not in self.by_family:
            return proposal
        if any(c.family == family for c in pending):
            return None  # its twin is running: the lever waits for it
        if any(r.config.family == family and r.outcome.ran for r in history):
            return proposal
        return Proposal(self.by_family[family][0], TWIN)
