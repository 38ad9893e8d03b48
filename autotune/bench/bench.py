"""`autotune bench`: judge search strategies on tuning landscapes, without hardware.

Each strategy searches a landscape through the replay executor under the same budget
(a fraction of what the exhaustive grid cost). Per landscape and strategy: quality (best
samples/s found / best in the table; on a table of noise-free rates, measured with fresh
noise, the rate of what the confirmation picks), cost (summed trial seconds / grid
seconds), trials run, OOMs hit, and speedup of the found config over the table's baseline
config (fp32 AdamW at the largest batch that fits, as auto_find_batch_size would pick).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.bench.landscape import Landscape, load_landscape
from autotune.bench.replay import ReplayExecutor
from autotune.config import BATCH, TrialConfig, halving_batches
from autotune.errors import SpecError
from autotune.knobs import device_rule
from autotune.plan.calibration import MemoryModel
from autotune.spec import SearchSpec
from autotune.tuning.confirm import contenders
from autotune.tuning.loop import Limits, drive
from autotune.tuning.recipe import landscape_values, recipe_rungs
from autotune.tuning.strategies.base import SearchContext
from autotune.tuning.strategies.probe import recipe_chains
from autotune.tuning.strategies.registry import BENCH_STRATEGIES, make_strategy, sampler_for
from autotune.tuning.study import StudyLog

if TYPE_CHECKING:
    from autotune.bench.seeding import Seeding
    from autotune.records import Record

DEFAULT_BUDGET_FRACTION = 0.03


def baseline_config(land: Landscape) -> TrialConfig | None:
    """The table's auto_find_batch_size config: the baseline family at the largest halved
    batch that ran."""
    ok = {c.per_device_train_batch_size: c for c, o in land.table.items()
          if c.family == land.baseline_family and o.ok}
    return next((ok[b] for b in halving_batches(land.per_rank) if b in ok), None)


# Generic search runs over the raw space, as a user would set it up; configs the device
# rules know cannot run are answered (and paid for) as the landscape's error rows.
RAW_SPACE = ("random", "tpe")


def context(land: Landscape, seed: int, *, raw: bool = False) -> SearchContext:
    """What a search on the landscape's machine would know before running anything:
    the space less what device rules rule out, the device, the model's shape. The
    landscape's knob columns count as installed there: rules about this machine's
    packages are for real searches."""
    key = "raw" if raw else "ruled"
    if key not in land.candidates:  # the same for every repeat: rules run once
        land.candidates[key] = sorted(c for c in land.table
                                      if raw or device_rule(c, land.device,
                                                            installs=False) is None)
    candidates = land.candidates[key]
    ctx = SearchContext(candidates, land.device, land.world_size, land.target_batch_size,
                        land.device.memory_bytes, land.shape, seed,
                        baseline_family=land.baseline_family)
    rungs = recipe_rungs(land.device, landscape_values(list(land.table)),
                         world_size=land.world_size, installs=False)
    batches = sorted({c.per_device_train_batch_size for c in land.table})
    ctx.recipe_chains = [[c for c in chain if c in land.table]
                         for chain in recipe_chains(ctx, rungs, batches)]
    return ctx


def choices(candidates: list[TrialConfig]) -> dict[str, list]:
    """Each dimension's values among the candidates: the study's distributions."""
    dims = [BATCH, *candidates[0].family.to_dict()] if candidates else [BATCH]
    return {k: sorted({c.to_dict()[k] for c in candidates}, key=repr) for k in dims}


def classification_accuracy(land: Landscape, memory: MemoryModel) -> float:
    """Share of the table's ok/oom configs the memory model puts on the right side."""
    rows = [(c, o) for c, o in land.table.items() if o.status in ("ok", "oom")]
    right = sum((memory.predict_total(c) <= land.device.memory_bytes
                 and not memory.known_oom(c)) == o.ok for c, o in rows)
    return right / len(rows) if rows else 1.0


def replay(land: Landscape, strategy_name: str, seed: int, budget_fraction: float,
           workers: int = 1, seeding: Seeding | None = None,
           resumed: Sequence[Record] = (), executor: ReplayExecutor | None = None,
           ) -> tuple[list[Record], list[float]]:
    """One search of `land` under the budget: its records and the virtual wall time at
    each (the new records only). `seeding`: what a similar search found runs first
    (bench/seeding.py). `resumed`: a study's records the search resumes from, as a rerun
    of the same command does (tuning/run.py). `executor`: the replay to search (one of
    `workers` seeded by `seed` where none is given)."""
    ctx = context(land, seed, raw=strategy_name in RAW_SPACE)
    ctx.resumed_records = len(resumed)
    if seeding is not None:
        ctx.memory_prior = seeding.calibration
    log = StudyLog.in_memory(choices(ctx.candidates), ctx.memory_limit_bytes,
                             sampler_for(strategy_name, seed))
    strategy = make_strategy(strategy_name, ctx, log, guarded=False)
    if seeding is not None:
        strategy = seeding.wrap(strategy, ctx, land.shape.seq_len)
    executor = executor or ReplayExecutor(land, workers, seed)
    clock: list[float] = []  # virtual wall time at each record
    history = drive(strategy, executor, log,
                    Limits(budget_seconds=budget_fraction * land.grid_seconds()),
                    history=list(resumed), on_record=lambda r: clock.append(executor.clock))
    return history[len(resumed):], clock


def worth(land: Landscape, config: TrialConfig) -> float:
    """`config`'s samples/s as the table holds it: for a table of noise-free rates what
    the config is worth, not what one measurement of it said."""
    return land.table[config].samples_per_second or 0.0


def confirmed_find(land: Landscape, history: Sequence[Record],
                   executor: ReplayExecutor) -> TrialConfig | None:
    """What a search hands its user where each measurement draws fresh noise: the
    contenders a real search's confirmation runs (tuning/confirm.py's: the best, the
    runner-ups within noise of it, the references), each measured the spec's default
    confirm_repeats more times, and the one of the best median that trains the target.
    The single best measurement where no contender trains it."""
    per_rank = land.per_rank
    repeats = max(1, SearchSpec.model_fields["confirm_repeats"].default)
    medians: dict[TrialConfig, float] = {}
    for _, r in contenders(history, per_rank):
        if r.config.samples_per_rank != per_rank or r.config in medians:
            continue
        figures = [f for _ in range(repeats) if (f := executor.measure(r.config))]
        if figures:
            medians[r.config] = statistics.median(figures)
    if medians:
        return max(medians, key=lambda c: medians[c])
    ok = [r for r in history if r.outcome.ok]
    return max(ok, key=lambda r: r.outcome.samples_per_second or 0.0).config if ok else None


def run_one(land: Landscape, strategy_name: str, seed: int, budget_fraction: float,
            workers: int = 1, seeding: Seeding | None = None) -> dict[str, Any]:
    """One repeat's figures. Quality is the found config's rate in the table over the
    table's best: on a table of one draw per config, the find is the best single
    measurement; where measurements draw fresh noise (`Landscape.fresh_noise`), it is
    what the confirmation picks, judged by what it is worth."""
    started = time.perf_counter()
    executor = ReplayExecutor(land, workers, seed)
    history, clock = replay(land, strategy_name, seed, budget_fraction, workers, seeding,
                            executor=executor)
    best_table = land.best()
    top = best_table[1].samples_per_second if best_table else None
    trajectory, spent, best_so_far, measured = [], 0.0, 0.0, 0.0
    for r, wall in zip(history, clock, strict=True):
        if not r.outcome.ran:
            continue
        spent += r.outcome.wall_seconds or 0.0
        if r.outcome.ok and (r.outcome.samples_per_second or 0.0) > measured:
            # The best measured so far, worth what the table says (the same figure on a
            # table of one draw per config; the confirmation, off the clock, is not in it).
            measured = r.outcome.samples_per_second or 0.0
            best_so_far = worth(land, r.config)
        trajectory.append((spent / land.grid_seconds(), best_so_far / top if top else 0.0,
                           wall))
    ok = [r for r in history if r.outcome.ok]
    if land.fresh_noise:
        found_config = confirmed_find(land, history, executor)
    else:
        best = max(ok, key=lambda r: r.outcome.samples_per_second or 0.0) if ok else None
        found_config = best.config if best else None
    base = baseline_config(land)
    found_sps = worth(land, found_config) if found_config else 0.0
    base_sps = land.table[base].samples_per_second if base else None
    # No number of workers reaches the target sooner than the shortest trial of a config
    # that meets it: the floor of the parallel speed-up.
    good = [o.wall_seconds for o in land.table.values() if top and o.ok
            and (o.samples_per_second or 0.0) >= (TARGET_QUALITY - 1e-12) * top]
    record: dict[str, Any] = {
        "landscape": land.name,
        "floor_seconds": min(good) if good else None,
        "strategy": strategy_name,
        "repeat": seed,
        "quality": (found_sps or 0.0) / best_table[1].samples_per_second if best_table else 0.0,
        "cost_fraction": trajectory[-1][0] if trajectory else 0.0,
        "trials": sum(1 for r in history if r.outcome.ran),
        "ooms": sum(1 for r in history if r.outcome.is_oom),
        "pruned": sum(1 for r in history if not r.outcome.ran),
        "workers": workers,
        "speedup": (found_sps / base_sps) if (found_config and base_sps) else None,
        "found": found_config.label() if found_config else None,
        "fresh_noise": land.fresh_noise,
        "seconds": time.perf_counter() - started,
        "trajectory": trajectory,  # (cost fraction, quality, virtual wall s) per trial
    }
    if strategy_name == "autotune":
        record["memory_accuracy_uncalibrated"] = classification_accuracy(
            land, MemoryModel(land.shape, land.device, land.world_size))
        record["memory_accuracy_calibrated"] = classification_accuracy(
            land, MemoryModel.from_history(land.shape, land.device, land.world_size, history,
                                           land.device.memory_bytes))
    return record


def run_bench(landscapes: Sequence[str | Path], *, strategies: Sequence[str] | None = None,
              budget_fraction: float | None = None, repeats: int = 5,
              workers: Sequence[int] = (1,), progress=None) -> list[dict[str, Any]]:
    """Every strategy with one worker; the tuner also with each count in `workers`."""
    fraction = DEFAULT_BUDGET_FRACTION if budget_fraction is None else budget_fraction
    if not 0 < fraction <= 1:
        raise SpecError(f"--budget-fraction: {fraction} is not in (0, 1]")
    if repeats < 1:
        raise SpecError(f"--repeats: {repeats} must be at least 1")
    if not workers or min(workers) < 1:
        raise SpecError(f"--workers: {list(workers)} must be counts of at least 1")
    names = list(strategies or BENCH_STRATEGIES)
    plan = [(name, 1) for name in names] + [("autotune", w) for w in workers
                                            if w != 1 and "autotune" in names]
    records = []
    for path in landscapes:
        land = load_landscape(path)
        for name, w in plan:
            for seed in range(repeats):
                records.append(run_one(land, name, seed, fraction, w))
                if progress is not None:
                    progress(records[-1])
    return records


def runs_planned(n_landscapes: int, strategies: int, repeats: int,
                 workers: Sequence[int]) -> int:
    return n_landscapes * repeats * (strategies + sum(1 for w in workers if w != 1))


def _median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def time_to(trajectory: list, quality: float) -> float | None:
    """Virtual wall seconds until the search first reached `quality`."""
    return next((wall for _, q, wall in trajectory if q >= quality - 1e-12), None)


TARGET_QUALITY = 0.98
# Qualities closer than this are a tie: the shipped landscapes carry about 2% noise.
TIE = 0.01


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median over repeats (and the 10th percentile of quality), per landscape, strategy
    and worker count."""
    groups: dict[tuple[str, str, int], list[dict]] = {}
    for r in records:
        groups.setdefault((r["landscape"], r["strategy"], r.get("workers", 1)), []).append(r)
    rows = []
    for (land, strat, workers), rs in groups.items():
        row = {"landscape": land, "strategy": strat, "workers": workers, "repeats": len(rs)}
        for key in ("quality", "cost_fraction", "trials", "ooms", "speedup", "floor_seconds",
                    "memory_accuracy_uncalibrated", "memory_accuracy_calibrated"):
            row[key] = _median([r.get(key) for r in rs])
        row["quality_p10"] = float(np.percentile([r["quality"] for r in rs], 10))
        times = [time_to(r["trajectory"], TARGET_QUALITY) for r in rs]
        reached = [t for t in times if t is not None]
        row["seconds_to_target"] = (statistics.median(reached)
                                    if len(reached) > len(times) / 2 else None)
        rows.append(row)
    return rows


def quality_at(trajectory: list, cost: float) -> float:
    """Best quality reached having spent at most `cost` (a fraction of the grid)."""
    return max((q for c, q, _ in trajectory if c <= cost + 1e-12), default=0.0)


def cost_to_reach(trajectory: list, quality: float) -> float | None:
    return next((c for c, q, _ in trajectory if q >= quality - 1e-12), None)


def verdicts(records: list[dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per landscape and baseline: the tuner's median quality at the baseline's median cost
    and its median cost to reach the baseline's median quality."""
    out = []
    for base in rows:
        if base["strategy"] == "autotune" or base["workers"] != 1:
            continue
        mine = [r for r in records if r["landscape"] == base["landscape"]
                and r["strategy"] == "autotune" and r.get("workers", 1) == 1]
        if not mine:
            continue
        q_equal = statistics.median(quality_at(r["trajectory"], base["cost_fraction"])
                                    for r in mine)
        costs = [cost_to_reach(r["trajectory"], base["quality"]) for r in mine]
        reached = [c for c in costs if c is not None]
        c_equal = statistics.median(reached) if len(reached) > len(costs) / 2 else None
        beats = q_equal >= base["quality"] - TIE or (c_equal is not None
                                                     and c_equal <= base["cost_fraction"])
        out.append({"landscape": base["landscape"], "baseline": base["strategy"],
                    "baseline_quality": base["quality"], "baseline_cost": base["cost_fraction"],
                    "autotune_quality_at_equal_cost": q_equal,
                    "autotune_cost_at_equal_quality": c_equal, "beats": beats})
    return out


def render(rows: list[dict[str, Any]], console, fraction: float) -> None:
    from rich.table import Table

    table = Table(title=f"autotune bench: median over repeats, budget {fraction:.1%} of the grid")
    for col in ("landscape", "strategy", "quality", "q p10", "cost", "trials", "OOMs",
                "speedup", "OOM classif. (uncal → cal)"):
        table.add_column(col, justify="left" if col in ("landscape", "strategy") else "right")
    for r in (r for r in rows if r["workers"] == 1):
        mem = ""
        if r.get("memory_accuracy_calibrated") is not None:
            mem = (f"{r['memory_accuracy_uncalibrated']:.1%} → "
                   f"{r['memory_accuracy_calibrated']:.1%}")
        table.add_row(r["landscape"], r["strategy"], f"{r['quality']:.3f}",
                      f"{r['quality_p10']:.3f}", f"{r['cost_fraction']:.2%}",
                      f"{r['trials']:g}", f"{r['ooms']:g}",
                      f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-", mem)
    console.print(table)


def _hours(seconds: float | None) -> str:
    return "not reached" if seconds is None else f"{seconds / 3600:.2f} h"


def render_workers(rows: list[dict[str, Any]], console) -> None:
    """The tuner's virtual wall time to TARGET_QUALITY by worker count (trials in
    parallel, each taking the seconds the landscape says)."""
    from rich.table import Table

    mine = [r for r in rows if r["strategy"] == "autotune"]
    if len({r["workers"] for r in mine}) < 2:
        return
    one = {r["landscape"]: r["seconds_to_target"] for r in mine if r["workers"] == 1}
    table = Table(title=f"autotune with parallel workers: wall time to {TARGET_QUALITY} "
                        "quality (medians, virtual clock)")
    for col in ("landscape", "workers", "quality", "cost", "wall to target", "vs 1 worker",
                "floor vs 1 worker"):
        table.add_column(col, justify="left" if col == "landscape" else "right")
    for r in sorted(mine, key=lambda r: (r["landscape"], r["workers"])):
        base, t, floor = one.get(r["landscape"]), r["seconds_to_target"], r["floor_seconds"]
        ratio = f"{t / base:.2f}" if base and t is not None else "-"
        # The shortest trial that reaches the target, over the 1-worker time: the best
        # ratio any number of workers could show.
        least = f"{min(floor / base, 1.0):.2f}" if base and floor else "-"
        table.add_row(r["landscape"], str(r["workers"]), f"{r['quality']:.3f}",
                      f"{r['cost_fraction']:.2%}", _hours(t), ratio, least)
    console.print(table)


def render_verdicts(verdict_rows: list[dict[str, Any]], console) -> None:
    from rich.table import Table

    table = Table(title="autotune vs each baseline at equal cost (medians)")
    for col in ("landscape", "baseline", "baseline quality @ cost",
                "autotune quality @ same cost", "autotune cost to same quality", "beats"):
        table.add_column(col)
    for v in verdict_rows:
        c_eq = v["autotune_cost_at_equal_quality"]
        table.add_row(v["landscape"], v["baseline"],
                      f"{v['baseline_quality']:.3f} @ {v['baseline_cost']:.2%}",
                      f"{v['autotune_quality_at_equal_cost']:.3f}",
                      f"{c_eq:.2%}" if c_eq is not None else "not reached",
                      "[green]yes[/]" if v["beats"] else "[red]no[/]")
    console.print(table)


# A budget under this many median trials cannot tell strategies apart: each barely runs
# its first trials (3% of a 50-config grid is about one).
THIN_BUDGET_TRIALS = 5


def thin_budget_note(land: Landscape, fraction: float) -> str | None:
    """A line saying the budget is too thin to judge on `land`, and what would not be."""
    costs = sorted(o.wall_seconds or 0.0 for o in land.table.values())
    median = costs[len(costs) // 2] if costs else 0.0
    trials = fraction * land.grid_seconds() / median if median else float("inf")
    if trials >= THIN_BUDGET_TRIALS:
        return None
    enough = min(1.0, THIN_BUDGET_TRIALS * 2 * median / max(land.grid_seconds(), 1e-9))
    return (f"{land.name}: --budget-fraction {fraction:g} buys about {trials:.1f} median "
            f"trials of its {len(costs)} configs, too few to tell strategies apart; "
            f"try --budget-fraction {enough:.2g}")


def bench_main(landscapes: Sequence[str], budget_fraction: float | None, repeats: int,
               json_path: str | None, console, workers: Sequence[int] = (1,),
               strategies: Sequence[str] | None = None) -> int:
    from rich.progress import Progress

    names = list(strategies or BENCH_STRATEGIES)
    unknown = sorted(set(names) - set(BENCH_STRATEGIES))
    if unknown or "autotune" not in names:
        raise SpecError(f"--strategies: {', '.join(names)}: each must be one of "
                        f"{', '.join(BENCH_STRATEGIES)}, autotune among them")
    fraction = DEFAULT_BUDGET_FRACTION if budget_fraction is None else budget_fraction
    started = time.perf_counter()
    total = runs_planned(len(landscapes), len(names), repeats, workers)
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("replaying", total=total)
        records = run_bench(landscapes, strategies=names, budget_fraction=fraction,
                            repeats=repeats, workers=workers,
                            progress=lambda r: bar.advance(task))
    rows = summarise(records)
    render(rows, console, fraction)
    for path in landscapes:
        note = thin_budget_note(load_landscape(path), fraction)
        if note:
            console.print(f"[yellow]{note}[/]", highlight=False)
    render_workers(rows, console)
    render_verdicts(verdicts(records, rows), console)
    console.print(f"[dim]{len(records)} replayed searches in "
                  f"{time.perf_counter() - started:.1f} s[/]")
    if json_path:
        Path(json_path).write_text(json.dumps(records, indent=2) + "\n")
        console.print(f"wrote {json_path}")
    return 0
