"""A config measured as a search measures it (a Ray task launching the trial process) and
alone (the trial runner called directly, no Ray), interleaved, several times each.

Before trials got the node's cores, the tiny example's b16x2 fp32 measured 29.4 samples/s
inside a search and 64.6 alone (Ray's one-CPU default capped torch at one thread). The two
should now agree within noise.

    .venv/bin/python benchmarks/inside_vs_alone.py [--repeats 5] [SPEC] [--batch 16]
"""

from __future__ import annotations

import argparse
import statistics

from autotune.config import Family
from autotune.device import local_device, memory_limit, node_cpus
from autotune.spec import load_spec
from autotune.trials.executor import RayExecutor
from autotune.trials.launch import run_trial
from autotune.trials.protocol import make_request


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="examples/tiny-gpt2.yaml")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    spec = load_spec(args.spec)
    device = local_device()
    config = Family.baseline().config(args.batch, spec.target_batch_size, spec.world_size)
    limit = memory_limit(device, spec.hardware.budget_bytes())
    ray = RayExecutor(spec, timeout_s=300)
    ray.discover()
    ray.budget = limit
    inside, alone, threads = [], [], set()
    try:
        for i in range(args.repeats):
            a = ray.run(config)
            b = run_trial(make_request(spec, config, on_cpu=not device.is_cuda, shape=None,
                                       memory_budget_bytes=limit, timeout_s=300,
                                       cpu_threads=node_cpus()))
            for out, into in ((a, inside), (b, alone)):
                if not out.ok:
                    raise SystemExit(f"{config.label()}: {out.status}: {out.error}")
                into.append(out.samples_per_second)
                threads.add(out.measured.cpu_threads)
            print(f"repeat {i + 1}: inside {a.samples_per_second:6.1f}  alone "
                  f"{b.samples_per_second:6.1f} samples/s", flush=True)
    finally:
        ray.close()
    mi, ma = statistics.median(inside), statistics.median(alone)
    print(f"{config.label()} on {device.name} ({node_cpus()} cores; trials saw "
          f"{sorted(threads)} torch threads): inside a search median {mi:.1f} "
          f"[{min(inside):.1f}-{max(inside):.1f}], alone {ma:.1f} [{min(alone):.1f}-"
          f"{max(alone):.1f}] samples/s; inside/alone {mi / ma:.3f}")


if __name__ == "__main__":
    main()
