"""A point of the search space: a family of knob values, and the batch split.

A family is every knob but the batch: configs of one family differ only along the batch
axis, which is where memory grows and the OOM frontier lies. Both are values built from
the knob table, so a new row of the table is a new attribute here with no other change.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from autotune import knobs
from autotune.errors import SpecError


def accumulation(target: int, batch: int, world_size: int = 1) -> int:
    """Gradient accumulation that keeps the effective batch at `target`: derived, never
    searched. The one place the split is computed."""
    per_step = batch * world_size
    if batch < 1 or target % per_step:
        raise SpecError(f"per_device_train_batch_size {batch} x world {world_size} does not "
                        f"divide target_batch_size {target}")
    return target // per_step


def auto_find_batches(start: int) -> list[int]:
    """The batches Trainer's auto_find_batch_size tries from `start`, largest first:
    accelerate's find_executable_batch_size multiplies the batch by 0.9 (rounding down)
    after each OOM. Gradient accumulation stays as it was, so the effective batch shrinks
    with it."""
    out, b = [], start
    while b >= 1:
        out.append(b)
        b = int(b * 0.9)
    return out


def halving_batches(per_rank: int) -> list[int]:
    """per_rank, per_rank/2, ... while it divides: the batches of a landscape's table (which
    holds only divisors of the target) that stand in for auto_find_batch_size in replays."""
    out, b = [], per_rank
    while b >= 1:
        out.append(b)
        if b % 2:
            break
        b //= 2
    return out


@dataclass(frozen=True, order=True)
class Family:
    """Every knob's value, in table order; knobs not given take their baseline value."""

    items: tuple[tuple[str, Any], ...] = ()
    # Derived from `items` once: group levels are on the search's hot path (every
    # candidate is scored after every trial).
    _levels: dict[bool, list] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self.items))
        # Knob values as instance attributes (the memory model reads them millions of
        # times in a replayed search). No knob is named as a field or method of Family or
        # TrialConfig (test_knobs).
        self.__dict__.update(self.items)

    def __hash__(self) -> int:
        return self.__dict__["_hash"]

    def __reduce__(self) -> tuple:
        # Rebuilt from the values on unpickling: string hashes differ between processes.
        return (Family, (self.items,))

    @classmethod
    def of(cls, values: Mapping[str, Any] | None = None, *, strict: bool = True,
           **kw: Any) -> Family:
        """From knob values (Python or text); unknown names are errors when `strict`."""
        given = dict(values or {}) | kw
        if strict:
            unknown = sorted(set(given) - set(knobs.names()))
            if unknown:
                raise SpecError(f"unknown knob(s) {', '.join(unknown)}; known: "
                                f"{', '.join(knobs.names())}")
        return cls(tuple((k.name, k.parse(given[k.name]) if k.name in given else k.baseline)
                         for k in knobs.table()))

    @classmethod
    def baseline(cls) -> Family:
        """Trainer's defaults: what a user gets without tuning."""
        return cls.of()

    def replace(self, **changes: Any) -> Family:
        return Family.of(self.to_dict() | changes)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.items)

    def config(self, batch: int, target: int, world_size: int = 1) -> TrialConfig:
        """At `batch` per rank, the accumulation that keeps the effective batch at
        `target` over the data-parallel ranks."""
        return TrialConfig(batch, accumulation(target, batch, self.data_parallel(world_size)),
                           self)

    def data_parallel(self, world_size: int) -> int:
        """The ranks of `world_size` that each take a batch of their own: a sequence split
        (Ulysses' or context parallelism's) over k ranks gives those k one batch. Where
        the split does not divide the ranks (a rule rules it out), all of them."""
        split = self.__dict__.get("sequence_parallel", 1) * self.__dict__.get(
            "context_parallel", 1)
        return world_size // split if world_size % split == 0 else world_size

    def label(self) -> str:
        # Derived from `items` once, as `levels`: the memory model orders siblings and
        # twins by it for every candidate after every trial.
        cached = self.__dict__.get("_label")
        if cached is None:
            cached = self.__dict__["_label"] = " ".join(
                t for k in knobs.table() if (t := k.tag_of(getattr(self, k.name))))
        return cached

    def is_baseline(self) -> bool:
        return self == Family.baseline()

    def levels(self, *, blamed_only: bool = False) -> list[tuple[str, tuple]]:
        """The family's values per knob group (the table's `group`: sharding is one): the
        units that calibration and the strategy learn effects and failures for."""
        cached = self._levels.get(blamed_only)
        if cached is None:
            cached = self._levels[blamed_only] = [
                (group, tuple(self.__dict__[k.name] for k in members))
                for group, members in knobs.groups().items()
                if not blamed_only or all(k.blamed for k in members)]
        return cached


BATCH = "per_device_train_batch_size"
ACCUMULATION = "gradient_accumulation_steps"


@dataclass(frozen=True, order=True)
class TrialConfig:
    """One trial: a family at one per-device batch (accumulation derived from the target).
    Knob values read as attributes (`config.precision`)."""

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    family: Family = field(default_factory=Family.baseline)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.per_device_train_batch_size,
                                                self.gradient_accumulation_steps, self.family)))
        self.__dict__.update(self.family.items)  # read without __getattr__, as Family's

    def __hash__(self) -> int:
        return self.__dict__["_hash"]

    def __reduce__(self) -> tuple:
        return (TrialConfig, (self.per_device_train_batch_size,
                              self.gradient_accumulation_steps, self.family))

    @classmethod
    def of(cls, batch: int, accum: int, **knob_values: Any) -> TrialConfig:
        return cls(batch, accum, Family.of(knob_values))

    def __getattr__(self, name: str) -> Any:
        family = self.__dict__.get("family")
        if family is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(family, name)

    @property
    def samples_per_rank(self) -> int:
        """Samples one rank takes per optimizer step: batch × accumulation."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    def to_dict(self) -> dict[str, Any]:
        return {BATCH: self.per_device_train_batch_size,
                ACCUMULATION: self.gradient_accumulation_steps} | self.family.to_dict()

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, strict: bool = False) -> TrialConfig:
        """From a record, a landscape row or a study: knobs missing take their baseline
        value; keys that are no knob (status, figures) are ignored unless `strict`."""
        knob_values = {k: v for k, v in d.items() if k in knobs.names()}
        if strict:
            Family.of({k: v for k, v in d.items() if k not in (BATCH, ACCUMULATION)})
        return cls(int(d[BATCH]), int(d[ACCUMULATION]), Family.of(knob_values))

    def label(self) -> str:
        """Short human label, for tables and logs."""
        head = f"b{self.per_device_train_batch_size}x{self.gradient_accumulation_steps}"
        return f"{head} {self.family.label()}".rstrip()

    @classmethod
    def from_label(cls, label: str) -> TrialConfig:
        """The config `label()` names, for recorded logs that keep only the label (the
        knobs it leaves out at their baseline)."""
        head, *tags = label.split()
        m = re.fullmatch(r"b(\d+)x(\d+)", head)
        if m is None:
            raise SpecError(f"{label!r}: a config's label starts with b<batch>x<accumulation>")
        values: dict[str, Any] = {}
        for tag in tags:
            named = [(k.name, v) for k in knobs.table() for v in k.allowed()
                     if k.tag_of(v) == tag]
            if len(named) != 1:
                raise SpecError(f"{label!r}: {tag!r} names {len(named)} knob values, not one")
            values[named[0][0]] = named[0][1]
        return cls.of(int(m[1]), int(m[2]), **values)


def auto_find_chain(start: TrialConfig) -> list[TrialConfig]:
    """`start` and the configs auto_find_batch_size falls back to from it, largest first:
    its family and accumulation, the batches of `auto_find_batches`."""
    acc, fam = start.gradient_accumulation_steps, start.family
    return [TrialConfig(b, acc, fam) for b in auto_find_batches(
        start.per_device_train_batch_size)]
