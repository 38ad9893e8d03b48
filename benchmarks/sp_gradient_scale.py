"""DeepSpeed's Ulysses sequence parallelism through Trainer: is its gradient the one a
single rank computes on the same sample? The finding behind knobs.SEQUENCE_PARALLEL's
ZeRO-3-only rule (issue 54).

Each run trains one step of a 2-layer Llama (seq 256, one sample per rank, plain SGD at
lr 0.1, no clipping) on CPU ranks over gloo: one rank without SP (the reference), then
two ranks with sp_size=2 at each ZeRO stage asked. It prints the step's loss and
gradient norm as Trainer logs them, and how far the step moved layer 0's down_proj.
Measured here (accelerate 1.15, DeepSpeed 0.19.8, transformers 5.24, 2 cores,
2026-11-28): the loss equals the reference's everywhere; the gradient is sp_size times
too large at ZeRO 0, 1 and 2 (grad norm 3.148 vs 1.574, down_proj moved 0.0482 vs
0.0241) and equal at ZeRO-3.

    .venv/bin/python benchmarks/sp_gradient_scale.py              # ZeRO 1 and 3, ~40 s
    .venv/bin/python benchmarks/sp_gradient_scale.py --stages 0 1 2 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SEQ = 256
WEIGHT = "model.layers.0.mlp.down_proj.weight"


def child(sp: int, stage: int, out: str) -> None:
    """One run, as a rank of torchrun: prints its figures as JSON on rank 0."""
    import deepspeed
    import torch
    import transformers
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = transformers.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=512, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    before = model.state_dict()[WEIGHT].detach().clone()
    ids = torch.randint(0, 512, (8, SEQ), generator=torch.Generator().manual_seed(1))
    rows = [{"input_ids": r, "labels": r, "position_ids": torch.arange(SEQ)} for r in ids]
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "zero_optimization": {"stage": stage},
          "gradient_clipping": 1e9}
    kwargs = dict(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=1,
                  max_steps=1, use_cpu=True, report_to="none", save_strategy="no",
                  logging_steps=1, deepspeed=ds, learning_rate=0.1, max_grad_norm=1e9,
                  optim="sgd", disable_tqdm=True)
    if sp > 1:
        kwargs["parallelism_config"] = ParallelismConfig(
            sp_backend="deepspeed", sp_size=sp, sp_handler=DeepSpeedSequenceParallelConfig(
                sp_seq_length=SEQ, sp_seq_length_is_variable=False,
                sp_attn_implementation="sdpa"))
    trainer = transformers.Trainer(model=model, args=transformers.TrainingArguments(**kwargs),
                                   train_dataset=rows)
    trainer.train()
    engine = trainer.model_wrapped
    param = dict(engine.module.named_parameters())[WEIGHT]
    with deepspeed.zero.GatheredParameters([param], enabled=stage == 3):
        moved = (param.detach() - before).norm().item()
    if int(os.environ.get("RANK", "0")) == 0:
        logged = next(e for e in trainer.state.log_history if "loss" in e)
        print("FIGURES " + json.dumps({"loss": logged["loss"],
                                       "grad_norm": logged.get("grad_norm"), "moved": moved}))
    torch.distributed.destroy_process_group()


def run(sp: int, stage: int) -> dict:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    with tempfile.TemporaryDirectory() as out:
        done = subprocess.run([torchrun, "--nproc_per_node", str(max(sp, 1)), "--master_port",
                               str(29610 + 10 * sp + stage), __file__, "--child", str(sp),
                               str(stage), out], capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("FIGURES ")]
    if done.returncode or not lines:
        raise SystemExit(f"sp {sp} ZeRO-{stage} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("FIGURES "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(int(args.child[0]), int(args.child[1]), args.child[2])
        return
    ref = run(1, 1)
    print(f"{'run':<22}{'loss':>10}{'grad norm':>12}{'down_proj moved':>18}{'x ref':>8}")
    print(f"{'1 rank, ZeRO-1':<22}{ref['loss']:>10.4f}{ref['grad_norm']:>12.4f}"
          f"{ref['moved']:>18.4f}{1:>8.2f}")
    for stage in args.stages:
        got = run(2, stage)
        norm = got["grad_norm"]
        print(f"{f'sp 2, ZeRO-{stage}':<22}{got['loss']:>10.4f}"
              f"{norm if norm is not None else float('nan'):>12.4f}{got['moved']:>18.4f}"
              f"{got['moved'] / ref['moved']:>8.2f}")


if __name__ == "__main__":
    main()
