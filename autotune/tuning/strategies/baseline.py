"""The baseline every search is compared against: what a user gets from Trainer's
defaults (the knob table's baseline family) with auto_find_batch_size on, per-device batch
set to the target (per rank) and accumulation left at 1.

auto_find_batch_size runs the target batch, and after each OOM 0.9 times that (rounded
down), keeping accumulation: it lands on the largest batch of that chain that runs, with
an effective batch that shrank with it. The probe finds that batch by real trials, as
accelerate does, but starts from the memory model's guess instead of the top: after a
success it jumps to the largest batch the now calibrated model says fits (or probes the
next one up while that is within TOLERANCE of the limit, so a batch that fits is tried
rather than assumed not to), after an OOM it comes down. A landscape
holds only divisors of the target; replays use the halving chain among them instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.config import Family, TrialConfig, auto_find_chain, halving_batches
from autotune.records import FAILED, PRUNED, Record
from autotune.tuning.strategies.base import Proposal, SearchContext
from autotune.tuning.strategies.memory_gate import MemoryGate

REASON = "baseline"
# Walk up while the calibrated prediction is at most this share of the limit: a batch
# predicted 10% over may still fit, one predicted far over is not worth an OOM trial.
TOLERANCE = 1.10


def baseline_chain(ctx: SearchContext) -> list[TrialConfig]:
    """The configs auto_find_batch_size would try, largest first (a real search)."""
    return auto_find_chain(TrialConfig(ctx.target_batch_size // ctx.world_size, 1,
                                       Family.baseline()))


def halving_chain(ctx: SearchContext) -> list[TrialConfig]:
    """The baseline family's candidates on the halving chain, largest first (replays)."""
    pool = {c.per_device_train_batch_size: c for c in ctx.candidates
            if c.family == Family.baseline()}
    per_rank = ctx.target_batch_size // ctx.world_size
    return [pool[b] for b in halving_batches(per_rank) if b in pool]


class BaselineProbe:
    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.chain = ctx.baseline_chain if ctx.baseline_chain is not None else (
            halving_chain(ctx))

    def next(self, history: Sequence[Record], pending: Sequence[TrialConfig],
             gate: MemoryGate) -> Proposal | None:
        if not self.chain or any(c in self.chain for c in pending):
            return None
        tried = {r.config: r.outcome for r in history if r.reason == REASON}
        if any(o.status in (PRUNED, *FAILED) for o in tried.values()):
            return None  # predicted not to fit at all, or failing: nothing to compare with
        ok = [i for i, c in enumerate(self.chain) if c in tried and tried[c].ok]
        oom = min((i for i, c in enumerate(self.chain) if c in tried and tried[c].is_oom),
                  default=None)  # the largest batch that ran out of memory
        if ok:  # up from the largest that ran, below the smallest that did not
            above = [i for i in range(min(ok)) if (oom is None or i > oom)
                     and self.chain[i] not in tried]
            if not above:
                return None
            limit = self.ctx.memory_limit_bytes
            predicted = {i: gate.predicted(self.chain[i]) for i in above}
            # Calibrated by what ran: jump to the largest predicted to fit; where none is,
            # probe the next one up if it is within TOLERANCE of the limit.
            fitting = [i for i in above if predicted[i] is None or predicted[i] <= limit]
            if fitting:
                i = fitting[0]
            elif predicted[above[-1]] <= TOLERANCE * limit:
                i = above[-1]
            else:
                return None
            return Proposal(self.chain[i], REASON, predicted_memory_bytes=predicted[i])
        below = [c for i, c in enumerate(self.chain)
                 if (oom is None or i > oom) and c not in tried]
        if not below:
            return None
        fitting = [c for c in below if gate.fits(c)[0]]
        if fitting:
            return Proposal(fitting[0], REASON, predicted_memory_bytes=gate.predicted(
                fitting[0]))
        smallest = below[-1]
        return Proposal(smallest, REASON, run=False, predicted_memory_bytes=gate.predicted(
            smallest))
