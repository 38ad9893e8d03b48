"""What a rank of a long-context trial holds, beside what the physics says it holds.

For each config family of the held-out long-context spec (benchmarks/longest_bisection.py's
five) at one length: a real trial on 2 CPU ranks, cold, with a probe in each rank
(benchmarks/rank_memory_hook/sitecustomize.py) that records what autograd saves in the
first training step (each storage once) and the rank's RSS before the forward, after it
and after the backward; beside them the trial's own peak (RSS on a CPU) and the physics'
activations and logits for the rank (plan/memory.py, uncalibrated). It shows where a CPU
rank's memory goes that the tensors do not explain: what the forward freed but malloc
kept.

    .venv/bin/python benchmarks/rank_memory.py [--seq-len 8192] [--family LABEL ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
from pathlib import Path

from longest_bisection import FAMILIES, SPEC

from autotune.config import Family, TrialConfig
from autotune.device import local_device, node_cpus
from autotune.plan.calibration import MemoryModel
from autotune.plan.estimate import estimate
from autotune.spec import load_spec
from autotune.trials.launch import run_trial
from autotune.trials.protocol import make_request

HOOK = Path(__file__).resolve().parent / "rank_memory_hook"
MiB = 2**20


def probe(spec, family: Family, n: int) -> tuple[object, list[dict]]:
    """The trial's outcome and each rank's probe row."""
    at = load_spec(spec, **{"data.seq_len": n, "measure.warmup_steps": 0,
                            "measure.steps": 1, "target_batch_size": 2})
    cfg = family.config(1, 2, at.world_size)
    with tempfile.TemporaryDirectory() as out:
        saved = {k: os.environ.get(k) for k in ("AUTOTUNE_COLD_TRIALS", "PYTHONPATH",
                                                "AUTOTUNE_RANK_MEMORY_OUT")}
        os.environ |= {"AUTOTUNE_COLD_TRIALS": "1", "AUTOTUNE_RANK_MEMORY_OUT": out,
                       "PYTHONPATH": os.pathsep.join(filter(None, [
                           str(HOOK), saved["PYTHONPATH"]]))}
        try:
            outcome = run_trial(make_request(at, cfg, on_cpu=True, shape=None,
                                             memory_budget_bytes=None, timeout_s=900,
                                             cpu_threads=node_cpus()))
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        rows = [json.loads(line) for path in sorted(Path(out).glob("rank-*.jsonl"))
                for line in path.read_text().splitlines() if line.strip()]
    return outcome, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--family", action="append", help="a family by its label (repeatable)")
    args = ap.parse_args()
    spec = load_spec(SPEC, **{"target_batch_size": 2})
    shape = dataclasses.replace(estimate(spec).shape, seq_len=args.seq_len)
    families = ([TrialConfig.from_label(f"b1x1 {label}").family for label in args.family]
                if args.family else [Family.of(values) for values in FAMILIES])
    model = MemoryModel(shape, local_device(), spec.world_size)
    model.traced = False
    print(f"{shape.name} at {args.seq_len} tokens, {spec.world_size} CPU ranks; MiB a rank\n")
    print("| family | rank | tokens | saved | RSS grown in the forward | by the backward's end "
          "| the trial's peak | physics: activations + logits |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |", flush=True)
    largest = []
    for family in families:
        cfg = family.config(1, 2, spec.world_size)
        parts = model.physics(cfg).components
        physics = (parts["activations"] + parts["logits"]) / MiB
        outcome, rows = probe(SPEC, family, args.seq_len)
        peaks = outcome.measured.peak_memory_by_rank or {} if outcome.ok else {}
        if not rows:
            print(f"| {family.label()} | - | - | {outcome.status}: "
                  f"{(outcome.error or '')[:120]} | | | | {physics:.0f} |", flush=True)
            continue
        for row in rows:
            peak = peaks.get(row["rank"])
            print(f"| {family.label()} | {row['rank']} | {row['tokens']} | "
                  f"{row['saved_mib']:.0f} | "
                  f"{row['rss_after_forward_mib'] - row['rss_before_mib']:.0f} | "
                  f"{row['rss_after_backward_mib'] - row['rss_before_mib']:.0f} | "
                  f"{peak / MiB if peak else float('nan'):.0f} | {physics:.0f} |", flush=True)
        largest.append((family.label(), rows[0]["largest"]))
    print("\nWhat rank 0 saved, the largest by shape (MiB):")
    for label, top in largest:
        print(f"- {label}: " + ", ".join(f"{shape} {mib:.0f}" for shape, mib in top))


if __name__ == "__main__":
    main()
