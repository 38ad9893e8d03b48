"""The `autotune` strategy: search the way the problem is built, not as generic HPO.

1. Baseline: what a user gets from Trainer defaults with auto_find_batch_size (baseline.py).
2. Then the config with the largest expected improvement under a structured throughput
   model (surrogate.py), among those the calibrated memory model says fit. A config the
   model would pick but predicts out of memory is recorded as pruned (never run), with
   the figure and the limit. An OOM rules out larger batches of its family.
3. Stop when no remaining config is expected to beat the best by `min_gain`: further
   trials would not pay for themselves.

Everything is rebuilt from the history, so a resumed search continues where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autotune.config import Family, TrialConfig
from autotune.records import FAILED, Record
from autotune.search.strategies.base import Proposal, SearchContext, Strategy
from autotune.search.strategies.baseline import BaselineProbe
from autotune.search.strategies.memory_gate import MemoryGate
from autotune.search.strategies.surrogate import ThroughputModel, expected_improvement

MIN_GAIN = 0.003  # expected relative gain below which another trial is not worth it


class AutotuneStrategy(Strategy):
    name = "autotune"

    def __init__(self, ctx: SearchContext, *, min_gain: float = MIN_GAIN) -> None:
        super().__init__(ctx)
        self.min_gain = min_gain
        self.gate = MemoryGate(ctx)
        self.baseline = BaselineProbe(ctx)
        self.throughput = ThroughputModel(ctx.candidates, ctx.device, ctx.world_size,
                                          ctx.shape)
        self._families: dict[Family, list[TrialConfig]] = {}
        for c in ctx.candidates:
            self._families.setdefault(c.family, []).append(c)
        self._fitted_on = -1
        # A tiny fixed jitter breaks ties between configs the model cannot tell apart.
        self._jitter = np.random.default_rng(ctx.seed).normal(0.0, 1e-6, len(ctx.candidates))

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        self.gate.update(history)
        proposal = self.baseline.next(history, pending, self.gate)
        if proposal is not None:
            return proposal
        ran = {r.config for r in history if r.outcome.ran} | set(pending)
        pruned = {r.config for r in history if not r.outcome.ran}
        ok = [(r.config, r.outcome.samples_per_second) for r in history
              if r.outcome.ok and r.outcome.samples_per_second]
        best = max((math.log(s) for _, s in ok), default=None)
        if len(ran) != self._fitted_on:
            # New evidence: refit, rescore, and walk the candidates from the top again.
            self.throughput.fit([c for c, _ in ok], [s for _, s in ok])
            self._fitted_on = len(ran)
            mu, sd = self.throughput.predict()
            score = (mu + sd) if best is None else expected_improvement(mu, sd, best)
            self._score = score + self._jitter
            self._order = [int(i) for i in np.argsort(-self._score)]
            self._pos = 0
        dead = self._dead_levels(history)
        while self._pos < len(self._order):
            i = self._order[self._pos]
            c = self.ctx.candidates[i]
            worth = best is None or self._score[i] >= self.min_gain
            if c in ran or dead.intersection(c.family.levels()):
                self._pos += 1
                continue
            fits, why = self.gate.fits(c)
            if not fits:
                self._pos += 1
                if c in pruned or not worth or self._implied(c):
                    continue
                # Worth running if it fit: record why it is not run.
                return Proposal(c, f"predicted-oom: {why}", run=False,
                                predicted_memory_bytes=self.gate.predicted(c))
            if not worth:
                return None
            return Proposal(c, "model" if best is not None else "explore",
                            predicted_memory_bytes=self.gate.predicted(c))
        return None

    def _implied(self, c: TrialConfig) -> bool:
        """A smaller batch of the family ran out of memory or is predicted to: only the
        smallest such batch is worth a record in the study."""
        b = c.per_device_train_batch_size
        oom = self.gate.oom_at.get(c.family)
        if oom is not None and b >= oom:
            return True
        return any(not self.gate.fits(o)[0] for o in self._families[c.family]
                   if o.per_device_train_batch_size < b)

    @staticmethod
    def _dead_levels(history: Sequence[Record]) -> set[tuple[str, tuple]]:
        """Knob values that failed (nan, error, crash) at least twice and never worked:
        for example fp16 overflowing to nan, or an optimizer this install cannot build.
        Knobs the table does not blame (checkpointing) are never written off."""
        fails: dict[tuple[str, tuple], int] = {}
        works: set[tuple[str, tuple]] = set()
        for r in history:
            levels = r.config.family.levels(blamed_only=True)
            if r.outcome.ok:
                works.update(levels)
            elif r.outcome.status in FAILED:
                for lv in levels:
                    fails[lv] = fails.get(lv, 0) + 1
        return {lv for lv, n in fails.items() if n >= 2 and lv not in works}
