"""A search that starts from what a similar search found (a near match in the results
store, or in the bench a search of another landscape): each record's winner runs first,
translated to this search's space, its runner-ups behind it, then `inner` takes over.

A runner-up runs only where the config before it did not end ok here (out of memory, an
error): measured on nine landscape pairs (docs/results.md), running the runner-ups as
well cost final quality on three of them (they are the winner's close kin: little news,
and they anchor the throughput model), while the winner alone reached 0.95 of the best
at its first trial as often. A winner on the baseline's chain or one of the recipe's is
left to the probes, which run the references under their own reasons (a seed that ran
the recipe's config under another reason would leave the recipe without its trial). A
seed the memory model says will not fit here (a longer seq_len, a smaller device) moves
down its family's batches to the largest it says fits, or is passed over.
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


def runnable(group: Sequence[TrialConfig], ctx: SearchContext) -> list[TrialConfig]:
    """What a Seeded strategy runs of a record's group (its winner first, its runner-ups
    behind): each config once, and none where the winner is on the baseline's chain or a
    recipe's (the probes run it under their own reason, and the references stand for
    it); a runner-up on a probe's chain is left out."""
    baseline = ctx.baseline_chain
    probes = {*(baseline if baseline is not None else halving_chain(ctx)),
              *(c for chain in ctx.recipe_chains or [] for c in chain)}
    if not group or group[0] in probes:
        return []
    return [c for c in dict.fromkeys(group) if c not in probes]


class Seeded(Strategy):
    """Each group's winner first (see the module); a runner-up only where the config
    before it in its group did not end ok here; then `inner`."""

    def __init__(self, inner: Strategy, groups: Sequence[Sequence[TrialConfig]]) -> None:
        super().__init__(inner.ctx)
        self.inner, self.name = inner, inner.name
        self.groups = [g for g in (runnable(g, self.ctx) for g in groups) if g]
        self.gate = MemoryGate(self.ctx)

    @property
    def seeds(self) -> list[TrialConfig]:
        return [c for g in self.groups for c in g]

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        seeded = [r for r in history if r.reason == SEEDED_REASON]
        taken = {r.config for r in history if r.outcome.ran} | set(pending)
        updated = False
        for group in self.groups:
            families = {c.family for c in group}
            if any(c.family in families for c in pending):
                continue  # one of it in flight
            tried = [r for r in seeded if r.config.family in families]
            if any(r.outcome.ok for r in tried):
                continue  # its winner (or a runner-up in its place) ran here
            done = {r.config.family for r in tried}  # a seed is tried once, at one batch
            for seed in (c for c in group if c.family not in done):
                if not updated:
                    self.gate.update(history)
                    updated = True
                c = self._fitting(seed)
                if c is not None and c not in taken:
                    return Proposal(c, SEEDED_REASON,
                                    predicted_memory_bytes=self.gate.predicted(c))
        return self.inner.ask(history, pending)

    def _fitting(self, seed: TrialConfig) -> TrialConfig | None:
        """The seed, or its family's largest smaller batch predicted to fit."""
        family = sorted((c for c in self.ctx.candidates if c.family == seed.family
                         and c.per_device_train_batch_size <= seed.per_device_train_batch_size),
                        key=lambda c: -c.per_device_train_batch_size)
        return next((c for c in family if self.gate.fits(c)[0]), None)
