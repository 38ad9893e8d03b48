"""Measure a real tuning landscape: every config of a space, one real trial each, written
in the shared landscape format (meta.json with `simulated: false`, trials.csv), so the
search can be judged on real measurements and their noise.

    .venv/bin/python benchmarks/measure_landscape.py SPEC SPACE OUT_DIR [--repeat-best 5]

Trials run one at a time through the same launcher a search uses, with the node's cores.
On CPU `memory_gib` is the trial budget and `peak_memory_gib` the trial's RSS growth (the
landscape README's convention); `seconds` is each trial's wall time. With --repeat-best,
the five fastest configs run that many more times and their spread is printed: the noise
a search works against.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from autotune.bench.landscape import landscape_row, write_landscape
from autotune.device import GiB, local_device, memory_limit, node_cpus
from autotune.plan.shape import model_shape
from autotune.records import OK
from autotune.space import build_space
from autotune.spec import load_spec
from autotune.trials.launch import run_trial
from autotune.trials.protocol import make_request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("space")
    ap.add_argument("out")
    ap.add_argument("--repeat-best", type=int, default=0)
    args = ap.parse_args()
    spec = load_spec(args.spec, **{"search.space": str(Path(args.space).resolve())})
    device = local_device()
    limit = memory_limit(device, spec.hardware.budget_bytes())
    space = build_space(spec, device)
    shape = model_shape(spec)

    def run(config):
        return run_trial(make_request(spec, config, on_cpu=not device.is_cuda,
                                      shape=shape.to_dict() if shape else None,
                                      memory_budget_bytes=limit, timeout_s=300,
                                      cpu_threads=node_cpus()))

    rows, started = [], time.time()
    for i, config in enumerate(space.candidates):
        out = run(config)
        peak = (out.peak_memory_bytes or 0) / GiB
        rows.append(landscape_row(config, out))
        print(f"{i + 1}/{len(space.candidates)} {config.label():45s} {out.status:5s} "
              f"{out.samples_per_second or 0:7.1f} samples/s {peak:6.3f} GiB "
              f"{out.wall_seconds or 0:5.1f} s", flush=True)
    meta = {"description": f"measured: every config of {Path(args.space).name} for "
                           f"{Path(args.spec).name} on {device.name} ({node_cpus()} cores), "
                           "one trial each, by benchmarks/measure_landscape.py",
            "simulated": False,
            "model": {k: v for k, v in shape.to_dict().items()
                      if k in ("name", "num_parameters", "num_layers", "hidden_size",
                               "num_attention_heads", "vocab_size", "causal_lm", "seq_len")},
            "device": {"name": device.name, "kind": device.kind,
                       "memory_gib": round(limit / GiB, 4), "count": 1},
            "world_size": spec.world_size, "target_effective_batch_size": spec.target_batch_size}
    folder = write_landscape(Path(args.out), meta, rows)
    print(f"{len(rows)} configs in {time.time() - started:.0f} s -> {folder}")
    if args.repeat_best:
        ok = sorted((r for r in rows if r["status"] == OK),
                    key=lambda r: -r["samples_per_second"])[:5]
        for r in ok:
            config = next(c for c in space.candidates if c.to_dict()["precision"] ==
                          r["precision"] and all(c.to_dict()[k] == r[k] for k in (
                              "per_device_train_batch_size", "optim", "zero_stage", "offload")
                                                 ) and str(c.gradient_checkpointing).lower()
                          == r["gradient_checkpointing"])
            figures = [run(config).samples_per_second or 0.0
                       for _ in range(args.repeat_best)]
            print(f"repeat {config.label():40s} first {r['samples_per_second']:6.1f}, then "
                  f"median {statistics.median(figures):6.1f} [{min(figures):.1f}-"
                  f"{max(figures):.1f}] over {len(figures)}")


if __name__ == "__main__":
    main()
