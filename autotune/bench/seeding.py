"""What seeding is worth, without hardware: a search of landscape A stands for the record a
near match leaves in the results store (its winner and runner-ups, its memory
calibration); a search of landscape B of the same model then starts from it, and is set
against the same search of B from nothing.

Per pair and repeat (the same seed for A's search and each of B's): the trials run until
the best found reaches EARLY_QUALITY and TARGET_QUALITY of B's best ("—": never within
the budget), the virtual wall time to it, the quality at the end of the budget, the
trials and the OOMs; for B from nothing, with A's memory calibration only, and seeded
(A's winner first, its runner-ups behind it, and the calibration). A's record is its searched
contenders (bench replays have no confirmation runs: the best and the runner-ups within
5% of it, as the confirmation would pick them), translated to B's space as a search
translates a stored record (tuning/strategies/seeded.py).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.bench.bench import TARGET_QUALITY, context, replay, run_one, time_to
from autotune.bench.landscape import Landscape, load_landscape
from autotune.errors import SpecError
from autotune.plan.calibration import MemoryModel
from autotune.summary import BASELINE, RECIPE
from autotune.tuning import confirm
from autotune.tuning.strategies.base import Proposal, Strategy
from autotune.tuning.strategies.seeded import Seeded, translate

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.records import Record
    from autotune.tuning.strategies.base import SearchContext


EARLY_QUALITY = 0.95  # a second, looser mark: how soon the search is near the best
VARIANTS = ("unseeded", "calibration", "seeded")  # each pair's three searches of B


@dataclass
class Seeding:
    """A stand-in for a stored record: configs to run first, the seq_len they ran at, the
    memory model's term scales."""

    source: str
    configs: list[dict[str, Any]]
    seq_len: int
    calibration: dict[str, float] | None = None

    def wrap(self, strategy: Strategy, ctx: SearchContext, seq_len: int) -> Seeded:
        seeds = [c for c in (translate(d, ctx, self.seq_len / seq_len)
                             for d in self.configs) if c is not None]
        return Seeded(strategy, [seeds])


def seeding_from(land: Landscape, seed: int, budget_fraction: float) -> Seeding:
    """A's search, kept as a record would keep it."""
    history, _ = replay(land, "autotune", seed, budget_fraction)
    picked = [r.config.to_dict() for role, r in confirm.contenders(history, land.per_rank)
              if role not in (BASELINE, RECIPE)]  # the best first, then the runner-ups
    scales = MemoryModel.from_history(land.shape, land.device, land.world_size, history,
                                      land.device.memory_bytes).term_scales()
    return Seeding(land.name, picked, land.shape.seq_len, scales)


def trials_to(trajectory: list, quality: float) -> int | None:
    """Trials run until the best found first reached `quality`."""
    return next((i + 1 for i, (_, q, _) in enumerate(trajectory) if q >= quality - 1e-12),
                None)


def run_pair(source: Landscape, target: Landscape, seed: int,
             budget_fraction: float) -> dict[str, Any]:
    seeding = seeding_from(source, seed, budget_fraction)
    ctx = context(target, seed)
    applied = seeding.wrap(_Idle(ctx), ctx, target.shape.seq_len).seeds
    out: dict[str, Any] = {"from": source.name, "to": target.name, "repeat": seed,
                           "seeds": len(applied)}
    calibration_only = Seeding(seeding.source, [], seeding.seq_len, seeding.calibration)
    for name, s in (("unseeded", None), ("calibration", calibration_only),
                    ("seeded", seeding)):
        r = run_one(target, "autotune", seed, budget_fraction, seeding=s)
        out[name] = {"trials_to_target": trials_to(r["trajectory"], TARGET_QUALITY),
                     "trials_to_early": trials_to(r["trajectory"], EARLY_QUALITY),
                     "seconds_to_target": time_to(r["trajectory"], TARGET_QUALITY),
                     "first_trial_quality": r["trajectory"][0][1] if r["trajectory"] else 0.0,
                     "quality": r["quality"], "trials": r["trials"], "ooms": r["ooms"],
                     "cost_fraction": r["cost_fraction"]}
    return out


class _Idle(Strategy):
    """Nothing to ask: to count the seeds that apply to a landscape."""

    def ask(self, history: Sequence[Record],
            pending: Sequence[TrialConfig] = ()) -> Proposal | None:
        return None


def _median(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) > len(values) / 2 else None


def seeding_main(landscapes: Sequence[str], seeded_from: Sequence[str],
                 budget_fraction: float, repeats: int, console) -> list[dict[str, Any]]:
    """Every (source, target) pair of a --seeded-from landscape and another --landscape,
    `repeats` seeds each; prints the medians and returns the per-repeat records."""
    from rich.table import Table

    if repeats < 1:
        raise SpecError(f"--repeats: {repeats} must be at least 1")
    if not 0 < budget_fraction <= 1:
        raise SpecError(f"--budget-fraction: {budget_fraction} is not in (0, 1]")
    loaded = {p: load_landscape(p) for p in dict.fromkeys([*landscapes, *seeded_from])}
    pairs = [(s, t) for t in landscapes for s in seeded_from
             if loaded[s].name != loaded[t].name]
    if not pairs:
        raise SpecError("--seeded-from: name a landscape other than the --landscape ones "
                        "(a search seeded by itself says nothing)")
    records = [run_pair(loaded[s], loaded[t], seed, budget_fraction)
               for s, t in pairs for seed in range(repeats)]
    table = Table(title=f"seeding, from nothing → with the record's memory calibration only "
                        f"→ seeded (its winner first, and the calibration): medians over "
                        f"{repeats} repeats, budget {budget_fraction:.1%} of the grid")
    for col in ("seeded from", "landscape", "seeds", f"trials to {EARLY_QUALITY}",
                "trials to target", "reached", "hours to target", "quality at the end",
                "trials", "OOMs"):
        table.add_column(col, justify="left" if col in ("seeded from", "landscape")
                         else "right")
    for s, t in pairs:
        rs = [r for r in records if r["from"] == loaded[s].name and r["to"] == loaded[t].name]

        def both(key: str, fmt: str, rs: list = rs) -> str:
            values = (_median([r[k][key] for r in rs]) for k in VARIANTS)
            return " → ".join("—" if v is None else format(v, fmt) for v in values)

        def hours(rs: list = rs) -> str:
            values = (_median([r[k]["seconds_to_target"] for r in rs]) for k in VARIANTS)
            return " → ".join("—" if v is None else f"{v / 3600:.2f}" for v in values)

        reached = " → ".join(
            f"{sum(r[k]['trials_to_target'] is not None for r in rs)}/{len(rs)}"
            for k in VARIANTS)
        table.add_row(loaded[s].name, loaded[t].name, f"{_median([r['seeds'] for r in rs]):g}",
                      both("trials_to_early", "g"), both("trials_to_target", "g"), reached, hours(),
                      both("quality", ".3f"), both("trials", "g"), both("ooms", "g"))
    console.print(table)
    return records
