"""The Optuna study drives the search and keeps its record.

Every trial is created in the study when it starts (RUNNING, so optuna-dashboard and
other drivers see it in flight) and told when it ends: COMPLETE with samples/s; an OOM
COMPLETE with value 0 and a violated memory constraint (the samplers' constraints_func
only reads COMPLETE trials, so an OOM told as FAIL would teach them nothing); a config
pruned on a memory prediction PRUNED; a failed trial FAIL. A sampler's proposal that is
no trial (a repeat, an excluded combination) is told and marked skipped. A RUNNING trial
whose driver died or was interrupted is marked abandoned, and its config runs again;
unless its outcome was written (the last of its record), when it is told that outcome.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import optuna
import psutil
from optuna.distributions import CategoricalDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from autotune.config import TrialConfig
from autotune.dburl import driver_url, shown
from autotune.errors import AutotuneError, SpecError
from autotune.records import LOST, OK, OOM, PRUNED, SAMPLES_PER_SECOND, Outcome, Record
from autotune.tuning.strategies.base import Proposal

FINGERPRINT_KEY = "spec_fingerprint"
SUMMARY_KEY = "autotune_summary"
WALL_KEY = "autotune_wall_seconds"
# Optuna's constraint of a trial (a system attribute that TPE and GP read): <= 0 fits.
CONSTRAINT_KEY = "constraints:memory"
# User attributes of a trial.
SKIPPED_KEY = "skipped"  # a sampler's proposal that was not a trial, and why
ABANDONED_KEY = "abandoned"  # left RUNNING by a driver that died or was interrupted
# System attributes of a RUNNING trial: who runs it, and when it last said so.
DRIVER_KEY = "autotune_driver"
HEARTBEAT_KEY = "autotune_heartbeat"
HEARTBEAT_SECONDS = 15.0
STALE_SECONDS = 8 * HEARTBEAT_SECONDS  # no heartbeat for this long: the driver is gone


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def _record_attrs(record: Record) -> dict[str, Any]:
    """A record as its study trial's user attributes (Record.to_dict, less the number: the
    trial's own); read back with `Record.from_dict(attrs | {"number": trial.number})`.
    The outcome comes last: written key by key, a trial with an outcome holds its whole
    record (what `abandon` and `recover_abandoned` rely on)."""
    d = {k: v for k, v in record.to_dict().items() if k != "number"}
    return d | {"outcome": d.pop("outcome")}


def _create_or_load(storage: str, study_name: str,
                    sampler: optuna.samplers.BaseSampler | None) -> optuna.Study:
    """The study, made if missing. Two processes opening a new SQLite storage at once
    both create its schema, and one fails on the other's version row (seen in CI: a
    driver and a reader of its storage); the schema is there once the other has made
    it, so that failure is tried again."""
    import sqlalchemy.exc

    def create() -> optuna.Study:
        return optuna.create_study(storage=driver_url(storage), study_name=study_name,
                                   direction="maximize", load_if_exists=True, sampler=sampler)

    for attempt in range(4):
        try:
            return create()
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.OperationalError):
            time.sleep(0.2 * (attempt + 1))
    return create()  # a fifth failure is no race: it is raised


class StudyLog:
    """The search's view of its Optuna study."""

    def __init__(self, study: optuna.Study, choices: dict[str, list], limit_bytes: int, *,
                 shared: bool = True, objective: str = SAMPLES_PER_SECOND) -> None:
        self.study, self.choices, self.shared = study, choices, shared
        # What its records are scored by: the driver's choice (autotune.tasks.objective_of)
        self.objective = objective
        self.limit_bytes = limit_bytes  # a trial's constraint is its peak against it
        self.storage = study._storage  # noqa: SLF001 - trial attrs need the storage itself
        self.study_id = self.storage.get_study_id_from_name(study.study_name)
        self.distributions = {k: CategoricalDistribution(v) for k, v in choices.items()}
        self.driver = {"host": socket.gethostname(), "pid": os.getpid(),
                       "started": time.time()}
        self._numbers: set[int] = set()  # trials this driver started and has not told

    # --- opening ------------------------------------------------------------------------
    @classmethod
    def open(cls, storage: str, study_name: str, fingerprint: str, choices: dict[str, list],
             limit_bytes: int, sampler: optuna.samplers.BaseSampler | None = None,
             objective: str = SAMPLES_PER_SECOND) -> StudyLog:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = _create_or_load(storage, study_name, sampler)
        known = study.user_attrs.get(FINGERPRINT_KEY)
        if known is None:
            study.set_user_attr(FINGERPRINT_KEY, fingerprint)
        elif known != fingerprint:
            raise SpecError(f"search.study_name: study {study_name!r} in {shown(storage)} was "
                            "made for a different model, data, target, space, device or "
                            "library versions; choose another study_name or output folder to "
                            "start afresh")
        return cls(study, choices, limit_bytes, objective=objective)

    @classmethod
    def in_memory(cls, choices: dict[str, list], limit_bytes: int,
                  sampler: optuna.samplers.BaseSampler | None = None,
                  objective: str = SAMPLES_PER_SECOND) -> StudyLog:
        """A study that lives as long as the process (landscape replays: samples/s, a
        remembered result's check)."""
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        return cls(optuna.create_study(direction="maximize", sampler=sampler), choices,
                   limit_bytes, shared=False, objective=objective)

    def record(self, proposal: Proposal, outcome: Outcome,
               number: int | None = None) -> Record:
        """A proposal's outcome as a record of this study, scored by its objective."""
        return Record(proposal.config, outcome, proposal.reason, number, self.objective)

    # --- reading ------------------------------------------------------------------------
    def _trials(self, states: Iterable[TrialState] | None = None) -> list[FrozenTrial]:
        return self.study.get_trials(deepcopy=False,
                                     states=tuple(states) if states is not None else None)

    def history(self, after: int = -1) -> list[Record]:
        """The records of finished trials (numbers above `after`), in the order they
        started; skipped and abandoned study trials are no records."""
        done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        out = []
        for t in sorted(self._trials(done), key=lambda t: t.number):
            a = t.user_attrs
            if t.number <= after or "outcome" not in a or SKIPPED_KEY in a \
                    or ABANDONED_KEY in a:
                continue
            record = Record.from_dict(a | {"number": t.number})
            # A setup failure (the data, the tokenizer) says nothing of its config: once the
            # spec is fixed, the config runs again.
            # Nor does a trial the infrastructure lost.
            if not record.outcome.failure.setup_field and record.outcome.status != LOST:
                out.append(record)
        return out

    def abandoned(self) -> list[tuple[TrialConfig, str]]:
        """(config, reason) of each trial a driver left in flight (interrupted, killed) whose
        config has not finished since: what a resumed search owes a run first."""
        finished = {r.config for r in self.history()}
        out = []
        for t in sorted(self._trials([TrialState.FAIL]), key=lambda t: t.number):
            a = t.user_attrs
            if ABANDONED_KEY in a and "config" in a:
                config = TrialConfig.from_dict(a["config"])
                if config not in finished and all(config != c for c, _ in out):
                    out.append((config, a.get("reason", "")))
        return out

    def running_elsewhere(self) -> list[TrialConfig]:
        """Configs in flight under other drivers sharing this study."""
        if not self.shared:
            return []
        return [TrialConfig.from_dict(t.user_attrs["config"])
                for t in self._trials([TrialState.RUNNING])
                if t.number not in self._numbers and "config" in t.user_attrs]

    # --- writing ------------------------------------------------------------------------
    def _params(self, config: TrialConfig) -> tuple[dict, dict]:
        values = config.to_dict()
        dists = {k: d for k, d in self.distributions.items() if values.get(k) in d.choices}
        return {k: values[k] for k in dists}, dists

    def _attrs(self, proposal: Proposal) -> dict[str, Any]:
        return {"config": proposal.config.to_dict(), "reason": proposal.reason,
                "predicted_memory_bytes": proposal.predicted_memory_bytes}

    def _set(self, number: int, attrs: dict[str, Any], *, system: bool = False) -> None:
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self.study_id, number)
        setter = self.storage.set_trial_system_attr if system else (
            self.storage.set_trial_user_attr)
        for key, value in attrs.items():
            setter(trial_id, key, _json(value))

    def start(self, proposal: Proposal) -> int | None:
        """The trial as RUNNING; None when another driver claimed the config first."""
        if proposal.trial_number is not None:
            number = proposal.trial_number
            self._set(number, self._attrs(proposal))
        else:
            params, dists = self._params(proposal.config)
            trial_id = self.storage.create_new_trial(self.study_id, create_trial(
                state=TrialState.RUNNING, params=params, distributions=dists,
                user_attrs=self._attrs(proposal)))
            number = self.storage.get_trial_number_from_id(trial_id)
        self._numbers.add(number)
        self._set(number, {DRIVER_KEY: self.driver, HEARTBEAT_KEY: time.time()}, system=True)
        if self.shared and not proposal.repeat and self._taken(proposal.config, number):
            self.skip(number, "claimed by another driver first")
            return None
        return number

    def _taken(self, config: TrialConfig, number: int) -> bool:
        """Another trial of this config ran, or started before this one (several drivers)."""
        mine = config.to_dict()
        for t in self._trials():
            a = t.user_attrs
            if t.number == number or a.get("config") != mine or SKIPPED_KEY in a \
                    or ABANDONED_KEY in a or t.state == TrialState.PRUNED:
                continue  # a prediction that pruned it is no claim on running it
            if t.state != TrialState.RUNNING or t.number < number:
                return True
        return False

    def finish(self, number: int, proposal: Proposal, outcome: Outcome) -> Record:
        if outcome.predicted_memory_bytes is None:
            outcome.predicted_memory_bytes = proposal.predicted_memory_bytes
        record = self.record(proposal, outcome, number)
        self._conclude(number, record)
        return record

    def _conclude(self, number: int, record: Record) -> None:
        """The record written, its outcome last, then told. A Ctrl-C (or a kill) can land
        between the writes: a trial whose outcome is written holds its whole record, and
        `abandon` and `recover_abandoned` tell it rather than run its config again (the
        measurement was made; one CI run lost it that way, and miscounted the resume)."""
        outcome = record.outcome
        constraint = None
        if outcome.status == OK:
            constraint = (outcome.peak_memory_bytes or 0) / self.limit_bytes - 1.0
        elif outcome.status == OOM:
            constraint = 1.0
        if constraint is not None:
            self._set(number, {CONSTRAINT_KEY: constraint}, system=True)
        self._set(number, _record_attrs(record))
        self._tell(number, record)

    def _tell(self, number: int, record: Record) -> None:
        """Optuna told what the record says: its score (0 for an OOM), a prune as PRUNED
        (the samplers read those, not FAIL), any other failure as FAIL."""
        status = record.outcome.status
        if status in (OK, OOM):
            value = float(record.score or 0.0) if status == OK else 0.0
            self.study.tell(number, value, skip_if_finished=True)
        else:
            state = TrialState.PRUNED if status == PRUNED else TrialState.FAIL
            self.study.tell(number, state=state, skip_if_finished=True)
        self._numbers.discard(number)

    def _measured(self, trial: FrozenTrial) -> bool:
        """A RUNNING trial whose outcome was written before its driver stopped: told as
        that outcome (its constraint was written before it), not abandoned."""
        if "outcome" not in trial.user_attrs or "config" not in trial.user_attrs:
            return False
        self._tell(trial.number, Record.from_dict(trial.user_attrs | {"number": trial.number}))
        return True

    def prune(self, proposal: Proposal) -> Record:
        """A config not run because a prediction says it would not fit."""
        outcome = Outcome(PRUNED, predicted_memory_bytes=proposal.predicted_memory_bytes,
                          error=f"not run: {proposal.why or proposal.reason}",
                          wall_seconds=0.0)
        attrs = self._attrs(proposal) | _record_attrs(self.record(proposal, outcome))
        if proposal.trial_number is not None:
            number = proposal.trial_number
            self._set(number, attrs)
            self.study.tell(number, state=TrialState.PRUNED)
        else:
            params, dists = self._params(proposal.config)
            trial_id = self.storage.create_new_trial(self.study_id, create_trial(
                state=TrialState.PRUNED, params=params, distributions=dists, user_attrs=attrs))
            number = self.storage.get_trial_number_from_id(trial_id)
        return self.record(proposal, outcome, number)

    def skip(self, number: int, why: str, known: Record | None = None) -> None:
        """A sampler's proposal that is no trial: told what is known of it (the record of
        the config it repeats)."""
        self._set(number, {SKIPPED_KEY: why})
        self._numbers.discard(number)
        if known is not None and known.outcome.ok:
            self._set(number, {CONSTRAINT_KEY: 0.0}, system=True)
            self.study.tell(number, float(known.score or 0.0))
        elif known is not None and known.outcome.status in (OOM, PRUNED):
            self._set(number, {CONSTRAINT_KEY: 1.0}, system=True)
            self.study.tell(number, 0.0)
        else:
            self.study.tell(number, state=TrialState.FAIL)

    def heartbeat(self) -> None:
        now = time.time()
        for number in self._numbers:
            self._set(number, {HEARTBEAT_KEY: now}, system=True)

    def abandon(self, why: str) -> None:
        """This driver stops with trials in flight (interrupted): they will run again, but
        for one whose outcome was written (told it) or that was told already (a Ctrl-C
        after its tell)."""
        running = {t.number: t for t in self._trials([TrialState.RUNNING])}
        for number in list(self._numbers):
            if number not in running or self._measured(running[number]):
                continue
            self._set(number, {ABANDONED_KEY: why})
            self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)
        self._numbers.clear()

    def recover_abandoned(self) -> list[int]:
        """RUNNING trials whose driver is gone (killed on this host, or silent for longer
        than STALE_SECONDS anywhere): marked abandoned, so their configs run again, unless
        their outcome was written (then told it)."""
        gone = []
        host = socket.gethostname()
        for t in self._trials([TrialState.RUNNING]):
            driver = t.system_attrs.get(DRIVER_KEY) or {}
            beat = float(t.system_attrs.get(HEARTBEAT_KEY) or 0.0)
            dead_here = (driver.get("host") == host
                         and not psutil.pid_exists(int(driver.get("pid") or -1)))
            if dead_here or time.time() - beat > STALE_SECONDS:
                if self._measured(t):
                    continue
                self._set(t.number, {ABANDONED_KEY: "its driver stopped while it ran"})
                self.study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
                gone.append(t.number)
        return gone

    # --- the study's own attributes -----------------------------------------------------
    def add_wall_seconds(self, seconds: float) -> float:
        """Wall time over every session of this study: a resumed search adds to it."""
        total = float(self.study.user_attrs.get(WALL_KEY, 0.0)) + seconds
        self.study.set_user_attr(WALL_KEY, total)
        return total

    def save_summary(self, summary: dict[str, Any]) -> None:
        """Keep the search's summary in the study too, so a report can be rebuilt from the
        storage alone (a shared database, no output folder at hand)."""
        self.study.set_user_attr(SUMMARY_KEY, _json(summary))


def summary_from_storage(storage: str, study_name: str | None = None) -> dict[str, Any]:
    # Opening an SQLite URL creates its file: a mistyped path would leave an empty one.
    if storage.startswith("sqlite:///"):
        path = Path(storage.removeprefix("sqlite:///").split("?", 1)[0])
        if str(path) not in ("", ":memory:") and not path.is_file():
            raise AutotuneError(f"{storage}: no such SQLite file ({path})")
    names = optuna.get_all_study_names(driver_url(storage))
    if study_name is None:
        if len(names) != 1:
            raise AutotuneError(f"{shown(storage)} holds {len(names)} studies "
                                f"({', '.join(names) or 'none'}); name one with --study-name")
        study_name = names[0]
    elif study_name not in names:
        raise AutotuneError(f"--study-name: {study_name!r} is not in {shown(storage)}; "
                            f"there: {', '.join(names) or 'none'}")
    summary = optuna.load_study(study_name=study_name,
                                storage=driver_url(storage)).user_attrs.get(
        SUMMARY_KEY)
    if summary is None:
        raise AutotuneError(f"study {study_name!r} has no autotune summary yet (its search "
                            "has not finished once)")
    return summary
