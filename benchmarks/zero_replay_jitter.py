"""How stable the ZeRO replay's reserved peak is: each DeepSpeed row of the H200 memory file
replayed 20 times with the sizes of its mid-sized allocations (1 MiB to 512 MiB) jittered
by up to 1%, as a different torch or model version might make them. A peak that jumps by a
whole segment under that is the allocator's chaos, which no replay pins down; one that
stays put while the device measured more is a rule the replay lacks.

    PYTHONPATH=. .venv/bin/python benchmarks/zero_replay_jitter.py     # about 10 s
"""
import random
import re
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
# A jump this size is a whole segment more or less (the row's large ones are 786 and 1572
# MiB: the loss's 16-bit and fp32 logits), not a block's drift.
SEGMENT = 700
ROOT = Path(__file__).resolve().parents[1]
# Where the H200's allocator reserved peaks are: the memory step's log.
MEMORY_LOG = ROOT / "reports" / "gpu-proof-h200" / "call1-memory.log"


def measured_reserved() -> dict[str, int]:
    """Each config's allocator reserved peak (MiB) as the memory step logged it."""
    found = re.findall(r"^\s+(\S.*?)\s+measured .*?reserved (\d+) MiB, peak set",
                       MEMORY_LOG.read_text(), re.MULTILINE)
    return {label: int(mib) for label, mib in found}


def jittered(events: list, rng: random.Random) -> list:
    return [(kind, key, int(n * (1 + rng.uniform(-JITTER, JITTER))))
            if kind == "alloc" and MiB < n < 512 * MiB else (kind, key, n)
            for kind, key, n in events]


def main() -> None:
    dev, by = recorded(str(Path(__file__).resolve().parent / "memory_accuracy_h200.txt"))
    measured = measured_reserved()
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
                physics.attention_kernel(c), capability=dev.compute_capability)
            streams = zero_replay.on_reduction_stream(c.zero_stage)
            base = allocator.replay(events, streams).peak_reserved // MiB
            peaks = sorted(allocator.replay(jittered(events, random.Random(seed)),
                                            streams).peak_reserved // MiB
                           for seed in range(RUNS))
            print(f"{c.label():40s} reserved MiB: measured {measured.get(c.label(), '?')}, "
                  f"replayed {base}, jittered {peaks[0]}-{peaks[-1]} "
                  f"(median {peaks[RUNS // 2]}; {sum(p > base + SEGMENT for p in peaks)} of "
                  f"{RUNS} a segment above, {sum(p < base - SEGMENT for p in peaks)} below)",
                  flush=True)


if __name__ == "__main__":
    main()
