"""Why a search on a noise-free landscape found what it found, repeat by repeat.

Replays `autotune` on LANDSCAPE (drawing each measurement's noise afresh, as `autotune
bench` does) for each seed, and prints the table's best configs by what they are worth,
then per repeat what its confirmation picked, its contenders (worth and the search's one
measurement, both over the table's best) and the search's best single measurements. It
tells a find the search never measured from one its confirmation lost.

    .venv/bin/python benchmarks/confirmed_finds.py LANDSCAPE [--fraction 0.005] [--seeds 10]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from autotune.bench.bench import confirmed_find, replay, worth
from autotune.bench.landscape import load_landscape
from autotune.bench.replay import ReplayExecutor
from autotune.tuning.confirm import contenders


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("landscape", type=Path)
    parser.add_argument("--fraction", type=float, default=0.005, help="of the grid's cost")
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--top", type=int, default=8, help="table rows and measurements shown")
    args = parser.parse_args()
    land = load_landscape(args.landscape)
    if not land.fresh_noise:
        parser.error(f"{args.landscape}: not a noise-free landscape "
                     "(simulate_landscape.py --noise-free writes them)")
    top = land.best()[1].samples_per_second
    ranked = sorted((c for c, o in land.table.items() if o.ok), key=lambda c: -worth(land, c))
    print("the table's best, by worth:")
    for c in ranked[:args.top]:
        print(f"  {worth(land, c) / top:.3f}  {c.label()}")
    for seed in range(args.seeds):
        executor = ReplayExecutor(land, 1, seed)
        history, _ = replay(land, "autotune", seed, args.fraction, executor=executor)
        found = confirmed_find(land, history, executor)
        ok = sorted((r for r in history if r.outcome.ok and not r.confirming),
                    key=lambda r: -(r.outcome.samples_per_second or 0.0))
        reached = max((worth(land, r.config) for r in ok), default=0.0) / top
        print(f"seed {seed}: picked {worth(land, found) / top if found else 0.0:.3f}, "
              f"best measured config worth {reached:.3f}, {len(history)} trials")
        for role, r in contenders(history, land.per_rank):
            print(f"  {role:10s} worth {worth(land, r.config) / top:.3f}  measured "
                  f"{(r.outcome.samples_per_second or 0.0) / top:.3f}  {r.config.label()}")
        for r in ok[:args.top]:
            print(f"  {'measured':10s} worth {worth(land, r.config) / top:.3f}  measured "
                  f"{(r.outcome.samples_per_second or 0.0) / top:.3f}  {r.config.label()}")


if __name__ == "__main__":
    main()
