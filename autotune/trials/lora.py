"""LoRA through PEFT: the one place the spec's `model.lora` becomes a LoraConfig, used by
the trial (the model it trains), the memory model (the trainable count, on the meta
device) and the exporter (lora_config.json)."""

from __future__ import annotations

from typing import Any

# PEFT's task types for the spec's tasks (what get_peft_model wraps the model as).
# PEFT has no task type for image classification: the adapters wrap the model as it is,
# and its classifier head, new for the task, trains whole (modules_to_save).
TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS",
              "masked-lm": "FEATURE_EXTRACTION", "seq2seq-lm": "SEQ_2_SEQ_LM",
              "image-classification": None}
HEADS = {"image-classification": ["classifier"]}


def lora_config_kwargs(lora: dict[str, Any], task: str) -> dict[str, Any]:
    """`LoraConfig(**kwargs)` for the spec's lora section."""
    out = {"r": lora["r"], "lora_alpha": lora["alpha"], "lora_dropout": lora["dropout"],
           "target_modules": lora["target_modules"], "bias": "none",
           "task_type": TASK_TYPES[task]}
    return out | ({"modules_to_save": HEADS[task]} if task in HEADS else {})


def with_lora(model, lora: dict[str, Any], task: str):
    """`model` with LoRA adapters; only the adapters (and a classifier head) train."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(**lora_config_kwargs(lora, task)))
