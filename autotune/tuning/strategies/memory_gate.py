"""Whether a config is worth running memory-wise, whoever proposes it.

The calibrated memory model with headroom for what it extrapolates, and the OOMs seen:
a batch at or above one that ran out of memory in its family will too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from autotune.config import Family, TrialConfig
from autotune.plan.calibration import MemoryModel
from autotune.plan.memory import GiB
from autotune.plan.shape import ModelShape
from autotune.records import Record
from autotune.tuning.strategies.base import SearchContext

# Headroom kept below the limit: a share of the limit for what no model sees (the CUDA
# context outside torch's count, the allocator's fragmentation: a peak this close to the
# limit already fails), plus the calibrated model's own error estimate (10% until measured
# families say otherwise) on the bytes the prediction extrapolates (all of them for a
# family not yet measured).
MARGIN_FIXED = 0.03
# The spread of a prediction beyond the model's own error, as a share of the limit, for
# the chance that a config fits (`p_fit`): about half the fixed margin, one sd.
SPREAD = 0.015


class MemoryGate:
    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.model = (MemoryModel(ctx.shape, ctx.device, ctx.world_size, ctx.memory_prior)
                      if ctx.shape is not None else None)
        self.oom_at: dict[Family, int] = {}  # per family, the smallest batch that OOMed
        self._ooms: list[TrialConfig] = []
        self._ceiling: float | None = None  # see `ceiling`, until the next update
        self._seen = 0

    def update(self, history: Sequence[Record]) -> None:
        """Learn from the records not seen yet (a factory model's shape from the first
        trial that reports it)."""
        if self.model is None:
            learned = next((r.outcome.shape for r in history if r.outcome.shape), None)
            if learned is not None:
                self.model = MemoryModel(ModelShape.from_dict(learned), self.ctx.device,
                                         self.ctx.world_size, self.ctx.memory_prior)
                self._seen = 0
        if len(history) > self._seen:
            self._ceiling = None
        for r in history[self._seen:]:
            if r.outcome.is_oom:
                b = r.config.per_device_train_batch_size
                self.oom_at[r.config.family] = min(b, self.oom_at.get(r.config.family, b))
                if not r.outcome.failure.host_memory:
                    self._ooms.append(r.config)
            if self.model is not None:
                self.model.learn(r, self.ctx.memory_limit_bytes)
        self._seen = len(history)

    def predicted(self, c: TrialConfig) -> int | None:
        return None if self.model is None else int(self.model.predict_total(c))

    def p_fit(self, c: TrialConfig) -> float:
        """The chance `c` fits: the calibrated prediction against the limit, with an error
        that is the model's own on the bytes it extrapolates plus SPREAD of the limit
        (what no model sees); 0 at or above a batch of its family that ran out."""
        b, oom = c.per_device_train_batch_size, self.oom_at.get(c.family)
        if oom is not None and b >= oom:
            return 0.0
        if self.model is None:
            return 1.0
        sd = (SPREAD * self.ctx.memory_limit_bytes
              + self.model.family_error * self.model.extrapolated_bytes(c))
        z = (self.ceiling() - self.model.predict_total(c)) / sd
        return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))

    def usable(self) -> float:
        """The peak a trial can reach: the limit less MARGIN_FIXED, what no model sees."""
        return (1.0 - MARGIN_FIXED) * self.ctx.memory_limit_bytes

    def ceiling(self) -> float:
        """The most a config may be predicted to need and still be likely to fit: the
        usable memory, or lower where a config predicted to need less ran out of memory
        (the model ranks configs by memory better than it places them against the limit,
        so a config predicted above one that did not fit will not fit either)."""
        if self._ceiling is None:
            limit = float(self.ctx.memory_limit_bytes)
            # One sd under the lowest prediction that ran out: a config predicted as much
            # fits with about a sixth of a chance, not an even one.
            predicted = [self.model.predict_total(c) - SPREAD * limit
                         for c in self._ooms] if self.model else []
            self._ceiling = min([self.usable(), *predicted])
        return self._ceiling

    def certain_oom(self, c: TrialConfig) -> str | None:
        """Why `c` cannot fit whatever the model's error, or None: its weights, gradients and
        optimizer states alone (parameter counts times bytes, nothing estimated) exceed
        the limit. Such a config is not worth a trial even as a reference's proof."""
        if self.model is None:
            return None
        states, limit = self.model.states_bytes(c), self.ctx.memory_limit_bytes
        if states <= limit:
            return None
        return (f"its weights, gradients and optimizer states alone need {states / GiB:.2f} "
                f"GiB, over the {limit / GiB:.2f} GiB limit")

    def fits(self, c: TrialConfig) -> tuple[bool, str]:
        """Whether `c` is worth running memory-wise, and if not, why (for the record)."""
        limit = self.ctx.memory_limit_bytes
        b, oom = c.per_device_train_batch_size, self.oom_at.get(c.family)
        if oom is not None and b >= oom:
            return False, (f"batch {b} >= batch {oom} that ran out of memory with the same "
                           "other knobs")
        if self.model is None:
            return True, ""
        pred = self.model.predict_total(c)
        most = self.usable() - self.model.family_error * self.model.extrapolated_bytes(c)
        if pred > most:
            headroom = limit - most
            return False, (f"predicted {pred / GiB:.2f} GiB > {most / GiB:.2f} "
                           f"GiB ({limit / GiB:.2f} GiB limit less {headroom / GiB:.2f} GiB "
                           "headroom)")
        return True, ""
