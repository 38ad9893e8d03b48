"""Optuna's own samplers as strategies: `search.sampler: tpe | gp | random`.

The sampler asks the study itself (the trial is RUNNING from that moment), so whatever
the sampler knows about the study (constraints, in-flight trials for TPE's constant liar)
it learns the way Optuna means it to. In a search, the baseline still runs first and the
memory gate still stands in front of every proposal: a config predicted not to fit is
told PRUNED, never run. Proposals that are no trial (a repeat of a config already
measured, a combination the device rules exclude) are told to the sampler and skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import optuna

from autotune.config import BATCH, Family, TrialConfig
from autotune.errors import SpecError, not_allowed
from autotune.records import Record
from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
from autotune.tuning.strategies.memory_gate import MemoryGate
from autotune.tuning.strategies.probe import BaselineProbe, RecipeProbe

if TYPE_CHECKING:
    from autotune.tuning.study import StudyLog

SAMPLERS = ("tpe", "gp", "random")
MAX_ASKS = 200  # proposals that are no trial before the sampler is taken to be done


def make_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler by name; TPE and GP read an OOM as a violated memory constraint
    (the study sets it on every finished trial)."""
    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise SpecError(f"search.sampler: {not_allowed(name, SAMPLERS)}")


class SamplerStrategy(Strategy):
    """`guarded`: with the baseline first and the memory gate (a search); without, the
    sampler alone over the raw space (how `autotune bench` judges generic HPO)."""

    def __init__(self, ctx: SearchContext, log: StudyLog, name: str, *,
                 guarded: bool = True) -> None:
        super().__init__(ctx)
        self.log, self.name, self.guarded = log, name, guarded
        self.valid = set(ctx.candidates)
        self.gate = MemoryGate(ctx) if guarded else None
        self.baseline = BaselineProbe(ctx) if guarded else None
        self.recipe = RecipeProbe(ctx) if guarded else None

    def _config(self, trial: optuna.Trial) -> TrialConfig:
        params = {k: trial.suggest_categorical(k, v) for k, v in self.log.choices.items()}
        b = int(params[BATCH])
        family = Family.of({k: v for k, v in params.items() if k != BATCH})
        return family.config(b, self.ctx.target_batch_size, self.ctx.world_size)

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        if self.gate is not None and self.baseline is not None and self.recipe is not None:
            self.gate.update(history)
            proposal = (self.baseline.next(history, pending, self.gate)
                        or self.recipe.next(history, pending, self.gate))
            if proposal is not None:
                return proposal
        seen = {r.config: r for r in history}
        for _ in range(MAX_ASKS):
            trial = self.log.study.ask()
            config = self._config(trial)
            if config not in self.valid:
                self.log.skip(trial.number, "excluded by the device rules")
            elif config in seen:  # answer from the record, as a user's objective would
                self.log.skip(trial.number, f"repeat of trial {seen[config].number}",
                              seen[config])
            elif config in pending:
                self.log.skip(trial.number, "already in flight")
            else:
                if self.gate is not None:
                    fits, why = self.gate.fits(config)
                    if not fits:
                        return Proposal(config, f"predicted-oom: {why}", run=False,
                                        predicted_memory_bytes=self.gate.predicted(config),
                                        trial_number=trial.number)
                predicted = self.gate.predicted(config) if self.gate else None
                return Proposal(config, self.name, predicted_memory_bytes=predicted,
                                trial_number=trial.number)
        return None
