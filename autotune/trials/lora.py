"""LoRA through PEFT: the one place the spec's `model.lora` becomes a LoraConfig, used by
the trial (the model it trains), the memory model (the trainable count, on the meta
device) and the exporter (lora_config.json)."""

from __future__ import annotations

from typing import Any

# PEFT's task types for the spec's tasks (what get_peft_model wraps the model as).
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS",
              "masked-lm": "FEATURE_EXTRACTION"}


def lora_config_kwargs(lora: dict[str, Any], task: str) -> dict[str, Any]:
    """`LoraConfig(**kwargs)` for the spec's lora section."""
    return {"r": lora["r"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
            "target_modules": lora["target_modules"], "bias": "none",
            "task_type": TASK_TYPES[task]}


def with_lora(model, lora: dict[str, Any], task: str):
    """`model` with LoRA adapters; only the adapters (and a classifier head) train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**lora_config_kwargs(lora, task)))
