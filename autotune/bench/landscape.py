"""Tuning landscapes: one search space measured exhaustively (see shared/landscapes/README.md).

Columns are read through the knob table: a knob a landscape has no column for takes its
baseline value, and columns that are no knob (a future addition) are ignored. Written
here too (`landscape_row`, `write_landscape`), for the benchmarks that measure one.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from autotune.config import Family, TrialConfig
from autotune.device import DeviceSpec, GiB, named_device
from autotune.errors import AutotuneError, SpecError
from autotune.knobs import knob
from autotune.plan.shape import ModelShape
from autotune.records import OK, Outcome

# What a knob's baseline value ran as where a landscape names it otherwise.
DEFAULT_AS = {"attn_implementation": "sdpa"}
# trials.csv's columns, as the shared landscapes have them.
FIELDS = ("per_device_train_batch_size", "gradient_accumulation_steps", "precision", "optim",
          "gradient_checkpointing", "zero_stage", "offload", "status", "samples_per_second",
          "peak_memory_gib", "seconds")


@dataclass
class Landscape:
    name: str
    meta: dict
    shape: ModelShape
    device: DeviceSpec
    world_size: int
    target_batch_size: int
    table: dict[TrialConfig, Outcome]  # Outcome.wall_seconds is the trial's cost
    candidates: dict[str, list[TrialConfig]] = field(default_factory=dict)  # bench's cache

    @cached_property
    def baseline_family(self) -> Family:
        """Trainer's defaults as the table names them: a landscape that measured the
        attention kernel names the model's default ("auto": transformers takes SDPA for
        the models these are) by its kernel."""
        values = {}
        for name, named in DEFAULT_AS.items():
            if not any(getattr(c, name) == knob(name).baseline for c in self.table):
                values[name] = named
        return Family.of(values)

    def best(self) -> tuple[TrialConfig, Outcome] | None:
        ok = [(c, o) for c, o in self.table.items() if o.ok]
        return max(ok, key=lambda co: co[1].samples_per_second or 0.0) if ok else None

    @cached_property
    def fresh_noise(self) -> float:
        """The log-normal sd of a measurement's noise to draw afresh at each replayed
        measurement: a table of noise-free rates (`"noise_free": true` in its meta) that
        says its devices' noise (`"noise_sd"`). A table of one draw per config (what a
        measured landscape is) returns the same draw each time, so re-measuring a config
        tells a search nothing and its luckiest draw is the table's best; 0 there."""
        if not self.meta.get("noise_free"):
            return 0.0
        sd = self.meta.get("noise_sd")
        if not isinstance(sd, int | float) or not 0.0 <= sd < 1.0:
            raise AutotuneError(f"landscape {self.name}: meta.json says noise_free, and its "
                                f"noise_sd {sd!r} is not a log-normal sd in [0, 1)")
        return float(sd)

    @property
    def per_rank(self) -> int:
        """The target effective batch one rank trains per optimizer step."""
        return self.target_batch_size // self.world_size

    def grid_seconds(self) -> float:
        return sum(o.wall_seconds or 0.0 for o in self.table.values())


def _device(dev: dict) -> DeviceSpec:
    """The landscape's device: a CPU one replays with CPU memory rules (its memory_gib is
    the budget the trials ran under), a GPU from the device table where we know it."""
    memory = int(float(dev["memory_gib"]) * GiB)
    count = int(dev.get("count", 1))
    if dev.get("kind", "cuda") == "cpu":
        return DeviceSpec(str(dev.get("name", "cpu")), "cpu", memory, None, count)
    nodes = int(dev.get("nodes", 1))  # the nodes one trial's ranks span
    try:
        known = named_device(dev["name"], count)
    except SpecError:  # a GPU we have no table entry for: memory from meta only
        return DeviceSpec(dev["name"], "cuda", memory, None, count, nodes=nodes)
    return DeviceSpec(known.name, "cuda", memory, known.compute_capability, count,
                      known.peak_flops, nodes=nodes)


def load_landscape(path: str | Path) -> Landscape:
    path = Path(path)
    if not (path / "meta.json").is_file() or not (path / "trials.csv").is_file():
        raise AutotuneError(f"--landscape {path}: not a landscape folder (it needs "
                            "meta.json and trials.csv)")
    meta = json.loads((path / "meta.json").read_text())
    seq_len = int(meta["model"]["seq_len"])
    table: dict[TrialConfig, Outcome] = {}
    with (path / "trials.csv").open() as f:
        for row in csv.DictReader(f):
            status = row["status"]
            sps = float(row["samples_per_second"] or 0.0) if status == OK else None
            table[TrialConfig.from_dict(row)] = Outcome(
                status=status, samples_per_second=sps,
                tokens_per_second=sps * seq_len if sps is not None else None,
                peak_memory_bytes=int(float(row["peak_memory_gib"] or 0.0) * GiB),
                wall_seconds=float(row["seconds"]))
    land = Landscape(path.name, meta, ModelShape.from_landscape_meta(meta),
                     _device(meta["device"]), int(meta.get("world_size", 1)),
                     int(meta["target_effective_batch_size"]), table)
    _ = land.fresh_noise  # a bad noise_sd is said now, not mid-replay
    return land


def landscape_row(config: TrialConfig, outcome: Outcome,
                  samples_per_second: float | None = None) -> dict:
    """One trials.csv row: `config` measured as `outcome`, with `samples_per_second` in
    place of the outcome's where given (the median of its repeats, say). Only a trial
    that ran to the end has a throughput; the loader reads no other's."""
    sps = outcome.samples_per_second if samples_per_second is None else samples_per_second
    row = {k: v for k, v in config.to_dict().items() if k in FIELDS}
    return row | {"gradient_checkpointing": str(config.gradient_checkpointing).lower(),
                  "status": outcome.status,
                  "samples_per_second": round(sps or 0.0, 4) if outcome.status == OK else 0.0,
                  "peak_memory_gib": round((outcome.peak_memory_bytes or 0) / GiB, 4),
                  "seconds": round(outcome.repeat_seconds, 2)}  # a replay's cost


def write_landscape(folder: Path, meta: dict, rows: list[dict]) -> Path:
    """`folder`/meta.json and trials.csv in the shared format."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "trials.csv").open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(rows)
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return folder
