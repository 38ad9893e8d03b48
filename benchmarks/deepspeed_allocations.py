"""DeepSpeed's own allocations, recorded from the real engine on CPU and replayed.

The allocator replay (autotune/plan/allocator.py) covers plain Trainer steps; DeepSpeed's
engine allocates outside the model's code (flat 16-bit and fp32 partitions, gradient
reduction buckets of `reduce_bucket_size` elements), so nothing traces it. This runs the
real engine (gloo, one rank) on GPT-2 124M at a short sequence, follows every storage it
allocates and frees from `deepspeed.initialize` through two steps of two micro-batches,
and replays them through the allocator rules, printing live and reserved bytes after each
phase. Not yet in the physics: on CPU the offloaded states live on the same device, and
the activations are a short sequence's; it shows where the engine's buffers live and die.

    .venv/bin/python benchmarks/deepspeed_allocations.py 1 none   # ZeRO stage, offload
"""

from __future__ import annotations

import os
import sys

import torch


def main(stage: int, offload: str) -> None:
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29650 + stage)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    import deepspeed
    from transformers import GPT2Config, GPT2LMHeadModel

    from autotune.config import Family, TrialConfig
    from autotune.plan.allocator import CachingAllocator
    from autotune.plan.trace import _LiveBytes
    from autotune.trials.trainargs import deepspeed_config

    config = TrialConfig(1, 2, Family.of(precision="bf16", optim="adamw_torch",
                                         zero_stage=stage, offload=offload))
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=12, n_positions=128))
    params = sum(p.numel() for p in model.parameters())
    events: list = []
    tracker = _LiveBytes(events, existing=[*model.parameters(), *model.buffers()])
    marks = []
    with tracker.mode:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4) if offload == "none" else None
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optim, config=deepspeed_config(config),
            model_parameters=model.parameters() if optim is None else None)
        marks.append(("initialize", len(events)))
        ids = torch.randint(0, 50257, (1, 128))
        for step in range(2):
            for micro in range(2):
                loss = engine(input_ids=ids, labels=ids).loss
                marks.append((f"step {step} micro {micro} forward", len(events)))
                engine.backward(loss)
                marks.append((f"step {step} micro {micro} backward", len(events)))
                engine.step()
                del loss
                marks.append((f"step {step} micro {micro} engine.step", len(events)))
    allocator, done = CachingAllocator(), 0
    print(f"ZeRO-{stage}, offload {offload}: {params / 1e6:.1f}M parameters; MiB after each "
          "phase (live, reserved)")
    for name, upto in marks:
        for kind, key, nbytes, _ in events[done:upto]:
            if kind == "alloc":
                allocator.malloc(key, nbytes)
            else:
                allocator.free(key)
        done = upto
        print(f"  {name:32s} {allocator.allocated / 2**20:7.0f} {allocator.reserved / 2**20:7.0f}")
    largest = sorted({n for kind, _, n, _ in events if kind == "alloc"}, reverse=True)[:5]
    print(f"  peak live {allocator.peak_allocated / 2**20:.0f} MiB, reserved "
          f"{allocator.peak_reserved / 2**20:.0f} MiB; largest allocations (MiB): "
          f"{[round(n / 2**20) for n in largest]}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2, sys.argv[2] if len(sys.argv) > 2 else "none")
