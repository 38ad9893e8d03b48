"""Search spaces: the knobs' values from search_spaces/*.yaml, the derived accumulation,
and the device rules that remove what cannot run before anything runs."""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune.config import OFFLOADS, PRECISIONS, TrialConfig
from autotune.errors import SpecError

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.spec import Spec

SPACES_DIR = Path(__file__).resolve().parent.parent / "search_spaces"
KNOBS = ("per_device_train_batch_size", "precision", "optim", "gradient_checkpointing",
         "zero_stage", "offload")
# Under optimizer offload DeepSpeed runs its own CPU implementation of the algorithm;
# these are the TrainingArguments optimizers it has one for (seed 000: "offload needs an
# optimizer that is adapted to both CPU and GPU").
CPU_OFFLOAD_OPTIMIZERS = {"adamw_torch": "AdamW", "adagrad": "Adagrad", "lion_32bit": "Lion"}
EIGHT_BIT_OPTIMIZERS = {"adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "lion_8bit",
                        "paged_lion_8bit", "rmsprop_bnb_8bit", "ademamix_8bit"}


@dataclass
class Space:
    batch_sizes: list[int]
    precision: list[str]
    optim: list[str]
    gradient_checkpointing: list[bool]
    zero_stage: list[int]
    offload: list[str]
    source: str = "default"

    def choices(self) -> dict[str, list[Any]]:
        """Each knob's values, in the order Optuna distributions need to stay stable."""
        return {"per_device_train_batch_size": self.batch_sizes, "precision": self.precision,
                "optim": self.optim, "gradient_checkpointing": self.gradient_checkpointing,
                "zero_stage": self.zero_stage, "offload": self.offload}


@dataclass
class SpaceResult:
    space: Space
    candidates: list[TrialConfig]
    pruned: dict[str, str] = field(default_factory=dict)  # rule label -> why


def optimizer_names() -> list[str]:
    from transformers.training_args import OptimizerNames

    return [o.value for o in OptimizerNames]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _as_list(raw: dict, key: str, default: list) -> list:
    value = raw.get(key, default)
    return value if isinstance(value, list) else [value]


def _check_values(key: str, values: list, allowed: list | tuple) -> None:
    for v in values:
        if v not in allowed:
            raise SpecError(f"search space {key}: {v!r} is not allowed; allowed: "
                            f"{', '.join(map(str, allowed))}")


def load_space(name_or_path: str, target_batch_size: int, world_size: int = 1) -> Space:
    path = Path(name_or_path)
    if not path.suffix:
        path = SPACES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
        raise SpecError(f"search.space: {name_or_path!r} is neither a file nor a space under "
                        f"search_spaces/ (known: {known})")
    raw = yaml.safe_load(path.read_text()) or {}
    unknown = set(raw) - set(KNOBS)
    if unknown:
        raise SpecError(f"search space {path.name}: unknown key(s) {sorted(unknown)}; "
                        f"allowed: {', '.join(KNOBS)}")
    per_rank = target_batch_size // world_size
    batches = raw.get("per_device_train_batch_size", "auto")
    batches = _divisors(per_rank) if batches == "auto" else _as_list(raw, KNOBS[0], [])
    _check_values("per_device_train_batch_size", batches, _divisors(per_rank))
    space = Space(
        batch_sizes=sorted(int(b) for b in batches),
        precision=_as_list(raw, "precision", ["fp32"]),
        optim=_as_list(raw, "optim", ["adamw_torch"]),
        gradient_checkpointing=_as_list(raw, "gradient_checkpointing", [False]),
        zero_stage=[int(z) for z in _as_list(raw, "zero_stage", [0])],
        offload=_as_list(raw, "offload", ["none"]),
        source=str(path),
    )
    _check_values("precision", space.precision, PRECISIONS)
    _check_values("optim", space.optim, optimizer_names())
    _check_values("gradient_checkpointing", space.gradient_checkpointing, [False, True])
    _check_values("zero_stage", space.zero_stage, [0, 1, 2, 3])
    _check_values("offload", space.offload, OFFLOADS)
    return space


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def device_rule(cfg: TrialConfig, device: DeviceSpec) -> tuple[str, str] | None:
    """(label, reason) of the first rule that rules `cfg` out on `device`, or None."""
    cc = device.compute_capability
    checks: list[tuple[bool, str, str]] = [
        (cfg.precision == "fp16" and not device.supports_fp16(), "precision=fp16",
         "fp16 mixed precision needs a CUDA GPU (Trainer has no fp16 AMP on CPU)"),
        (cfg.precision == "tf32" and not device.supports_tf32(), "precision=tf32",
         f"tf32 needs an Ampere or newer GPU (compute capability 8.0+; here {cc or 'CPU'})"),
        (cfg.precision == "bf16" and not device.supports_bf16(), "precision=bf16",
         f"bf16 needs compute capability 8.0+ (here {cc})"),
        (cfg.optim == "adamw_torch_fused" and not device.is_cuda, "optim=adamw_torch_fused",
         "fused AdamW is a GPU kernel; on CPU it measures nothing adamw_torch does not"),
        (cfg.optim in EIGHT_BIT_OPTIMIZERS and not _installed("bitsandbytes"),
         f"optim={cfg.optim}", "8-bit optimizers need bitsandbytes, which is not installed"),
        (cfg.zero_stage > 0 and not _installed("deepspeed"), "zero_stage>0",
         "ZeRO needs deepspeed, which is not installed"),
        (cfg.offload != "none" and cfg.zero_stage == 0, f"offload={cfg.offload} without ZeRO",
         "offload is a DeepSpeed ZeRO feature (zero_stage 1-3)"),
        (cfg.offload == "optimizer+param" and cfg.zero_stage != 3,
         "offload=optimizer+param with zero_stage<3", "parameter offload needs ZeRO stage 3"),
        (cfg.offload != "none" and cfg.optim not in CPU_OFFLOAD_OPTIMIZERS,
         f"offload with optim={cfg.optim}",
         "optimizer offload runs DeepSpeed's CPU optimizer, which exists only for "
         f"{', '.join(CPU_OFFLOAD_OPTIMIZERS)}"),
    ]
    for fired, label, reason in checks:
        if fired:
            return label, reason
    return None


def build_space(spec: Spec, device: DeviceSpec, space: Space | None = None) -> SpaceResult:
    """Every config the space allows on `device`, with accumulation derived from the target."""
    space = space or load_space(spec.search.space, spec.target_batch_size, spec.world_size)
    world, target = spec.world_size, spec.target_batch_size
    result = SpaceResult(space, [])
    for b, p, o, gc, z, off in itertools.product(
            space.batch_sizes, space.precision, space.optim, space.gradient_checkpointing,
            space.zero_stage, space.offload):
        cfg = TrialConfig(b, target // (b * world), p, o, bool(gc), z, off)
        rule = device_rule(cfg, device)
        if rule is None:
            result.candidates.append(cfg)
        else:
            result.pruned.setdefault(*rule)
    return result
