"""summary.json: what a search found, in one schema that the search writes and the
study keeps, and the report, the CLI, the API and the tests read back."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError
from autotune.records import Record

SUMMARY_FILE = "summary.json"


def autotune_version() -> str:
    try:
        return version("autotune")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@dataclass
class Summary:
    """Everything a report needs, with no access to the search that made it."""

    model: dict[str, Any]  # the ModelShape's figures, or just a name for a factory model
    device: dict[str, Any]  # name, kind, memory_bytes, compute_capability, count
    memory_limit_bytes: int
    target_batch_size: int
    world_size: int = 1
    seq_len: int | None = None
    trials: list[Record] = field(default_factory=list)
    pruned_by_rules: dict[str, str] = field(default_factory=dict)
    search: dict[str, Any] = field(default_factory=dict)  # wall time, study, storage, sampler
    exports: dict[str, str | None] = field(default_factory=dict)
    projection: dict[str, Any] = field(default_factory=dict)  # the spec's run section
    memory_components: dict[str, int] | None = None  # the winner's, calibrated
    autotune_version: str = field(default_factory=autotune_version)

    # --- derived: never stored apart from the trials they come from --------------------
    @property
    def ran(self) -> list[Record]:
        return [t for t in self.trials if t.outcome.ran]

    @property
    def best(self) -> Record | None:
        ok = [t for t in self.trials if t.outcome.ok]
        return max(ok, key=lambda t: t.outcome.samples_per_second or 0.0) if ok else None

    @property
    def baseline(self) -> Record | None:
        """Trainer defaults with auto_find_batch_size: the largest baseline batch that ran."""
        ok = [t for t in self.trials if t.reason == "baseline" and t.outcome.ok]
        return max(ok, key=lambda t: t.config.per_device_train_batch_size) if ok else None

    @property
    def speedup(self) -> float | None:
        best, base = self.best, self.baseline
        if best is None or base is None or not base.outcome.samples_per_second:
            return None
        return (best.outcome.samples_per_second or 0.0) / base.outcome.samples_per_second

    @property
    def ooms(self) -> int:
        return sum(1 for t in self.trials if t.outcome.is_oom)

    # --- the file ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        best, base = self.best, self.baseline
        return {
            "autotune_version": self.autotune_version,
            "model": self.model, "device": self.device,
            "memory_limit_bytes": self.memory_limit_bytes,
            "target_batch_size": self.target_batch_size, "world_size": self.world_size,
            "seq_len": self.seq_len,
            # Repeated from `trials` for people reading the file; ignored when read back.
            "best": best.to_dict() if best else None,
            "baseline": base.to_dict() if base else None,
            "speedup": self.speedup,
            "memory_components": self.memory_components,
            "trials": [t.to_dict() for t in self.trials],
            "pruned_by_rules": self.pruned_by_rules,
            "search": self.search | {"trials_run": len(self.ran), "ooms": self.ooms},
            "exports": self.exports, "projection": self.projection,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        try:
            return cls(
                model=dict(d.get("model") or {}), device=dict(d.get("device") or {}),
                memory_limit_bytes=int(d.get("memory_limit_bytes") or 0),
                target_batch_size=int(d.get("target_batch_size") or 0),
                world_size=int(d.get("world_size") or 1), seq_len=d.get("seq_len"),
                trials=[Record.from_dict(t) for t in d.get("trials") or []],
                pruned_by_rules=dict(d.get("pruned_by_rules") or {}),
                search=dict(d.get("search") or {}), exports=dict(d.get("exports") or {}),
                projection=dict(d.get("projection") or {}),
                memory_components=d.get("memory_components"),
                autotune_version=str(d.get("autotune_version", "unknown")))
        except (KeyError, TypeError, ValueError) as exc:
            raise AutotuneError(f"not an autotune summary: {exc!r}") from None

    def write(self, folder: Path) -> Path:
        path = folder / SUMMARY_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2, default=str) + "\n")
        return path


def load_summary(output_dir: str | Path) -> Summary:
    """The summary.json a search wrote into `output_dir`."""
    path = Path(output_dir) / SUMMARY_FILE
    if not path.is_file():
        raise AutotuneError(f"{path} not found: is {output_dir} the output folder of an "
                            "`autotune search` (the spec's `output:`)?")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise AutotuneError(f"{path} is not valid JSON ({exc}); rerun the search or "
                            "restore the file") from exc
    if not isinstance(raw, dict) or not isinstance(raw.get("trials", []), list):
        raise AutotuneError(f"{path} is not an autotune summary (no 'trials' list)")
    return Summary.from_dict(raw)
