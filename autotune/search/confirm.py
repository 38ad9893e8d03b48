"""Confirmation: the search's best is the maximum of many single short measurements, and
the baseline is one; both are biased, the best upwards. So after the search the winner,
the runner-ups within noise of it and the baseline are measured again, interleaved (so
drift of the machine hits all alike), several times each with more steps, each trial
built from the exported training_args.json alone (what is exported is what is measured).
The winner is chosen from these figures, and the speedup comes with an interval.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autotune.config import TrialConfig
from autotune.records import Record
from autotune.search.strategies.base import Proposal, SearchContext, Strategy
from autotune.summary import Confirmation, ConfirmedConfig

if TYPE_CHECKING:
    from autotune.spec import Spec

REASON = "confirm"
RUNNER_UP_WITHIN = 0.05  # single measurements this close to the best may be the best
MAX_RUNNER_UPS = 2
STEPS_FACTOR = 2  # confirmation trials time this many times the search's steps
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrap interval on the speedup
BOOTSTRAP_SAMPLES = 4000


def contenders(history: Sequence[Record]) -> list[tuple[str, Record]]:
    """(role, the search's record) of the configs worth confirming: the best, up to
    MAX_RUNNER_UPS within RUNNER_UP_WITHIN of it, and the baseline."""
    searched = [r for r in history if r.reason != REASON]
    ok = sorted((r for r in searched if r.outcome.ok),
                key=lambda r: -(r.outcome.score or 0.0))
    if not ok:
        return []
    # Winners train the target effective batch: the baseline's auto_find_batch_size chain
    # keeps its accumulation as the batch shrinks, so it is the reference, not a contender
    # (unless nothing else ran).
    eligible = [r for r in ok if r.reason != "baseline"] or ok
    best = eligible[0]
    floor = (best.outcome.score or 0.0) * (1 - RUNNER_UP_WITHIN)
    out = [("best", best)] + [("runner-up", r) for r in eligible[1:MAX_RUNNER_UPS + 1]
                              if (r.outcome.score or 0.0) >= floor]
    baselines = [r for r in ok if r.reason == "baseline"]
    if baselines:
        base = max(baselines, key=lambda r: r.config.per_device_train_batch_size)
        if all(base.config != r.config for _, r in out):
            out.append(("baseline", base))
        else:
            out = [(role if r.config != base.config else "baseline", r) for role, r in out]
    return out


class ConfirmStrategy(Strategy):
    """Proposes the contenders round-robin until each has `repeats` confirmation trials
    (counting those of an earlier session of the study)."""

    name = REASON

    def __init__(self, ctx: SearchContext, spec: Spec, folder: Path,
                 picked: list[tuple[str, Record]], repeats: int, on_cpu: bool) -> None:
        super().__init__(ctx)
        self.picked, self.repeats = picked, repeats
        self.steps = spec.measure.steps * STEPS_FACTOR
        self.exported: dict[TrialConfig, dict] = {}
        from autotune.outputs.export import TRAINING_ARGS_FILE, export_config

        for i, (_, r) in enumerate(picked):
            where = folder / f"{i}-{r.config.label().replace(' ', '-').replace(':', '_')}"
            export_config(r.config, where, on_cpu=on_cpu, seed=spec.search.seed,
                          world_size=spec.world_size)
            self.exported[r.config] = json.loads((where / TRAINING_ARGS_FILE).read_text())

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        done = {r.config: 0 for _, r in self.picked}
        for r in history:
            if r.reason == REASON and r.config in done:
                done[r.config] += 1
        for c in pending:
            if c in done:
                done[c] += 1
        config = min(done, key=lambda c: done[c])  # round-robin: interleaved repeats
        if done[config] >= self.repeats:
            return None
        return Proposal(config, REASON, repeat=True, overrides={
            "training_args": self.exported[config], "steps": self.steps})


def _interval(win: list[float], base: list[float], seed: int) -> tuple[float, float]:
    """Bootstrap percentiles of median(winner) / median(baseline)."""
    rng = np.random.default_rng(seed)
    w = rng.choice(win, size=(BOOTSTRAP_SAMPLES, len(win)))
    b = rng.choice(base, size=(BOOTSTRAP_SAMPLES, len(base)))
    ratios = np.median(w, axis=1) / np.median(b, axis=1)
    low, high = np.percentile(ratios, INTERVAL)
    return float(low), float(high)


def summarise(history: Sequence[Record], repeats: int, steps: int,
              seed: int = 0) -> Confirmation | None:
    """The confirmed figures of the contenders, the winner among them and the speedup."""
    picked = contenders(history)
    rows = []
    for role, r in picked:
        runs = [t for t in history if t.reason == REASON and t.config == r.config]
        figures = [t.outcome.score for t in runs
                   if t.outcome.ok and t.outcome.score]
        rows.append(ConfirmedConfig(role, r.config, r.number, figures,
                                    [t.number for t in runs]))
    measured = [row for row in rows if row.samples_per_second]
    if not measured:
        return None
    contending = [row for row in measured if row.role != "baseline"] or measured
    winner = max(contending, key=lambda row: row.median or 0.0)
    base = next((row for row in measured if row.role == "baseline"), None)
    speedup = low = high = None
    if base is not None:
        speedup = (winner.median or 0.0) / (base.median or 1.0)
        low, high = _interval(winner.samples_per_second, base.samples_per_second, seed)
    return Confirmation(repeats, steps, rows, winner.config, speedup, low, high)
