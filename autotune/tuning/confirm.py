"""Confirmation: the search's best is the maximum of many single short measurements, and
the references are one each; all are biased, the best upwards. So after the search the
winner, the runner-ups within noise of it and the two references (Trainer's defaults and
the guide's recipe) are measured again, interleaved (so drift of the machine hits all
alike), several times each with more steps, each trial built from the exported
training_args.json alone (what is exported is what is measured). The winner is chosen
from these figures, and the speedups come with intervals.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from autotune.config import TrialConfig, auto_find_chain
from autotune.records import CONFIRM_REASON, Record
from autotune.summary import BASELINE, RECIPE, Confirmation, ConfirmedConfig, at_target
from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
from autotune.tuning.strategies.probe import reference

if TYPE_CHECKING:
    from autotune.spec import Spec

RUNNER_UP_WITHIN = 0.05  # single measurements this close to the best may be the best
MAX_RUNNER_UPS = 2
STEPS_FACTOR = 2  # confirmation trials time this many times the search's steps
INTERVAL = (5.0, 95.0)  # percentiles of the bootstrap interval on the speedup
BOOTSTRAP_SAMPLES = 4000
# A confirmation round's order after the best (first, whatever its role): the speedup's
# denominator, then the recipe's, then the runner-ups.
ROUND_ORDER = {BASELINE: 1, RECIPE: 2}
RECENT_WAITS = 4  # trials whose lease waits price the confirmation's (another search's)


def contenders(history: Sequence[Record], per_rank: int) -> list[tuple[str, Record]]:
    """(role, the search's record) of the configs worth confirming: the best, up to
    MAX_RUNNER_UPS within RUNNER_UP_WITHIN of it, and the two references, the baseline
    and the guide's recipe (a contender that is one takes its role). `per_rank`: the
    target effective batch per rank; none where no config at the target succeeded (the
    baseline's chain below its top is the reference, never a contender)."""
    searched = [r for r in history if not r.confirming]
    ok = sorted((r for r in searched if r.outcome.ok),
                key=lambda r: -(r.score or 0.0))
    eligible = at_target(ok, per_rank)
    if not eligible:
        return []
    best = eligible[0]
    floor = (best.score or 0.0) * (1 - RUNNER_UP_WITHIN)
    out = [("best", best)] + [("runner-up", r) for r in eligible[1:MAX_RUNNER_UPS + 1]
                              if (r.score or 0.0) >= floor]
    for role in (RECIPE, BASELINE):
        ref = reference(searched, role)
        if ref is None:
            continue
        if all(ref.config != r.config for _, r in out):
            out.append((role, ref))
        else:
            out = [(role if r.config == ref.config else was, r) for was, r in out]
    return out


def cost_seconds(picked: Sequence[tuple[str, Record]], repeats: int,
                 capacity: int = 1, history: Sequence[Record] = ()) -> float:
    """About how long confirming `picked` takes: each contender's search trial again (its
    start-up and warm-up as they were, its timed steps STEPS_FACTOR times), as many times
    as it still owes of `repeats` (a resumed study's earlier confirmation runs in
    `history` count), each after the wait for devices its trials have lately had
    (`lease_wait_seconds`), `capacity` at a time, but no less than the costliest contender's
    repeats one after another (a baseline's repeats wait for each other). On an H200
    this prices a GPT-2 search's six runs at 54 s; they took 53 s. The 18 median trials
    held back before were 130 s, which ended that 120 s search at its first trial past
    the baseline's probes."""
    owed = []
    wait = lease_wait_seconds(history)
    for role, r in picked:
        config = confirmed_config(history, role, r)
        done = len(confirmation_runs(history, config))
        owed.append(next_run_cost(config, r, history, wait) * max(0, repeats - done))
    return max(sum(owed) / max(1, capacity), max(owed, default=0.0))


def next_run_cost(config: TrialConfig, r: Record, history: Sequence[Record],
                  wait: float) -> float:
    """What `config`'s next confirmation run costs, after `wait` for the devices: what its
    last one took, where it made one (a reference moved down its chain trains another
    batch than the trial `r` that picked it), else `r`'s trial again with the timed steps
    STEPS_FACTOR times. The reserve and the deadline's gate both price runs so."""
    runs = [t for t in confirmation_runs(history, config) if t.outcome.ok]
    if runs:
        return runs[-1].outcome.repeat_seconds + wait
    return (r.outcome.repeat_seconds + (r.outcome.timed_seconds or 0.0) * (STEPS_FACTOR - 1)
            + wait)


def lease_wait_seconds(history: Sequence[Record]) -> float:
    """What each run is likely to wait for the devices another search holds: the median
    wait of the last RECENT_WAITS trials that ran. A trial's wall time leaves its wait
    out, so without this a search beside another priced its confirmation at a third of
    what it took, ran on, and reached its timeout with the confirmation cut to one or
    two runs each (the tiny example beside the GRPO one, on 2 cores: waits of 9-73 s).
    A trial with no wait recorded (lost before its lease) is no evidence of one."""
    waits = [w for r in history if r.outcome.ran
             and (w := r.outcome.launch.lease_wait_s) is not None]
    return float(np.median(waits[-RECENT_WAITS:])) if waits else 0.0


def confirmed_config(history: Sequence[Record], role: str, r: Record) -> TrialConfig:
    """The config a contender's confirmation runs train: its own, or for a reference
    the one its long run would reach (`long_run_reference`)."""
    return long_run_reference(history, r.config, role) if role in (BASELINE, RECIPE) else (
        r.config)


def confirmation_runs(history: Sequence[Record], config: TrialConfig) -> list[Record]:
    return [t for t in history if t.confirming and t.config == config]


def reference_chain(start: TrialConfig, role: str) -> list[TrialConfig]:
    """Where a reference's long run goes when it runs out of memory: the baseline down
    auto_find_batch_size's chain (accumulation unchanged); the recipe to the next smaller
    batch that keeps the target effective batch, as its user would."""
    if role == BASELINE:
        return auto_find_chain(start)
    per_rank, fam = start.samples_per_rank, start.family
    return [TrialConfig(b, per_rank // b, fam)
            for b in range(start.per_device_train_batch_size, 0, -1) if per_rank % b == 0]


def long_run_reference(history: Sequence[Record], base: TrialConfig,
                       role: str = BASELINE) -> TrialConfig:
    """A reference as the long run would hold it: a confirmation repeat (longer than the
    probe) that runs out of memory moves it down its `reference_chain`, as Trainer's
    auto_find_batch_size (0.9 times the batch) or the recipe's user would."""
    chain = reference_chain(base, role)
    for c in chain:
        if not any(r.confirming and r.config == c and r.outcome.is_oom for r in history):
            return c
    return chain[-1]


class ConfirmStrategy(Strategy):
    """Proposes the contenders round-robin until each has `repeats` confirmation trials
    (counting those of an earlier session of the study). Each round runs the best first,
    then the baseline, then the recipe, then the runner-ups: a confirmation the deadline
    cuts keeps two runs of the best and the baseline, the speedup's interval, where it
    would have spent them on a runner-up (seen beside another search on 2 cores: the
    baseline, last in its round, ran once and the report had no interval). No run starts
    that would end past `deadline` (search.timeout) at its price (`next_run_cost`):
    started up to the deadline, the last ran on past it (6-minute searches beside another
    ended 1-30 s late, and on a GPU one run of a large model is minutes)."""

    name = CONFIRM_REASON

    def __init__(self, ctx: SearchContext, spec: Spec, folder: Path,
                 picked: list[tuple[str, Record]], repeats: int, on_cpu: bool,
                 deadline: float | None = None) -> None:
        super().__init__(ctx)
        self.picked, self.repeats, self.deadline = picked, repeats, deadline
        self.steps = spec.measure.steps * STEPS_FACTOR
        self.folder, self.spec, self.on_cpu = folder, spec, on_cpu
        self.exported: dict[TrialConfig, dict] = {}

    def _exported(self, config: TrialConfig) -> dict:
        """The config's training_args.json (sft_config.json under SFT, dpo_config.json
        under DPO), written once under the confirm folder."""
        if config not in self.exported:
            from autotune.outputs.export import export_config, spec_exports, trainer_file

            where = self.folder / config.label().replace(" ", "-").replace(":", "_")
            export_config(config, where, on_cpu=self.on_cpu,
                          **spec_exports(self.spec, config))
            self.exported[config] = json.loads((where / trainer_file(self.spec)).read_text())
        return self.exported[config]

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        done, waiting, order, priced = {}, set(), {}, {}
        for i, (role, r) in enumerate(self.picked):
            config = confirmed_config(history, role, r)
            priced.setdefault(config, r)
            # Two roles may share a config (a reference moved down its chain onto a
            # runner-up's): the earlier place in the round holds.
            rank = 0 if i == 0 else ROUND_ORDER.get(role, len(ROUND_ORDER) + 1)
            order[config] = min(order.get(config, rank), rank)
            if role in (BASELINE, RECIPE) and any(c in reference_chain(r.config, role)
                                                  for c in pending):
                waiting.add(config)  # a repeat in flight may yet move it down its chain
            done[config] = len(confirmation_runs(history, config))
        for c in pending:
            if c in done:
                done[c] += 1
        open_ = {c: n for c, n in done.items() if n < self.repeats and c not in waiting}
        if not open_:
            return None
        # Round-robin (interleaved repeats), in each round by `order`; near the deadline
        # the first that still fits (time only shrinks: one that does not fit now never
        # will, and skipping it takes nothing from it).
        wait = lease_wait_seconds(history)
        for config in sorted(open_, key=lambda c: (open_[c], order[c])):
            if self.deadline is None or time.time() + next_run_cost(
                    config, priced[config], history, wait) <= self.deadline:
                return Proposal(config, CONFIRM_REASON, repeat=True, overrides={
                    "training_args": self._exported(config), "steps": self.steps})
        return None


def _interval(win: list[float], base: list[float], seed: int) -> tuple[float, float]:
    """Bootstrap percentiles of median(winner) / median(baseline)."""
    rng = np.random.default_rng(seed)
    w = rng.choice(win, size=(BOOTSTRAP_SAMPLES, len(win)))
    b = rng.choice(base, size=(BOOTSTRAP_SAMPLES, len(base)))
    ratios = np.median(w, axis=1) / np.median(b, axis=1)
    low, high = np.percentile(ratios, INTERVAL)
    return float(low), float(high)


def summarise(history: Sequence[Record], repeats: int, steps: int, per_rank: int,
              seed: int = 0) -> Confirmation | None:
    """The confirmed figures of the contenders, the winner among them and the speedup."""
    picked = contenders(history, per_rank)
    rows = []
    for role, r in picked:
        config = confirmed_config(history, role, r)
        runs = confirmation_runs(history, config)
        figures = [t.score for t in runs if t.outcome.ok and t.score]
        rows.append(ConfirmedConfig(role, config, r.number if config == r.config else None,
                                    figures, [t.number for t in runs]))
    measured = [row for row in rows if row.samples_per_second]
    if not measured:
        return None
    # The winner trains the target: where every such contender's longer runs failed, the
    # baseline (whose chain may have moved below it) is no winner in their place.
    contending = [row for row in measured if row.config.samples_per_rank == per_rank]
    if not contending:
        return Confirmation(repeats, steps, rows, None)
    winner = max(contending, key=lambda row: row.median or 0.0)
    base = next((row for row in measured if row.role == BASELINE), None)
    recipe = next((row for row in measured if row.role == RECIPE), None)
    speedup, low, high = _ratio(winner, base, seed)
    vs_recipe = None
    if recipe is not None:
        ratio, lo, hi = _ratio(winner, recipe, seed)
        vs_recipe = {"speedup": ratio, "low": lo, "high": hi}
    return Confirmation(repeats, steps, rows, winner.config, speedup, low, high, vs_recipe)


def _ratio(winner: ConfirmedConfig, ref: ConfirmedConfig | None,
           seed: int) -> tuple[float | None, float | None, float | None]:
    """The winner's median over a reference's, with its bootstrap interval where both
    ran twice or more; exactly 1 where the reference is the winner."""
    if ref is None:
        return None, None, None
    if ref is winner:
        return 1.0, 1.0, 1.0
    ratio = (winner.median or 0.0) / (ref.median or 1.0)
    if min(len(winner.samples_per_second), len(ref.samples_per_second)) > 1:
        return (ratio, *_interval(winner.samples_per_second, ref.samples_per_second, seed))
    return ratio, None, None
