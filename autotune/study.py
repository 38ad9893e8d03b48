"""The Optuna study: persistent record of every trial, and the source of resumption.

Every trial is added with its params and its outcome as user attributes. An OOM is
COMPLETE with value 0 and a violated constraint (Optuna's constraints_func only reads
COMPLETE trials, so an OOM told as FAIL would teach the sampler nothing); errors are
FAIL; configs skipped on a memory prediction are PRUNED.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import optuna
from optuna.distributions import CategoricalDistribution
from optuna.trial import TrialState, create_trial

from autotune.config import Outcome, TrialConfig
from autotune.errors import AutotuneError, SpecError
from autotune.strategies.base import Record

if TYPE_CHECKING:
    from autotune.space import Space

CONSTRAINTS_KEY = "constraints"  # the system attr Optuna's samplers read constraints from
FINGERPRINT_KEY = "spec_fingerprint"


def open_study(storage: str, study_name: str, fingerprint: str) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=storage, study_name=study_name, direction="maximize",
                                load_if_exists=True)
    known = study.user_attrs.get(FINGERPRINT_KEY)
    if known is None:
        study.set_user_attr(FINGERPRINT_KEY, fingerprint)
    elif known != fingerprint:
        raise SpecError(f"search.study_name: study {study_name!r} in {storage} was made for a "
                        "different model/data/target/space; choose another study_name or "
                        "output folder to start afresh")
    return study


def distributions(space: Space) -> dict[str, CategoricalDistribution]:
    return {k: CategoricalDistribution(v) for k, v in space.choices().items()}


def _state_and_value(outcome: Outcome, limit: int) -> tuple[TrialState, float | None, list]:
    if outcome.status == "ok":
        used = (outcome.peak_memory_bytes or 0) / limit - 1.0
        return TrialState.COMPLETE, float(outcome.samples_per_second or 0.0), [used]
    if outcome.status == "oom":
        return TrialState.COMPLETE, 0.0, [1.0]
    if outcome.status == "pruned":
        return TrialState.PRUNED, None, []
    return TrialState.FAIL, None, []


def record_trial(study: optuna.Study, record: Record, space: Space, limit_bytes: int) -> int:
    """Add one finished (or pruned) trial; returns its number in the study."""
    cfg = record.config
    params = {k: getattr(cfg, k) for k in space.choices()}
    dists = {k: d for k, d in distributions(space).items() if params[k] in d.choices}
    state, value, constraints = _state_and_value(record.outcome, limit_bytes)
    trial = create_trial(
        state=state, value=value, params={k: params[k] for k in dists}, distributions=dists,
        user_attrs={"config": cfg.to_dict(), "outcome": json.loads(
            json.dumps(record.outcome.to_dict(), default=str)), "reason": record.reason},
        system_attrs={CONSTRAINTS_KEY: constraints} if constraints else {},
    )
    study.add_trial(trial)
    return len(study.trials) - 1


def load_history(study: optuna.Study) -> list[Record]:
    """The records of an earlier run, in the order they happened."""
    history = []
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        attrs: dict[str, Any] = t.user_attrs
        if "config" in attrs and "outcome" in attrs:
            history.append(Record(TrialConfig.from_dict(attrs["config"]),
                                  Outcome.from_dict(attrs["outcome"]), attrs.get("reason", "")))
    return history


SUMMARY_KEY = "autotune_summary"


def save_summary(study: optuna.Study, summary: dict[str, Any]) -> None:
    """Keep the search's summary in the study too, so a report can be rebuilt from the
    storage alone (a shared database, no output folder at hand)."""
    study.set_user_attr(SUMMARY_KEY, json.loads(json.dumps(summary, default=str)))


def summary_from_storage(storage: str, study_name: str | None = None) -> dict[str, Any]:
    names = optuna.get_all_study_names(storage)
    if study_name is None:
        if len(names) != 1:
            raise AutotuneError(f"{storage} holds {len(names)} studies "
                                f"({', '.join(names) or 'none'}); name one with --study-name")
        study_name = names[0]
    elif study_name not in names:
        raise AutotuneError(f"--study-name: {study_name!r} is not in {storage}; "
                            f"there: {', '.join(names) or 'none'}")
    summary = optuna.load_study(study_name=study_name, storage=storage).user_attrs.get(
        SUMMARY_KEY)
    if summary is None:
        raise AutotuneError(f"study {study_name!r} has no autotune summary yet (its search "
                            "has not finished once)")
    return summary
