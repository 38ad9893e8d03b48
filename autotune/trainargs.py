"""The one place a TrialConfig becomes TrainingArguments kwargs and a DeepSpeed config.

The trial and the exporter both call these functions: what is measured is what is
exported.
"""

from __future__ import annotations

from typing import Any

from autotune.config import TrialConfig
from autotune.space import CPU_OFFLOAD_OPTIMIZERS

OUTPUT_DIR_PLACEHOLDER = "OUTPUT_DIR"
# TrainingArguments defaults that the DeepSpeed config must repeat (HF's integration
# refuses a ds_config whose explicit values disagree with the TrainingArguments).
LEARNING_RATE = 5e-5
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0
MAX_GRAD_NORM = 1.0


def _checkpointing_name() -> str:
    """transformers 5 renamed gradient_checkpointing; use the installed version's name so
    the exported kwargs load without deprecation warnings where they will be used."""
    from dataclasses import fields

    from transformers import TrainingArguments

    names = {f.name for f in fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else (
        "gradient_checkpointing")


_CHECKPOINTING = _checkpointing_name()


def training_arguments_kwargs(
    config: TrialConfig,
    *,
    output_dir: str = OUTPUT_DIR_PLACEHOLDER,
    on_cpu: bool = False,
    deepspeed: str | dict | None = None,
    seed: int = 42,
) -> dict[str, Any]:
    """kwargs for `TrainingArguments(**kwargs)` that train with `config`.

    `deepspeed` is the DeepSpeed config (a dict, or a path for exported files); it is
    required when config.zero_stage > 0.
    """
    if config.uses_deepspeed and deepspeed is None:
        raise ValueError("zero_stage > 0 needs the DeepSpeed config (deepspeed=...)")
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "learning_rate": LEARNING_RATE,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPS,
        "weight_decay": WEIGHT_DECAY,
        "max_grad_norm": MAX_GRAD_NORM,
        "optim": config.optim,
        "bf16": config.precision == "bf16",
        "fp16": config.precision == "fp16",
        _CHECKPOINTING: config.gradient_checkpointing,
        "seed": seed,
        "report_to": "none",
    }
    if config.precision == "tf32":
        kwargs["tf32"] = True
    if config.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs and ZeRO-3; the reentrant
        # default warns and is slated for removal in torch.
        kwargs[f"{_CHECKPOINTING}_kwargs"] = {"use_reentrant": False}
    if on_cpu:
        kwargs["use_cpu"] = True  # Trainer needs it for bf16 autocast on CPU
    if deepspeed is not None:
        kwargs["deepspeed"] = deepspeed
    return kwargs


def deepspeed_config(config: TrialConfig, *, world_size: int = 1) -> dict[str, Any] | None:
    """The DeepSpeed JSON for `config`, or None when it uses no ZeRO.

    Every value is explicit (no "auto") so DeepSpeed's own parser accepts the file
    outside Trainer, and each one equals its TrainingArguments counterpart above.
    """
    if not config.uses_deepspeed:
        return None
    micro, accum = config.per_device_train_batch_size, config.gradient_accumulation_steps
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage >= 2:
        zero |= {"overlap_comm": True, "contiguous_gradients": True}
    if config.offload in ("optimizer", "optimizer+param"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if config.offload == "optimizer+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_batch_size": micro * accum * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": MAX_GRAD_NORM,
        "bf16": {"enabled": config.precision == "bf16"},
        "fp16": {"enabled": config.precision == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.offload != "none":
        # Offload needs DeepSpeed's CPU optimizer, so the optimizer is named here rather
        # than created by Trainer from `optim`.
        ds["optimizer"] = {"type": CPU_OFFLOAD_OPTIMIZERS[config.optim], "params": {
            "lr": LEARNING_RATE, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
            "weight_decay": WEIGHT_DECAY}}
    return ds
