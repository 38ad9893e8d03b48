"""`autotune estimate --longest` against the longest length that runs (issue 54).

For a few config families of a spec (by default the held-out long-context one on 2 CPU
ranks), the length the memory model predicts to fit a memory budget, and the longest that
does, measured: real trials (their peak per rank: RSS on a CPU) at multiples of 256,
bisected from the prediction (up by a quarter until one does not fit, then halved to
256). Prints each family's predicted and measured longest and the error; the bar is 15%.

    .venv/bin/python benchmarks/longest_bisection.py [--budget 1GiB] [--spec PATH]
        [--family "fp32 adamw_torch z1" ...]
    .venv/bin/python benchmarks/longest_bisection.py --from benchmarks/longest_bisection_cpu.txt

`--from` a recorded output runs nothing: each measured peak beside the physics' tensors
at its length (the model as it is now), per family the slope and intercept of both (what
a token costs, what does not grow), and the longest predicted now against the recorded
measured one, with the error.

A CPU trial holds glibc's mmap threshold (autotune/trials/host_malloc.py): its peak is
its tensors'. The files recorded before it did (2026-11-28/29, malloc's high-water) were
replaced; their figures are in docs/results.md.

On a GPU (`--spec examples/llama-8b-32k.yaml --budget 80GiB`) a trial that does not fit
runs out of memory; on a CPU nothing does, and a peak over the budget is what does not
fit.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import time
from pathlib import Path

from autotune.config import Family, TrialConfig
from autotune.device import local_device, node_cpus
from autotune.plan.estimate import estimate
from autotune.plan.longest import STEP
from autotune.spec import load_spec, parse_bytes
from autotune.trials.launch import run_trial
from autotune.trials.protocol import make_request

HERE = Path(__file__).parent
SPEC = HERE / "held_out" / "long-context-cpu.yaml"
FAMILIES = [  # the levers one at a time and together, beside the plain family
    {"zero_stage": 1},
    {"zero_stage": 1, "gradient_checkpointing": True},
    {"zero_stage": 3, "sequence_parallel": 2},
    {"zero_stage": 3, "tiled_mlp": True, "tiled_loss": True},
    {"zero_stage": 3, "sequence_parallel": 2, "tiled_mlp": True, "tiled_loss": True,
     "gradient_checkpointing": True},
]


def measured_peak(spec, family: Family, n: int, budget: int) -> int | None:
    """The trial's largest peak over its ranks at `n` tokens, None where it failed."""
    at = load_spec(spec, **{"data.seq_len": n, "measure.warmup_steps": 0,
                            "measure.steps": 1, "target_batch_size": 2})
    cfg = family.config(1, 2, at.world_size)
    device = local_device()
    out = run_trial(make_request(at, cfg, on_cpu=not device.is_cuda, shape=None,
                                 memory_budget_bytes=budget if device.is_cuda else None,
                                 timeout_s=600, cpu_threads=node_cpus()))
    if out.status != "ok":
        print(f"    {n}: {out.status} {out.error[:200] if out.error else ''}")
        return None
    peaks = [p for p in (out.measured.peak_memory_by_rank or {}).values() if p] or [
        out.peak_memory_bytes]
    return max(peaks)


def longest_measured(spec, family: Family, predicted: int, budget: int) -> tuple[int, int]:
    """The longest multiple of STEP that ran within `budget`, and the trials it took."""
    fits: dict[int, bool] = {}

    def ok(n: int) -> bool:
        if n not in fits:
            started = time.time()
            peak = measured_peak(spec, family, n * STEP, budget)
            fits[n] = peak is not None and peak <= budget
            print(f"    {n * STEP:>6} tokens: peak {peak / 2**30 if peak else float('nan'):.3f}"
                  f" GiB {'fits' if fits[n] else 'over'} ({time.time() - started:.0f} s)",
                  flush=True)
        return fits[n]

    n = max(1, predicted // STEP)
    if ok(n):
        lo, hi = n, None
        while hi is None:
            up = max(lo + 1, int(lo * 1.25))
            if ok(up):
                lo = up
            else:
                hi = up
    else:
        hi, lo = n, None
        while lo is None:
            down = max(1, int(hi * 0.75))
            if down == hi or ok(down):
                lo = down
            else:
                hi = down
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return lo * STEP, len(fits)


def _fit(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares slope (MiB a token) and intercept (MiB) of (tokens, MiB) points."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in points) / var
    return slope, my - slope * mx


def replay(path: Path, spec, predicted: dict, shape) -> None:
    """A recorded bisection against the physics as it is now (see the module's doc)."""
    from autotune.plan.calibration import MemoryModel

    measured: dict[str, list[tuple[int, float]]] = {}
    longest: dict[str, int] = {}  # the bisection's answer, from its table
    family = None
    for line in path.read_text().splitlines():
        if m := re.match(r"(\S.*): predicted \d+", line):
            family = m.group(1)
            measured[family] = []
        elif (m := re.match(r"\s+(\d+) tokens: peak ([\d.]+) GiB", line)) and family:
            measured[family].append((int(m.group(1)), float(m.group(2)) * 1024))
        elif m := re.match(r"\| (\S[^|]*?) \| \d+ \| (\d+) \| [+-]", line):
            longest[m.group(1)] = int(m.group(2))
    device = local_device()
    print("| family | tokens | measured MiB | tensors MiB | runtime MiB | ratio |\n"
          "| --- | --- | --- | --- | --- | --- |")
    fits = []
    for label, points in measured.items():
        fam = TrialConfig.from_label(f"b1x1 {label}").family
        cfg = fam.config(1, 2, spec.world_size)
        tensors = []
        for n, mib in sorted(points):
            model = MemoryModel(dataclasses.replace(shape, seq_len=n), device,
                                spec.world_size)
            model.traced = False
            parts = model.physics(cfg).components
            held = sum(v for k, v in parts.items() if k != "runtime") / 2**20
            runtime = model.runtime_bytes(cfg) / 2**20
            tensors.append((n, held))
            print(f"| {label} | {n} | {mib:.0f} | {held:.0f} | {runtime:.0f} | "
                  f"{(mib - runtime) / held:.2f} |")
        fits.append((label, _fit(sorted(points)), _fit(tensors)))
    print("\n| family | measured MiB/token | physics MiB/token | measured MiB at 0 | "
          "physics MiB at 0 | longest predicted now |\n| --- | --- | --- | --- | --- | --- |")
    for label, (ms, mi), (ps, pi) in fits:
        fam = TrialConfig.from_label(f"b1x1 {label}").family
        print(f"| {label} | {ms:.4f} | {ps:.4f} | {mi:.0f} | {pi:.0f} | "
              f"{predicted.get(fam, '-')} |")
    rows = [(label, predicted[fam], longest[label], None) for label in longest
            if (fam := TrialConfig.from_label(f"b1x1 {label}").family) in predicted]
    if rows:
        print_errors(rows, "predicted now")


def print_errors(rows: list[tuple[str, int, int, int | None]],
                 predicted: str = "predicted") -> None:
    """Each family's predicted and measured longest, the error and, after a run, the
    trials it took; then the worst error. (`replay` reads a run's table back.)"""
    trials = rows[0][3] is not None
    cols = ["family", predicted, "measured", "error"] + (["trials"] if trials else [])
    print("\n| " + " | ".join(cols) + " |\n|" + " --- |" * len(cols))
    for label, p, m, t in rows:
        print(f"| {label} | {p} | {m} | {(p - m) / m:+.1%} |" + (f" {t} |" if trials else ""))
    print(f"\nworst error {max(abs(p - m) / m for _, p, m, _ in rows):.1%} (bar: 15%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", type=Path, default=SPEC)
    ap.add_argument("--budget", default="1GiB", help="memory per rank")
    ap.add_argument("--family", action="append", help="a family by its label (repeatable; "
                    "default: the held-out spec's five)")
    ap.add_argument("--from", dest="recorded", type=Path,
                    help="a recorded output: split its peaks against the physics, run nothing")
    args = ap.parse_args()
    budget = parse_bytes(args.budget)
    spec = load_spec(args.spec, **{"hardware.memory_budget": args.budget,
                                   "target_batch_size": 2})
    result = estimate(spec, longest=True)
    if args.recorded:
        replay(args.recorded, spec, {r.family: r.seq_len for r in result.longest},
               result.shape)
        return
    predicted = {r.family: r.seq_len for r in result.longest}
    print(f"{result.shape.name}, {spec.world_size} ranks on {local_device().name}, budget "
          f"{args.budget} a rank; predicted by the physics (no trial calibrates it)")
    rows = []
    families = ([TrialConfig.from_label(f"b1x1 {label}").family for label in args.family]
                if args.family else [Family.of(values) for values in FAMILIES])
    for family in families:
        if family not in predicted:
            print(f"{family.label()}: not in the spec's space")
            continue
        print(f"{family.label()}: predicted {predicted[family]}", flush=True)
        measured, trials = longest_measured(spec, family, predicted[family], budget)
        rows.append((family.label(), predicted[family], measured, trials))
    print_errors(rows)


if __name__ == "__main__":
    main()
