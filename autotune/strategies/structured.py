"""The `autotune` strategy: search the way the problem is built, not as generic HPO.

1. Baseline: what a user gets from Trainer defaults with auto_find_batch_size (fp32,
   adamw_torch, no checkpointing, no DeepSpeed, batch halved from the target), starting
   at the largest batch the memory model says fits instead of at the target.
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

from autotune.config import BASELINE_FAMILY, TrialConfig, halving_batches
from autotune.memory import GiB, MemoryModel
from autotune.shape import ModelShape
from autotune.strategies.base import Proposal, Record, SearchContext, Strategy
from autotune.strategies.surrogate import ThroughputModel, expected_improvement

FAILED_STATUSES = ("nan", "error", "timeout", "crashed")
# Headroom kept below the limit: a share of the limit for what no model sees, plus a
# share of the bytes the prediction extrapolates (all of it for a family not yet measured).
MARGIN_FIXED = 0.03
MARGIN_EXTRAPOLATED = 0.10
MIN_GAIN = 0.003  # expected relative gain below which another trial is not worth it


class AutotuneStrategy(Strategy):
    name = "autotune"

    def __init__(self, ctx: SearchContext, *, min_gain: float = MIN_GAIN) -> None:
        super().__init__(ctx)
        self.min_gain = min_gain
        self.memory = (MemoryModel(ctx.shape, ctx.device, ctx.world_size)
                       if ctx.shape is not None else None)
        self.throughput = ThroughputModel(ctx.candidates, ctx.device, ctx.world_size,
                                          ctx.shape)
        self._families: dict[tuple, list[TrialConfig]] = {}
        for c in ctx.candidates:
            self._families.setdefault(c.family(), []).append(c)
        self._seen = 0  # history records already fed to the memory model
        self._fitted_on = -1
        # A tiny fixed jitter breaks ties between configs the model cannot tell apart.
        self._jitter = np.random.default_rng(ctx.seed).normal(0.0, 1e-6, len(ctx.candidates))

    # ---------------------------------------------------------------- memory
    def _observe(self, history: Sequence[Record]) -> None:
        if self.memory is None:
            learned = next((r.outcome.extra["shape"] for r in history
                            if r.outcome.extra.get("shape")), None)
            if learned is not None:  # a factory model: its first trial told us its shape
                self.memory = MemoryModel(ModelShape(**learned), self.ctx.device,
                                          self.ctx.world_size)
                self._seen = 0
        for r in history[self._seen:]:
            if self.memory is None:
                continue
            if r.outcome.ok:
                self.memory.observe(r.config, r.outcome.peak_memory_bytes)
            elif r.outcome.is_oom:
                self.memory.observe_oom(r.config, self.ctx.memory_limit_bytes)
        self._seen = len(history)

    def _oom_below(self, history: Sequence[Record]) -> dict[tuple, int]:
        """Per family, the smallest batch that ran out of memory."""
        smallest: dict[tuple, int] = {}
        for r in history:
            if r.outcome.is_oom:
                fam, b = r.config.family(), r.config.per_device_train_batch_size
                smallest[fam] = min(b, smallest.get(fam, b))
        return smallest

    def predicted(self, c: TrialConfig) -> float | None:
        return self.memory.predict_total(c) if self.memory is not None else None

    def fits(self, c: TrialConfig, oom_at: dict[tuple, int]) -> tuple[bool, str]:
        """Whether `c` is worth running memory-wise, and if not, why (for the record)."""
        limit = self.ctx.memory_limit_bytes
        b = c.per_device_train_batch_size
        if c.family() in oom_at and b >= oom_at[c.family()]:
            return False, (f"batch {b} >= batch {oom_at[c.family()]} that ran out of "
                           "memory with the same other knobs")
        pred = self.predicted(c)
        if pred is None:
            return True, ""
        headroom = MARGIN_FIXED * limit + MARGIN_EXTRAPOLATED * self.memory.extrapolated_bytes(c)
        if pred > limit - headroom:
            return False, (f"predicted {pred / GiB:.2f} GiB > {limit / GiB:.2f} GiB limit "
                           f"less {headroom / GiB:.2f} GiB headroom")
        return True, ""

    # -------------------------------------------------------------- baseline
    def _baseline(self, history: Sequence[Record], oom_at: dict[tuple, int]) -> Proposal | None:
        """auto_find_batch_size's batch: the largest of target, target/2, ... that runs.

        It starts at the largest batch predicted to fit; once a baseline trial has run and
        calibrated the model, the next larger batch is tried too if it is now predicted to
        fit, so a cautious first prediction does not understate the baseline."""
        tried = {r.config: r for r in history if r.reason == "baseline"}
        if any(r.outcome.status == "pruned" for r in tried.values()):
            return None
        if any(r.outcome.status in FAILED_STATUSES for r in tried.values()):
            return None  # the baseline itself fails: nothing to compare against
        pool = {c.per_device_train_batch_size: c for c in self.ctx.candidates
                if c.family() == BASELINE_FAMILY}
        per_rank = self.ctx.target_batch_size // self.ctx.world_size
        halving = [b for b in halving_batches(per_rank) if b in pool]
        if not halving:
            return None
        ok_batches = [c.per_device_train_batch_size for c, r in tried.items() if r.outcome.ok]
        if ok_batches:
            larger = [b for b in halving if b > max(ok_batches)]
            if not larger:
                return None
            c = pool[min(larger)]  # the next batch up from the largest that ran
            if c in tried or not self.fits(c, oom_at)[0]:
                return None
            return Proposal(c, "baseline", predicted_memory_bytes=self._int(c))
        for b in halving:
            c = pool[b]
            if c not in tried and self.fits(c, oom_at)[0]:
                return Proposal(c, "baseline", predicted_memory_bytes=self._int(c))
        smallest = pool[halving[-1]]
        if smallest in tried or self.fits(smallest, oom_at)[0]:
            return None
        return Proposal(smallest, "baseline", run=False,
                        predicted_memory_bytes=self._int(smallest))

    def _int(self, c: TrialConfig) -> int | None:
        pred = self.predicted(c)
        return None if pred is None else int(pred)

    # ------------------------------------------------------------------ main
    def ask(self, history: Sequence[Record]) -> Proposal | None:
        self._observe(history)
        oom_at = self._oom_below(history)
        proposal = self._baseline(history, oom_at)
        if proposal is not None:
            return proposal
        ran = {r.config for r in history if r.outcome.status != "pruned"}
        pruned = {r.config for r in history if r.outcome.status == "pruned"}
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
            if c in ran or self._is_dead(c, dead):
                self._pos += 1
                continue
            fits, why = self.fits(c, oom_at)
            if not fits:
                self._pos += 1
                if c in pruned or not worth or self._implied(c, oom_at):
                    continue
                # Worth running if it fit: record why it is not run.
                return Proposal(c, f"predicted-oom: {why}", run=False,
                                predicted_memory_bytes=self._int(c))
            if not worth:
                return None
            return Proposal(c, "model" if best is not None else "explore",
                            predicted_memory_bytes=self._int(c))
        return None

    def _implied(self, c: TrialConfig, oom_at: dict[tuple, int]) -> bool:
        """A smaller batch of the family ran out of memory or is predicted to: only the
        smallest such batch is worth a record in the study."""
        fam, b = c.family(), c.per_device_train_batch_size
        if fam in oom_at and b >= oom_at[fam]:
            return True
        return any(not self.fits(o, oom_at)[0] for o in self._families[fam]
                   if o.per_device_train_batch_size < b)

    @staticmethod
    def _dead_levels(history: Sequence[Record]) -> set[tuple[str, object]]:
        """Knob values that failed (nan, error, crash) at least twice and never worked:
        for example fp16 overflowing to nan, or an optimizer this install cannot build."""
        fails: dict[tuple[str, object], int] = {}
        works: set[tuple[str, object]] = set()
        for r in history:
            levels = [("precision", r.config.precision), ("optim", r.config.optim),
                      ("zero", (r.config.zero_stage, r.config.offload))]
            if r.outcome.ok:
                works.update(levels)
            elif r.outcome.status in FAILED_STATUSES:
                for lv in levels:
                    fails[lv] = fails.get(lv, 0) + 1
        return {lv for lv, n in fails.items() if n >= 2 and lv not in works}

    @staticmethod
    def _is_dead(c: TrialConfig, dead: set[tuple[str, object]]) -> bool:
        return bool(dead) and (("precision", c.precision) in dead or ("optim", c.optim) in dead
                               or ("zero", (c.zero_stage, c.offload)) in dead)
