"""LoRA through PEFT: the one place the spec's `model.lora` becomes a LoraConfig, used by
the trial (the model it trains), the memory model (the trainable count, on the meta
device) and the exporter (lora_config.json). PEFT's task type, and the modules that
train whole beside the adapters, are the task's (tasks/base.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from autotune.tasks.base import Task


def lora_config_kwargs(lora: dict[str, Any], task: Task | str | None) -> dict[str, Any]:
    """`LoraConfig(**kwargs)` for the spec's lora section and its model's task (or its
    name)."""
    from autotune.tasks.registry import task as named

    kind = named(task) if task is None or isinstance(task, str) else task
    out = {"r": lora["r"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
           "target_modules": lora["target_modules"], "bias": "none",
           "task_type": kind.lora_task_type}
    trained = list(kind.lora_trained_modules)
    return out | ({"modules_to_save": trained} if trained else {})


def with_lora(model, lora: dict[str, Any], task: Task | str | None):
    """`model` with LoRA adapters; only the adapters (and a classifier head) train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**lora_config_kwargs(lora, task)))
