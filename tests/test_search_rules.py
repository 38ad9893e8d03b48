"""The autotune strategy's rules that the bench's averages hide: how a failure is
blamed, and how a search spends the last trials its limits allow."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config import TrialConfig
from autotune.records import Outcome, Record
from autotune.tuning.loop import Limits
from autotune.tuning.strategies.structured import _blame, _dead, _neighbours

LANDSCAPES = Path(__file__).resolve().parents[2] / "shared" / "landscapes"


def _rec(status: str, **values) -> Record:
    sps = 1.0 if status == "ok" else None
    return Record(TrialConfig.of(8, 8, **values), Outcome(status, samples_per_second=sps))


def test_a_failure_is_put_down_to_a_written_off_value_not_to_the_values_beside_it():
    """fp16 diverged with ZeRO-2 and 8-bit Adam, then with SGD: fp16 is written off, and
    ZeRO-2, 8-bit Adam and SGD carry none of its failures (before, each kept a third of
    its chance, and a search could stop short of the best config, bf16 with ZeRO-2)."""
    history = [_rec("ok", precision="bf16"),
               _rec("nan", precision="fp16", zero_stage=2, optim="adamw_bnb_8bit"),
               _rec("nan", precision="fp16", optim="sgd")]
    assert ("precision", ("fp16",)) in _dead(history)
    works, fails = _blame(history)
    assert fails == {("precision", ("fp16",)): 2}
    # One failure alone is still shared by every value it holds: nothing is written off.
    works, fails = _blame(history[:2])
    assert fails[("sharding", (2, "none", "none"))] == 1 and fails[("precision", ("fp16",))] == 1


def test_limits_say_how_many_trials_are_left():
    assert Limits().trials_left([10.0], 0) is None
    assert Limits(max_trials=10).trials_left([1.0] * 4, 1) == 5
    assert Limits(budget_seconds=100).trials_left([10.0, 10.0, 20.0], 0) == 6
    assert Limits(budget_seconds=100).trials_left([10.0, 10.0, 20.0], 1) == 5
    assert Limits(budget_seconds=100, max_trials=5).trials_left([10.0] * 3, 0) == 2
    assert Limits(budget_seconds=10).trials_left([20.0], 0) == 0


@pytest.mark.skipif(not LANDSCAPES.is_dir(), reason="needs ../shared/landscapes")
def test_the_last_trials_a_budget_allows_go_to_the_best_configs_neighbours():
    """With three trials left, a search the model still expects to gain ENDGAME_GAIN by
    exploring explores; one that expects less polishes its best (a near-tie's look)."""
    from autotune.bench.bench import context, replay
    from autotune.bench.landscape import load_landscape
    from autotune.tuning.strategies.structured import (
        ENDGAME_GAIN,
        NEAR_TIE_REASON,
        AutotuneStrategy,
    )

    land = load_landscape(LANDSCAPES / "sim-gpt2-medium-a10g-24gb")
    history, _ = replay(land, "autotune", 0, 0.03)
    start = next(i for i, r in enumerate(history) if r.reason == "model")
    # A few of the model's trials in (still unsure: it expects 18% from its next), and
    # near the end (it expects 3%); each prefix ends on a config held back (pruned), so a
    # trial is next.
    late = max(n for n in range(len(history) - 8) if not history[n - 1].outcome.ran)
    for n, endgame in ((start + 6, "model"), (late, NEAR_TIE_REASON)):
        early = history[:n]
        assert not early[-1].outcome.ran
        best = max((r for r in early if r.outcome.ok),
                   key=lambda r: r.outcome.samples_per_second)
        for left, reason in ((None, "model"), (20.0, "model"), (3.0, endgame)):
            ctx = context(land, 0)
            ctx.trials_left = left
            strategy = AutotuneStrategy(ctx)
            proposal = strategy.ask(early)
            assert proposal is not None and proposal.reason == reason, (n, left, proposal)
        tried = {r.config for r in early}
        expected = max(score for c, score in zip(strategy.ctx.candidates, strategy._score,
                                                 strict=True) if c not in tried)
        assert (expected >= ENDGAME_GAIN) == (endgame == "model"), (n, expected)
        if endgame == NEAR_TIE_REASON:
            assert _neighbours(proposal.config, best.config)


def test_nothing_is_written_off_before_a_trial_worked():
    """Two unrelated failures before any success share every value no trial has cleared:
    the space's fixed values, no sharding, no compile. Written off, they took every config
    with them."""
    none = ("sharding", (0, "none", "none"))
    history = [_rec("error", precision="fp32"), _rec("error", precision="bf16", optim="sgd")]
    assert _dead(history + history) == set()
    history += [_rec("ok", precision="fp16", zero_stage=2)]  # a success that lacks it
    assert _dead(history) == set()
    # After one: what failed twice since and never worked, unless every config holds it.
    history += [_rec("error", precision="fp32", optim="sgd"), _rec("nan", precision="fp32")]
    assert ("precision", ("fp32",)) in _dead(history) and none in _dead(history)
    assert none not in _dead(history, fixed={"sharding"})


@pytest.mark.skipif(not LANDSCAPES.is_dir(), reason="needs ../shared/landscapes")
def test_two_references_that_error_leave_the_search_exploring_and_a_space_that_fails_stops():
    """Trainer's defaults and the recipe's first rung both error (fp32 that a kernel
    rejects, a kernel that fails to build, say) before anything worked. Every value they
    shared was written off, the fixed ones with it, so every config was dead and the
    search ended after two trials with no winner. Where every config fails, the search
    still stops early (`FAILING`), says how to go on, and goes on when rerun."""
    import dataclasses

    from autotune.bench.bench import replay
    from autotune.bench.landscape import load_landscape
    from autotune.records import ERROR
    from autotune.summary import Summary
    from autotune.tuning.strategies.structured import FAILING

    land = load_landscape(LANDSCAPES / "sim-gpt2-medium-a10g-24gb")
    history, _ = replay(land, "autotune", 0, 0.03)
    refs = {r.config for r in history if r.reason in ("baseline", "recipe") and r.outcome.ran}
    table = dict(land.table)
    table.update({c: Outcome(ERROR, wall_seconds=3.0) for c in refs})
    broken = dataclasses.replace(land, table=table, candidates={})
    history, _ = replay(broken, "autotune", 0, 0.03)
    best = max((r.score for r in history if r.outcome.ok and r.score), default=0.0)
    top = max(o.samples_per_second or 0.0 for c, o in table.items() if c not in refs)
    assert best >= 0.99 * top, [(r.reason, r.config.label(), r.outcome.status)
                                for r in history[:8]]

    failing = dataclasses.replace(land, table={c: Outcome(ERROR, wall_seconds=3.0)
                                               for c in land.table}, candidates={})
    history, _ = replay(failing, "autotune", 0, 0.03)
    assert sum(r.outcome.ran for r in history) == FAILING
    summary = Summary(model={}, device=land.device, memory_limit_bytes=1,
                      target_batch_size=land.target_batch_size, world_size=1, seq_len=8,
                      trials=history)
    assert f"{FAILING} failed" in summary.no_winner_why
    assert "run the same command to resume" in summary.no_winner_why

    # The user runs the same command again, which resumes the study with its failures:
    # where the fault is still there, it stops after FAILING more; where it was fixed, the
    # search goes on. (It stopped at once, on the failures it resumed with.)
    again, _ = replay(failing, "autotune", 0, 0.03, resumed=history)
    assert sum(r.outcome.ran for r in again) == FAILING
    resumed, _ = replay(land, "autotune", 0, 0.03, resumed=history)
    found = max((r.score for r in resumed if r.outcome.ok and r.score), default=0.0)
    assert found >= 0.98 * land.best()[1].samples_per_second  # issue 16's bar (0.989 now)


@pytest.mark.skipif(not LANDSCAPES.is_dir(), reason="needs ../shared/landscapes")
def test_a_recipe_that_errors_leaves_the_search_exploring():
    """The recipe's first rung errors (compile with flash-attention 2 on a model without
    it, say) before anything but the baseline worked. Its failure blamed every knob value
    it held, those every config holds too (a dozen groups the space keeps fixed): each
    took a half off every config's chance to work, no config was worth a trial, and the
    search went straight to the baseline's near-ties (BERT-large on an A10G ended at 0.963
    of its best for it)."""
    import dataclasses

    from autotune.bench.bench import replay
    from autotune.bench.landscape import load_landscape
    from autotune.records import ERROR
    from autotune.tuning.strategies.structured import NEAR_TIE_REASON

    land = load_landscape(LANDSCAPES / "sim-llama-3b-h100-80gb-gpuknobs")
    history, _ = replay(land, "autotune", 0, 0.005)
    recipe = next(r.config for r in history if r.reason == "recipe")
    table = dict(land.table)
    table[recipe] = Outcome(ERROR, wall_seconds=3.0)
    broken = dataclasses.replace(land, table=table, candidates={})
    history, _ = replay(broken, "autotune", 0, 0.005)
    after = [r for r in history if r.outcome.ran and r.reason not in ("baseline", "recipe")]
    assert after[0].reason == "model", [(r.reason, r.config.label()) for r in history[:6]]
    assert sum(r.reason == NEAR_TIE_REASON for r in after[:4]) == 0


@pytest.mark.skipif(not LANDSCAPES.is_dir(), reason="needs ../shared/landscapes")
@pytest.mark.parametrize("name", ["sim-phi-1.5-a100-40gb", "sim-llama-3b-h100-80gb-gpuknobs",
                                  "sim-gpt2-medium-l4-24gb-gpuknobs"])
def test_the_recipe_stops_at_the_largest_batch_the_model_gives_an_even_chance(name):
    """After a success, the recipe jumps to the largest batch of its rung the calibrated
    model gives an even chance to fit, and no further. Until 2026-11-30 it then walked up
    to the next batch where that was predicted within 10% over the limit: on these three
    landscapes, at 4-7% over, and each ran out of memory (as every such walk on the
    bench's landscapes did)."""
    from autotune.bench.bench import replay
    from autotune.bench.landscape import load_landscape

    land = load_landscape(LANDSCAPES / name)
    history, _ = replay(land, "autotune", 0, 0.005 if "gpuknobs" in name else 0.03)
    recipe = [r for r in history if r.reason == "recipe" and r.outcome.ran]
    first = next(i for i, r in enumerate(recipe) if r.outcome.ok)
    assert not any(r.outcome.is_oom for r in recipe[first:]), [
        (r.config.label(), r.outcome.status) for r in recipe]


def test_a_near_tie_is_settled_by_the_neighbours_that_may_be_faster(tmp_path, monkeypatch):
    """The near-ties go to the best config's neighbours likeliest to beat it. Chosen by
    expected improvement, they went to the least known: on our simulator's GPT-2-medium on
    an H100, after the best (compiled, 8-bit Adam, ZeRO-1), its checkpointed twin, which
    the model put 27% slower at sd 0.3 and which ran at 0.58 of the best, while its twin
    without ZeRO, the landscape's fastest, was left unmeasured."""
    import importlib.util
    import sys

    from autotune.bench.bench import replay
    from autotune.bench.landscape import load_landscape
    from autotune.tuning.strategies.structured import NEAR_TIE_REASON

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "simulate_landscape.py"
    spec = importlib.util.spec_from_file_location("simulate_landscape", path)
    sim = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "simulate_landscape", sim)  # its dataclasses look it up
    spec.loader.exec_module(sim)
    scenario = next(s for s in sim.HELD_OUT_2_SCENARIOS if s.name.startswith("sim4-gpt2-medium"))
    sim.main(str(tmp_path), scenarios=[scenario])
    history, _ = replay(load_landscape(tmp_path / scenario.name), "autotune", 0, 0.005)
    ties = [n for n, r in enumerate(history) if r.reason == NEAR_TIE_REASON]
    assert ties
    for n in ties:
        best = max(r.outcome.samples_per_second for r in history[:n] if r.outcome.ok)
        assert history[n].outcome.samples_per_second >= 0.9 * best, history[n].config.label()


def test_the_likeliest_to_beat_the_best_is_not_the_least_known():
    """A neighbour 1% under the best at sd 0.03 against one 27% under at sd 0.3 (GPT-2-
    medium's no-ZeRO and checkpointed twins): expected improvement ranks the little-known
    one first, the chance to beat the best the near one."""
    import numpy as np

    from autotune.tuning.strategies.surrogate import (
        expected_improvement,
        probability_of_improvement,
    )

    best = np.log(141.5)
    mu, sd = np.array([best - 0.01, best - 0.315]), np.array([0.03, 0.3])
    assert np.argmax(expected_improvement(mu, sd, best)) == 1
    assert np.argmax(probability_of_improvement(mu, sd, best)) == 0
    assert probability_of_improvement(np.array([best]), np.array([0.1]), best)[0] == 0.5
