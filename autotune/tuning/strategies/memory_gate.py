"""Whether a config is worth running memory-wise, whoever proposes it.

The calibrated memory model with headroom for what it extrapolates, and the OOMs seen:
a batch at or above one that ran out of memory in its family will too.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.config import Family, TrialConfig
from autotune.plan.calibration import MemoryModel
from autotune.plan.memory import GiB
from autotune.plan.shape import ModelShape
from autotune.records import Record
from autotune.tuning.strategies.base import SearchContext

# Headroom kept below the limit: a share of the limit for what no model sees, plus the
# calibrated model's own error estimate (10% until measured families say otherwise) on the
# bytes the prediction extrapolates (all of them for a family not yet measured).
MARGIN_FIXED = 0.03


class MemoryGate:
    def __init__(self, ctx: SearchContext) -> None:
        self.ctx = ctx
        self.model = (MemoryModel(ctx.shape, ctx.device, ctx.world_size)
                      if ctx.shape is not None else None)
        self.oom_at: dict[Family, int] = {}  # per family, the smallest batch that OOMed
        self._seen = 0

    def update(self, history: Sequence[Record]) -> None:
        """Learn from the records not seen yet (a factory model's shape from the first
        trial that reports it)."""
        if self.model is None:
            learned = next((r.outcome.shape for r in history if r.outcome.shape), None)
            if learned is not None:
                self.model = MemoryModel(ModelShape(**learned), self.ctx.device,
                                         self.ctx.world_size)
                self._seen = 0
        for r in history[self._seen:]:
            if r.outcome.is_oom:
                b = r.config.per_device_train_batch_size
                self.oom_at[r.config.family] = min(b, self.oom_at.get(r.config.family, b))
            if self.model is not None:
                self.model.learn(r, self.ctx.memory_limit_bytes)
        self._seen = len(history)

    def predicted(self, c: TrialConfig) -> int | None:
        return None if self.model is None else int(self.model.predict_total(c))

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
        headroom = (MARGIN_FIXED * limit
                    + self.model.family_error * self.model.extrapolated_bytes(c))
        if pred > limit - headroom:
            return False, (f"predicted {pred / GiB:.2f} GiB > {(limit - headroom) / GiB:.2f} "
                           f"GiB ({limit / GiB:.2f} GiB limit less {headroom / GiB:.2f} GiB "
                           "headroom)")
        return True, ""
