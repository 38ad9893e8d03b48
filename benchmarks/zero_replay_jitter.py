"""How stable the ZeRO replay's reserved peak is: each DeepSpeed row of the H200 memory file
replayed 20 times with the sizes of its mid-sized allocations (1 MiB to 512 MiB) jittered
by up to 1%, as a different torch or model version might make them. A peak that jumps by a
whole segment under that is the allocator's chaos, which no replay pins down; one that
stays put while the device measured more is a rule the replay lacks.

    PYTHONPATH=. .venv/bin/python benchmarks/zero_replay_jitter.py     # about 10 s
"""
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory_accuracy import recorded, shape_table, spec_for  # noqa: E402

from autotune.plan import allocator, zero_replay  # noqa: E402
from autotune.plan.memory import Physics  # noqa: E402
from autotune.plan.shape import model_shape  # noqa: E402
from autotune.spec import load_spec  # noqa: E402

MiB = 2**20
RUNS, JITTER = 20, 0.01
# The H200's allocator reserved peaks (reports/gpu-proof-h200/call1-memory.log).
MEASURED = {"b8x4 bf16 adamw_torch z2 off:optimizer": 12026,
            "b8x4 bf16 adamw_torch z1": 13674, "b8x4 bf16 adamw_torch z2": 12578}


def jittered(events: list, rng: random.Random) -> list:
    return [(kind, key, int(n * (1 + rng.uniform(-JITTER, JITTER))))
            if kind == "alloc" and MiB < n < 512 * MiB else (kind, key, n)
            for kind, key, n in events]


def main() -> None:
    dev, by = recorded(str(Path(__file__).resolve().parent / "memory_accuracy_h200.txt"))
    shapes, _ = shape_table(dev)
    for name, rows in by.items():
        shape = model_shape(load_spec(spec_for(*shapes[name])))
        physics = Physics(shape, dev)
        for c, _ in rows:
            if not physics.zero_replayed(c):
                continue
            events = zero_replay.emulated(
                shape.hf_config, shape.seq_len, c.per_device_train_batch_size,
                c.gradient_accumulation_steps, c.zero_stage, c.offload, True, c.optim,
                physics.attention_kernel(c))
            streams = zero_replay.on_reduction_stream(c.zero_stage)
            base = allocator.replay(events, streams).peak_reserved // MiB
            peaks = sorted(allocator.replay(jittered(events, random.Random(seed)),
                                            streams).peak_reserved // MiB
                           for seed in range(RUNS))
            print(f"{c.label():40s} reserved MiB: measured {MEASURED.get(c.label(), '?')}, "
                  f"replayed {base}, jittered {peaks[0]}-{peaks[-1]} "
                  f"(median {peaks[RUNS // 2]}; {sum(p > base + 1000 for p in peaks)} of "
                  f"{RUNS} a segment above, {sum(p < base - 1000 for p in peaks)} below)",
                  flush=True)


if __name__ == "__main__":
    main()
