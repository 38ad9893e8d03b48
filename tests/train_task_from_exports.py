"""What a user does with a seq2seq, image or DPO search's files, in a fresh process and
another folder: build the trainer's arguments straight from the exported file
(Seq2SeqTrainingArguments from training_args.json, TrainingArguments for a ViT, DPOConfig
from dpo_config.json with lora_config.json as DPOTrainer's peft_config), train two steps,
print what happened.

    python train_task_from_exports.py KIND EXPORT_DIR CONFIG_JSON OUT [ROWS TOKENIZER]

KIND: seq2seq, image, dpo or grpo; CONFIG_JSON: the model's inline config.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

STEPS = {"max_steps": 2, "save_strategy": "no", "disable_tqdm": True, "report_to": "none"}


def _model(auto: str, raw: dict):
    import transformers

    raw = dict(raw)
    if auto == "AutoModelForSeq2SeqLM":  # as T5's checkpoints set it
        raw.setdefault("decoder_start_token_id", 0)
    config = transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    return getattr(transformers, auto).from_config(config)


def seq2seq(export: Path, raw: dict, out: str, rows: str, tokenizer: str):
    import datasets
    from transformers import AutoTokenizer, Seq2SeqTrainer, Seq2SeqTrainingArguments

    kwargs = json.loads((export / "training_args.json").read_text())
    args = Seq2SeqTrainingArguments(**kwargs | {"output_dir": out} | STEPS)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.pad_token = tok.pad_token or tok.eos_token
    target = args.generation_max_length  # the trials' target length, exported

    def encode(row):
        source = tok(row["prompt"], truncation=True, max_length=64, padding="max_length")
        labels = tok(text_target=row["completion"], truncation=True, max_length=target,
                     padding="max_length")["input_ids"]
        return source | {"labels": [t if t != tok.pad_token_id else -100 for t in labels]}

    pairs = datasets.load_dataset("json", data_files=rows)["train"]
    data = pairs.map(encode, remove_columns=pairs.column_names)
    return Seq2SeqTrainer(model=_model("AutoModelForSeq2SeqLM", raw), args=args,
                          train_dataset=data), args


def image(export: Path, raw: dict, out: str):
    import torch
    from transformers import Trainer, TrainingArguments

    kwargs = json.loads((export / "training_args.json").read_text())
    args = TrainingArguments(**kwargs | {"output_dir": out} | STEPS)
    side = raw["image_size"]
    data = [{"pixel_values": torch.randn(3, side, side), "labels": torch.tensor(i % 2)}
            for i in range(64)]
    return Trainer(model=_model("AutoModelForImageClassification", raw), args=args,
                   train_dataset=data), args


def dpo(export: Path, raw: dict, out: str, rows: str, tokenizer: str):
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    args = DPOConfig(**json.loads((export / "dpo_config.json").read_text())
                     | {"output_dir": out} | STEPS)
    lora = export / "lora_config.json"
    peft = None
    if lora.is_file():  # the reference is then the base with the adapters off
        from peft import LoraConfig

        peft = LoraConfig(**json.loads(lora.read_text()))
    model = _model("AutoModelForCausalLM", raw)
    reference = None if peft or args.precompute_ref_log_probs else _model(
        "AutoModelForCausalLM", raw)
    tok = AutoTokenizer.from_pretrained(tokenizer)
    pairs = datasets.load_dataset("json", data_files=rows)["train"]
    return DPOTrainer(model=model, ref_model=reference, args=args, train_dataset=pairs,
                      processing_class=tok, peft_config=peft), args


def grpo(export: Path, raw: dict, out: str, rows: str, tokenizer: str):
    """GRPOConfig from grpo_config.json, as the docs say to use it; the model saved to a
    folder first where the reference is TRL's to load (beta > 0 without LoRA)."""
    import datasets
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(**json.loads((export / "grpo_config.json").read_text())
                      | {"output_dir": out} | STEPS)
    model = _model("AutoModelForCausalLM", raw)
    if args.beta:
        model.save_pretrained(Path(out) / "policy")
        model = str(Path(out) / "policy")
    tok = AutoTokenizer.from_pretrained(tokenizer)
    prompts = datasets.load_dataset("json", data_files=rows)["train"]

    def length(completions, **kwargs):
        return [float(len(str(c))) for c in completions]

    return GRPOTrainer(model=model, reward_funcs=length, args=args, train_dataset=prompts,
                       processing_class=tok), args


def main(kind: str, export_dir: str, config: str, out: str, *data: str) -> None:
    make = {"seq2seq": seq2seq, "image": image, "dpo": dpo, "grpo": grpo}[kind]
    trainer, args = make(Path(export_dir), json.loads(config), out, *data)
    trainer.train()
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    print(json.dumps({"global_step": trainer.state.global_step, "args": type(args).__name__,
                      "batch": args.per_device_train_batch_size,
                      "accum": args.gradient_accumulation_steps, "trainable": trainable}))


if __name__ == "__main__":
    main(*sys.argv[1:])
