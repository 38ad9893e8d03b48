"""What the tuner is compared against in `autotune bench`, besides Optuna's own
samplers over the raw space (samplers.py: `random`, `tpe`):

halving:   Trainer's auto_find_batch_size: the baseline family, batch halved from the target.
deepspeed: the DeepSpeed autotuner's plan: ZeRO stages in order (fastest first), per
           stage the micro-batch sizes up to the largest that fits; stop at the first
           stage that is no faster than the one before.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.config import TrialConfig, halving_batches
from autotune.records import Record
from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy


class HalvingStrategy(Strategy):
    """auto_find_batch_size: fp32, adamw_torch, no checkpointing, no DeepSpeed."""

    name = "halving"

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        if any(r.outcome.ok for r in history) or pending:
            return None
        tried = {r.config for r in history}
        pool = {c.per_device_train_batch_size: c for c in self.ctx.candidates
                if c.family == self.ctx.baseline_family}
        for b in halving_batches(self.ctx.target_batch_size // self.ctx.world_size):
            if b in pool and pool[b] not in tried:
                return Proposal(pool[b], "baseline")
        return None


class DeepSpeedStyleStrategy(Strategy):
    """ZeRO stage by stage (0, 1, 2, 3, fastest first), each stage's micro-batches from 1
    upwards until one runs out of memory; 16-bit where the device has it."""

    name = "deepspeed"

    def __init__(self, ctx: SearchContext) -> None:
        super().__init__(ctx)
        precisions = {c.precision for c in ctx.candidates}
        self.precision = next((p for p in ("bf16", "fp16", "fp32") if p in precisions), "fp32")
        self.stages = sorted({c.zero_stage for c in ctx.candidates})

    def _stage_configs(self, stage: int) -> list[TrialConfig]:
        family = self.ctx.baseline_family.replace(precision=self.precision, zero_stage=stage)
        return sorted((c for c in self.ctx.candidates if c.family == family),
                      key=lambda c: c.per_device_train_batch_size)

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        if pending:
            return None  # a plan of steps, each decided by the one before
        by_config = {r.config: r for r in history}
        previous_best = 0.0
        for stage in self.stages:
            configs = self._stage_configs(stage)
            stage_best = max((by_config[c].score or 0.0 for c in configs
                              if c in by_config and by_config[c].outcome.ok), default=0.0)
            for c in configs:
                if c not in by_config:
                    return Proposal(c, f"zero{stage}")
                if not by_config[c].outcome.ok:
                    break  # out of memory (or failed): larger micro-batches will be too
            if previous_best and stage_best <= previous_best:
                return None  # a higher stage that is no faster: stop, as the autotuner does
            previous_best = max(previous_best, stage_best)
        return None
