"""The guide's recipe: what a careful user writes by hand from the seeds, the second
reference every search is measured against (the first is Trainer's defaults).

Each knob's row in the table says what that user prefers (`Knob.recipe`, best first): bf16
where the device has it, fused AdamW on CUDA, flash-attention 2 or SDPA, torch.compile and
Liger on GPUs, dataloader workers on real data. The recipe takes, knob by knob in table
order, the first preferred value that the model allows and the device rules admit beside
the values already taken. Its batch is the largest that fits without checkpointing; where
none does, the user reaches for the guide's memory levers in its order (`FALLBACKS`), one
rung at a time. Which rung and batch is settled by trials (tuning/strategies/probe.py),
as the user would settle it: by running it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from autotune import knobs
from autotune.config import Family, TrialConfig

if TYPE_CHECKING:
    from autotune.device import DeviceSpec

# The guide's memory levers in its order, each rung with checkpointing: DPO's reference
# precomputed, 8-bit optimizer states, a 4-bit base under LoRA, then DeepSpeed ZeRO
# (stage 2 over several ranks, stage 3) and its CPU offload, whose optimizer must have a
# CPU implementation (DeepSpeed's CPU Adam).
FALLBACKS: tuple[dict[str, Any], ...] = (
    {"gradient_checkpointing": True},
    # Under DPO without LoRA: the reference's log-probs precomputed, its copy never made
    # (TRL's documented way to save the reference's memory).
    {"gradient_checkpointing": True, "precompute_ref_log_probs": True},
    {"gradient_checkpointing": True, "optim": "adamw_bnb_8bit"},
    # Under LoRA: the base in 4 bits (QLoRA), how a 7-8B model fits a 24 GB card.
    {"gradient_checkpointing": True, "quantization": "nf4"},
    {"gradient_checkpointing": True, "zero_stage": 2},
    {"gradient_checkpointing": True, "zero_stage": 3},
    {"gradient_checkpointing": True, "zero_stage": 3, "offload": "optimizer",
     "optim": "adamw_torch"},
    {"gradient_checkpointing": True, "zero_stage": 3, "offload": "optimizer+param",
     "optim": "adamw_torch"},
)


def _admits(values: Mapping[str, Any], device: DeviceSpec, installs: bool) -> bool:
    """What the rules admit, less Liger beside torch.compile: compiled, Liger's fused loss
    holds several times the logits it exists to avoid (LIGER_COMPILED_LOGITS, measured),
    so the careful user takes one of the two (the first in the table: compile). The
    search may still try both; the memory model prices them."""
    if values.get("torch_compile") and values.get("use_liger_kernel"):
        return False
    return knobs.device_rule(TrialConfig(1, 1, Family.of(values)), device,
                             installs=installs) is None


def recipe_family(device: DeviceSpec, available: Mapping[str, set], *, real_data: bool = False,
                  installs: bool = True, fixed: Mapping[str, Any] | None = None) -> Family:
    """The recipe's knob values: per knob the first preferred value in `available` (what
    the model and data allow, or what a landscape measured) that the rules admit beside
    `fixed` (a memory rung's levers) and the values taken before it."""
    values: dict[str, Any] = dict(fixed or {})
    for k in knobs.table():
        if k.name in values:
            continue
        allowed = available.get(k.name, {k.baseline})
        chosen = next((v for v in k.preferred(device, real_data) if v in allowed
                       and _admits(values | {k.name: v}, device, installs)), k.baseline)
        values[k.name] = chosen
    return Family.of(values)


def recipe_rungs(device: DeviceSpec, available: Mapping[str, set], *, world_size: int = 1,
                 real_data: bool = False, installs: bool = True) -> list[Family]:
    """The recipe, then each memory fallback the device and `available` admit, in the
    guide's order; ZeRO-2, and ZeRO-3 without offload, only over several ranks (on one
    they partition nothing: ZeRO-3 alone holds what the rung before it held, and pays its
    gathers)."""
    base = recipe_family(device, available, real_data=real_data, installs=installs)
    out = [base]
    for change in FALLBACKS:
        if change.get("zero_stage") in (2, 3) and "offload" not in change and world_size < 2:
            continue
        if not (all(v in available.get(k, {knobs.knob(k).baseline}) for k, v in change.items())
                and _admits(change, device, installs)):
            continue
        # The rest as the recipe has it, unless a lever rules a value out (Liger under
        # ZeRO-3): then what the user would pick beside it.
        fam = Family.of(base.to_dict() | change)
        if not _admits(fam.to_dict(), device, installs):
            fam = recipe_family(device, available, real_data=real_data, installs=installs,
                                fixed=change)
        if fam not in out:
            out.append(fam)
    return out


def available_values(spec: Any) -> dict[str, set]:
    """Per knob, every value the table allows that this spec's model and data admit (the
    recipe is not bound by the search space: it is what the user would do instead)."""
    from autotune.space import applicable

    return {k.name: {v for v in k.allowed() if applicable(spec, k, v) is None}
            for k in knobs.table()}


def landscape_values(configs: list[TrialConfig]) -> dict[str, set]:
    """Per knob, the values a landscape measured: the columns it has."""
    out: dict[str, set] = {k.name: set() for k in knobs.table()}
    for c in configs:
        for name, v in c.family.items:
            out[name].add(v)
    return out
