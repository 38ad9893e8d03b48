"""Every type that travels as a dict (to a Ray task and back, to a trial process as JSON,
into the study and summary.json) goes through one `to_dict` and one `from_dict`, and comes
back whole: each example sets every field off its default, so a field added later and not
carried fails here, not on a cluster."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from autotune import knobs
from autotune.config import TrialConfig
from autotune.device import DeviceSpec, local_device, named_device
from autotune.plan.shape import ModelShape
from autotune.records import (
    SAMPLES_PER_SECOND,
    TOKENS_PER_SECOND,
    Compile,
    Failure,
    Generation,
    GpuMemory,
    Launch,
    Lengths,
    Measurement,
    ModelBuild,
    Outcome,
    Part,
    Phases,
    Precompute,
    RanWith,
    Record,
)
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


def _every_field_set(obj: Any, where: str = "") -> list[str]:
    """The fields `obj` leaves at their defaults, and those of the typed parts it holds
    (an Outcome's): an example must set them all."""
    left = []
    for f in dataclasses.fields(obj):
        if f.name.startswith("_"):
            continue
        value = getattr(obj, f.name)
        if isinstance(value, Part):
            left += _every_field_set(value, f"{where}{f.name}.")
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            continue
        if value == default:
            left.append(where + f.name)
    return left


def _config() -> TrialConfig:
    """A config with every knob off its baseline: a knob added to the table is carried."""
    values = {k.name: next(v for v in k.allowed() if v != k.baseline) for k in knobs.table()}
    return TrialConfig.of(4, 2, **values)


DEVICE = DeviceSpec("H100-80GB", "cuda", 80 * GiB, (9, 0), 16, {"bf16": 989e12, "fp32": 67e12},
                    native_bf16=True, nodes=2,
                    links={"intra": "NVLink", "inter": "InfiniBand 400 Gb/s"})
OUTCOME = Outcome(
    "ok", samples_per_second=12.5, tokens_per_second=1600.0, peak_memory_bytes=3 * GiB,
    step_seconds=[0.5, 0.25], wall_seconds=30.5, timed_seconds=0.75,
    predicted_memory_bytes=2 * GiB, error="a warning", shape={"num_layers": 2},
    measured=Measurement(
        micro_batches=[4, 4], micro_batches_by_rank={0: [4, 4], 1: [4, 3]},
        peak_memory_by_rank={0: 3 * GiB, 1: None}, peaks_by_step=[[GiB, 2 * GiB]],
        warmup_seconds=1.5, losses=[6.5, 6.25], grad_norms=[1.5, 1.25], loss_scale_skips=1,
        loss_drift=0.01, loss_drift_noise=0.02, loss_accumulation_scale=2,
        parity_gap=1e-6, parity_twin=3, mfu=0.25,
        lengths=Lengths(min=3.0, p50=20.0, p90=30.0, max=32.0, mean=19.5, seq_len=32.0,
                        padding=0.4, truncated=0.125, loss_tokens=0.5),
        num_parameters=1000, trainable_parameters=100, flop_parameters=900,
        flop_trainable_parameters=90, cpu_threads=2, mmap_threshold=131072),
    phases=Phases(launch=0.5, model=1.5, engine=0.25, warmup=2.0, steps=0.75,
                  model_build=ModelBuild(
                      weights="random", device="cuda:0", partitioned=False,
                      quantized="on the device, a block at a time", routing="random routers",
                      disk_read_bytes=4096, disk_write_bytes=0, held_parameter_bytes=GiB,
                      parameter_bytes=2 * GiB, host_peak_rss_bytes=GiB // 2,
                      device_peak_bytes=GiB)),
    ran_with=RanWith(tf32=True, compiled=True, compile_mode="max-autotune",
                     compiled_graphs=3, liger=True, attn_implementation="sdpa",
                     wrapped_as="DeepSpeedEngine", bitsandbytes="libbitsandbytes_cuda.so",
                     sequence_parallel=2, context_parallel=2, tiled_mlps=2,
                     tiled_loss_calls=4, checkpointing="selective 2/2",
                     activation_offloading=True),
    compile=Compile(seconds=12.5, cache="warm", cache_hits=4, cache_misses=1,
                    charged_seconds=11.0, recompiled_steps=1, run_seconds=600.0),
    launch=Launch(kind="warm", cold_because="a new environment", lease_wait_s=2.5,
                  launcher_start_s=1.25,
                  node="n1", nodes=2, rank_nodes={0: "n1", 1: "n2"}, rank=1,
                  started_at=1.7e9, ended_at=1.7e9 + 30, time_limit_s=90.0,
                  compile_allowance_s=60.0, compile_not_counted_s=12.5,
                  infrastructure_failures=["Ray lost the trial's worker"]),
    gpu_memory=GpuMemory(
        allocator_peak_reserved=3 * GiB, allocator_peak_allocated=2 * GiB,
        pinned_host_peak="unavailable: RuntimeError", nvml_overhead=GiB // 2,
        nvml_process="pid", reserved_by_stream={"default": 2 * GiB, "7": GiB},
        segment_growth=[{"bytes": GiB, "stream": "default"}],
        large_segments="unavailable: KeyError", history_events=10, history_full=True,
        trace_file="/tmp/trace.jsonl.gz"),
    failure=Failure(setup_field="data.source", setup_message="no such file",
                    host_memory=True),
    precompute=Precompute(ref_seconds=1.5, charged_seconds=0.5),
    generation=Generation(seconds=[0.5, 0.25], training_seconds=[0.25, 0.5], share=0.5,
                          completion_length=16),
    diagnostics={"bitsandbytes": {"backend": "cuda"}})
SHAPE = ModelShape(1_000_000, 2, 64, 2, 512, 32, causal_lm=False, intermediate_size=256,
                   name="tiny", attn_implementation="sdpa", task="masked-lm",
                   trainable_parameters=1000, hf_config={"model_type": "bert"},
                   lora={"r": 8}, embedding_parameters=32768, quantizable_parameters=4096,
                   largest_linear=256, decoder_layers=2, target_len=16, pixels=3072,
                   trainer="dpo", generated_len=8, reference=True, gated_mlp=True)
RECORD = Record(_config(), OUTCOME, "recipe", 3, TOKENS_PER_SECOND)
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


REPORTS = Path(__file__).resolve().parents[1] / "reports"


@pytest.mark.parametrize("name", ["tiny-gpt2", "gpt2-h200"])
def test_a_summary_from_before_the_typed_parts_reads_into_them(name):
    """summary.json written when an outcome's facts were one `extra` dict (the bundled
    reports', a study's or the results store's records): every key lands in its typed
    field, none is left over, and the figures derived from them are the file's."""
    d = json.loads((REPORTS / name / "summary.json").read_text())
    summary = Summary.from_dict(d)
    for t, raw in zip(summary.trials, d["trials"], strict=True):
        extra, o = raw["outcome"].get("extra") or {}, t.outcome
        assert not o.diagnostics, o.diagnostics
        assert t.objective == extra.get("objective", SAMPLES_PER_SECOND)
        assert o.launch.kind == extra.get("launch")
        assert o.launch.lease_wait_s == extra.get("lease_wait_s")
        assert o.measured.losses == extra.get("losses")
        assert o.measured.cpu_threads == extra.get("cpu_threads")
        assert o.measured.mfu == extra.get("mfu")
        assert o.ran_with.wrapped_as == extra.get("wrapped_as")
        assert o.ran_with.attn_implementation == extra.get("attn_implementation")
        assert o.phases.seconds() == extra.get("phases", {})
        assert o.gpu_memory.allocator_peak_reserved == extra.get("allocator_peak_reserved")
        if "model_build" in extra:
            assert o.phases.model_build.to_dict() == {
                k: v for k, v in extra["model_build"].items() if v is not None}
        # and through this version's layout, whole
        assert _same(Record.from_dict(json.loads(json.dumps(t.to_dict()))), t)
    assert summary.best.number == d["best"]["number"]
    assert summary.speedup == d["speedup"]
    assert summary.efficiency == d["search"].get("efficiency")


def test_an_old_outcome_s_renamed_keys_and_the_worker_s_objective():
    """The keys renamed on the way into the typed parts, the objective a worker wrote
    (now the driver's, on the Record), and a key no part holds (kept as a diagnostic)."""
    old = {"status": "ok", "samples_per_second": 10.0, "tokens_per_second": 200.0,
           "extra": {"objective": "tokens_per_second", "compile_seconds": 30.0,
                     "run_seconds": 300.0, "compile": {"seconds": 28.0, "cache": "cold"},
                     "time_limit": {"seconds": 90, "compile_allowance_s": 60,
                                    "compile_not_counted_s": 28.0},
                     "precompute_ref_seconds": 2.0, "generation_share": 0.5,
                     "setup_field": "data.source", "host_memory": True, "later": 1}}
    record = Record.from_dict({"config": TrialConfig(4, 1).to_dict(), "outcome": old})
    o = record.outcome
    assert record.objective == TOKENS_PER_SECOND
    assert record.score == pytest.approx(200.0 * 300 / 330)
    assert o.score_for(SAMPLES_PER_SECOND) == pytest.approx(10.0 * 300 / 330)
    assert (o.compile.charged_seconds, o.compile.seconds, o.compile.cache) == (
        30.0, 28.0, "cold")
    assert (o.launch.time_limit_s, o.launch.compile_not_counted_s) == (90, 28.0)
    assert o.precompute.ref_seconds == 2.0 and o.generation.share == 0.5
    assert o.failure.setup_field == "data.source" and o.failure.host_memory
    assert o.diagnostics == {"later": 1}
    assert Record.from_dict({"config": TrialConfig(4, 1).to_dict(),
                             "outcome": {"status": "ok"}}).objective == SAMPLES_PER_SECOND
