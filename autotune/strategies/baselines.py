"""What the tuner is compared against in `autotune bench`.

random:    uniform over the candidates, without replacement.
tpe:       Optuna's default TPESampler over the raw knobs; OOM and failures told as FAIL.
halving:   Trainer's auto_find_batch_size: fp32 AdamW, batch halved from the target.
deepspeed: the DeepSpeed autotuner's plan: ZeRO stages in order (fastest first), per
           stage the micro-batch sizes up to the largest that fits; stop at the first
           stage that is no faster than the one before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from autotune.config import BASELINE_FAMILY, TrialConfig, halving_batches
from autotune.strategies.base import Proposal, Record, SearchContext, Strategy

KNOBS = ("per_device_train_batch_size", "precision", "optim", "gradient_checkpointing",
         "zero_stage", "offload")


class RandomStrategy(Strategy):
    name = "random"

    def __init__(self, ctx: SearchContext) -> None:
        super().__init__(ctx)
        self.order = [ctx.candidates[i]
                      for i in np.random.default_rng(ctx.seed).permutation(len(ctx.candidates))]

    def ask(self, history: Sequence[Record]) -> Proposal | None:
        done = {r.config for r in history}
        return next((Proposal(c, "random") for c in self.order if c not in done), None)


class TPEStrategy(Strategy):
    """Optuna's TPE, as a user would run it: every knob categorical, no problem knowledge."""

    name = "tpe"

    def __init__(self, ctx: SearchContext) -> None:
        import optuna

        super().__init__(ctx)
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.study = optuna.create_study(direction="maximize",
                                         sampler=optuna.samplers.TPESampler(seed=ctx.seed))
        self.choices = {k: sorted({getattr(c, k) for c in ctx.candidates}, key=str)
                        for k in KNOBS}
        self.valid = set(ctx.candidates)
        self._told = 0
        self._pending = None

    def _config(self, params: dict) -> TrialConfig:
        b = params["per_device_train_batch_size"]
        accum = self.ctx.target_batch_size // (b * self.ctx.world_size)
        return TrialConfig(b, accum, params["precision"], params["optim"],
                           params["gradient_checkpointing"], params["zero_stage"],
                           params["offload"])

    def ask(self, history: Sequence[Record]) -> Proposal | None:
        import optuna

        for r in history[self._told:]:
            trial = self._pending if (self._pending is not None
                                      and self._config(self._pending.params) == r.config) else None
            if trial is None:  # a record from elsewhere (resume): teach it as a finished trial
                dists = {k: optuna.distributions.CategoricalDistribution(v)
                         for k, v in self.choices.items()}
                params = {k: getattr(r.config, k) for k in KNOBS}
                state = (optuna.trial.TrialState.COMPLETE if r.outcome.ok
                         else optuna.trial.TrialState.FAIL)
                self.study.add_trial(optuna.trial.create_trial(
                    params=params, distributions=dists, state=state,
                    value=r.outcome.samples_per_second if r.outcome.ok else None))
            elif r.outcome.ok:
                self.study.tell(trial, r.outcome.samples_per_second)
            else:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            self._pending = None
        self._told = len(history)
        seen = {r.config: r.outcome for r in history}
        for _ in range(200):  # TPE may repeat itself; a repeat costs nothing and is skipped
            trial = self.study.ask()
            params = {k: trial.suggest_categorical(k, v) for k, v in self.choices.items()}
            cfg = self._config(params)
            if cfg not in self.valid:
                self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            elif cfg in seen:  # a repeat: answer from the record, as a user's objective would
                known = seen[cfg]
                self.study.tell(trial, known.samples_per_second if known.ok else None,
                                state=None if known.ok else optuna.trial.TrialState.FAIL)
            else:
                self._pending = trial
                return Proposal(cfg, "tpe")
        return None


class HalvingStrategy(Strategy):
    """auto_find_batch_size: fp32, adamw_torch, no checkpointing, no DeepSpeed."""

    name = "halving"

    def ask(self, history: Sequence[Record]) -> Proposal | None:
        if any(r.outcome.ok for r in history):
            return None
        tried = {r.config for r in history}
        pool = {c.per_device_train_batch_size: c for c in self.ctx.candidates
                if c.family() == BASELINE_FAMILY}
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
        return sorted((c for c in self.ctx.candidates
                       if c.family() == (self.precision, "adamw_torch", False, stage, "none")),
                      key=lambda c: c.per_device_train_batch_size)

    def ask(self, history: Sequence[Record]) -> Proposal | None:
        by_config = {r.config: r.outcome for r in history}
        previous_best = 0.0
        for stage in self.stages:
            configs = self._stage_configs(stage)
            stage_best = max((by_config[c].samples_per_second or 0.0 for c in configs
                              if c in by_config and by_config[c].ok), default=0.0)
            for c in configs:
                if c not in by_config:
                    return Proposal(c, f"zero{stage}")
                if not by_config[c].ok:
                    break  # out of memory (or failed): larger micro-batches will be too
            if previous_best and stage_best <= previous_best:
                return None  # a higher stage that is no faster: stop, as the autotuner does
            previous_best = max(previous_best, stage_best)
        return None
