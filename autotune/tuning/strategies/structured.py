"""The `autotune` strategy: search the way the problem is built, not as generic HPO.

1. The references (probe.py): what a user gets from Trainer defaults with
   auto_find_batch_size, then the guide's recipe at the largest batch that fits.
2. Then the config with the largest expected improvement per second of trial under a
   structured throughput model (surrogate.py), among those the calibrated memory model
   says fit (a slow config's trial costs more to learn the same). A config the
   model would pick but predicts out of memory is recorded as pruned (never run), with
   the figure and the limit. An OOM rules out larger batches of its family.
3. A knob value that failed (nan, error, crash) weighs its configs' expected improvement
   by its chance of working, (works + 1) / (works + fails + 2); twice failed and never
   worked, it is written off. One divergence thus costs at most one more trial of it.
   Once a value is written off, its failures are no longer held against the values
   beside it (`_blame`). Only failures after a trial worked count; FAILING failures
   with none that worked stop the search once the references have run (a resumed one,
   FAILING more of its own: the user has likely fixed what they shared).
4. Stop when no remaining config is expected to beat the best by `min_gain`, but first
   give up to NEAR_TIES neighbours (one knob group or one batch step away) of the best
   measured config a look, the most promising first: the model cannot tell configs
   within noise apart, and a short measurement's noise can hide the best among them.
   Where the search's limits leave room for no more than NEAR_TIES trials, that look
   comes now: a search that ends on its budget polishes its best before it ends, rather
   than spending its last trials on exploring; unless the model still expects a config
   to beat the best by ENDGAME_GAIN, more than polishing can find.

Everything is rebuilt from the history, so a resumed search continues where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np

from autotune.config import Family, TrialConfig
from autotune.records import FAILED, Record
from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
from autotune.tuning.strategies.memory_gate import MemoryGate
from autotune.tuning.strategies.probe import REASON, RECIPE_REASON, BaselineProbe, RecipeProbe
from autotune.tuning.strategies.surrogate import (
    ThroughputModel,
    expected_improvement,
    probability_of_improvement,
)

MIN_GAIN = 0.01  # expected relative gain below which another trial is not worth it: half
# the 2% noise floor of one short measurement (surrogate.NOISE_FLOOR): a trial could not
# tell such a gain from noise, and near-ties get their own look before stopping.
NEAR_TIES = 4  # neighbours of the best config tried before stopping, per best config
NEAR_TIE_REASON = "near-tie"
# In the endgame a config the model expects to beat the best by this much still runs
# before the near-ties: a near-tie finds what noise hid, a percent or two. (Issue 51's
# bar on its 15 GPU-lever landscapes: 0.05, 0.1, 0.2 and never (always polish) meet it on
# 14, 13, 12 and 11; on all 27, 0.05 and 0.1 on 25 each, 0.05 adding an OOM trial on
# Mistral-7B on an H100 where it gains Llama-13B's quality.)
ENDGAME_GAIN = 0.1
# How much a trial's predicted duration discounts its expected improvement (1: per second).
COST_WEIGHT = 1.0
# A config runs where it fits with at least this chance; below, where it is the most
# promising, it is recorded as pruned with its predicted figure.
P_RUN = 0.5
# Each OOM of the search's own trials (the references' probes aside) asks that much more
# of a config's chance to fit, up to P_RUN_MAX: a search whose predictions near the limit
# keep failing stops betting on them. (The bench's landscapes, shipped and our own, at
# 0.0, 0.1, 0.2: 0.1 kept their quality and cut their median OOMs from 5 to 4 where
# the memory model kept missing.)
P_RUN_STEP = 0.1
P_RUN_MAX = 0.9
# An OOM costs more than its seconds: a failed trial on the user's GPUs. Its expected
# cost, (1 - chance to fit) x this, in relative gain, comes off a config's worth: a 2%
# gain at even odds is not worth an OOM. (0.02 on the same landscapes against 0, 0.05
# and 0.1: the fewest OOM trials without a loss of quality.)
OOM_PENALTY = 0.02
# An OOM's cost as a share of a full trial's, before trials have been timed.
OOM_COST_SHARE = 0.3
# Failed trials, with none that worked, after which the search stops once the references
# have run (`_failing`): where only they failed, one config chosen away from them.
FAILING = 3


class AutotuneStrategy(Strategy):
    name = "autotune"

    def __init__(self, ctx: SearchContext, *, min_gain: float = MIN_GAIN) -> None:
        super().__init__(ctx)
        self.min_gain = min_gain
        self.gate = MemoryGate(ctx)
        self.baseline = BaselineProbe(ctx)
        self.recipe = RecipeProbe(ctx)
        self.throughput = ThroughputModel(ctx.candidates, ctx.device, ctx.world_size,
                                          ctx.shape)
        self._families: dict[Family, list[TrialConfig]] = {}
        for c in ctx.candidates:
            self._families.setdefault(c.family, []).append(c)
        # Knob groups with one value in the space: every config holds it, so its chance to
        # work tells configs nothing apart (`_success`).
        values: dict[str, set] = {}
        for fam in self._families:
            for group, value in fam.levels(blamed_only=True):
                values.setdefault(group, set()).add(value)
        self._fixed = {group for group, seen in values.items() if len(seen) == 1}
        self._fitted_on = -1
        # A tiny fixed jitter breaks ties between configs the model cannot tell apart.
        self._jitter = np.random.default_rng(ctx.seed).normal(0.0, 1e-6, len(ctx.candidates))

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        self.gate.update(history)
        proposal = (self.baseline.next(history, pending, self.gate)
                    or self.recipe.next(history, pending, self.gate))
        if proposal is not None:
            return proposal
        if _failing(history, self.ctx.resumed_records):
            return None
        ran = {r.config for r in history if r.outcome.ran} | set(pending)
        endgame = self.ctx.trials_left is not None and self.ctx.trials_left <= NEAR_TIES
        pruned = {r.config for r in history if not r.outcome.ran}
        ok = [(r.config, r.score) for r in history
              if r.outcome.ok and r.score and self.throughput.knows(r.config)]
        best = max((math.log(s) for _, s in ok), default=None)
        if len(ran) != self._fitted_on:
            # New evidence: refit, rescore, and walk the candidates from the top again.
            self.throughput.fit([c for c, _ in ok], [s for _, s in ok])
            self._fitted_on = len(ran)
            mu, sd = self.throughput.predict()
            lies = [c for c in pending if c in self.throughput.row]
            if lies:
                # Constant liar: trials in flight count as measured at their predicted
                # mean, so the next ask looks elsewhere instead of next to them.
                lied = [float(np.exp(mu[self.throughput.row[c]])) for c in lies]
                self.throughput.fit([c for c, _ in ok] + lies, [s for _, s in ok] + lied)
                mu, sd = self.throughput.predict()
            score = (mu + sd) if best is None else expected_improvement(mu, sd, best)
            self._mu, self._sd = mu, sd
            # A config that may not fit is worth its improvement times the chance it
            # fits, less the OOM's price (OOM_PENALTY), and costs a full trial if it
            # does, an OOM's if it does not.
            p_fit = np.array([self.gate.p_fit(c) for c in self.ctx.candidates])
            self._p_fit = p_fit
            self._works = self._success(history)
            gain = score * self._works
            self._score = gain * p_fit - (1 - p_fit) * OOM_PENALTY
            full, oom = self._cost(history, mu)
            cost = p_fit * full + (1 - p_fit) * oom
            self._if_it_fit = gain / full ** COST_WEIGHT  # for `_held_back`
            # The walk goes by improvement per second of trial; `worth` by improvement.
            self._order = [int(i) for i in np.argsort(
                -(self._score / cost ** COST_WEIGHT + self._jitter))]
            self._pos = 0
        dead = self._dead_levels(history)
        self._p_run = self._run_threshold(history)
        i = self._next_runnable(ran, dead)
        if endgame and best is not None and (i is None or self._score[i] < ENDGAME_GAIN):
            polish = self._near_tie(history, ran)
            if polish is not None:
                return polish
        if i is not None:
            if best is not None and self._score[i] < self.min_gain:
                return self._near_tie(history, ran)
            held = self._held_back(i, history, ran, pruned, dead)
            if held is not None:
                return held
            c = self.ctx.candidates[i]
            return Proposal(c, "model" if best is not None else "explore",
                            predicted_memory_bytes=self.gate.predicted(c))
        if not any(r.outcome.ran for r in history) and not pending:
            return self._cheapest()
        return self._near_tie(history, ran)

    def _next_runnable(self, ran: set[TrialConfig], dead: set) -> int | None:
        """The model's next candidate by improvement per second that has not run, holds no
        written-off value and fits with the chance `_p_run` asks; the walk moves past the
        others for good (what ran, what is written off and that chance only grow)."""
        while self._pos < len(self._order):
            i = self._order[self._pos]
            c = self.ctx.candidates[i]
            if (c not in ran and not dead.intersection(c.family.levels())
                    and self._p_fit[i] >= self._p_run):
                return i
            self._pos += 1
        return None

    @staticmethod
    def _run_threshold(history: Sequence[Record]) -> float:
        """The chance to fit a config needs to run (P_RUN_STEP)."""
        ooms = sum(1 for r in history
                   if r.outcome.is_oom and r.reason not in (REASON, RECIPE_REASON))
        return min(P_RUN_MAX, P_RUN + P_RUN_STEP * ooms)

    def _held_back(self, i: int, history: Sequence[Record], ran: set[TrialConfig],
                   pruned: set[TrialConfig], dead: set) -> Proposal | None:
        """Before running candidate `i`: the config the model would rather run if it fit
        and that the memory model says will not, recorded as pruned with its figure and
        the limit (one per trial run: the user sees what memory held back, not a list of
        every config too large)."""
        if history and not history[-1].outcome.ran:
            return None  # one already recorded before this trial
        better = [j for j in np.flatnonzero(self._if_it_fit > self._if_it_fit[i])
                  if self._p_fit[j] < self._p_run]
        for j in sorted(better, key=lambda j: -self._if_it_fit[j]):
            c = self.ctx.candidates[j]
            if c in ran or c in pruned or dead.intersection(c.family.levels()):
                continue
            fits, why = self.gate.fits(c)
            if fits or self._implied(c):
                continue
            return Proposal(c, f"predicted-oom: {why}", run=False,
                            predicted_memory_bytes=self.gate.predicted(c))
        return None

    def _cheapest(self) -> Proposal | None:
        """Every config is predicted over the limit and nothing has run: an uncalibrated
        prediction is a guess, so the config predicted smallest runs rather than the
        search ending without a trial."""
        if self.gate.model is None or not self.ctx.candidates:
            return None
        c = min(self.ctx.candidates, key=lambda c: self.gate.model.predict_total(c))
        return Proposal(c, "explore: every config is predicted over the limit; the "
                        "smallest runs", predicted_memory_bytes=self.gate.predicted(c))

    def _cost(self, history: Sequence[Record],
              mu: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each candidate's predicted trial seconds if it runs (fixed overhead plus the
        timed work, which goes as 1 / samples/s; fitted to the trials so far, equal costs
        before) and if it runs out of memory (the OOMs' median, else the fixed part)."""
        ran = [(r.outcome.repeat_seconds, r.score) for r in history
               if r.outcome.ok and r.outcome.repeat_seconds and r.score]
        ooms = [r.outcome.repeat_seconds for r in history
                if r.outcome.is_oom and r.outcome.repeat_seconds]
        if len(ran) < 2:
            return np.ones(len(mu)), np.full(len(mu), OOM_COST_SHARE)
        A = np.array([[1.0, 1.0 / sps] for _, sps in ran])
        (fixed, work), *_ = np.linalg.lstsq(A, np.array([w for w, _ in ran]), rcond=None)
        fixed = max(fixed, 0.05 * float(np.median([w for w, _ in ran])))
        full = fixed + max(work, 0.0) / np.exp(mu)
        oom = float(np.median(ooms)) if ooms else fixed
        return full, np.minimum(full, oom)

    def _success(self, history: Sequence[Record]) -> np.ndarray:
        """Per candidate, the chance its knob values work, from the failures seen. Values of
        knob groups the space holds fixed are left out: every config holds them, and each
        failure seen before a success put a half on each (BERT-large on an A10G: the
        recipe's error took eleven such halves, 0.0005, off every config, and no config was
        worth a trial after the first)."""
        works, fails = _blame(history, self._fixed)
        fails = {lv: n for lv, n in fails.items() if lv[0] not in self._fixed}
        if not fails:
            return np.ones(len(self.ctx.candidates))
        p = {lv: (works.get(lv, 0) + 1) / (works.get(lv, 0) + n + 2) for lv, n in fails.items()}
        return np.array([float(np.prod([p.get(lv, 1.0)
                                        for lv in c.family.levels(blamed_only=True)]))
                         for c in self.ctx.candidates])

    def _near_tie(self, history: Sequence[Record], ran: set[TrialConfig]) -> Proposal | None:
        """Before stopping: up to NEAR_TIES neighbours of the best measured config. The
        model cannot tell configs within noise of each other apart, and the best among
        them differs from its neighbours by one knob: a new best starts its own look."""
        ok = [(n, r) for n, r in enumerate(history) if r.outcome.ok and r.score
              and r.config in self.throughput.row]
        if not ok:
            return None
        at, incumbent = max(ok, key=lambda nr: nr[1].score or 0.0)
        if sum(1 for r in history[at + 1:] if r.reason == NEAR_TIE_REASON) >= NEAR_TIES:
            return None
        dead = self._dead_levels(history)
        options = [i for i, c in enumerate(self.ctx.candidates)
                   if c not in ran and _neighbours(c, incumbent.config)
                   and not dead.intersection(c.family.levels()) and self._p_fit[i] >= self._p_run]
        if not options:
            return None
        # The neighbour likeliest to beat the incumbent (and to work and fit), not the one
        # of the largest expected improvement: its sd term grows without bound, so a config
        # predicted far slower but little known outranked one within noise of the best
        # (docs/results.md, 2026-11-30, after the final).
        beats = (probability_of_improvement(self._mu[options], self._sd[options],
                                            math.log(incumbent.score))
                 * self._works[options] * self._p_fit[options])
        i = options[int(np.argmax(beats + self._jitter[options]))]
        c = self.ctx.candidates[i]
        return Proposal(c, NEAR_TIE_REASON, predicted_memory_bytes=self.gate.predicted(c))

    def _implied(self, c: TrialConfig) -> bool:
        """A smaller batch of the family ran out of memory or is predicted to: only the
        smallest such batch is worth a record in the study."""
        b = c.per_device_train_batch_size
        oom = self.gate.oom_at.get(c.family)
        if oom is not None and b >= oom:
            return True
        return any(not self.gate.fits(o)[0] for o in self._families[c.family]
                   if o.per_device_train_batch_size < b)

    def _dead_levels(self, history: Sequence[Record]) -> set[tuple[str, tuple]]:
        """`_dead`, the space's fixed groups left out."""
        return _dead(history, self._fixed)


def _neighbours(a: TrialConfig, b: TrialConfig) -> bool:
    """One knob group apart at the same batch, or the same family one batch step apart."""
    if a.family == b.family:
        return max(a.per_device_train_batch_size, b.per_device_train_batch_size) == 2 * min(
            a.per_device_train_batch_size, b.per_device_train_batch_size)
    if a.per_device_train_batch_size != b.per_device_train_batch_size:
        return False
    return sum(x != y for x, y in zip(a.family.levels(), b.family.levels(), strict=True)) == 1


def _dead(history: Sequence[Record],
          fixed: Collection[str] = frozenset()) -> set[tuple[str, tuple]]:
    """Knob values that failed (nan, error, timeout, crash) at least twice after a trial
    worked, and never worked: fp16 overflowing to nan, an optimizer this install cannot
    build. Failures before any success are left to `_success`'s odds: they share every
    value no success has cleared (docs/search.md). Never a `fixed` group's value (every
    config holds it), nor a knob the table does not blame (checkpointing)."""
    first = next((i for i, r in enumerate(history) if r.outcome.ok), None)
    if first is None:
        return set()
    works, fails = _counts(history[first:])  # every success is from `first` on
    return {lv for lv, n in fails.items()
            if n >= 2 and lv not in works and lv[0] not in fixed}


def _failing(history: Sequence[Record], began: int = 0) -> bool:
    """FAILING configs have failed (nan, error, timeout, crash) since record `began` (what
    a resumed study held when this run began) and none has ever worked: a fault they all
    share that autotune did not recognise as the setup's (the model, the data), or one no
    config of the space avoids. The search stops rather than spend its budget on it. A
    rerun of the same command tries FAILING more: it follows a fix more often than not."""
    return (not any(r.outcome.ok for r in history)
            and sum(r.outcome.status in FAILED for r in history[began:]) >= FAILING)


def _counts(history: Sequence[Record],
            dead: set[tuple[str, tuple]] = frozenset()) -> tuple[dict, dict]:
    """Per blamed knob value, the trials with it that worked and that failed; a failure
    of a config holding a `dead` value counts against the dead values alone."""
    works: dict[tuple[str, tuple], int] = {}
    fails: dict[tuple[str, tuple], int] = {}
    for r in history:
        levels = r.config.family.levels(blamed_only=True)
        if r.outcome.ok:
            for lv in levels:
                works[lv] = works.get(lv, 0) + 1
        elif r.outcome.status in FAILED:
            for lv in dead.intersection(levels) or levels:
                fails[lv] = fails.get(lv, 0) + 1
    return works, fails


def _blame(history: Sequence[Record],
           fixed: Collection[str] = frozenset()) -> tuple[dict, dict]:
    """`_counts` with the failures explained away: once a value is written off (`_dead`:
    fp16 that diverged twice), the configs' other values are not blamed for its failures
    (GPT-Neo on an L4: an fp16 ZeRO-2 divergence kept ZeRO-2's chance at a third, and
    the search stopped before the best config, bf16 ZeRO-2)."""
    return _counts(history, _dead(history, fixed))
