"""What a user does with the exported files, in a fresh process and another folder: build
TrainingArguments straight from training_args.json, train two steps, print what happened
(and what DeepSpeed's own parser makes of ds_config.json)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


def main(export_dir: str, output_dir: str) -> None:
    export = Path(export_dir)
    kwargs = json.loads((export / "training_args.json").read_text())
    kwargs["output_dir"] = output_dir
    parsed = None
    if kwargs.get("deepspeed"):
        import deepspeed
        from deepspeed.runtime.config import DeepSpeedConfig

        ds_file = export / "ds_config.json"  # the launcher's copy: the same dict
        assert json.loads(ds_file.read_text()) == kwargs["deepspeed"]
        deepspeed.init_distributed(dist_backend="gloo")
        c = DeepSpeedConfig(str(ds_file))  # DeepSpeed's own parser
        parsed = [c.train_batch_size, c.train_micro_batch_size_per_gpu,
                  c.gradient_accumulation_steps, c.zero_optimization_stage]
    args = TrainingArguments(**kwargs, max_steps=2, save_strategy="no", disable_tqdm=True)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=512,
                                       n_positions=64))
    ids = torch.randint(0, 512, (64, 32))
    data = [{"input_ids": r, "labels": r} for r in ids]
    lora = export / "lora_config.json"
    if lora.is_file():
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(**json.loads(lora.read_text())))
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    if args.process_index != 0:
        return
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(json.dumps({"global_step": trainer.state.global_step, "deepspeed": parsed,
                      "trainable": trainable, "world": args.world_size,
                      "batch": args.per_device_train_batch_size,
                      "accum": args.gradient_accumulation_steps, "bf16": args.bf16}))


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2])
    finally:
        # Without this, gloo's threads can outlive the interpreter's teardown and abort it
        # ("terminate called without an active exception", seen once in CI): a run that
        # trained and printed would still exit -6.
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
