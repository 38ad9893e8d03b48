"""Next-token prediction (`model.task: causal-lm`): GPT, Llama and their kin, the task
TRL's trainers and Liger's fused loss are for."""

from __future__ import annotations

from autotune.tasks.base import Task


class CausalLM(Task):
    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    lora_task_type = "CAUSAL_LM"
    lm_logits = True
    causal = True
    data_comment = ("synthetic tokens as written; for your rows set source (a .jsonl, "
                    ".parquet, dataset folder or hub id)\nand tokenizer; format is found from "
                    "the columns (text, messages, prompt/completion; chosen/rejected\nunder "
                    "trainer: dpo).")


CAUSAL_LM = CausalLM()
