"""Every type that travels as a dict (to a Ray task and back, to a trial process as JSON,
into the study and summary.json) goes through one `to_dict` and one `from_dict`, and comes
back whole: each example sets every field off its default, so a field added later and not
carried fails here, not on a cluster."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from autotune import knobs
from autotune.config import TrialConfig
from autotune.device import DeviceSpec, local_device, named_device
from autotune.plan.shape import ModelShape
from autotune.records import Outcome, Record
from autotune.summary import Confirmation, ConfirmedConfig, Summary
from autotune.trials.executor import Probe
from autotune.trials.launch import NodeReport
from autotune.trials.protocol import TrialRequest

GiB = 2**30


def _same(a: Any, b: Any) -> bool:
    """Equal field by field, fields that equality skips (a device's peak FLOP/s and links)
    included, and of the same types (a tuple is not a list)."""
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(
            _same(getattr(a, f.name), getattr(b, f.name))
            for f in dataclasses.fields(a) if not f.name.startswith("_"))
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _every_field_set(obj: Any) -> list[str]:
    """The fields `obj` leaves at their defaults: an example must set them all."""
    left = []
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if getattr(obj, f.name) == default:
            left.append(f.name)
    return left


def _config() -> TrialConfig:
    """A config with every knob off its baseline: a knob added to the table is carried."""
    values = {k.name: next(v for v in k.allowed() if v != k.baseline) for k in knobs.table()}
    return TrialConfig.of(4, 2, **values)


DEVICE = DeviceSpec("H100-80GB", "cuda", 80 * GiB, (9, 0), 16, {"bf16": 989e12, "fp32": 67e12},
                    native_bf16=True, nodes=2,
                    links={"intra": "NVLink", "inter": "InfiniBand 400 Gb/s"})
OUTCOME = Outcome("ok", samples_per_second=12.5, tokens_per_second=1600.0,
                  peak_memory_bytes=3 * GiB, step_seconds=[0.5, 0.25], wall_seconds=30.5,
                  timed_seconds=0.75, predicted_memory_bytes=2 * GiB, error="a warning",
                  shape={"num_layers": 2}, extra={"mfu": 0.25, "node": "n1"})
SHAPE = ModelShape(1_000_000, 2, 64, 2, 512, 32, causal_lm=False, intermediate_size=256,
                   name="tiny", attn_implementation="sdpa", task="masked-lm",
                   trainable_parameters=1000, hf_config={"model_type": "bert"},
                   lora={"r": 8}, embedding_parameters=32768, quantizable_parameters=4096,
                   largest_linear=256, decoder_layers=2, target_len=16, pixels=3072,
                   trainer="dpo", generated_len=8, reference=True)
RECORD = Record(_config(), OUTCOME, "recipe", 3)
CONFIRMATION = Confirmation(
    3, 8, [ConfirmedConfig("best", _config(), 3, [12.0, 12.5, 13.0], [7, 8, 9])],
    _config(), speedup=1.5, speedup_low=1.25, speedup_high=1.75,
    vs_recipe={"speedup": 1.125, "low": 1.0, "high": 1.25})
SUMMARY = Summary(
    model=SHAPE.to_dict(), device=DEVICE, memory_limit_bytes=GiB, target_batch_size=16,
    world_size=2, seq_len=32, trials=[RECORD], pruned_by_rules={"precision=fp16": "why"},
    search={"wall_seconds": 95.5, "study_name": "autotune-abc"},
    exports={"training_args": "training_args.json"}, projection={"steps": 1000},
    memory_components={"weights": 4096}, confirmation=CONFIRMATION,
    autotune_version="9.9.9",
    remembered={"from": "2026-11-27T10:00:00+00:00", "output": "runs/a", "reconfirmed": True},
    seeded_by=[{"key": "abc123", "configs": 2}])

EXAMPLES = {
    "DeviceSpec": (DEVICE, DeviceSpec.from_dict),
    "Probe": (Probe("node-1", 8, DEVICE), Probe.from_dict),
    "TrialRequest": (TrialRequest(
        spec={"model": {"name_or_path": "gpt2"}}, config=_config().to_dict(),
        training_args={"bf16": True}, shape=SHAPE.to_dict(), memory_budget_bytes=GiB,
        timeout_s=90.0, cpu_threads=4, world_size=2, nodes=2, on_cpu=True, node_trials=2,
        seed=7, import_paths=["/models"]), TrialRequest.from_dict),
    "Outcome": (OUTCOME, Outcome.from_dict),
    "Record": (RECORD, Record.from_dict),
    "NodeReport": (NodeReport(1, code=-9, timed_out=True, ranks={1: OUTCOME},
                              log_tail="Killed", launch="warm", lost="held", node="n2"),
                   NodeReport.from_dict),
    "ModelShape": (SHAPE, ModelShape.from_dict),
    "ConfirmedConfig": (CONFIRMATION.rows[0], ConfirmedConfig.from_dict),
    "Confirmation": (CONFIRMATION, Confirmation.from_dict),
    "Summary": (SUMMARY, Summary.from_dict),
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_each_type_comes_back_whole_through_json(name):
    obj, from_dict = EXAMPLES[name]
    assert not _every_field_set(obj), f"{name}: the example leaves {_every_field_set(obj)} " \
        "at their defaults; set them, so the round trip covers them"
    back = from_dict(json.loads(json.dumps(obj.to_dict())))  # strict JSON: no default=str
    assert _same(back, obj), (back, obj)


def test_a_trial_request_reaches_the_trial_process_whole():
    request, _ = EXAMPLES["TrialRequest"]
    assert _same(TrialRequest.from_json(request.to_json()), request)


def test_the_devices_autotune_reads_come_back_whole():
    for device in (local_device(), named_device("A100-80GB", 8)):
        assert _same(DeviceSpec.from_dict(json.loads(json.dumps(device.to_dict()))), device)


def test_a_device_from_an_older_or_newer_autotune_reads_with_defaults():
    """summary.json from before native_bf16 and the peak FLOP/s, and one with a key this
    version does not know; gpus_per_node is for readers of the file, derived."""
    old = {"name": "NVIDIA H200", "kind": "cuda", "memory_bytes": 150 * GiB,
           "compute_capability": [9, 0], "count": 8, "gpus_per_node": 8, "later": 1}
    device = DeviceSpec.from_dict(old)
    assert device.compute_capability == (9, 0) and not device.native_bf16
    assert device.peak_flops == {} and device.nodes == 1
    assert DEVICE.to_dict()["gpus_per_node"] == 8
