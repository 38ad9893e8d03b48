"""What happened to a config: a trial's Outcome, and the Record the study keeps of it.

One record type serves the search, the study, the summary, the report and the bench.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autotune.config import TrialConfig

# A trial's verdicts. `pruned`: not run, because a prediction said it would not fit.
# `lost`: the infrastructure failed under it (a worker or node died, twice): no verdict
# on the config, which a later session runs again.
OK, OOM, NAN, ERROR, TIMEOUT, CRASHED, PRUNED, LOST = (
    "ok", "oom", "nan", "error", "timeout", "crashed", "pruned", "lost")
# The config itself failed (two such, and the strategy stops trying its knob values).
FAILED = (NAN, ERROR, TIMEOUT, CRASHED)


@dataclass
class Outcome:
    """What a trial measured: the result a trial process writes, and what the study keeps.
    Figures are None when they were not measured, never a placeholder."""

    status: str
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    peak_memory_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    wall_seconds: float | None = None
    timed_seconds: float | None = None
    predicted_memory_bytes: int | None = None
    error: str | None = None
    shape: dict[str, Any] | None = None  # a factory model's shape, learned by the trial
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def is_oom(self) -> bool:
        return self.status == OOM

    @property
    def score(self) -> float | None:
        """What the search maximises: samples/s, or real (non-pad) tokens/s where the
        trial says padding or packing make them differ (extra["objective"]); for a
        compiled trial over the whole long run, its compilation paid once in it
        (extra["run_seconds"] at the measured speed, extra["compile_seconds"])."""
        rate = (self.tokens_per_second if self.extra.get("objective") == "tokens_per_second"
                else self.samples_per_second)
        run, once = self.extra.get("run_seconds"), self.extra.get("compile_seconds")
        if rate is None or not run or not once:
            return rate
        return rate * run / (run + once)

    @property
    def ran(self) -> bool:
        return self.status != PRUNED

    @property
    def median_step(self) -> float | None:
        steps = [s for s in self.step_seconds if s is not None and s >= 0]
        return statistics.median(steps) if steps else None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Outcome:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The reason of a confirmation run: the one fact that sets such runs apart from the search's.
CONFIRM_REASON = "confirm"


@dataclass
class Record:
    """One trial of a search: the config, why it was chosen, what happened, and its
    number in the study (None until the study has it)."""

    config: TrialConfig
    outcome: Outcome
    reason: str = ""
    number: int | None = None

    @property
    def confirming(self) -> bool:
        """A confirmation run (a contender measured again after the search), not one of
        the search's trials: search.n_trials does not count it."""
        return self.reason == CONFIRM_REASON

    @property
    def counted(self) -> bool:
        """One of the trials search.n_trials counts: it ran (was not pruned on a
        prediction) and is no confirmation run."""
        return self.outcome.ran and not self.confirming

    @property
    def throughput(self) -> float | None:
        return self.outcome.samples_per_second if self.outcome.ok else None

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "config": self.config.to_dict(),
                "outcome": self.outcome.to_dict(), "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        return cls(TrialConfig.from_dict(d["config"]),
                   Outcome.from_dict(d.get("outcome") or {"status": ERROR}),
                   str(d.get("reason") or ""),
                   None if d.get("number") is None else int(d["number"]))
