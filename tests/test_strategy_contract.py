"""One contract, run over every strategy the registry makes (as Optuna runs one test case
over every sampler): on a small landscape each proposes only configs of its context's
candidates, never a config that ran, respects what is in flight, and resumes from any
history: a new instance given a search's records goes on from them."""

from __future__ import annotations

import pytest

from autotune.bench.bench import RAW_SPACE, choices, context
from autotune.bench.landscape import load_landscape
from autotune.bench.replay import ReplayExecutor
from autotune.tuning.loop import Limits, drive
from autotune.tuning.strategies.registry import BENCH_STRATEGIES, make_strategy, sampler_for
from autotune.tuning.strategies.samplers import SAMPLERS
from autotune.tuning.study import StudyLog
from tests.test_bench import make_landscape

STRATEGIES = sorted({*BENCH_STRATEGIES, *SAMPLERS})


def _search(land, name: str, guarded: bool, trials: int):
    ctx = context(land, 0, raw=name in RAW_SPACE)
    log = StudyLog.in_memory(choices(ctx.candidates), ctx.memory_limit_bytes,
                             sampler_for(name, 0))
    strategy = make_strategy(name, ctx, log, guarded=guarded)
    return ctx, drive(strategy, ReplayExecutor(land), log, Limits(max_trials=trials)), strategy


@pytest.mark.parametrize("guarded", [True, False])
@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_keeps_the_contract(tmp_path, name, guarded):
    land = load_landscape(make_landscape(tmp_path, "toy", memory_gib=4.0))
    ctx, history, strategy = _search(land, name, guarded, trials=6)
    ran = [r for r in history if r.outcome.ran]
    assert ran, "a strategy with candidates left runs something"
    assert all(r.config in ctx.candidates for r in history)
    assert len({r.config for r in ran}) == len(ran)  # no config twice
    # What is in flight is not proposed again.
    asked = strategy.ask(history, [])
    if asked is not None:
        assert strategy.ask(history, [asked.config]) is None or (
            strategy.ask(history, [asked.config]).config != asked.config)
        assert asked.config not in {r.config for r in ran}
    # A fresh instance resumes from the records: it proposes nothing that ran.
    again = make_strategy(name, ctx, StudyLog.in_memory(
        choices(ctx.candidates), ctx.memory_limit_bytes, sampler_for(name, 0)),
        guarded=guarded)
    resumed = again.ask(history, [])
    assert resumed is None or resumed.config not in {r.config for r in ran}
