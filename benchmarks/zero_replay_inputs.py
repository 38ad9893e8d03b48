"""The ZeRO replay's inputs and peaks for the H200 memory file's rows, to compare machines:
the traced step's event count and digest, and the replayed allocated and reserved peaks
(per stream). Run on the H200 (torch 2.11) and here (torch 2.13), the ZeRO-1 row's trace
differed by 16 events and its reserved peak by 1.5 GiB
(reports/gpu-proof-h200/call2-zero1-replay.txt).

    PYTHONPATH=. .venv/bin/python benchmarks/zero_replay_inputs.py
"""
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from memory_accuracy import recorded, shape_table, spec_for  # noqa: E402

from autotune.plan import zero_replay  # noqa: E402
from autotune.plan.memory import Physics  # noqa: E402
from autotune.plan.shape import model_shape  # noqa: E402
from autotune.spec import load_spec  # noqa: E402

dev, by = recorded(str(Path(__file__).resolve().parent / "memory_accuracy_h200.txt"))
print("torch", torch.__version__, dev.name)
shapes, _ = shape_table(dev)
name = "gpt2-124m-s1024"
shape = model_shape(load_spec(spec_for(*shapes[name])))
m = Physics(shape, dev)
for c, measured in by[name]:
    att = m.attention_kernel(c)
    line = [c.label(), att, round(measured / 2**20), round(m.physics(c).total_bytes / 2**20)]
    if m.zero_replayed(c):
        ev = zero_replay.emulated(shape.hf_config, shape.seq_len, c.per_device_train_batch_size,
                                  c.gradient_accumulation_steps, c.zero_stage, c.offload, True,
                                  c.optim, att, capability=dev.compute_capability)
        h = hashlib.sha1(repr(ev).encode()).hexdigest()[:10]
        a = zero_replay.trial_replay(shape, c, att, dev.compute_capability)
        line += [len(ev), h, round(a.peak_allocated / 2**20), round(a.peak_reserved / 2**20),
                 {k: round(v / 2**20) for k, v in a.reserved_by_stream.items()}]
    print(*line)
