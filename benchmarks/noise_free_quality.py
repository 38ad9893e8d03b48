"""A search's find judged by what each config is worth, not by the one noisy draw the table holds.

The bench's quality is the found config's samples/s over the table's best, and a simulated
table holds one draw per config of its 2-5% noise. Where a dozen configs lie within that
noise, the table's best is the luckiest draw of them: a search that finds the truly fastest
config can score 0.96 by that measure, and one that finds a lucky draw scores 1.0. Our
simulator can write the same landscapes without noise (`simulate_landscape.py OUT
--noise-free`), so this reads the bench's `--json` files and judges each repeat's find
again by its noise-free rate over the best noise-free rate.

    .venv/bin/python benchmarks/noise_free_quality.py --noise-free DIR [DIR ...] \\
        --landscapes DIR [DIR ...] --json BENCH.json [BENCH.json ...]

(`--noise-free`: folders of `simulate_landscape.py --noise-free` landscapes; `--landscapes`:
the folders of the noisy ones the bench searched, to find each table's best.)

Per landscape it prints the bench's median and p10 quality; the same judged by noise-free
rates; again against the best config the device rules let a search run (`allowed`, for a
table whose best a rule rules out; `worth` is that config's noise-free rate over the
best's); the noise-free worth of the table's own best
(how lucky its draw was); and how many configs lie within 1% and 2% of the best
noise-free rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from autotune.bench.bench import RAW_SPACE, context
from autotune.bench.landscape import load_landscape


def p10(values: list[float]) -> float:
    """The bench's 10th percentile (numpy's, interpolated)."""
    return float(np.percentile(values, 10))


def noise_free_rates(folder: Path) -> dict[str, float]:
    """Each ok config's label -> its noise-free samples/s."""
    land = load_landscape(folder)
    rates = {c.label(): o.samples_per_second for c, o in land.table.items() if o.ok}
    if len(rates) != sum(o.ok for o in land.table.values()):
        raise SystemExit(f"{folder}: two ok configs share a label")
    return rates


def judge(rows: list[dict], rates: dict[str, float], noisy_best: str,
          allowed: set[str] | None = None) -> dict:
    """Bench rows' qualities, and again by noise-free rate; `allowed`: the configs the device
    rules let a search run (the best is looked for among them, as the search must)."""
    best = max(rates.values())
    best_allowed = best
    if allowed is not None:
        if not allowed.intersection(rates):
            raise SystemExit("no config the rules allow worked on this landscape")
        best_allowed = max(v for k, v in rates.items() if k in allowed)
    table = [r["quality"] for r in rows]
    # A repeat that found nothing (`found` None) is worth nothing.
    true = [rates.get(r["found"], 0.0) / best for r in rows]
    true_allowed = [rates.get(r["found"], 0.0) / best_allowed for r in rows]
    return {"repeats": len(rows), "median": statistics.median(table), "p10": p10(table),
            "true_median": statistics.median(true), "true_p10": p10(true),
            "allowed_median": statistics.median(true_allowed),
            "allowed_p10": p10(true_allowed), "allowed_best_worth": best_allowed / best,
            "table_best_worth": rates[noisy_best] / best,
            "within_1pct": sum(v >= 0.99 * best for v in rates.values()),
            "within_2pct": sum(v >= 0.98 * best for v in rates.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--noise-free", nargs="+", type=Path, required=True,
                        help="folders written by simulate_landscape.py --noise-free")
    parser.add_argument("--landscapes", nargs="+", type=Path, required=True,
                        help="folders holding the landscapes the bench searched")
    parser.add_argument("--json", nargs="+", type=Path, required=True,
                        help="`autotune bench --json` files")
    parser.add_argument("--strategy", default="autotune")
    a = parser.parse_args()
    clean, noisy = ({d.name: d for root in roots for d in root.iterdir()
                     if (d / "trials.csv").is_file()} for roots in (a.noise_free, a.landscapes))
    print(f"{'landscape':48s} {'median':>6s} {'p10':>6s} | {'true':>6s} {'p10':>6s} | "
          f"{'allowed':>7s} {'p10':>6s} {'worth':>6s} | {'table best':>10s} {'<=1%':>5s} "
          f"{'<=2%':>5s}")
    for path in a.json:
        rows = [r for r in json.loads(path.read_text()) if r["strategy"] == a.strategy]
        for name in sorted({r["landscape"] for r in rows}):
            if name not in clean or name not in noisy:
                print(f"{name:48s} (no noise-free or searched landscape; skipped)")
                continue
            mine = [r for r in rows if r["landscape"] == name]
            land = load_landscape(noisy[name])
            table_best = land.best()
            assert table_best is not None, name
            # Random and TPE search the raw space, as a user would set them up.
            raw = a.strategy in RAW_SPACE
            allowed = {c.label() for c in context(land, 0, raw=raw).candidates}
            j = judge(mine, noise_free_rates(clean[name]), table_best[0].label(), allowed)
            print(f"{name:48s} {j['median']:6.3f} {j['p10']:6.3f} | {j['true_median']:6.3f} "
                  f"{j['true_p10']:6.3f} | {j['allowed_median']:7.3f} {j['allowed_p10']:6.3f} "
                  f"{j['allowed_best_worth']:6.3f} | {j['table_best_worth']:10.3f} "
                  f"{j['within_1pct']:5d} {j['within_2pct']:5d}")


if __name__ == "__main__":
    main()
