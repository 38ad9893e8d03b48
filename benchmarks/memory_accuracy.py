"""Memory model vs measured peak memory of real CPU trials (HF Trainer, DeepSpeed, bnb).

For each model shape, runs every config as a real trial, then predicts each one with
the model calibrated on the others (leave-one-out) and prints the relative errors.

    .venv/bin/python benchmarks/memory_accuracy.py [--quick]
    .venv/bin/python benchmarks/memory_accuracy.py --from benchmarks/memory_accuracy.txt
        (re-predict the recorded measurements with the current model; runs no trial)
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from autotune.config import TrialConfig
from autotune.device import local_device
from autotune.memory import CPU_RUNTIME_BYTES, MemoryModel, leave_one_out_errors
from autotune.search import model_shape
from autotune.spec import load_spec
from autotune.trial import run_trial

SHAPES = {  # name: (n_layer, n_embd, n_head, seq_len)
    "gpt2-2x128-s64": (2, 128, 4, 64),
    "gpt2-2x128-s128": (2, 128, 4, 128),
    "gpt2-4x256-s128": (4, 256, 4, 128),
    "gpt2-4x256-s256": (4, 256, 4, 256),
}
TARGET = 16


def configs(quick: bool) -> list[TrialConfig]:
    def c(b, p="fp32", o="adamw_torch", ck=False, z=0):
        return TrialConfig(b, TARGET // b, p, o, ck, z, "none")
    picked = [c(4), c(8), c(16), c(16, ck=True), c(8, o="adamw_bnb_8bit"), c(8, z=2)]
    if not quick:
        picked += [c(8, z=1), c(8, z=3), c(8, "bf16"), c(16, o="adamw_bnb_8bit", ck=True)]
    return picked


def spec_for(layers: int, embd: int, heads: int, seq: int) -> dict:
    return {"model": {"config": {"model_type": "gpt2", "n_layer": layers, "n_embd": embd,
                                 "n_head": heads, "vocab_size": 8192, "n_positions": seq}},
            "data": {"seq_len": seq}, "target_batch_size": TARGET,
            "measure": {"warmup_steps": 1, "steps": 2}, "output": "/tmp/autotune-memacc"}


def measure(name: str, quick: bool) -> tuple[list[float], list[tuple]]:
    spec = load_spec(spec_for(*SHAPES[name]))
    shape, device = model_shape(spec), local_device()
    measured, rows = [], []
    for cfg in configs(quick):
        started = time.time()
        out = run_trial(spec.model_dump(), cfg, shape=shape.to_dict(), timeout_s=300)
        if not out.ok or not out.peak_memory_bytes:
            print(f"  {cfg.label():40s} {out.status}: {(out.error or '')[-200:]}")
            continue
        measured.append((cfg, out.peak_memory_bytes))
        physics = MemoryModel(shape, device).predict_total(cfg)
        rows.append((cfg, out.peak_memory_bytes, physics, time.time() - started))
    errors = leave_one_out_errors(shape, device, 1, measured)
    for (cfg, actual, physics, secs), err in zip(rows, errors, strict=True):
        print(f"  {cfg.label():40s} measured {actual / 2**20:7.1f} MiB  physics "
              f"{physics / 2**20:7.1f}  calibrated error {err:6.1%}  ({secs:.0f} s)")
    return errors, rows


def replay(path: str) -> None:
    """Leave-one-out errors of the current model on measurements recorded earlier."""
    import re

    by_shape: dict[str, list[tuple[TrialConfig, int]]] = {}
    shape_name = None
    for line in Path(path).read_text().splitlines():
        if line.strip() in SHAPES:
            shape_name = line.strip()
            continue
        m = re.match(r"\s+(b\d+x\d+ .*?)\s+measured\s+([\d.]+) MiB", line)
        if m and shape_name:
            cfg = next(c for c in configs(False) if c.label() == m.group(1).strip())
            by_shape.setdefault(shape_name, []).append((cfg, int(float(m.group(2)) * 2**20)))
    all_errors, ratios = [], []
    device = local_device()
    for name, measured in by_shape.items():
        shape = model_shape(load_spec(spec_for(*SHAPES[name])))
        errors = leave_one_out_errors(shape, device, 1, measured)
        all_errors += errors
        for cfg, actual in measured:  # RSS growth beyond the fixed runtime, per tensor byte
            phys = MemoryModel(shape, device).physics(cfg)
            tensors = phys.total_bytes - phys.components["runtime"]
            ratios.append((actual - CPU_RUNTIME_BYTES) / tensors)
        print(f"{name}: median calibrated error {statistics.median(errors):.1%}")
    print(f"overall: {len(all_errors)} recorded trials, median calibrated (leave-one-out) "
          f"relative error {statistics.median(all_errors):.1%}, max {max(all_errors):.1%}")
    print(f"RSS growth / tensor bytes: median {statistics.median(ratios):.2f}x, "
          f"range {min(ratios):.2f}-{max(ratios):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="two shapes, six configs each")
    ap.add_argument("--from", dest="recorded", help="re-predict a recorded output, run nothing")
    args = ap.parse_args()
    if args.recorded:
        replay(args.recorded)
        return
    names = list(SHAPES)[:2] if args.quick else list(SHAPES)
    all_errors = []
    for name in names:
        print(name)
        errors, _ = measure(name, args.quick)
        all_errors += errors
        print(f"  median calibrated error {statistics.median(errors):.1%}")
    print(f"overall: {len(all_errors)} trials, median calibrated (leave-one-out) relative "
          f"error {statistics.median(all_errors):.1%}, max {max(all_errors):.1%}")


if __name__ == "__main__":
    main()
