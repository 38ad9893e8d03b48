"""What a recorded result is keyed by: two searches with the same exact fingerprint would
measure the same thing, and a near fingerprint says what a record can still teach.

The exact fingerprint (`Fingerprint.exact`):
- the model's architecture: its config less names and paths (a folder's config and the
  same config given inline are one model), the task, LoRA, the attention kernel asked for;
- the data: `synthetic`, or the length distribution of the real rows at `seq_len`
  (not their path: the same rows moved, or other rows of the same lengths, measure the
  same), whether the loss is on completions only, `seq_len`, the target batch;
- the trainer (trainer or sft) and how a trial is timed (warm-up and timed steps);
- the device: name, kind, memory, compute capability, ranks, nodes, the links between
  them; the per-trial memory budget and the trials run at once (they share a node);
- the space (its batch sizes and knob values) and what the rules ruled out of it, so
  the winner was chosen among the same;
- the versions of the libraries that change what a trial measures (autotune/versions.py,
  the list a resumed study checks too), and on a CPU how its RSS is measured (the mmap
  threshold held: trials/host_malloc.py).

The near fingerprint (`Fingerprint.near`) keeps what a record's winners carry over: the
architecture's figures (model type, parameters, layers, widths, vocabulary), the task,
LoRA, the data without `seq_len` (synthetic, or the rows' untruncated lengths), the
trainer, the ranks, and the device's family (its kind and compute capability major,
so an A10G and an L4 are kin, an A100 and an H100 are not). Another `seq_len`, target
batch, device of the family, space or library versions is a near match.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune import versions
from autotune.trials.host_malloc import measured_under

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.plan.shape import ModelShape
    from autotune.space import SpaceResult
    from autotune.spec import Spec

logger = logging.getLogger(__name__)

# Config keys that name or locate a model rather than shape it, or that only say how its
# weights are stored: none changes a trial's speed or memory (the precision knob does).
NAMES = ("name_or_path", "_name_or_path", "architectures", "transformers_version",
         "id2label", "label2id", "dtype", "torch_dtype", "_commit_hash")
# The shape's figures a near match keeps (no name, no seq_len, no full config).
NEAR_SHAPE = ("num_parameters", "num_layers", "hidden_size", "num_attention_heads",
              "vocab_size", "intermediate_size", "trainable_parameters", "task")
ROWS_READ = 1000  # real rows tokenized for their length distribution
QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


@dataclass(frozen=True)
class Fingerprint:
    exact: dict[str, Any]
    near: dict[str, Any]

    @property
    def key(self) -> str:
        return digest(self.exact)

    @property
    def near_key(self) -> str:
        return digest(self.near)


def digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def device_fields(device: DeviceSpec) -> dict[str, Any]:
    """The device as a dict: DeviceSpec's own serialisation, every field."""
    return device.to_dict()


def model_identity(spec: Spec, shape: ModelShape | None) -> dict[str, Any]:
    """The architecture: the config less names and paths, or a factory by its function."""
    m = spec.model
    arch: dict[str, Any]
    if shape is not None and shape.hf_config is not None:
        arch = {k: v for k, v in shape.hf_config.items() if k not in NAMES}
        labels = shape.hf_config.get("id2label")
        if labels:
            arch["num_labels"] = len(labels)
    elif m.factory is not None:
        arch = {"factory": m.factory}
    else:  # a hub id whose config could not be read here: its name is all there is
        arch = {"name_or_path": m.name_or_path}
    return {"architecture": arch, "task": m.task, "attn_implementation": m.attn_implementation,
            "lora": m.lora.model_dump() if m.lora else None}


def near_model(spec: Spec, shape: ModelShape | None) -> dict[str, Any]:
    """The architecture's figures only: they survive a transformers upgrade that adds
    config fields."""
    if shape is None:
        return model_identity(spec, shape) | {"architecture": {"factory": spec.model.factory}}
    figures = {k: getattr(shape, k) for k in NEAR_SHAPE}
    model_type = (shape.hf_config or {}).get("model_type", shape.name)
    return {"model_type": model_type, "figures": figures,
            "lora": spec.model.lora.model_dump() if spec.model.lora else None}


def row_lengths(spec: Spec) -> list[int]:
    """The token count of each of the first ROWS_READ rows, untruncated, as the trials'
    tokenizer and chat template make them."""
    from autotune.tasks.data import _encode_row, data_format, load_tokenizer, read_rows

    data = spec.data.model_dump()
    rows = read_rows(data["source"], ROWS_READ)
    fmt = data_format(data, list(rows.column_names))
    tok = load_tokenizer(data)
    only = bool(data.get("completion_only_loss"))
    return [len(_encode_row(tok, row, fmt, data, only, i)[0]) for i, row in enumerate(rows)]


def _quantiles(lengths: list[int]) -> list[int]:
    ordered = sorted(lengths)
    return [ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in QUANTILES]


def data_identity(spec: Spec, lengths: list[int] | None) -> tuple[dict, dict]:
    """(exact, near): synthetic, or the rows' length quantiles at seq_len (exact) and
    untruncated (near)."""
    d = spec.data
    if lengths is None:
        return {"rows": "synthetic", "seq_len": d.seq_len}, {"rows": "synthetic"}
    at = [min(n, d.seq_len) for n in lengths]
    common = {"completion_only_loss": d.completion_only_loss}
    return ({"rows": len(lengths), "lengths": _quantiles(at), "mean": round(
        sum(at) / len(at), 1), "seq_len": d.seq_len} | common,
            {"rows": len(lengths), "lengths": _quantiles(lengths)} | common)


def device_family(fields: dict[str, Any]) -> str:
    """A device's kin: the kind and compute capability major ("cuda-8": A100, A10G, L4)."""
    cc = fields.get("compute_capability")
    return f"{fields['kind']}-{cc[0]}" if cc else str(fields["kind"])


def fingerprint_of(spec: Spec, device: DeviceSpec, space: SpaceResult,
                   shape: ModelShape | None) -> Fingerprint:
    """The spec's fingerprints on `device` over `space` (its values and the rules that
    ruled configs of it out: a rule added since, by a newer autotune of the same version
    string, makes a record a near match). Real data is read and tokenized here (ROWS_READ
    rows): a SetupError says it cannot be."""
    lengths = None if spec.data.source == "synthetic" else row_lengths(spec)
    data, near_data = data_identity(spec, lengths)
    dev = device_fields(device)
    hw = spec.hardware
    exact = {
        "model": model_identity(spec, shape), "data": data,
        "target_batch_size": spec.target_batch_size, "trainer": spec.trainer,
        "measure": spec.measure.model_dump(),
        "device": {k: dev.get(k) for k in ("name", "kind", "memory_bytes",
                                            "compute_capability", "count", "nodes",
                                            "links", "native_bf16")},
        "hardware": {"gpus_per_trial": hw.gpus_per_trial, "nodes_per_trial": hw.nodes_per_trial,
                     "parallel_trials": hw.parallel_trials,
                     "memory_budget": hw.budget_bytes()},
        "space": space.space.choices(), "ruled_out": sorted(space.pruned),
        "versions": versions.library_versions(),
    }
    if heap := measured_under(device.is_cuda):  # a CPU's peaks: trials/host_malloc.py
        exact["heap"] = heap
    near = {"model": near_model(spec, shape), "data": near_data, "trainer": spec.trainer,
            "world_size": spec.world_size, "device": device_family(dev)}
    return Fingerprint(exact, near)
