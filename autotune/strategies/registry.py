"""Strategies by name, for the search (`autotune`) and the bench (all of them)."""

from __future__ import annotations

from autotune.strategies.base import SearchContext, Strategy
from autotune.strategies.baselines import (
    DeepSpeedStyleStrategy,
    HalvingStrategy,
    RandomStrategy,
    TPEStrategy,
)
from autotune.strategies.structured import AutotuneStrategy

STRATEGIES: dict[str, type[Strategy]] = {
    "autotune": AutotuneStrategy,
    "random": RandomStrategy,
    "tpe": TPEStrategy,
    "halving": HalvingStrategy,
    "deepspeed": DeepSpeedStyleStrategy,
}


def make_strategy(name: str, ctx: SearchContext) -> Strategy:
    try:
        cls = STRATEGIES[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}") from None
    return cls(ctx)
