"""Per-trial overhead of finished searches: what a trial costs beyond its timed steps.

    .venv/bin/python benchmarks/trial_overhead.py runs/tiny-gpt2/summary.json [more ...]

Prints, over every trial that ran to the end, the median and range of wall time minus
the timed steps (the issue's measure: process start, model and data build, Trainer
set-up and the warm-up steps), and the same without the warm-up steps (what launching
costs, the part a warm launcher can remove).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def overheads(paths: list[str]) -> tuple[list[float], list[float], list[float]]:
    beyond_steps, beyond_warmup, warmup = [], [], []
    for path in paths:
        for t in json.loads(Path(path).read_text())["trials"]:
            o = t["outcome"]
            if o["status"] != "ok" or not o.get("timed_seconds"):
                continue
            w = float(o["extra"].get("warmup_seconds") or 0.0)
            beyond_steps.append(o["wall_seconds"] - o["timed_seconds"])
            beyond_warmup.append(o["wall_seconds"] - o["timed_seconds"] - w)
            warmup.append(w)
    return beyond_steps, beyond_warmup, warmup


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    rows = zip(("wall - timed steps", "wall - timed - warm-up", "warm-up steps"),
               overheads(sys.argv[1:]), strict=True)
    for label, xs in rows:
        if xs:
            print(f"{label:24s} median {statistics.median(xs):6.2f} s   range "
                  f"{min(xs):.2f}-{max(xs):.2f} s   ({len(xs)} trials)")


if __name__ == "__main__":
    main()
