"""A lever the memory model does not know: what its OOMs may teach, and what they may not.

`with_unmodelled` turns a landscape into one where every config holding one knob value
needs `factor` times the memory the table measured (a kernel's workspace, a compiled
graph's buffers: something no formula here holds), so that those pushed over the limit
run out of memory. `oom_isolation` then replays a search on it and sets the memory
model calibrated on all its records against the same model without its OOMs: the
configs without the lever should not move, and the lever's configs that run out of
memory should be predicted not to fit (docs/memory.md, "What an OOM teaches").
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from autotune.bench.landscape import Landscape
from autotune.config import TrialConfig
from autotune.plan.calibration import MemoryModel
from autotune.records import OOM, Outcome


def holds(config: TrialConfig, knob: str, value: Any) -> bool:
    return getattr(config, knob) == value


def with_unmodelled(land: Landscape, knob: str, value: Any, factor: float = 1.5) -> Landscape:
    """`land` with `factor` times the measured peak for every config holding `knob=value`;
    those it puts over the device's memory become OOMs (their cost unchanged: the replay's
    budget is the same)."""
    limit = land.device.memory_bytes
    table: dict[TrialConfig, Outcome] = {}
    for c, o in land.table.items():
        if o.ok and holds(c, knob, value):
            peak = int((o.peak_memory_bytes or 0) * factor)
            o = (dataclasses.replace(o, peak_memory_bytes=peak) if peak <= limit else
                 Outcome(OOM, peak_memory_bytes=limit, wall_seconds=o.wall_seconds))
        table[c] = o
    return dataclasses.replace(land, name=f"{land.name}+{knob}={value}x{factor:g}",
                               table=table, candidates={})


def oom_isolation(land: Landscape, knob: str, value: Any, seed: int = 0,
                  budget_fraction: float = 0.005) -> dict[str, Any]:
    """One search of `land` (already `with_unmodelled`): how far the OOMs of configs
    holding `knob=value` moved the predictions of configs without it (median and largest
    relative change: the model calibrated on every record against the same model without
    those OOMs), and
    the share of the configs holding it that ran out of memory in the table which the
    calibrated model puts out of memory (predicted over the limit, or at or above a batch
    of their family that ran out), and the least either model predicts of any config."""
    from autotune.bench.bench import replay

    history, _ = replay(land, "autotune", seed, budget_fraction)
    limit = land.device.memory_bytes

    def model(records) -> MemoryModel:
        return MemoryModel.from_history(land.shape, land.device, land.world_size, records,
                                        limit)

    taught = model(history)
    untaught = model([r for r in history
                      if not (r.outcome.is_oom and holds(r.config, knob, value))])
    others = [c for c, o in land.table.items() if o.status in ("ok", "oom")
              and not holds(c, knob, value)]
    moved = [abs(taught.predict_total(c) / untaught.predict_total(c) - 1.0) for c in others]
    least = min((m.predict_total(c) for m in (taught, untaught) for c in land.table),
                default=0.0)
    lever_ooms = [c for c, o in land.table.items() if o.is_oom and holds(c, knob, value)]
    flagged = [taught.predict_total(c) > limit or taught.known_oom(c) for c in lever_ooms]
    return {"landscape": land.name, "seed": seed,
            "ooms": sum(1 for r in history if r.outcome.is_oom),
            "lever_ooms_run": sum(1 for r in history
                                  if r.outcome.is_oom and holds(r.config, knob, value)),
            "others_moved_median": statistics.median(moved) if moved else 0.0,
            "others_moved_max": max(moved, default=0.0),
            "lever_ooms_flagged": sum(flagged) / len(flagged) if flagged else 1.0,
            "least_predicted": least}
