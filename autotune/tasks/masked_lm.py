"""Masked tokens (`model.task: masked-lm`): BERT's pretraining head, 15% of a row's
tokens as its labels."""

from __future__ import annotations

from typing import Any

from autotune.tasks.base import Task

MASKED = 0.15  # the share of a row's tokens that are its labels, as BERT's recipe has it


class MaskedLM(Task):
    name = "masked-lm"
    auto_class = "AutoModelForMaskedLM"
    lora_task_type = "FEATURE_EXTRACTION"
    lm_logits = True
    data_comment = ("synthetic tokens as written; for your rows set source (a .jsonl, "
                    ".parquet, dataset folder or hub id)\nand tokenizer (text rows: a share "
                    "of their tokens become the labels).")

    def row_labels(self, ids: Any, mask: Any, labels: Any, generator: Any) -> Any:
        import torch

        from autotune.tasks.data import IGNORE

        lab = ids.clone()
        lab[torch.rand(len(ids), generator=generator) > MASKED] = IGNORE
        lab[mask == 0] = IGNORE
        return lab


MASKED_LM = MaskedLM()
