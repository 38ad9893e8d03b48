"""benchmarks/rank_memory.py's probe, loaded into each rank of a cold trial through
PYTHONPATH: what autograd saves in the rank's first training step (each storage once) and
its RSS before the forward, after it and after the backward, one JSON line per rank in
$AUTOTUNE_RANK_MEMORY_OUT. Does nothing in any other process."""

import os

if os.environ.get("AUTOTUNE_RANK_MEMORY_OUT") and "RANK" in os.environ:
    import collections
    import json

    import psutil
    import torch
    import transformers

    _step = transformers.Trainer.training_step
    _seen_steps = []

    def _rss() -> float:
        return psutil.Process().memory_info().rss / 2**20

    def training_step(self, model, inputs, num_items_in_batch=None):
        if _seen_steps:
            return _step(self, model, inputs, num_items_in_batch)
        _seen_steps.append(1)
        saved: dict[int, int] = {}
        by_shape: collections.Counter = collections.Counter()

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in saved and storage.nbytes():
                saved[storage.data_ptr()] = storage.nbytes()
                by_shape[f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += (
                    storage.nbytes())
            return t

        row = {"rank": int(os.environ["RANK"]), "rss_before_mib": _rss(),
               "tokens": int(inputs["input_ids"].numel())}
        backward = self.accelerator.backward

        def measured_backward(loss, **kwargs):
            row.update({"rss_after_forward_mib": _rss(),
                        "saved_mib": sum(saved.values()) / 2**20,
                        "largest": [[k, v / 2**20] for k, v in by_shape.most_common(6)]})
            out = backward(loss, **kwargs)
            row["rss_after_backward_mib"] = _rss()
            return out

        self.accelerator.backward = measured_backward
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                return _step(self, model, inputs, num_items_in_batch)
        finally:
            self.accelerator.backward = backward
            path = os.path.join(os.environ["AUTOTUNE_RANK_MEMORY_OUT"],
                                f"rank-{row['rank']}.jsonl")
            with open(path, "a", encoding="utf-8") as out:
                out.write(json.dumps(row) + "\n")

    transformers.Trainer.training_step = training_step
