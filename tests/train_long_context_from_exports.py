"""What a user's Trainer script adds beside the exported files for a sequence split (run
under `accelerate launch --config_file accelerate_config.yaml`, whose parallelism_config
block builds the ParallelismConfig): DeepSpeed's comm layer over gloo on CPU before the
Trainer, and position_ids in every batch. Trains two steps and prints what ran. A third
argument, a spec, gives the model's shape and the length (a held-out search's winner);
without it, the test's small Llama at 128 tokens."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch
import yaml
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "max_position_embeddings": 256}


def main(export_dir: str, output_dir: str, spec: str | None = None) -> None:
    shape, seq = SMALL, 128
    if spec:
        given = yaml.safe_load(Path(spec).read_text())
        shape = {k: v for k, v in given["model"]["config"].items() if k != "model_type"}
        seq = given["data"]["seq_len"]
    kwargs = json.loads((Path(export_dir) / "training_args.json").read_text())
    args = TrainingArguments(**kwargs | {"output_dir": output_dir}, max_steps=2,
                             save_strategy="no", disable_tqdm=True)
    args.device  # noqa: B018 - the process group, before DeepSpeed's comm layer joins it
    deepspeed.init_distributed(dist_backend="gloo")
    model = LlamaForCausalLM(LlamaConfig(**shape))
    ids = torch.randint(0, shape["vocab_size"], (16, seq),
                        generator=torch.Generator().manual_seed(0))
    rows = [{"input_ids": r, "labels": r, "position_ids": torch.arange(seq)} for r in ids]
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    if args.process_index == 0:
        print(json.dumps({"global_step": trainer.state.global_step, "world": args.world_size,
                          "sp": trainer.get_sp_size(),
                          "loss": trainer.state.log_history[-1].get("train_loss")}))


if __name__ == "__main__":
    try:
        main(*sys.argv[1:4])
        if torch.distributed.is_initialized():
            # Both ranks leave together: once in CI a rank aborted in gloo's thread as its
            # peer tore the group down (SIGABRT, "terminate called without an active
            # exception", 2026-11-29).
            torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
