"""The baseline every search is compared against: Trainer's defaults (the knob table's
baseline family) at the batch auto_find_batch_size would reach."""

from __future__ import annotations

from collections.abc import Sequence

from autotune.config import Family, TrialConfig, halving_batches
from autotune.records import FAILED, PRUNED, Record
from autotune.search.strategies.base import Proposal, SearchContext
from autotune.search.strategies.memory_gate import MemoryGate

REASON = "baseline"


class BaselineProbe:
    """auto_find_batch_size's batch: the largest of target, target/2, ... that runs.

    It starts at the largest batch predicted to fit; once a baseline trial has run and
    calibrated the model, the next larger batch is tried too if it is now predicted to
    fit, so a cautious first prediction does not understate the baseline."""

    def __init__(self, ctx: SearchContext) -> None:
        self.pool = {c.per_device_train_batch_size: c for c in ctx.candidates
                     if c.family == Family.baseline()}
        per_rank = ctx.target_batch_size // ctx.world_size
        self.halving = [b for b in halving_batches(per_rank) if b in self.pool]

    def next(self, history: Sequence[Record], pending: Sequence[TrialConfig],
             gate: MemoryGate) -> Proposal | None:
        if not self.halving or any(c.family == Family.baseline() for c in pending):
            return None
        tried = {r.config: r for r in history if r.reason == REASON}
        if any(r.outcome.status in (PRUNED, *FAILED) for r in tried.values()):
            return None  # predicted not to fit at all, or failing: nothing to compare with
        ok = [c.per_device_train_batch_size for c, r in tried.items() if r.outcome.ok]
        if ok:
            larger = [b for b in self.halving if b > max(ok)]
            if not larger:
                return None
            c = self.pool[min(larger)]  # the next batch up from the largest that ran
            if c in tried or not gate.fits(c)[0]:
                return None
            return Proposal(c, REASON, predicted_memory_bytes=gate.predicted(c))
        for b in self.halving:
            c = self.pool[b]
            if c not in tried and gate.fits(c)[0]:
                return Proposal(c, REASON, predicted_memory_bytes=gate.predicted(c))
        smallest = self.pool[self.halving[-1]]
        if smallest in tried:
            return None
        return Proposal(smallest, REASON, run=False, predicted_memory_bytes=gate.predicted(
            smallest))
