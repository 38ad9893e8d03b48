"""Where finished searches' time went: per trial and per phase, and the search's efficiency.

    .venv/bin/python benchmarks/trial_overhead.py runs/qwen-0.5b-qlora/summary.json [more ...]

Per summary: the search's wall time and efficiency (timed-step seconds over wall seconds
times its slots), then over the trials that reached each phase the median and the largest
seconds of launch, model, engine, warm-up and timed steps, and the largest time before a
first step (launch + model + engine) of the trials with a 4-bit base and of the rest.
Summaries written before trials said where their time went (no `phases`) get the older
figures: wall time less the timed steps, with and without the warm-up.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.records import PHASES, Record  # noqa: E402


def phase_table(trials: list[Record]) -> list[str]:
    lines = []
    for name in PHASES:
        seen = [s for t in trials if (s := getattr(t.outcome.phases, name)) is not None]
        if seen:
            lines.append(f"  {name:8s} median {statistics.median(seen):6.2f} s   max "
                         f"{max(seen):6.2f} s   ({len(seen)} trials)")
    for label, quantized in (("4-bit base", True), ("the rest", False)):
        first = [p.before_first_step for t in trials
                 if (p := t.outcome.phases).warmup is not None
                 and p.before_first_step is not None
                 and (t.config.quantization != "none") == quantized]
        if first:
            lines.append(f"  before the first step, {label}: median "
                         f"{statistics.median(first):.2f} s, max {max(first):.2f} s")
    return lines


def legacy(trials: list[Record]) -> list[str]:
    beyond_steps, beyond_warmup = [], []
    for t in trials:
        o = t.outcome
        if not o.ok or not o.timed_seconds:
            continue
        w = o.measured.warmup_seconds or 0.0
        beyond_steps.append((o.wall_seconds or 0.0) - o.timed_seconds)
        beyond_warmup.append((o.wall_seconds or 0.0) - o.timed_seconds - w)
    return [f"  {label:24s} median {statistics.median(xs):6.2f} s   range "
            f"{min(xs):.2f}-{max(xs):.2f} s   ({len(xs)} trials)"
            for label, xs in (("wall - timed steps", beyond_steps),
                              ("wall - timed - warm-up", beyond_warmup)) if xs]


def report(path: str) -> list[str]:
    summary = json.loads(Path(path).read_text())
    search = summary.get("search", {})
    trials = [Record.from_dict(t) for t in summary.get("trials", [])]
    eff = search.get("efficiency")
    lines = [f"{path}: {search.get('trials_run')} trials, {search.get('wall_seconds', 0):.0f} s"
             " wall" + (f", efficiency {eff:.2f}" if eff is not None else "")]
    ran = [t for t in trials if t.outcome.ran]
    if any(t.outcome.phases.seconds() for t in ran):
        return lines + phase_table(ran)
    return lines + legacy(ran)


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for path in sys.argv[1:]:
        print("\n".join(report(path)))


if __name__ == "__main__":
    main()
