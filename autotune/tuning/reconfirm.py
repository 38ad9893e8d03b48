"""A remembered result checked on read: its winner and Trainer's defaults run once more,
through the confirmation's own machinery (ConfirmStrategy: the exported training_args.json,
the confirmation's steps), and each figure must fall within its recorded interval. The
results store hands over the record; the check runs here, beside the confirmation.

"Within its recorded interval" is a prediction interval for one new run of a config from
the record's own evidence. The record's confirmation ran each contender `n` times,
interleaved; the spread of those repeats around each contender's mean, pooled over the
contenders on a log scale, is the run-to-run noise `s` of that machine with
`df = sum(n - 1)` degrees of freedom. One more run of a config whose repeats have the
geometric mean `m` lies, if nothing changed, within

    m * exp(± t(0.995, df) * s * sqrt(1 + 1/n))

99 times in 100 (Student's t, since `s` is itself estimated from a few runs: with the
default 3 repeats of 3-4 contenders, df = 6-8 and t = 3.4-3.7). `s` is at least
NOISE_FLOOR, the 2% a short measurement varies by at the least; where no contender ran
twice the record says nothing of its noise, and NO_REPEATS_NOISE stands in with the
normal quantile. Two-sided, because a winner that now runs much faster also says the
record no longer describes this machine (a driver, a kernel, another tenant gone), and
its projected figures would mislead. The baseline is held to the same band: Trainer's
defaults are the control, and they moving means the machine moved.

On a GPU (1-2% noise) the band is about ±8%: the 35-40% that bitsandbytes 0.41 cost QLoRA
fails it; so does an 18% slowdown. On 2 shared CPU cores, where short runs of a tiny model
vary by tens of percent, the band is as wide as the record's own repeats say it must be.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.config import BATCH
from autotune.records import OK, Outcome, Record
from autotune.summary import BASELINE, Confirmation, ConfirmedConfig
from autotune.tasks import objective_of
from autotune.tuning.confirm import ConfirmStrategy
from autotune.tuning.loop import Limits, drive
from autotune.tuning.study import StudyLog

if TYPE_CHECKING:
    from autotune.spec import Spec
    from autotune.summary import Summary
    from autotune.trials.executor import Executor
    from autotune.tuning.strategies.base import Proposal, SearchContext

NOISE_FLOOR = 0.02  # a short measurement's relative noise at the least
NO_REPEATS_NOISE = 0.10  # where no contender of the record ran twice
# Student's t, two-sided 99% (the 0.995 quantile), by degrees of freedom; a df between two
# entries takes the smaller one's (the wider band).
T_995 = {1: 63.657, 2: 9.925, 3: 5.841, 4: 4.604, 5: 4.032, 6: 3.707, 7: 3.499, 8: 3.355,
         9: 3.250, 10: 3.169, 12: 3.055, 15: 2.947, 20: 2.845, 30: 2.750}
Z_995 = 2.576


def t_quantile(df: int) -> float:
    if df <= 0:
        return Z_995
    if df > max(T_995):
        return Z_995 + (T_995[30] - Z_995) * 30 / df  # t approaches z as 1/df
    return T_995[max(k for k in T_995 if k <= df)]


def noise(confirmation: Confirmation) -> tuple[float, int]:
    """(s, df): the pooled log-scale sd of the contenders' repeats and its degrees of
    freedom; (NO_REPEATS_NOISE, 0) where no contender ran twice."""
    squares, df = 0.0, 0
    for row in confirmation.rows:
        logs = [math.log(x) for x in row.samples_per_second if x and x > 0]
        if len(logs) > 1:
            mean = statistics.fmean(logs)
            squares += sum((v - mean) ** 2 for v in logs)
            df += len(logs) - 1
    if df == 0:
        return NO_REPEATS_NOISE, 0
    return max(NOISE_FLOOR, math.sqrt(squares / df)), df


@dataclass
class Check:
    """One config run again against its recorded repeats."""

    role: str  # winner or baseline
    config_label: str
    recorded: list[float]
    low: float
    high: float
    measured: float | None = None
    status: str | None = None  # the re-run's outcome; None: it did not run
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == OK and self.measured is not None and (
            self.low <= self.measured <= self.high)

    @property
    def centre(self) -> float:
        return math.exp(statistics.fmean(math.log(x) for x in self.recorded))

    def why(self) -> str:
        """What went wrong, as one clause ("the winner ran 18% slower than recorded ...")."""
        if self.status is None:
            return f"the {self.role} did not run again (the search's time ran out)"
        if self.status != OK or self.measured is None:
            said = f": {self.error.splitlines()[-1][:160]}" if self.error else ""
            return f"the {self.role}'s run ended {self.status}{said}"
        change = self.measured / self.centre - 1
        way = "slower" if change < 0 else "faster"
        return (f"the {self.role} ran {abs(change):.0%} {way} than recorded "
                f"({self.measured:,.1f} against {self.low:,.1f}-{self.high:,.1f} samples/s)")

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "config": self.config_label, "recorded": self.recorded,
                "low": self.low, "high": self.high, "measured": self.measured,
                "status": self.status, "within": self.ok}


def band(row: ConfirmedConfig, s: float, df: int) -> tuple[float, float]:
    """Where one more run of `row`'s config falls 99 times in 100 if nothing changed."""
    xs = [x for x in row.samples_per_second if x and x > 0]
    centre = math.exp(statistics.fmean(math.log(x) for x in xs))
    half = t_quantile(df) * s * math.sqrt(1 + 1 / len(xs))
    return centre * math.exp(-half), centre * math.exp(half)


def planned(summary: Summary) -> list[tuple[str, ConfirmedConfig]]:
    """(role, recorded row) of what runs again: the winner, and Trainer's defaults where
    they ran and are not the winner."""
    c = summary.confirmation
    if c is None or c.winner is None:
        return []
    winner = c.row(c.winner)
    if winner is None or not winner.samples_per_second:
        return []
    base = next((r for r in c.rows if r.role == BASELINE and r.samples_per_second), None)
    return [("winner", winner)] + ([(BASELINE, base)] if base is not None
                                   and base.config != winner.config else [])


def run_checks(summary: Summary, spec: Spec, ctx: SearchContext, executor: Executor,
               folder: Path, deadline: float,
               on_start: Callable[[Proposal], None] | None = None,
               on_record: Callable[[Record], None] | None = None) -> list[Check]:
    """Run the planned configs once each (real trials, in a study of their own that lives
    as long as the check) and hold each figure to its band."""
    plan = planned(summary)
    c = summary.confirmation
    if not plan or c is None:
        return []
    s, df = noise(c)
    picked = [("best" if role == "winner" else BASELINE,
               Record(row.config, Outcome(OK), role)) for role, row in plan]
    confirmer = ConfirmStrategy(ctx, spec, folder, picked, 1, on_cpu=not ctx.device.is_cuda)
    configs = [*ctx.candidates, *(r.config for _, r in picked)]
    keys = [BATCH, *configs[0].family.to_dict()]
    choices = {k: sorted({c.to_dict()[k] for c in configs}, key=repr) for k in keys}
    log = StudyLog.in_memory(choices, ctx.memory_limit_bytes, objective=objective_of(spec))
    runs: list[Record] = []
    drive(confirmer, executor, log, Limits(deadline=deadline), history=runs,
          on_start=on_start, on_record=on_record)
    checks = []
    for role, row in plan:
        low, high = band(row, s, df)
        check = Check(role, row.config.label(), list(row.samples_per_second), low, high)
        ran = next((r for r in runs if r.config == row.config), None)
        if ran is not None:
            check.status, check.error = ran.outcome.status, ran.outcome.error
            check.measured = ran.score if ran.outcome.ok else None
        checks.append(check)
    return checks


def verdict(checks: Sequence[Check], versions: dict[str, str]) -> str | None:
    """None where every check holds; else why not, in one clause with the versions."""
    if not checks:
        return "the record has no confirmed winner to run again"
    failed = [c for c in checks if not c.ok]
    if not failed:
        return None
    said = "; ".join(c.why() for c in failed)
    return f"{said}, with torch {versions.get('torch', '?')} (CUDA {versions.get('cuda', '?')})"
