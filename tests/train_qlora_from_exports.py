"""What a user does with a QLoRA search's files, in a fresh process and another folder:
load the base with model_kwargs.json (its quantization_config), prepare it for k-bit
training, add the adapters of lora_config.json, and train two steps with Trainer from
training_args.json, or with TRL's SFTTrainer from sft_config.json where it was exported.

    python train_qlora_from_exports.py EXPORT_DIR CHAT.jsonl TOKENIZER CONFIG_JSON OUT
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path


def main(export_dir: str, rows: str, tokenizer: str, config: str, output_dir: str) -> None:
    import datasets
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
    )

    export = Path(export_dir)
    raw = json.loads(config)
    base = tempfile.mkdtemp()  # the user's checkpoint
    AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw)
                                     ).save_pretrained(base)
    loading = export / "model_kwargs.json"
    kwargs = json.loads(loading.read_text()) if loading.is_file() else {}
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    quantized = type(model.model.layers[0].mlp.up_proj).__name__
    if "quantization_config" in kwargs:
        assert kwargs["quantization_config"] == json.loads(
            (export / "quantization_config.json").read_text())
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(**json.loads(
        (export / "lora_config.json").read_text())))
    tok = AutoTokenizer.from_pretrained(tokenizer)
    chat = datasets.load_dataset("json", data_files=rows)["train"]
    sft = export / "sft_config.json"
    if sft.is_file():
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**json.loads(sft.read_text()) | {
            "output_dir": output_dir, "max_steps": 2, "save_strategy": "no",
            "disable_tqdm": True})
        trainer = SFTTrainer(model=model, args=args, train_dataset=chat, processing_class=tok)
    else:
        args = TrainingArguments(**json.loads((export / "training_args.json").read_text()) | {
            "output_dir": output_dir, "max_steps": 2, "save_strategy": "no",
            "disable_tqdm": True})
        data = []
        for r in chat:  # each conversation rendered, cut or padded to 32 tokens
            x = tok.apply_chat_template(r["messages"], tokenize=True,
                                        return_dict=True)["input_ids"][:32]
            pad = 32 - len(x)
            data.append({"input_ids": x + [tok.pad_token_id] * pad,
                         "attention_mask": [1] * len(x) + [0] * pad,
                         "labels": x + [-100] * pad})
        trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    print(json.dumps({"global_step": trainer.state.global_step, "quantized": quantized,
                      "batch": args.per_device_train_batch_size}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
