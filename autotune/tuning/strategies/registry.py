"""Strategies by name: for the search (`search.sampler`) and for the bench (all of them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.errors import SpecError
from autotune.tuning.strategies.base import SearchContext, Strategy
from autotune.tuning.strategies.baselines import DeepSpeedStyleStrategy, HalvingStrategy
from autotune.tuning.strategies.samplers import SAMPLERS, SamplerStrategy, make_sampler
from autotune.tuning.strategies.structured import AutotuneStrategy

if TYPE_CHECKING:
    import optuna

    from autotune.tuning.study import StudyLog

# The bench's line-up: the tuner, Optuna's samplers as a user would run them (raw space,
# no memory model), and two fixed plans people use today.
BENCH_STRATEGIES = ("autotune", "random", "tpe", "halving", "deepspeed")


def sampler_for(name: str, seed: int) -> optuna.samplers.BaseSampler | None:
    """The Optuna sampler a strategy asks the study through; None where autotune chooses
    the trials itself (the study then only hands out fixed params)."""
    return make_sampler(name, seed) if name in SAMPLERS else None


def make_strategy(name: str, ctx: SearchContext, log: StudyLog, *,
                  guarded: bool = True) -> Strategy:
    """`guarded` gives Optuna's samplers the baseline and the memory gate (a search);
    the bench runs them bare."""
    if name == "autotune":
        return AutotuneStrategy(ctx)
    if name in SAMPLERS:
        return SamplerStrategy(ctx, log, name, guarded=guarded)
    if name == "halving":
        return HalvingStrategy(ctx)
    if name == "deepspeed":
        return DeepSpeedStyleStrategy(ctx)
    known = ", ".join(["autotune", *SAMPLERS, "halving", "deepspeed"])
    raise SpecError(f"unknown strategy {name!r}; known: {known}")
