"""The two references every search is compared against, found by real trials the way a
user finds them: Trainer's defaults and the guide's recipe.

The baseline is what a user gets from Trainer's defaults (the knob table's baseline
family) with auto_find_batch_size on, per-device batch set to the target (per rank) and
accumulation left at 1. auto_find_batch_size runs the target batch, and after each OOM 0.9
times that (rounded down), keeping accumulation: it lands on the largest batch of that
chain that runs, with an effective batch that shrank with it. A landscape holds only
divisors of the target; replays use the halving chain among them instead.

The recipe (tuning/recipe.py) runs right after it: its family at the largest batch that fits
with the target effective batch (accumulation derived), on the first of its rungs (the
recipe, then the guide's memory levers) that the memory model says fits at all.

Both walk a chain of batches, largest first, as accelerate does, but start from the
memory model's guess instead of the top: after a success they jump to the largest batch
the now calibrated model gives an even chance to fit (`MemoryGate.ceiling`, the odds the
search's own trials need), after an OOM they come down. They do not walk up past it: the
model, calibrated by the success below, is believed (docs/search.md has the figures).
Where the model says nothing on the chain fits, its smallest batch runs once: one trial
proves it, rather than a walk down the chain OOM by OOM. Where the baseline's weights,
gradients and optimizer states alone exceed the limit (fp32 AdamW states of a model too
large for the device: arithmetic, not an estimate), not even that trial runs: its record
says so, as pruned.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.config import Family, TrialConfig, auto_find_chain, halving_batches
from autotune.records import FAILED, PRUNED, Outcome, Record
from autotune.summary import BASELINE, RECIPE
from autotune.tuning.strategies.base import Proposal, SearchContext
from autotune.tuning.strategies.memory_gate import MemoryGate

REASON, RECIPE_REASON = BASELINE, RECIPE  # the probes' trials' reasons


def baseline_chain(ctx: SearchContext) -> list[TrialConfig]:
    """The configs auto_find_batch_size would try, largest first (a real search)."""
    return auto_find_chain(TrialConfig(ctx.target_batch_size // ctx.world_size, 1,
                                       ctx.baseline_family))


def halving_chain(ctx: SearchContext) -> list[TrialConfig]:
    """The baseline family's candidates on the halving chain, largest first (replays)."""
    pool = {c.per_device_train_batch_size: c for c in ctx.candidates
            if c.family == ctx.baseline_family}
    per_rank = ctx.target_batch_size // ctx.world_size
    return [pool[b] for b in halving_batches(per_rank) if b in pool]


def recipe_chains(ctx: SearchContext, rungs: Sequence[Family],
                  batches: Sequence[int]) -> list[list[TrialConfig]]:
    """Each rung of the recipe at `batches` (divisors of the per-rank target), largest
    first, accumulation derived: every config trains the target effective batch."""
    return [[fam.config(b, ctx.target_batch_size, ctx.world_size)
             for b in sorted(batches, reverse=True)] for fam in rungs]


def walk(chain: Sequence[TrialConfig], tried: dict[TrialConfig, Outcome],
         gate: MemoryGate) -> TrialConfig | None:
    """The next batch of `chain` (largest first) to run given what ran, or None when the
    largest batch that fits is known (or nothing on it fits)."""
    ok = [i for i, c in enumerate(chain) if c in tried and tried[c].ok]
    oom = min((i for i, c in enumerate(chain) if c in tried and tried[c].is_oom),
              default=None)  # the largest batch that ran out of memory
    if ok:  # up from the largest that ran, below the smallest that did not
        above = [i for i in range(min(ok)) if (oom is None or i > oom)
                 and chain[i] not in tried]
        if not above:
            return None
        # Calibrated by what ran: jump to the largest batch with an even chance to fit.
        return next((chain[i] for i in above if gate.p_fit(chain[i]) >= 0.5), None)
    below = [c for i, c in enumerate(chain) if (oom is None or i > oom) and c not in tried]
    if not below:
        return None
    fitting = [c for c in below if gate.fits(c)[0]]
    return fitting[0] if fitting else below[-1]


def _tried(history: Sequence[Record], reason: str) -> dict[TrialConfig, Outcome]:
    return {r.config: r.outcome for r in history if r.reason == reason}


class BaselineProbe:
    """Trainer's defaults with auto_find_batch_size, probed as described above."""

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.chain = ctx.baseline_chain if ctx.baseline_chain is not None else (
            halving_chain(ctx))

    def next(self, history: Sequence[Record], pending: Sequence[TrialConfig],
             gate: MemoryGate) -> Proposal | None:
        if not self.chain or any(c in self.chain for c in pending):
            return None
        tried = _tried(history, REASON)
        if any(o.status in (PRUNED, *FAILED) for o in tried.values()):
            return None  # failing (or pruned by an earlier version): nothing to compare with
        c = walk(self.chain, tried, gate)
        if c is None:
            return None
        why = gate.certain_oom(c) if not any(o.ran for o in tried.values()) else None
        return Proposal(c, REASON, run=why is None, predicted_memory_bytes=gate.predicted(c),
                        why=why or "")


class RecipeProbe:
    """The guide's recipe at the largest batch that fits, on the first rung that fits."""

    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.rungs = ctx.recipe_chains or []

    def next(self, history: Sequence[Record], pending: Sequence[TrialConfig],
             gate: MemoryGate) -> Proposal | None:
        if any(c in rung for rung in self.rungs for c in pending):
            return None
        tried = _tried(history, RECIPE_REASON)
        if any(o.status in (PRUNED, *FAILED) for o in tried.values()):
            return None  # the recipe itself fails (a kernel, a compile): no reference
        started = [i for i, rung in enumerate(self.rungs) if any(c in tried for c in rung)]
        if started:  # once a rung ran, the ones before it are settled
            first = started[-1]
        else:  # the first rung whose smallest batch the memory model says fits
            first = next((i for i, rung in enumerate(self.rungs)
                          if gate.fits(rung[-1])[0]), len(self.rungs) - 1)
        for i, rung in enumerate(self.rungs[first:], first):
            if i > first and not gate.fits(rung[-1])[0]:
                # A rung after one that ran out of memory at every batch: tried only where
                # the model, taught by those OOMs, says its smallest batch fits (a chain of
                # OOMs at the lever combination the rungs share is cut, not walked).
                continue
            c = walk(rung, tried, gate)
            if c is None and not any(tried[c].ok for c in rung if c in tried):
                continue  # down to its smallest batch and out of memory: the next rung
            return None if c is None else Proposal(
                c, RECIPE_REASON, predicted_memory_bytes=gate.predicted(c))
        return None


def reference(history: Sequence[Record], reason: str) -> Record | None:
    """The reference a probe settled on: the largest batch of its trials that ran (the
    baseline's chain keeps its accumulation; the recipe's rungs move on only when none of
    a rung's batches ran, so its successes share one rung)."""
    ok = [r for r in history if r.reason == reason and r.outcome.ok]
    return max(ok, key=lambda r: r.config.per_device_train_batch_size) if ok else None

