"""A class per row (`model.task: sequence-classification`): BERT's usual fine-tuning,
a classifier head over the encoder (or a decoder's last token)."""

from __future__ import annotations

from typing import Any

from autotune.tasks.base import Task

CLASSES = 2  # a config without num_labels: a binary head, as transformers' default


class SequenceClassification(Task):
    name = "sequence-classification"
    auto_class = "AutoModelForSequenceClassification"
    lora_task_type = "SEQ_CLS"
    model_types = ("bert",)
    data_comment = ("synthetic tokens as written; for your rows set source (a .jsonl, "
                    ".parquet, dataset folder or hub id)\nand tokenizer (text rows; their "
                    "labels are drawn: the head's classes do not change the step).")

    def prepare_config(self, hf_config: Any) -> Any:
        """A head of num_labels classes, and a pad token a GPT-style model's batches need."""
        hf_config.num_labels = getattr(hf_config, "num_labels", CLASSES) or CLASSES
        if getattr(hf_config, "pad_token_id", None) is None:
            hf_config.pad_token_id = getattr(hf_config, "eos_token_id", None) or 0
        return hf_config

    def trace_inputs(self, hf_config: Any, seq_len: int, batch: int, target_len: int,
                     rows: int) -> dict[str, Any]:
        import torch

        inputs = super().trace_inputs(hf_config, seq_len, batch, target_len, rows)
        return inputs | {"labels": torch.zeros(batch, dtype=torch.long)}

    def row_labels(self, ids: Any, mask: Any, labels: Any, generator: Any) -> Any:
        import torch

        return torch.randint(0, CLASSES, (), generator=generator)


SEQUENCE_CLASSIFICATION = SequenceClassification()
