"""The `autotune` strategy: search the way the problem is built, not as generic HPO.

1. Baseline: what a user gets from Trainer defaults with auto_find_batch_size (baseline.py).
2. Then the config with the largest expected improvement per second of trial under a
   structured throughput model (surrogate.py), among those the calibrated memory model
   says fit (a slow config's trial costs more to learn the same). A config the
   model would pick but predicts out of memory is recorded as pruned (never run), with
   the figure and the limit. An OOM rules out larger batches of its family.
3. A knob value that failed (nan, error, crash) weighs its configs' expected improvement
   by its chance of working, (works + 1) / (works + fails + 2); twice failed and never
   worked, it is written off. One divergence thus costs at most one more trial of it.
4. Stop when no remaining config is expected to beat the best by `min_gain`, but first
   give up to NEAR_TIES neighbours (one knob group or one batch step away) of the configs
   measured within noise of the best one look: the model cannot tell them apart, and a
   short measurement's noise can hide the best among them.

Everything is rebuilt from the history, so a resumed search continues where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from autotune.config import Family, TrialConfig
from autotune.records import FAILED, Record
from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
from autotune.tuning.strategies.baseline import BaselineProbe
from autotune.tuning.strategies.memory_gate import MemoryGate
from autotune.tuning.strategies.surrogate import ThroughputModel, expected_improvement

MIN_GAIN = 0.01  # expected relative gain below which another trial is not worth it: half
# the 2% noise floor of one short measurement (surrogate.NOISE_FLOOR): a trial could not
# tell such a gain from noise, and near-ties get their own look before stopping.
NEAR_TIES = 3  # neighbours of near-best configs tried before stopping, per search
NEAR_TIE_REASON = "near-tie"
# How much a trial's predicted duration discounts its expected improvement (1: per second).
COST_WEIGHT = 1.0


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
        ok = [(r.config, r.outcome.score) for r in history
              if r.outcome.ok and r.outcome.score]
        best = max((math.log(s) for _, s in ok), default=None)
        if len(ran) != self._fitted_on:
            # New evidence: refit, rescore, and walk the candidates from the top again.
            self.throughput.fit([c for c, _ in ok], [s for _, s in ok])
            self._fitted_on = len(ran)
            mu, sd = self.throughput.predict()
            lies = [c for c in pending if c in self.throughput.row]
            if lies:
                # Constant liar: trials in flight count as measured at their predicted
                # mean, so the next ask looks elsewhere instead of next to them.
                lied = [float(np.exp(mu[self.throughput.row[c]])) for c in lies]
                self.throughput.fit([c for c, _ in ok] + lies, [s for _, s in ok] + lied)
                mu, sd = self.throughput.predict()
            score = (mu + sd) if best is None else expected_improvement(mu, sd, best)
            self._mu = mu
            self._score = score * self._success(history)
            # The walk goes by improvement per second of trial; `worth` by improvement.
            self._order = [int(i) for i in np.argsort(
                -(self._score / self._cost(history, mu) ** COST_WEIGHT + self._jitter))]
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
                return self._near_tie(history, ran)
            return Proposal(c, "model" if best is not None else "explore",
                            predicted_memory_bytes=self.gate.predicted(c))
        if not any(r.outcome.ran for r in history) and not pending:
            return self._cheapest()
        return self._near_tie(history, ran)

    def _cheapest(self) -> Proposal | None:
        """Every config is predicted over the limit and nothing has run: an uncalibrated
        prediction is a guess, so the config predicted smallest runs rather than the
        search ending without a trial."""
        if self.gate.model is None or not self.ctx.candidates:
            return None
        c = min(self.ctx.candidates, key=lambda c: self.gate.model.predict_total(c))
        return Proposal(c, "explore: every config is predicted over the limit; the "
                        "smallest runs", predicted_memory_bytes=self.gate.predicted(c))

    def _cost(self, history: Sequence[Record], mu: np.ndarray) -> np.ndarray:
        """Each candidate's predicted trial seconds: fixed overhead plus the timed work,
        which goes as 1 / samples/s; fitted to the trials so far (equal costs before)."""
        ran = [(r.outcome.wall_seconds, r.outcome.score) for r in history
               if r.outcome.ok and r.outcome.wall_seconds and r.outcome.score]
        if len(ran) < 2:
            return np.ones(len(mu))
        A = np.array([[1.0, 1.0 / sps] for _, sps in ran])
        (fixed, work), *_ = np.linalg.lstsq(A, np.array([w for w, _ in ran]), rcond=None)
        fixed = max(fixed, 0.05 * float(np.median([w for w, _ in ran])))
        return fixed + max(work, 0.0) / np.exp(mu)

    def _success(self, history: Sequence[Record]) -> np.ndarray:
        """Per candidate, the chance its knob values work, from the failures seen."""
        works: dict[tuple, int] = {}
        fails: dict[tuple, int] = {}
        for r in history:
            for lv in r.config.family.levels(blamed_only=True):
                if r.outcome.ok:
                    works[lv] = works.get(lv, 0) + 1
                elif r.outcome.status in FAILED:
                    fails[lv] = fails.get(lv, 0) + 1
        if not fails:
            return np.ones(len(self.ctx.candidates))
        p = {lv: (works.get(lv, 0) + 1) / (works.get(lv, 0) + n + 2) for lv, n in fails.items()}
        return np.array([float(np.prod([p.get(lv, 1.0)
                                        for lv in c.family.levels(blamed_only=True)]))
                         for c in self.ctx.candidates])

    def _near_tie(self, history: Sequence[Record], ran: set[TrialConfig]) -> Proposal | None:
        """Before stopping: the most promising unmeasured neighbour of a config measured
        within noise of the best, up to NEAR_TIES of them per search."""
        if sum(1 for r in history if r.reason == NEAR_TIE_REASON) >= NEAR_TIES:
            return None
        ok = [r for r in history if r.outcome.ok and r.outcome.score]
        if not ok:
            return None
        top = max(r.outcome.score for r in ok)
        noise = 2 * self.throughput.noise
        near = [r.config for r in ok if math.log(top / r.outcome.score) <= noise]
        dead = self._dead_levels(history)
        options = [(float(self._mu[i]), c) for i, c in enumerate(self.ctx.candidates)
                   if c not in ran and any(_neighbours(c, n) for n in near)
                   and not dead.intersection(c.family.levels()) and self.gate.fits(c)[0]]
        if not options:
            return None
        _, c = max(options, key=lambda o: o[0])
        return Proposal(c, NEAR_TIE_REASON, predicted_memory_bytes=self.gate.predicted(c))

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
        """Knob values that failed at least twice and never worked."""
        return _dead(history)


def _neighbours(a: TrialConfig, b: TrialConfig) -> bool:
    """One knob group apart at the same batch, or the same family one batch step apart."""
    if a.family == b.family:
        return max(a.per_device_train_batch_size, b.per_device_train_batch_size) == 2 * min(
            a.per_device_train_batch_size, b.per_device_train_batch_size)
    if a.per_device_train_batch_size != b.per_device_train_batch_size:
        return False
    return sum(x != y for x, y in zip(a.family.levels(), b.family.levels(), strict=True)) == 1


def _dead(history: Sequence[Record]) -> set[tuple[str, tuple]]:
    """Knob values that failed (nan, error, crash) at least twice and never worked: for
    example fp16 overflowing to nan, or an optimizer this install cannot build. Knobs the
    table does not blame (checkpointing) are never written off."""
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
