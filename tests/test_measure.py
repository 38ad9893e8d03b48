"""Measurements that mean one thing: what a trial's logs say about its numerics, how a
dead process is classified, what makes two searches' figures comparable, how the
confirmation's interval is drawn."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from autotune.config import TrialConfig
from autotune.device import DeviceSpec, named_device
from autotune.records import CONFIRM_REASON, Measurement, Outcome, Record
from autotune.space import Space, build_space
from autotune.spec import load_spec
from autotune.trials.launch import _classify
from autotune.trials.worker import _parameters
from autotune.trials.worker import numerics as trial_numerics
from autotune.tuning import confirm, numerics
from autotune.tuning.run import fingerprint

INF = math.inf


def _log(losses, norms):
    return [{"loss": loss, "grad_norm": g, "step": i + 1}
            for i, (loss, g) in enumerate(zip(losses, norms, strict=True))]


def test_fp16_loss_scale_skips_are_counted_not_nan():
    """What an fp16 run logs while the GradScaler settles: overflowing steps (grad_norm
    inf) are skipped, the scale drops, later steps are finite."""
    settles = _log([6.2, 6.2, 6.2, 6.1, 6.0, 5.9], [INF, INF, INF, 1.3, 1.1, 0.9])
    assert trial_numerics(settles, "fp16") == (None, 3)
    never = _log([6.2, 6.2, 6.2, 6.2], [INF, INF, INF, INF])
    why, skips = trial_numerics(never, "fp16")
    assert "settle" in why and skips == 4
    # Without a scaler nothing is skipped: an infinite gradient norm is a failure.
    assert trial_numerics(settles, "bf16")[0] is not None
    assert "loss" in trial_numerics(_log([6.0, math.nan], [1.0, 1.0]), "fp16")[0]


def test_a_killed_process_that_ran_out_of_host_memory_is_an_oom(tmp_path: Path):
    log = "terminate called after throwing an instance of 'std::bad_alloc'\n"
    assert _classify(-6, False, {}, log, 60).status == "oom"  # SIGABRT
    assert _classify(-11, False, {}, "Segfault", 60).status == "crashed"


def test_zero3_partitioned_parameters_count_whole():
    model = torch.nn.Linear(4, 4)
    for p in model.parameters():
        p.ds_numel = p.numel()
        p.data = torch.empty(0)  # what a ZeRO-3 rank holds between gathers
    assert _parameters(model) == 20


def test_fingerprint_covers_device_space_model_and_versions(monkeypatch):
    spec = load_spec({"model": {"config": {"model_type": "gpt2", "n_layer": 1}},
                      "target_batch_size": 8})
    a100, h100 = named_device("A100-80GB"), named_device("H100-80GB")
    space = build_space(spec, a100).space
    key = fingerprint(spec, a100, space)
    assert key == fingerprint(load_spec(spec, **{"search.n_trials": 3}), a100, space)
    assert key != fingerprint(spec, h100, space)
    smaller = Space(space.batch_sizes, space.values | {"precision": ["fp32"]})
    assert key != fingerprint(spec, a100, smaller)  # the space file's contents changed
    assert key != fingerprint(load_spec(spec, **{"target_batch_size": 16}), a100, space)
    from autotune import versions

    real = versions.library_versions()  # another torch (or TRL, flash-attn...) measures apart
    monkeypatch.setattr(versions, "library_versions", lambda: real | {"torch": "0.0.0"})
    assert key != fingerprint(spec, a100, space)


def _rec(n, precision, losses, batch=4, reason="model", sps=10.0):
    cfg = TrialConfig.of(batch, 16 // batch, precision=precision)
    return Record(cfg, Outcome("ok", samples_per_second=sps,
                               measured=Measurement(losses=losses)), reason, n)


def test_a_precision_whose_losses_drift_is_rejected_with_the_figures():
    history = [_rec(0, "fp32", [6.0, 5.5, 5.0, 4.6])]
    close = _rec(1, "bf16", [6.01, 5.52, 5.03, 4.6])
    numerics.review(close, history, 16, 1, 0.05)
    assert close.outcome.ok and close.outcome.measured.loss_drift == pytest.approx(0.06 / 4
                                                                                   / 5.275)
    far = _rec(2, "bf16", [6.0, 6.4, 7.0, 7.3])  # diverges: past the reference's steps
    numerics.review(far, history, 16, 1, 0.05)
    assert far.outcome.status == "nan" and "step 2's loss 6.4 is outside" in far.outcome.error
    assert "fp32 reference's steps (trial #0), 4.6 to 6" in far.outcome.error
    # A loss that stalls while the reference's falls, inside its range: a steady drift,
    # which the noise (read from step-to-step changes) does not absorb.
    history = [_rec(0, "fp32", [6.0, 5.6, 5.2, 4.9, 4.6, 4.4])]
    stalls = _rec(3, "bf16", [6.0, 5.9, 5.8, 5.7, 5.6, 5.5])
    numerics.review(stalls, history, 16, 1, 0.05)
    assert stalls.outcome.status == "nan" and "loss drifts 12.4%" in stalls.outcome.error
    assert "noise 3.4%" in stalls.outcome.error


def test_dropout_noise_in_the_step_losses_is_not_a_broken_precision():
    """Seen on an H200 (the GPU proof's BERT-large search, random labels, dropout 0.1): the
    bf16 trial's steps were up to 15% off the fp32 reference's and it was rejected, while
    it ran 2.6x faster. Its mean is 3.7% off, well inside the paired steps' noise."""
    fp32 = [0.61629, 0.76100, 2.13890, 1.27370, 0.73308, 0.84526]
    bf16 = [0.66406, 0.87109, 1.99219, 1.08594, 0.71875, 0.79688]
    d = numerics.drift(bf16, fp32, 0.05)
    assert d.mean == pytest.approx(0.0375, abs=0.001) and d.noise > 0.1
    assert not d.past(0.05)
    history = [_rec(0, "fp32", fp32)]
    rec = _rec(1, "bf16", bf16)
    numerics.review(rec, history, 16, 1, 0.05)
    assert rec.outcome.ok
    # The same noise plus a blow-up at the last step is rejected.
    rec = _rec(2, "fp16", [*bf16[:5], 3.5])
    numerics.review(rec, history, 16, 1, 0.05)
    assert rec.outcome.status == "nan" and "step 6's loss 3.5 is outside" in rec.outcome.error


def test_confirmation_picks_the_winner_on_medians_with_an_interval():
    searched = [_rec(0, "fp32", [], batch=8, reason="baseline", sps=10.0),
                _rec(1, "bf16", [], sps=15.0), _rec(2, "bf16", [], batch=2, sps=14.6),
                _rec(3, "bf16", [], batch=8, sps=12.0)]
    roles = [(role, r.number) for role, r in confirm.contenders(searched, 16)]
    assert roles == [("best", 1), ("runner-up", 2), ("baseline", 0)]  # 12.0 is not within 5%
    runs = {1: [13.0, 13.2, 12.9], 2: [14.1, 14.3, 14.0], 0: [10.0, 10.2, 9.9]}
    history = list(searched)
    for rep in range(3):
        for n in (1, 2, 0):
            r = searched[n] if n else searched[0]
            history.append(Record(r.config, Outcome("ok", samples_per_second=runs[n][rep]),
                                  CONFIRM_REASON, 10 + len(history)))
    c = confirm.summarise(history, 3, 8, 16)
    assert c.winner == searched[2].config  # the single best measurement did not hold up
    assert c.speedup == pytest.approx(14.1 / 10.0)
    assert c.speedup_low <= c.speedup <= c.speedup_high
    assert c.speedup_low > 1.3
    # An interval that holds 1 is no confirmed gain, and the report says so (a newcomer's
    # busy machine gave "2.18× (0.34–3.48)").
    from autotune.outputs.report import headline
    from autotune.summary import Confirmation, Summary

    def speedup_detail(confirmation) -> str:
        summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=16,
                          world_size=1, seq_len=8, trials=history, confirmation=confirmation)
        return next(f for f in headline(summary) if f.label == "Speedup").detail

    assert "too noisy" not in speedup_detail(c)
    noisy = Confirmation(c.repeats, c.steps, c.rows, c.winner, 2.18, 0.34, 3.48)
    assert "it holds 1, so the runs were too noisy to confirm a gain" in speedup_detail(noisy)


def test_a_baseline_chain_config_is_the_reference_never_the_winner():
    """Found in a fresh-clone run: the baseline's auto_find_batch_size chain (b15x1, an
    effective batch of 15 for a target of 32) measured fastest and was reported as the
    best config. The winner must train the target effective batch."""
    searched = [_rec(0, "fp32", [], batch=14, reason="baseline", sps=28.0),
                _rec(1, "fp32", [], batch=12, reason="baseline", sps=27.0),
                _rec(2, "fp32", [], batch=8, sps=26.5)]
    roles = [(role, r.number) for role, r in confirm.contenders(searched, 16)]
    assert roles == [("best", 2), ("baseline", 0)]
    history = list(searched) + [
        Record(searched[n].config, Outcome("ok", samples_per_second=sps), CONFIRM_REASON,
               10 + i) for i, (n, sps) in enumerate([(2, 26.0), (0, 27.5), (2, 26.2)])]
    c = confirm.summarise(history, 2, 8, 16)
    assert c.winner == searched[2].config and c.speedup < 1  # said as it is


def test_a_baseline_that_trains_the_target_and_confirms_fastest_is_the_winner():
    """Found in CI: a baseline at the target (b16x1 for 16) confirmed faster than the
    search's best. It is the winner, at a speedup of exactly 1, not one bootstrapped from
    its own runs drawn twice, and the report says the baseline held."""
    from autotune.outputs.report import headline
    from autotune.summary import Summary

    searched = [_rec(0, "fp32", [], batch=16, reason="baseline", sps=10.0),
                _rec(1, "fp32", [], batch=8, sps=10.4)]
    assert [role for role, _ in confirm.contenders(searched, 16)] == ["best", "baseline"]
    history = list(searched) + [
        Record(searched[n].config, Outcome("ok", samples_per_second=sps), CONFIRM_REASON,
               10 + i) for i, (n, sps) in enumerate([(1, 9.8), (0, 10.3), (1, 9.9), (0, 10.1)])]
    c = confirm.summarise(history, 2, 8, 16)
    assert c.winner == searched[0].config
    assert (c.speedup, c.speedup_low, c.speedup_high) == (1.0, 1.0, 1.0)
    summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=16,
                      world_size=1, seq_len=8, trials=history, confirmation=c)
    assert summary.best.config == searched[0].config
    fact = next(f for f in headline(summary) if f.label == "Speedup")
    assert fact.value == "1.00× Trainer defaults"
    assert "the baseline confirmed fastest" in fact.detail


def test_a_budget_spent_on_the_baseline_probes_has_no_winner(tmp_path):
    """Found by a review: `--trials 3` went to the baseline's probes (b15x1, b22x1, an
    OOM at b28x1 for a target of 32), and b15x1 was exported as the winner, training 15
    samples a step while the report said 32. Now there is none, and the report says why;
    a baseline at the chain's top trains the target and may win."""
    from autotune.outputs.report import headline
    from autotune.summary import Summary

    probes = [_rec(0, "fp32", [], batch=14, reason="baseline", sps=28.0),
              _rec(1, "fp32", [], batch=12, reason="baseline", sps=27.0)]
    assert confirm.contenders(probes, 16) == []
    summary = Summary(model={}, device=None, memory_limit_bytes=1, target_batch_size=16,
                      world_size=1, seq_len=8, trials=probes)
    assert summary.best is None and "raise search.n_trials" in summary.no_winner_why
    assert headline(summary)[0].detail == summary.no_winner_why
    # A target-batch trial that ran and failed: more trials is not the advice.
    failed = Record(TrialConfig.of(4, 4), Outcome("error", error="boom"), "model", 3)
    summary.trials = [*probes, failed]
    assert summary.best is None and "see the errors" in summary.no_winner_why
    top = _rec(2, "fp32", [], batch=16, reason="baseline", sps=26.0)
    assert [r.number for _, r in confirm.contenders([*probes, top], 16)] == [2]
    summary.trials = [*probes, top]
    assert summary.best is top
    assert "effective batch 16 (16 × 1 accumulation × 1 rank)" in headline(summary)[0].detail


def test_a_baseline_is_no_winner_in_place_of_contenders_whose_confirmation_failed():
    """Found by a review: every confirmation run of the target-batch contender ran out of
    memory, the baseline's (b14x1 for a target of 16) did not, and it was made the
    winner. The winner trains the target or there is none."""
    from autotune.summary import Summary

    searched = [_rec(0, "fp32", [], batch=14, reason="baseline", sps=20.0),
                _rec(1, "fp32", [], batch=4, sps=24.0)]
    history = list(searched) + [
        Record(c, o, CONFIRM_REASON, 10 + i) for i, (c, o) in enumerate([
            (searched[1].config, Outcome("oom")), (searched[0].config,
                                                   Outcome("ok", samples_per_second=19.0)),
            (searched[1].config, Outcome("oom")), (searched[0].config,
                                                   Outcome("ok", samples_per_second=19.5))])]
    c = confirm.summarise(history, 2, 8, 16)
    assert c is not None and c.winner is None and c.speedup is None
    summary = Summary(model={}, device=None, memory_limit_bytes=1, target_batch_size=16,
                      world_size=1, trials=history, confirmation=c)
    assert summary.best is None and "confirmation runs all failed" in summary.no_winner_why
    again = Summary.from_dict(summary.to_dict())
    assert again.confirmation.winner is None and again.best is None


def test_a_baseline_that_runs_out_of_memory_in_a_longer_run_moves_down_its_chain(tmp_path):
    """Found in the committed example: the baseline b25x1 fit its short probe, then two of
    its three longer confirmation runs ran out of memory, and the interval was drawn from
    one figure. The long run's auto_find_batch_size would retry at 0.9x: so does this."""
    from autotune.summary import Summary
    from autotune.tuning.strategies.base import SearchContext
    from tests.conftest import TINY_SPEC

    base = TrialConfig.of(16, 1)
    searched = [Record(base, Outcome("ok", samples_per_second=20.0), "baseline", 0),
                _rec(1, "fp32", [], batch=4, sps=24.0)]
    picked = confirm.contenders(searched, 16)
    assert [role for role, _ in picked] == ["best", "baseline"]
    spec = load_spec(TINY_SPEC | {"output": str(tmp_path / "out")})
    ctx = SearchContext([], DeviceSpec("cpu", "cpu", 2**34), 1, 16, 2**30)
    strategy = confirm.ConfirmStrategy(ctx, spec, tmp_path, picked, 2, on_cpu=True)
    history = list(searched)
    asked, figures = [], {4: [23.0, 22.0], 16: [None], 14: [19.0, 19.5]}  # None: OOM
    for _ in range(5):
        proposal = strategy.ask(history)
        b = proposal.config.per_device_train_batch_size
        asked.append(b)
        sps = figures[b].pop(0)
        outcome = Outcome("ok", samples_per_second=sps) if sps else Outcome("oom")
        history.append(Record(proposal.config, outcome, CONFIRM_REASON, len(history)))
    assert asked == [4, 16, 14, 4, 14]  # round-robin; the OOM moved the baseline to 14
    assert strategy.ask(history) is None
    assert (tmp_path / "b14x1-fp32-adamw_torch" / "training_args.json").exists()
    c = confirm.summarise(history, 2, 8, 16)
    row = next(r for r in c.rows if r.role == "baseline")
    assert row.config == TrialConfig.of(14, 1) and row.searched_number is None
    assert row.samples_per_second == [19.0, 19.5]
    assert c.speedup == pytest.approx(22.5 / 19.25)
    summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=16,
                      world_size=1, seq_len=32, trials=history, confirmation=c)
    assert summary.baseline.config == TrialConfig.of(14, 1)


def test_time_is_held_back_for_confirmation_only_once_there_is_something_to_confirm():
    """Found in CI's rehearsal: `--trials 6 --timeout 100s` stopped after its first trial
    (a baseline probe, 7 s) to keep 18 trials' time for a confirmation, which then had no
    contender at the target: the search now runs on until one succeeded. Then seen on an
    H200: 18 median trials (130 s) ended a 120 s search at its first trial past the probes,
    where the contenders' own times price their six runs at 54 s (they took 53 s)."""
    import time

    from autotune.tuning.loop import Limits

    def rec(n, batch, accum, reason, wall, timed):
        r = Record(TrialConfig.of(batch, accum), Outcome("ok", samples_per_second=10.0 + n,
                                                          wall_seconds=wall,
                                                          timed_seconds=timed), reason, n)
        return r

    history = [rec(0, 12, 1, "baseline", 19.96, 1.49), rec(1, 14, 1, "baseline", 6.76, 1.62)]
    reserve = [0.0]

    def held() -> float:
        reserve[0] = confirm.cost_seconds(confirm.contenders(history, 16), 3)
        return reserve[0]

    limits = Limits(max_trials=20, deadline=time.time() + 30, reserve=held)
    assert not limits.exhausted([19.96, 6.76], 0) and reserve[0] == 0  # nothing at target
    history.append(rec(42, 8, 2, "model", 7.72, 2.06))  # best; the baseline's top beside it
    costs = [19.96, 6.76, 7.72]
    # 54.5 s for the confirmation, and the next trial's 7.7 s (the median) before it.
    assert not Limits(deadline=time.time() + 66, reserve=held).exhausted(costs, 0)
    assert reserve[0] == pytest.approx(3 * (7.72 + 2.06 + 6.76 + 1.62))
    assert Limits(deadline=time.time() + 60, reserve=held).exhausted(costs, 0)
    assert Limits(deadline=time.time() + 66, reserve=held).exhausted(costs, 1)  # in flight
    # On two GPUs no faster than the costlier contender's three runs one after another.
    assert confirm.cost_seconds(confirm.contenders(history, 16), 3, capacity=2) == (
        pytest.approx(3 * (7.72 + 2.06)))
    # A resumed study: the confirmation runs an earlier session made are not paid again,
    # and what a config's last one took prices its next.
    done = [Record(TrialConfig.of(8, 2), Outcome("ok", samples_per_second=18.0,
                                                 wall_seconds=12.0), CONFIRM_REASON, 50 + i)
            for i in range(2)]
    done.append(Record(TrialConfig.of(14, 1), Outcome("ok", samples_per_second=11.0,
                                                      wall_seconds=10.0), CONFIRM_REASON, 52))
    assert confirm.cost_seconds(confirm.contenders(history, 16), 3, history=history + done) == (
        pytest.approx(1 * 12.0 + 2 * 10.0))
    more = [Record(TrialConfig.of(8, 2), Outcome("ok", samples_per_second=18.0),
                   CONFIRM_REASON, 60 + i) for i in range(3)]
    assert confirm.cost_seconds(confirm.contenders(history, 16), 3,
                                history=history + done + more) == pytest.approx(
        2 * 10.0)  # the best owes none; never less than nothing


def test_the_launchers_start_is_not_projected_onto_the_trials_after_it():
    """Found in a fresh-clone CI on 2 busy cores: a search's first trial started this
    process's warm launcher (its imports: 136 s there, where the trial itself took 3 s).
    Priced at its wall time, the confirmation (three runs each) and the next trial no
    longer fitted the search's 10 minutes, and it stopped after the baseline. What a
    config costs to run again is its wall time less that start, which later trials of
    the process do not pay."""
    import time

    from autotune.records import Launch
    from autotune.tuning.loop import Limits

    first = Outcome("ok", samples_per_second=18.8, wall_seconds=138.97, timed_seconds=1.70,
                    launch=Launch(kind="warm", launcher_start_s=135.89))
    assert first.repeat_seconds == pytest.approx(138.97 - 135.89)
    assert Outcome("ok", wall_seconds=5.0).repeat_seconds == 5.0
    history = [Record(TrialConfig.of(16, 1), first, "baseline", 0)]

    def held() -> float:
        return confirm.cost_seconds(confirm.contenders(history, 16), 3)

    assert held() == pytest.approx(3 * (138.97 - 135.89 + 1.70 * (confirm.STEPS_FACTOR - 1)))
    # Ten minutes' search, started nine before (the launcher's start among them): room
    # for more trials and their confirmation, as the repeats' 3-6 s showed there.
    assert not Limits(max_trials=6, deadline=time.time() + 60, reserve=held).exhausted(
        [first.repeat_seconds], 0)


def test_the_confirmation_is_priced_with_the_waits_for_another_searchs_trials():
    """Found running the README's example beside the GRPO one on 2 cores: each trial
    waited 9-73 s for the other search's, which its wall time leaves out. Priced without
    them, the confirmation did not fit what the search left it, and its 15 minutes ran
    out with one or two runs of each contender. Each owed run now pays the recent
    trials' median wait; the waits of trials long past do not count."""
    from autotune.records import Launch

    def rec(n, batch, accum, reason, wait):
        return Record(TrialConfig.of(batch, accum), Outcome(
            "ok", samples_per_second=10.0 + n, wall_seconds=8.0, timed_seconds=2.0,
            launch=Launch(lease_wait_s=wait)), reason, n)

    alone = [rec(0, 16, 1, "baseline", 0.0), rec(1, 8, 2, "model", 0.0)]
    each = 8.0 + 2.0 * (confirm.STEPS_FACTOR - 1)
    assert confirm.cost_seconds(confirm.contenders(alone, 16), 3, history=alone) == (
        pytest.approx(2 * 3 * each))
    beside = alone + [rec(2, 4, 4, "model", 40.0), rec(3, 2, 8, "model", 60.0),
                      rec(4, 8, 2, "recipe", 50.0)]
    assert confirm.lease_wait_seconds(beside) == pytest.approx(45.0)  # the last four's
    picked = confirm.contenders(beside, 16)
    assert [(role, r.number) for role, r in picked] == [("recipe", 4), ("baseline", 0)]
    assert confirm.cost_seconds(picked, 3, history=beside) == pytest.approx(
        2 * 3 * (each + 45.0))
    # A pruned config ran nowhere and a lost one recorded no wait: neither is evidence.
    pruned = Record(TrialConfig.of(1, 16), Outcome("pruned"), "predicted-oom", 5)
    lost = Record(TrialConfig.of(1, 16), Outcome("lost"), "model", 6)
    assert confirm.lease_wait_seconds(beside[2:] + [pruned, lost]) == pytest.approx(50.0)
    assert confirm.lease_wait_seconds(beside + [rec(7, 16, 1, "model", 0.0)] * 4) == 0.0


def test_the_next_trial_is_priced_with_its_wait_for_another_searchs_trials():
    """A search beside another stopped starting trials by their wall times, which leave
    out each one's wait for the other's: its last trial then ate the confirmation's time.
    The next trial's price now holds the recent wait, as each confirmation run's does."""
    import time

    from autotune.tuning.loop import Limits

    costs, held = [10.0, 10.0, 10.0], (lambda: 20.0)  # confirmation: 20 s owed
    # 20 s held back and 10 s for the next trial fit in 35 s; with its 15 s wait they do not.
    assert not Limits(deadline=time.time() + 35, reserve=held).exhausted(costs, 0)
    assert Limits(deadline=time.time() + 35, reserve=held, wait=lambda: 15.0).exhausted(
        costs, 0)
    assert not Limits(deadline=time.time() + 50, reserve=held, wait=lambda: 15.0).exhausted(
        costs, 0)
    # What a strategy is told it has left: trials of 25 s each, not of 10.
    assert Limits(deadline=time.time() + 120, reserve=held, wait=lambda: 15.0).trials_left(
        costs, 0) == pytest.approx(4.0, abs=0.01)
    assert Limits(deadline=time.time() + 120, reserve=held).trials_left(
        costs, 0) == pytest.approx(10.0, abs=0.01)


def test_each_confirmation_round_runs_the_best_and_the_baseline_first(tmp_path):
    """A confirmation its deadline cuts keeps the speedup's interval (two runs each of the
    best and the baseline) before a runner-up's second run: beside another search, the
    baseline ran last in its round, once, and the report had no interval."""
    from autotune.tuning.strategies.base import SearchContext
    from tests.conftest import TINY_SPEC

    searched = [_rec(0, "fp32", [], batch=16, reason="baseline", sps=20.0),
                _rec(1, "bf16", [], batch=8, reason="recipe", sps=21.0),
                _rec(2, "fp32", [], batch=4, sps=24.0), _rec(3, "fp32", [], batch=2, sps=23.5)]
    picked = confirm.contenders(searched, 16)
    assert [(role, r.number) for role, r in picked] == [
        ("best", 2), ("runner-up", 3), ("recipe", 1), ("baseline", 0)]
    spec = load_spec(TINY_SPEC | {"output": str(tmp_path / "out")})
    ctx = SearchContext([], DeviceSpec("cpu", "cpu", 2**34), 1, 16, 2**30)

    def asked(picked, repeats):
        """The batches the confirmation asks for, in order, each run as it is asked."""
        strategy = confirm.ConfirmStrategy(ctx, spec, tmp_path, picked, repeats, on_cpu=True)
        history, out = list(searched), []
        while (proposal := strategy.ask(history)) is not None:
            out.append(proposal.config.per_device_train_batch_size)
            history.append(Record(proposal.config, Outcome("ok", samples_per_second=20.0),
                                  CONFIRM_REASON, len(history)))
        return out

    assert asked(picked, 2) == [4, 16, 8, 2] * 2
    # The best is first whatever its role: here the recipe is the fastest.
    searched[1].outcome.samples_per_second = 24.5
    picked = confirm.contenders(searched, 16)
    assert [(role, r.number) for role, r in picked] == [
        ("recipe", 1), ("runner-up", 2), ("runner-up", 3), ("baseline", 0)]
    assert asked(picked, 1) == [8, 16, 4, 2]


def test_no_confirmation_run_starts_that_would_end_past_the_deadline(tmp_path):
    """search.timeout is the invocation's wall time: a confirmation run is started only
    where, at its price, it ends by the deadline (its search trial again with twice the
    timed steps, or what its last confirmation run took; after the recent wait for
    devices). Started up to the deadline, the last runs of 6-minute searches beside
    another ended 1-30 s past it. One that does not fit never will: a cheaper one that
    does goes in its place."""
    import time

    from autotune.records import Launch
    from autotune.tuning.strategies.base import SearchContext
    from tests.conftest import TINY_SPEC

    def rec(n, batch, reason, wait=0.0, wall=8.0):  # a run priced wall + 2 s, and a wait
        return Record(TrialConfig.of(batch, 16 // batch), Outcome(
            "ok", samples_per_second=20.0 + n, wall_seconds=wall, timed_seconds=2.0,
            launch=Launch(lease_wait_s=wait)), reason, n)

    searched = [rec(0, 16, "baseline"), rec(1, 8, "recipe"), rec(2, 4, "model")]
    spec = load_spec(TINY_SPEC | {"output": str(tmp_path / "out")})
    ctx = SearchContext([], DeviceSpec("cpu", "cpu", 2**34), 1, 16, 2**30)
    picked = confirm.contenders(searched, 16)

    def first(history, left):
        """The batch the confirmation would run next with `left` seconds to go."""
        strategy = confirm.ConfirmStrategy(ctx, spec, tmp_path, picked, 3, on_cpu=True,
                                           deadline=time.time() + left)
        proposal = strategy.ask(history)
        return proposal and proposal.config.per_device_train_batch_size

    assert first(searched, 60.0) == 4  # the best
    assert first(searched, 9.0) is None  # 8 s, and the doubled timed steps 2 s more
    # Beside another search each run also waits its turn: 10 s of run and 30 s of wait
    # (the median of the last four trials' waits).
    waited = [*searched, *(rec(n, 2, "model", 30.0) for n in (3, 4, 5))]
    assert first(waited, 60.0) == 4 and first(waited, 35.0) is None
    # The best's first confirmation run took 40 s: its second is priced so, and with 25 s
    # left the baseline (10 s) runs in its place.
    ran = [*searched, Record(searched[2].config, Outcome(
        "ok", samples_per_second=20.0, wall_seconds=40.0), CONFIRM_REASON, 3)]
    assert first(ran, 60.0) == 16  # round two not begun: the baseline's first run
    ran += [Record(c.config, Outcome("ok", samples_per_second=20.0, wall_seconds=8.0),
                   CONFIRM_REASON, n) for n, c in ((4, searched[0]), (5, searched[1]))]
    assert first(ran, 60.0) == 4 and first(ran, 25.0) == 16 and first(ran, 5.0) is None
    # Without a deadline nothing is held back.
    assert confirm.ConfirmStrategy(ctx, spec, tmp_path, picked, 3, on_cpu=True).ask(
        searched) is not None


def test_a_search_spends_its_budget_on_wall_time_and_projects_repeat_costs():
    """The search loop itself (real Optuna study, autotune's strategy, the outcomes of the
    CPU landscape measured here): every trial takes 10 s, the first 100 s more to start
    the warm launcher. Within 140 s, four trials: after the first, 110 s spent and 10 s
    projected (priced at its wall time, the next would be projected at 110 s: one trial;
    spent counted as repeat costs, thirteen)."""
    from autotune.bench.bench import choices, context
    from autotune.bench.landscape import load_landscape
    from autotune.bench.replay import ReplayExecutor
    from autotune.records import Launch
    from autotune.tuning.loop import Limits, drive
    from autotune.tuning.strategies.registry import make_strategy, sampler_for
    from autotune.tuning.study import StudyLog

    land = load_landscape(Path(__file__).resolve().parents[1] / "benchmarks" / "landscapes"
                          / "cpu-tiny-gpt2-2core")

    class Timed(ReplayExecutor):
        def _answer(self, config):
            outcome = super()._answer(config)
            first = self._next == 0
            outcome.wall_seconds = 110.0 if first else 10.0
            outcome.launch = Launch(kind="warm", launcher_start_s=100.0 if first else None)
            return outcome

    ctx = context(land, 0)
    log = StudyLog.in_memory(choices(ctx.candidates), ctx.memory_limit_bytes,
                             sampler_for("autotune", 0))
    history = drive(make_strategy("autotune", ctx, log, guarded=False), Timed(land), log,
                    Limits(budget_seconds=140.0))
    assert [r.outcome.wall_seconds for r in history if r.counted] == [110.0, 10.0, 10.0, 10.0]


def test_a_loss_logged_summed_over_micro_batches_is_compared_at_its_scale():
    """Seen on an H200 (BERT-large classification): Trainer left the b8x2 trials' losses
    unscaled for accumulation, so they logged twice the b16x1 reference's and both were
    rejected. The first step (same weights, same samples) shows the ratio."""
    fp32 = [0.61629, 0.76100, 2.13890, 1.27370, 0.73308, 0.84526]
    history = [_rec(0, "fp32", fp32, batch=16)]
    summed = _rec(1, "bf16", [1.2656, 2.9688, 3.3516, 1.8125, 1.6016, 1.3945], batch=8,
                  sps=12.0)
    numerics.review(summed, history, 16, 1, 0.05)
    assert summed.outcome.ok and summed.outcome.measured.loss_accumulation_scale == 2
    # Twice the loss where the accumulation is the same is no logging quirk.
    doubled = _rec(2, "bf16", [2 * x for x in fp32], batch=16)
    numerics.review(doubled, history, 16, 1, 0.05)
    assert doubled.outcome.status == "nan"
    assert doubled.outcome.measured.loss_accumulation_scale is None
    # The report tells the user: the exported run sums its gradients too.
    from autotune.outputs.report import headline
    from autotune.summary import Summary

    summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=16,
                      world_size=1, seq_len=8, trials=[*history, summed])
    best = headline(summary)[0]
    assert best.value == summed.config.label()
    assert "summed over the 2 micro-batches" in best.detail
    assert "summed" not in headline(Summary(model={}, device=None, memory_limit_bytes=2**30,
                                            target_batch_size=16, world_size=1, seq_len=8,
                                            trials=history))[0].detail
    # The model sums (a fact of the study): the best's own accumulation is what it sums
    # over, and a best without accumulation has nothing to sum.
    quad = _rec(4, "bf16", [], batch=4, sps=14.0)
    summary.trials = [*history, summed, quad]
    assert "summed over the 4 micro-batches" in headline(summary)[0].detail
    whole = _rec(5, "bf16", [], batch=16, sps=15.0)
    summary.trials = [*history, summed, quad, whole]
    assert headline(summary)[0].value == whole.config.label()
    assert "summed" not in headline(summary)[0].detail
    # Scaled, and still off: the message says at which scale it was read.
    off = _rec(3, "bf16", [1.2656, 2.9688, 3.3516, 1.8125, 1.6016, 9.0], batch=8)
    numerics.review(off, history, 16, 1, 0.05)
    assert off.outcome.status == "nan"
    assert "step 6's loss 4.5 (logged 2x, as a sum over micro-batches) is outside" in (
        off.outcome.error)


def test_an_accumulation_near_the_references_is_not_read_as_a_summed_loss():
    """From a review: a 5/4 accumulation ratio is within 25% of 1, so an ordinary loss
    would have been read as logged 1.25x and rejected."""
    ref = Record(TrialConfig.of(5, 4),
                 Outcome("ok", measured=Measurement(losses=[6.0, 5.5, 5.0])), "model", 0)
    same = Record(TrialConfig.of(4, 5, precision="bf16"),
                  Outcome("ok", measured=Measurement(losses=[6.0, 5.5, 5.0])), "model", 1)
    assert numerics.accumulation_scale(same, ref) == 1
    numerics.review(same, [ref], 20, 1, 0.05)
    assert same.outcome.ok
    # A reference that logged its two micro-batches summed, against a trial of one.
    summed = Record(TrialConfig.of(4, 2),
                    Outcome("ok", measured=Measurement(losses=[1.26, 1.5])), "model", 2)
    whole = Record(TrialConfig.of(8, 1, precision="bf16"),
                   Outcome("ok", measured=Measurement(losses=[0.64, 0.74])), "model", 3)
    assert numerics.accumulation_scale(whole, summed) == 0.5
