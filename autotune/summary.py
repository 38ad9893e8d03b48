"""summary.json: what a search found, in one schema that the search writes and the
study keeps, and the report, the CLI, the API and the tests read back."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from autotune.config import TrialConfig
from autotune.device import DeviceSpec
from autotune.errors import AutotuneError
from autotune.files import write_atomically
from autotune.records import FAILED, PHASES, PRUNED, TOKENS_PER_SECOND, Record

SUMMARY_FILE = "summary.json"
# Written into the file's `search` for people reading it, derived from the trials: not
# read back (the figures would go stale beside the trials they come from).
DERIVED_SEARCH_KEYS = ("trials_run", "ooms", "efficiency")


def autotune_version() -> str:
    try:
        return version("autotune")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


@dataclass
class ConfirmedConfig:
    """One contender's confirmation: its role, the search trial it came from, and the
    samples/s of each repeat (the trials' numbers alongside)."""

    role: str  # best, runner-up or baseline (what the search's single measurement said)
    config: TrialConfig
    searched_number: int | None
    samples_per_second: list[float]
    numbers: list[int | None] = field(default_factory=list)

    @property
    def median(self) -> float | None:
        return statistics.median(self.samples_per_second) if self.samples_per_second else None

    @property
    def spread(self) -> float | None:
        """(max - min) / median of the repeats."""
        m, xs = self.median, self.samples_per_second
        return (max(xs) - min(xs)) / m if m and len(xs) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "config": self.config.to_dict(),
                "label": self.config.label(), "searched_number": self.searched_number,
                "samples_per_second": self.samples_per_second, "numbers": self.numbers,
                "median": self.median, "spread": self.spread}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConfirmedConfig:
        return cls(d["role"], TrialConfig.from_dict(d["config"]), d.get("searched_number"),
                   list(d.get("samples_per_second") or []), list(d.get("numbers") or []))


BASELINE = "baseline"  # the reason of the baseline probe's trials
RECIPE = "recipe"  # the reason of the recipe probe's trials


def at_target(records: list[Record], per_rank: int | None) -> list[Record]:
    """The records whose config trains the target effective batch, the only ones that may
    win: the baseline's auto_find_batch_size chain keeps its accumulation as its batch
    shrinks. Where the target is not known (an old summary), every record but the
    baseline's."""
    if per_rank is None:
        return [r for r in records if r.reason != BASELINE]
    return [r for r in records if r.config.samples_per_rank == per_rank]


@dataclass
class Confirmation:
    """The contenders measured again after the search; the winner is chosen here."""

    repeats: int
    steps: int
    rows: list[ConfirmedConfig]
    winner: TrialConfig | None  # None: no contender at the target confirmed
    speedup: float | None = None  # median(winner) / median(baseline)
    speedup_low: float | None = None  # bootstrap interval (5th-95th percentile)
    speedup_high: float | None = None
    # median(winner) / median(the guide's recipe): {"speedup", "low", "high"}; None where
    # the recipe did not run or no run of it measured
    vs_recipe: dict[str, float | None] | None = None

    def row(self, config: TrialConfig) -> ConfirmedConfig | None:
        return next((r for r in self.rows if r.config == config), None)

    @property
    def baseline_won(self) -> bool:
        """The baseline trained the target and confirmed fastest: the speedup is 1."""
        return self.winner_role == BASELINE

    @property
    def recipe_won(self) -> bool:
        """The guide's recipe confirmed fastest: the tuner found nothing faster."""
        return self.winner_role == RECIPE

    @property
    def winner_role(self) -> str | None:
        row = self.row(self.winner) if self.winner else None
        return row.role if row is not None else None

    def to_dict(self) -> dict[str, Any]:
        return {"repeats": self.repeats, "steps": self.steps,
                "configs": [r.to_dict() for r in self.rows],
                "winner": self.winner.to_dict() if self.winner else None,
                "speedup": self.speedup,
                "speedup_low": self.speedup_low, "speedup_high": self.speedup_high,
                "vs_recipe": self.vs_recipe}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Confirmation:
        return cls(int(d["repeats"]), int(d["steps"]),
                   [ConfirmedConfig.from_dict(r) for r in d.get("configs") or []],
                   TrialConfig.from_dict(d["winner"]) if d.get("winner") else None,
                   d.get("speedup"),
                   d.get("speedup_low"), d.get("speedup_high"), d.get("vs_recipe"))


@dataclass
class Summary:
    """Everything a report needs, with no access to the search that made it."""

    model: dict[str, Any]  # the ModelShape's figures, or just a name for a factory model
    device: DeviceSpec | None  # where the trials ran, whole; None: not known
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
    confirmation: Confirmation | None = None
    autotune_version: str = field(default_factory=autotune_version)
    # Answered from the results store (autotune/store): {from, output, reconfirmed, checks,
    # ...}; with reconfirmed false, the record this search replaced and why.
    remembered: dict[str, Any] | None = None
    seeded_by: list[dict[str, Any]] = field(default_factory=list)  # near matches run first

    # --- derived: never stored apart from the trials they come from --------------------
    @property
    def ran(self) -> list[Record]:
        return [t for t in self.trials if t.outcome.ran]

    @property
    def searched(self) -> list[Record]:
        """The search's trials, without the confirmation's repeats."""
        return [t for t in self.trials if not t.confirming]

    @property
    def best(self) -> Record | None:
        """The winner: chosen by confirmation when it ran, else the fastest single trial
        at the target effective batch."""
        ok = at_target([t for t in self.searched if t.outcome.ok], self.per_rank_target)
        if self.confirmation is not None:
            return next((t for t in ok if t.config == self.confirmation.winner), None)
        return max(ok, key=lambda t: t.score or 0.0) if ok else None

    @property
    def per_rank_target(self) -> int | None:
        """The target effective batch per rank; None where a summary does not say."""
        return self.target_batch_size // max(1, self.world_size) or None

    @property
    def no_winner_why(self) -> str | None:
        """Why there is no winner; None where there is one, or where nothing succeeded and
        running out of memory, not failures, is most of why (the trials say so)."""
        ok = [t for t in self.searched if t.outcome.ok]
        if self.best is not None:
            return None
        if not ok:
            failed = sum(t.outcome.status in FAILED for t in self.searched)
            ooms = sum(t.outcome.is_oom for t in self.searched)
            if not failed or failed < ooms:
                return None
            return (f"no trial succeeded and {failed} failed (their errors are in the "
                    "trials); fix what they share, then run the same command to resume "
                    "(with more --trials where search.n_trials is spent; into another "
                    "--output where the fix changes the spec or its libraries)")
        if all(t.reason == BASELINE for t in self.searched if t.outcome.ran):
            return ("no config at the target effective batch ran: the trials went to the "
                    "baseline's auto_find_batch_size probes (raise search.n_trials / --trials)")
        if self.confirmation is not None and at_target(ok, self.per_rank_target):
            return ("the contenders' longer confirmation runs all failed (see them in the "
                    "table): none is claimed")
        return ("no config at the target effective batch succeeded (see the errors in the "
                "table); only the baseline's probes, whose effective batch shrank, ran")

    def throughput(self, record: Record | None) -> float | None:
        """A config's objective (samples/s, or real tokens/s on real data, over the long run
        where compile is paid once): its confirmed median where confirmed, else its
        trial's."""
        if record is None:
            return None
        row = self.confirmation.row(record.config) if self.confirmation else None
        if row is not None and row.median:
            return row.median
        return record.score

    def samples_per_second(self, record: Record | None) -> float | None:
        """`throughput` in samples/s where the objective is real tokens/s (its trial's
        ratio of samples to tokens carries the confirmed figure over)."""
        value = self.throughput(record)
        if value is None or not self.objective_is_tokens(record):
            return value
        o = record.outcome  # type: ignore[union-attr]
        if not o.tokens_per_second or not o.samples_per_second:
            return None
        return value * o.samples_per_second / o.tokens_per_second

    def objective_is_tokens(self, record: Record | None) -> bool:
        return record is not None and record.objective == TOKENS_PER_SECOND

    @property
    def baseline(self) -> Record | None:
        """Trainer defaults with auto_find_batch_size: the largest baseline batch that ran,
        or, where a longer confirmation run of it ran out of memory, the batch the
        confirmation moved it down to."""
        return self._reference(BASELINE)

    @property
    def recipe(self) -> Record | None:
        """The guide's recipe at the largest batch that ran (or that its confirmation
        moved it down to)."""
        return self._reference(RECIPE)

    def _reference(self, role: str) -> Record | None:
        row = next((r for r in self.confirmation.rows if r.role == role),
                   None) if self.confirmation else None
        if row is not None and row.searched_number is None:
            runs = [t for t in self.trials if t.config == row.config and t.outcome.ok]
            if runs:
                return runs[0]
        ok = [t for t in self.searched if t.reason == role and t.outcome.ok]
        return max(ok, key=lambda t: t.config.per_device_train_batch_size) if ok else None

    @property
    def defaults_do_not_fit(self) -> bool:
        """Trainer's defaults ran and every run was out of memory, or their model states
        alone exceed the limit (pruned without a run): there is no baseline on this device,
        and the speedups are stated against the recipe alone."""
        tried = [t for t in self.searched if t.reason == BASELINE]
        return bool(tried) and all(t.outcome.is_oom or t.outcome.status == PRUNED
                                   for t in tried)

    @property
    def vs_recipe(self) -> float | None:
        """The winner over the guide's recipe: confirmed, else single trials."""
        c = self.confirmation
        if c is not None and c.vs_recipe is not None and c.vs_recipe.get("speedup"):
            return c.vs_recipe["speedup"]
        best, rec = self.best, self.recipe
        if best is None or rec is None or not rec.score:
            return None
        return (best.score or 0.0) / rec.score

    @property
    def speedup(self) -> float | None:
        if self.confirmation is not None and self.confirmation.speedup is not None:
            return self.confirmation.speedup
        best, base = self.best, self.baseline
        if best is None or base is None or not base.score:
            return None
        return (best.score or 0.0) / base.score

    @property
    def ooms(self) -> int:
        return sum(1 for t in self.trials if t.outcome.is_oom)

    @property
    def efficiency(self) -> float | None:
        """Timed-step seconds over the search's wall seconds times the trials it could run
        at once: the share of what the search cost that measured speed (the rest is
        launching, building, engines, warm-up, the driver, pruned and failed trials)."""
        wall, slots = self.search.get("wall_seconds"), self.search.get("slots") or 1
        timed = [p.steps or 0.0 for t in self.trials if (p := t.outcome.phases).seconds()]
        if not wall or not timed:  # a summary from before trials said where time went
            return None
        return sum(timed) / (wall * slots)

    def phase_medians(self) -> dict[str, float]:
        """Per phase (PHASES), the median seconds over the trials that reached it."""
        out = {}
        for name in PHASES:
            seen = [s for t in self.trials
                    if (s := getattr(t.outcome.phases, name)) is not None]
            if seen:
                out[name] = statistics.median(seen)
        return out

    # --- the file ----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        best, base = self.best, self.baseline
        return {
            "autotune_version": self.autotune_version,
            "model": self.model, "device": self.device.to_dict() if self.device else None,
            "memory_limit_bytes": self.memory_limit_bytes,
            "target_batch_size": self.target_batch_size, "world_size": self.world_size,
            "seq_len": self.seq_len,
            # Repeated from `trials` for people reading the file; ignored when read back.
            "best": best.to_dict() if best else None,
            "baseline": base.to_dict() if base else None,
            "recipe": self.recipe.to_dict() if self.recipe else None,
            "speedup": self.speedup, "vs_recipe": self.vs_recipe,
            "defaults_do_not_fit": self.defaults_do_not_fit,
            "memory_components": self.memory_components,
            "confirmation": self.confirmation.to_dict() if self.confirmation else None,
            "trials": [t.to_dict() for t in self.trials],
            "pruned_by_rules": self.pruned_by_rules,
            "search": self.search | {  # DERIVED_SEARCH_KEYS
                "trials_run": sum(t.counted for t in self.trials), "ooms": self.ooms,
                "efficiency": self.efficiency},
            "exports": self.exports, "projection": self.projection,
            "remembered": self.remembered, "seeded_by": self.seeded_by,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Summary:
        try:
            return cls(
                model=dict(d.get("model") or {}),
                device=DeviceSpec.from_dict(d["device"]) if d.get("device") else None,
                memory_limit_bytes=int(d.get("memory_limit_bytes") or 0),
                target_batch_size=int(d.get("target_batch_size") or 0),
                world_size=int(d.get("world_size") or 1), seq_len=d.get("seq_len"),
                trials=[Record.from_dict(t) for t in d.get("trials") or []],
                pruned_by_rules=dict(d.get("pruned_by_rules") or {}),
                search={k: v for k, v in (d.get("search") or {}).items()
                        if k not in DERIVED_SEARCH_KEYS},
                exports=dict(d.get("exports") or {}),
                projection=dict(d.get("projection") or {}),
                memory_components=d.get("memory_components"),
                confirmation=Confirmation.from_dict(d["confirmation"])
                if d.get("confirmation") else None,
                autotune_version=str(d.get("autotune_version", "unknown")),
                remembered=d.get("remembered"), seeded_by=list(d.get("seeded_by") or []))
        except (KeyError, TypeError, ValueError) as exc:
            raise AutotuneError(f"not an autotune summary: {exc!r}") from None

    def write(self, folder: Path) -> Path:
        path = folder / SUMMARY_FILE
        return write_atomically(path, json.dumps(self.to_dict(), indent=2, default=str) + "\n")


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
