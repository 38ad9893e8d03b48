"""A search that starts from what a similar search found (a near match in the results
store, or in the bench a search of another landscape): the recorded winners and
runner-ups run first, translated to this search's space, then `inner` takes over.

A seed on the baseline's chain or one of the recipe's is left to the probes, which run
the references under their own reasons (a seed that ran the recipe's config under another
reason would leave the recipe without its trial). A seed the memory model says will not
fit here (a longer seq_len, a smaller device) moves down its family's batches to the
largest it says fits, or is dropped.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from autotune.config import Family, TrialConfig
from autotune.records import Record
from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
from autotune.tuning.strategies.memory_gate import MemoryGate
from autotune.tuning.strategies.probe import halving_chain

SEEDED_REASON = "seeded"


def translate(recorded: Mapping[str, Any], ctx: SearchContext,
              tokens_ratio: float = 1.0) -> TrialConfig | None:
    """A recorded config (`TrialConfig.to_dict()` of another search) in this search's
    candidates: each knob's recorded value where this space has it, else the value
    Trainer's defaults take here; the batch nearest (on a log scale, the smaller on a
    tie) to the recorded one times `tokens_ratio` (the recorded seq_len over this one:
    a micro-batch of as many tokens), among the family's candidates. None where the
    family is not a candidate here (the device rules exclude it)."""
    if not ctx.candidates:
        return None
    names = list(ctx.candidates[0].family.to_dict())
    present = {k: {c.family.to_dict()[k] for c in ctx.candidates} for k in names}
    base = ctx.baseline_family.to_dict()
    values = {k: recorded[k] if recorded.get(k) in present[k] else base[k] for k in names}
    try:
        family = Family.of(values)
    except Exception:  # noqa: BLE001 - a value this autotune's knob table cannot read
        return None
    mine = [c for c in ctx.candidates if c.family == family]
    if not mine:
        return None
    want = max(1.0, float(recorded.get("per_device_train_batch_size") or 1) * tokens_ratio)
    return min(mine, key=lambda c: (abs(math.log(c.per_device_train_batch_size / want)),
                                    c.per_device_train_batch_size))


def runnable(seeds: Sequence[TrialConfig], ctx: SearchContext) -> list[TrialConfig]:
    """The seeds a Seeded strategy runs itself: each once, none that is on the baseline's
    chain or a recipe's (the probes run those under their own reasons)."""
    baseline = ctx.baseline_chain
    probes = {*(baseline if baseline is not None else halving_chain(ctx)),
              *(c for chain in ctx.recipe_chains or [] for c in chain)}
    return [c for c in dict.fromkeys(seeds) if c not in probes]


class Seeded(Strategy):
    """`seeds` first (see the module), then `inner`."""

    def __init__(self, inner: Strategy, seeds: Sequence[TrialConfig]) -> None:
        super().__init__(inner.ctx)
        self.inner, self.name = inner, inner.name
        self.seeds = runnable(seeds, self.ctx)
        self.gate = MemoryGate(self.ctx)

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        # A seed is tried once: where it ran out of memory, the search takes it from there.
        tried = {r.config.family for r in history if r.reason == SEEDED_REASON} | {
            c.family for c in pending}
        taken = {r.config for r in history if r.outcome.ran} | set(pending)
        open_ = [s for s in self.seeds if s.family not in tried]
        if open_:
            self.gate.update(history)
        for seed in open_:
            c = self._fitting(seed)
            if c is not None and c not in taken:
                return Proposal(c, SEEDED_REASON, predicted_memory_bytes=self.gate.predicted(c))
        return self.inner.ask(history, pending)

    def _fitting(self, seed: TrialConfig) -> TrialConfig | None:
        """The seed, or its family's largest smaller batch predicted to fit."""
        family = sorted((c for c in self.ctx.candidates if c.family == seed.family
                         and c.per_device_train_batch_size <= seed.per_device_train_batch_size),
                        key=lambda c: -c.per_device_train_batch_size)
        return next((c for c in family if self.gate.fits(c)[0]), None)
