"""The vocabulary every module shares: one trial's knobs and what happened when it ran."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal

Precision = Literal["fp32", "tf32", "fp16", "bf16"]
Offload = Literal["none", "optimizer", "optimizer+param"]
Status = Literal["ok", "oom", "nan", "error", "timeout", "crashed", "pruned"]

PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16")
OFFLOADS: tuple[str, ...] = ("none", "optimizer", "optimizer+param")
STATUSES: tuple[str, ...] = ("ok", "oom", "nan", "error", "timeout", "crashed", "pruned")


# Trainer defaults: fp32, adamw_torch, no checkpointing, no DeepSpeed. With
# auto_find_batch_size this is the baseline every search is compared against.
BASELINE_FAMILY = ("fp32", "adamw_torch", False, 0, "none")


def halving_batches(per_rank: int) -> list[int]:
    """The batches auto_find_batch_size tries: per_rank, per_rank/2, ... while it divides."""
    out, b = [], per_rank
    while b >= 1:
        out.append(b)
        if b % 2:
            break
        b //= 2
    return out


@dataclass(frozen=True, order=True)
class TrialConfig:
    """One point of the search space.

    `gradient_accumulation_steps` is derived (target / (batch x world)) and stored only so
    a config is self-describing when exported or replayed.
    """

    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    precision: str = "fp32"
    optim: str = "adamw_torch"
    gradient_checkpointing: bool = False
    zero_stage: int = 0
    offload: str = "none"

    def family(self) -> tuple:
        """Everything but the batch split: configs of one family differ only in memory/speed
        along the batch axis, which is where the OOM frontier lies."""
        return (self.precision, self.optim, self.gradient_checkpointing, self.zero_stage,
                self.offload)

    def with_batch(self, batch: int, target: int, world_size: int = 1) -> TrialConfig:
        return TrialConfig(batch, target // (batch * world_size), *self.family())

    @property
    def uses_deepspeed(self) -> bool:
        return self.zero_stage > 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialConfig:
        names = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["per_device_train_batch_size"] = int(kw["per_device_train_batch_size"])
        kw["gradient_accumulation_steps"] = int(kw["gradient_accumulation_steps"])
        kw["zero_stage"] = int(kw.get("zero_stage", 0))
        gc = kw.get("gradient_checkpointing", False)
        kw["gradient_checkpointing"] = gc if isinstance(gc, bool) else str(gc).lower() == "true"
        return cls(**kw)

    def label(self) -> str:
        """Short human label, for tables and logs."""
        parts = [f"b{self.per_device_train_batch_size}x{self.gradient_accumulation_steps}",
                 self.precision, self.optim]
        if self.gradient_checkpointing:
            parts.append("ckpt")
        if self.zero_stage:
            parts.append(f"z{self.zero_stage}")
        if self.offload != "none":
            parts.append(f"off:{self.offload}")
        return " ".join(parts)


@dataclass
class Outcome:
    """What a trial measured. Figures are None when they were not measured, never -1."""

    status: str
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    peak_memory_bytes: int | None = None
    host_peak_memory_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    wall_seconds: float | None = None
    timed_seconds: float | None = None
    predicted_memory_bytes: int | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def is_oom(self) -> bool:
        return self.status == "oom"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Outcome:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
