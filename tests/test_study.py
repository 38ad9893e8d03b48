"""The Optuna study drives: trials are RUNNING while they run, told when they end, and a
dead driver's trials run again; two drivers on one storage never run a config twice."""

from __future__ import annotations

import subprocess
import sys

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import BATCH, TrialConfig
from autotune.device import DeviceSpec
from autotune.records import Outcome
from autotune.tuning.strategies.base import Proposal, SearchContext
from autotune.tuning.strategies.samplers import SamplerStrategy, make_sampler
from autotune.tuning.study import ABANDONED_KEY, DRIVER_KEY, StudyLog

CPU = DeviceSpec("cpu", "cpu", 16 * 2**30)
CONFIGS = [TrialConfig.of(b, 16 // b, precision=p) for b in (4, 8, 16) for p in ("fp32", "bf16")]
CHOICES = {BATCH: [4, 8, 16], "precision": ["fp32", "bf16"]}
GiB = 2**30


def _log(storage: str) -> StudyLog:
    return StudyLog.open(storage, "s", "fingerprint", CHOICES, 2 * GiB)


def _state(log: StudyLog, number: int) -> TrialState:
    return log.study.trials[number].state


def test_trials_are_running_then_told(tmp_path):
    log = _log(f"sqlite:///{tmp_path / 'study.db'}")
    ok = log.start(Proposal(CONFIGS[0], "baseline"))
    assert _state(log, ok) == TrialState.RUNNING  # what optuna-dashboard shows in flight
    log.finish(ok, Proposal(CONFIGS[0], "baseline"),
               Outcome("ok", samples_per_second=50.0, peak_memory_bytes=GiB))
    oom = log.start(Proposal(CONFIGS[5], "model"))
    log.finish(oom, Proposal(CONFIGS[5], "model"), Outcome("oom"))
    pruned = log.prune(Proposal(CONFIGS[4], "predicted-oom: x", run=False))
    trials = log.study.trials
    assert trials[ok].state == TrialState.COMPLETE and trials[ok].value == 50.0
    assert trials[ok].constraints == {"memory": -0.5}  # half the limit: feasible
    assert trials[oom].value == 0.0 and trials[oom].constraints == {"memory": 1.0}
    assert trials[pruned.number].state == TrialState.PRUNED
    assert [r.config for r in log.history()] == [CONFIGS[0], CONFIGS[5], CONFIGS[4]]


def _driver_died(log: StudyLog, number: int) -> None:
    """The trial's driver as a process of this host that has exited."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    trial_id = log.storage.get_trial_id_from_study_id_trial_number(log.study_id, number)
    log.storage.set_trial_system_attr(trial_id, DRIVER_KEY, log.driver | {"pid": int(dead)})


def test_a_dead_drivers_running_trial_is_abandoned_and_its_config_runs_again(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = _log(storage)
    number = first.start(Proposal(CONFIGS[1], "model"))
    _driver_died(first, number)
    second = _log(storage)
    assert second.recover_abandoned() == [number]
    assert ABANDONED_KEY in second.study.trials[number].user_attrs
    assert second.history() == [] and second.running_elsewhere() == []


def test_two_drivers_on_one_storage_never_run_a_config_twice(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    a, b = _log(storage), _log(storage)
    assert a.start(Proposal(CONFIGS[2], "model")) is not None
    assert b.running_elsewhere() == [CONFIGS[2]]  # B's strategy sees it as pending
    assert b.start(Proposal(CONFIGS[2], "model")) is None  # and a late claim is refused


def test_an_optuna_sampler_asks_the_study_itself():
    ctx = SearchContext(CONFIGS, CPU, 1, 16, 2 * GiB, None, 0)
    log = StudyLog.in_memory(CHOICES, 2 * GiB, make_sampler("tpe", 0))
    proposal = SamplerStrategy(ctx, log, "tpe", guarded=False).ask([], [])
    assert proposal is not None and proposal.trial_number is not None
    assert log.study.trials[proposal.trial_number].state == TrialState.RUNNING
    assert proposal.config in CONFIGS
    assert isinstance(log.study.sampler, optuna.samplers.TPESampler)


def test_a_config_pruned_on_a_prediction_may_still_run_later(tmp_path):
    """A calibrated model can later say a pruned config fits; the prune is no claim."""
    log = _log(f"sqlite:///{tmp_path / 'study.db'}")
    log.prune(Proposal(CONFIGS[3], "predicted-oom: x", run=False))
    assert log.start(Proposal(CONFIGS[3], "model")) is not None


def test_a_resumed_search_first_runs_what_was_left_in_flight():
    """Found with two trials in flight at Ctrl-C: the resumed strategy re-ran one and never
    chose the other again. A resume owes each a run, under the reason it was asked for."""
    from autotune.tuning.strategies.base import Resume, Strategy

    log = StudyLog.in_memory(CHOICES, 2**30)
    done = Proposal(CONFIGS[4], "baseline")
    log.finish(log.start(done), done, Outcome("ok", samples_per_second=1.0))
    for proposal in (Proposal(CONFIGS[2], "baseline"), Proposal(CONFIGS[1], "model")):
        log.start(proposal)
    log.abandon("interrupted")
    owed = log.abandoned()
    assert owed == [(CONFIGS[2], "baseline"), (CONFIGS[1], "model")]

    class Nothing(Strategy):
        def ask(self, history, pending=()):
            return None

    resume = Resume(Nothing(SearchContext([], None, 1, 16, 2**30)), owed)
    history = log.history()
    first = resume.ask(history)
    assert (first.config, first.reason) == owed[0]
    assert resume.ask(history, [first.config]).config == owed[1][0]
    assert resume.ask(history, [c for c, _ in owed]) is None


OPENER = """
import sys, time
from autotune.tuning.study import StudyLog
start = float(sys.argv[2])
while time.time() < start:
    pass
StudyLog.open(sys.argv[1], "s", "fingerprint", {"precision": ["fp32"]}, 2**31)
"""


def test_drivers_opening_a_new_storage_at_once_all_get_the_study(tmp_path):
    """Several drivers on one storage, started together: each creates the SQLite schema
    if missing, and the losers of that race must load what the winner made."""
    import time

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    start = str(time.time() + 4)  # past every process's imports: they open at once
    procs = [subprocess.Popen([sys.executable, "-c", OPENER, storage, start],
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors
    assert optuna.get_all_study_names(storage) == ["s"]


def _interrupt_once(monkeypatch, obj, name: str, when=lambda *a, **k: True) -> None:
    """Ctrl-C landing at `obj.name`'s first call that `when` picks."""
    real = getattr(obj, name)
    fired = []

    def interrupted(*args, **kwargs):
        if not fired and when(*args, **kwargs):
            fired.append(True)
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, interrupted)


def test_a_ctrl_c_after_the_outcome_is_written_keeps_the_measurement(tmp_path, monkeypatch):
    """One CI run's Ctrl-C landed between a trial's outcome being written and its tell:
    the trial was abandoned, its measurement lost and its config run again, and the
    resumed search counted one trial fewer than had run."""
    log = _log(f"sqlite:///{tmp_path / 'study.db'}")
    proposal = Proposal(CONFIGS[0], "baseline")
    number = log.start(proposal)
    _interrupt_once(monkeypatch, log.study, "tell")
    with pytest.raises(KeyboardInterrupt):
        log.finish(number, proposal, Outcome("ok", samples_per_second=50.0,
                                             peak_memory_bytes=GiB))
    log.abandon("interrupted")
    trial = log.study.trials[number]
    assert trial.state == TrialState.COMPLETE and trial.value == 50.0
    assert ABANDONED_KEY not in trial.user_attrs and trial.constraints == {"memory": -0.5}
    assert [r.outcome.samples_per_second for r in log.history()] == [50.0]
    assert log.abandoned() == []


def test_a_ctrl_c_before_the_outcome_is_written_runs_the_config_again(tmp_path, monkeypatch):
    """A record written in part (its outcome not yet) is no record: the config is owed."""
    log = _log(f"sqlite:///{tmp_path / 'study.db'}")
    proposal = Proposal(CONFIGS[0], "model")
    number = log.start(proposal)
    _interrupt_once(monkeypatch, log, "_set",
                    lambda number, attrs, **kw: "outcome" in attrs)
    with pytest.raises(KeyboardInterrupt):
        log.finish(number, proposal, Outcome("ok", samples_per_second=50.0))
    log.abandon("interrupted")
    assert "outcome" not in log.study.trials[number].user_attrs
    assert log.history() == [] and log.abandoned() == [(CONFIGS[0], "model")]


def test_a_dead_drivers_trial_with_its_outcome_written_is_told_not_run_again(tmp_path,
                                                                           monkeypatch):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = _log(storage)
    proposal = Proposal(CONFIGS[1], "model")
    number = first.start(proposal)
    _interrupt_once(monkeypatch, first.study, "tell")  # killed before its tell
    with pytest.raises(KeyboardInterrupt):
        first.finish(number, proposal, Outcome("oom", error="budget"))
    _driver_died(first, number)
    second = _log(storage)
    assert second.recover_abandoned() == []
    trial = second.study.trials[number]
    assert trial.state == TrialState.COMPLETE and trial.constraints == {"memory": 1.0}
    assert [r.outcome.status for r in second.history()] == ["oom"]
    assert second.abandoned() == []


def test_a_ctrl_c_after_the_tell_leaves_the_trial_as_told(tmp_path, monkeypatch):
    """The Ctrl-C lands after the tell, before the driver forgets the trial: abandoning it
    would write to a finished trial (Optuna refuses) and hide the interrupt."""
    log = _log(f"sqlite:///{tmp_path / 'study.db'}")
    proposal, other = Proposal(CONFIGS[0], "baseline"), Proposal(CONFIGS[1], "model")
    number, in_flight = log.start(proposal), log.start(other)
    log.finish(number, proposal, Outcome("ok", samples_per_second=50.0))
    log._numbers.add(number)  # as if the interrupt came before the discard
    log.abandon("interrupted")
    assert log.study.trials[number].state == TrialState.COMPLETE
    assert ABANDONED_KEY in log.study.trials[in_flight].user_attrs
    assert log.abandoned() == [(CONFIGS[1], "model")]


def test_a_samplers_prune_cut_before_its_tell_is_recovered_as_pruned(tmp_path, monkeypatch):
    """TPE and GP read PRUNED trials and drop FAIL ones: a prune recovered as a failure
    would hide from them what the prediction said."""
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    first = _log(storage)
    asked = first.study.ask()
    proposal = Proposal(CONFIGS[5], "predicted-oom: x", run=False, trial_number=asked.number)
    _interrupt_once(monkeypatch, first.study, "tell")
    with pytest.raises(KeyboardInterrupt):
        first.prune(proposal)
    second = _log(storage)  # its heartbeat never written: stale at once
    assert second.recover_abandoned() == []
    assert second.study.trials[asked.number].state == TrialState.PRUNED
    assert [r.outcome.status for r in second.history()] == ["pruned"]
