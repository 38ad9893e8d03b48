"""Tuning landscapes: one search space measured exhaustively (see shared/landscapes/README.md)."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

from autotune.config import Outcome, TrialConfig
from autotune.device import DeviceSpec, GiB, named_device
from autotune.shape import ModelShape

LANDSCAPE_STATUSES = ("ok", "oom", "nan", "error")


@dataclass
class Landscape:
    name: str
    meta: dict
    shape: ModelShape
    device: DeviceSpec
    world_size: int
    target_batch_size: int
    table: dict[TrialConfig, Outcome]  # Outcome.wall_seconds is the trial's cost

    def best(self) -> tuple[TrialConfig, Outcome] | None:
        ok = [(c, o) for c, o in self.table.items() if o.ok]
        return max(ok, key=lambda co: co[1].samples_per_second or 0.0) if ok else None

    def grid_seconds(self) -> float:
        return sum(o.wall_seconds or 0.0 for o in self.table.values())


def load_landscape(path: str | Path) -> Landscape:
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    dev = meta["device"]
    try:
        device = named_device(dev["name"], int(dev.get("count", 1)))
        device = DeviceSpec(device.name, device.kind, int(float(dev["memory_gib"]) * GiB),
                            device.compute_capability, device.count, device.peak_flops)
    except ValueError:  # a device we have no table entry for: memory from meta only
        device = DeviceSpec(dev["name"], "cuda", int(float(dev["memory_gib"]) * GiB),
                            None, int(dev.get("count", 1)))
    table: dict[TrialConfig, Outcome] = {}
    with (path / "trials.csv").open() as f:
        for row in csv.DictReader(f):
            cfg = TrialConfig.from_dict(row)
            status = row["status"]
            sps = float(row["samples_per_second"] or 0.0)
            table[cfg] = Outcome(
                status=status,
                samples_per_second=sps if status == "ok" else None,
                tokens_per_second=(sps * int(meta["model"]["seq_len"]) if status == "ok"
                                   else None),
                peak_memory_bytes=int(float(row["peak_memory_gib"] or 0.0) * GiB),
                wall_seconds=float(row["seconds"]),
            )
    return Landscape(path.name, meta, ModelShape.from_landscape_meta(meta), device,
                     int(meta.get("world_size", 1)), int(meta["target_effective_batch_size"]),
                     table)
