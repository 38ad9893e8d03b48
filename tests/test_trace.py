"""The traced activation term (plan/trace.py): a fake step counts what a real one holds,
its terms move with the knobs as the kernels dictate, and it brings the uncalibrated
prediction of the recorded H100 trials within the issue's 10%."""

from __future__ import annotations

import contextlib
import importlib.util
import statistics
from pathlib import Path

from autotune.config import TrialConfig
from autotune.device import DeviceSpec, named_device
from autotune.plan.memory import Physics
from autotune.plan.shape import shape_from_hf_config
from autotune.plan.trace import _cuda_dropout, _LiveBytes, _peak, trace_activations
from autotune.records import GpuMemory, Measurement, Outcome
from autotune.tasks.models import load_hf_config

ROOT = Path(__file__).resolve().parents[1]
GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 64, "n_head": 4, "vocab_size": 512,
        "n_positions": 64}
S = 64


def test_a_fake_step_counts_what_a_real_step_holds():
    """Same model, same step, CPU rules: fake tensors (no bytes) and real ones agree."""
    cfg = load_hf_config({"config": GPT2})
    for mode, ckpt in (("fp32", False), ("autocast16", False), ("fp32", True)):
        fake = _peak(cfg, "causal-lm", S, 2, 2, mode, ckpt, "sdpa", False, None)
        real = _peak(cfg, "causal-lm", S, 2, 2, mode, ckpt, "sdpa", False, None, fake=False)
        assert abs(fake - real) <= 0.02 * real, (mode, ckpt, fake, real)


def test_depth_and_batch_are_read_bilinearly():
    """Traced on one and two layers, the term predicts the four-layer model at batch 3."""
    cfg = load_hf_config({"config": GPT2})
    for mode, ckpt in (("autocast16", False), ("fp32", True), ("native16", False)):
        t = trace_activations(GPT2, "causal-lm", S, mode, ckpt, "sdpa", True)
        full = _peak(cfg, "causal-lm", S, 4, 3, mode, ckpt, "sdpa", True, None)
        assert abs(t.fixed + 3 * t.per_sample - full) <= 0.01 * full, (mode, ckpt)


def test_a_gpu_trace_keeps_cudas_bool_dropout_mask():
    """CUDA's dropout is one kernel keeping a bool mask for the backward; the CPU build
    keeps a noise tensor in the input's dtype, which a GPU trace must not count."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    def kept(patch) -> list[int]:
        events: list = []
        with FakeTensorMode():
            x = torch.randn(4, 256, dtype=torch.bfloat16, requires_grad=True)
            tracker = _LiveBytes(events)
            with tracker.mode, patch:
                y = torch.nn.functional.dropout(x, 0.1, True)
                z = torch.nn.functional.dropout(x, 0.1, False)  # evaluation: no mask
        assert z is x and y.shape == x.shape
        return sorted(n for kind, _, n, _ in events if kind == "alloc")

    n = 4 * 256
    assert kept(_cuda_dropout()) == [n, 2 * n]  # the bool mask and the output
    assert kept(contextlib.nullcontext()) == [2 * n, 2 * n]  # the CPU's noise and output


def test_traced_terms_follow_the_knobs():
    t = lambda mode="autocast16", ckpt=False, attn="sdpa": trace_activations(  # noqa: E731
        GPT2, "causal-lm", S, mode, ckpt, attn, True)
    layers, heads = GPT2["n_layer"], GPT2["n_head"]
    # Eager keeps, per score, the fp32 softmax, the dropout's bool mask (CUDA's fused
    # dropout) and its 16-bit output for the matmul with the values; the fused kernel
    # keeps none of them (within 5%: the per-sample figure is read off two batches).
    scores = layers * heads * S * S
    assert t(attn="eager").per_sample - t().per_sample >= 0.95 * scores * (4 + 1 + 2)
    assert t(ckpt=True).per_sample < 0.6 * t().per_sample
    assert t("native16").per_sample < t().per_sample < t("fp32").per_sample
    # Autocast's 16-bit weight copies are held once per step, whatever the batch.
    params = shape_from_hf_config(load_hf_config({"config": GPT2}), S).num_parameters
    assert abs(t().fixed - 2 * params) < 0.15 * 2 * params


def test_physics_traces_for_a_gpu_and_falls_back_to_the_formulas():
    shape = shape_from_hf_config(load_hf_config({"config": GPT2}), S)
    h100, cpu = named_device("H100"), DeviceSpec("cpu", "cpu", 64 * 2**30)
    c = TrialConfig.of(4, 4, precision="bf16")
    assert Physics(shape, h100).trace(c) is not None
    assert Physics(shape, cpu).trace(c) is None  # a CPU peak is RSS: the formulas
    broken = shape.__class__(**(shape.to_dict() | {"hf_config": {"model_type": "no-such"}}))
    formula = shape.__class__(**(shape.to_dict() | {"hf_config": None}))
    assert Physics(broken, h100).trace(c) is None
    assert (Physics(broken, h100).physics(c).total_bytes
            == Physics(formula, h100).physics(c).total_bytes)


def _bench():
    path = ROOT / "benchmarks" / "memory_accuracy.py"
    spec = importlib.util.spec_from_file_location("memory_accuracy", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_prediction_of_the_recorded_h100_trials():
    """Issue 14's figures on the 14 recorded H100 trials of GPT-2 124M at s1024: before
    any trial the median error is at most 10% (30% with the formulas alone, 7.9% with the
    traced activations, 3.0% with the allocator replay, 0.2% since the replay makes
    cuBLAS's workspaces, empties the cache where DeepSpeed does and keeps CUDA's bool
    dropout masks, and the runtime beyond the allocator is the H100's measured figure).
    Every row is replayed (ZeRO-3 since its engine is emulated: it had been 5.0% under
    through the formulas) and within 1% (0.2%). Calibrated on the other trials: median at
    most 2% (0.0%), each row within 1% (0.3%)."""
    from autotune.plan.calibration import leave_one_out_errors
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec

    bench = _bench()
    device, by_shape = bench.recorded(str(ROOT / "benchmarks" / "memory_accuracy_h100.txt"))
    errors = [e for name, measured in by_shape.items()
              for e in bench.physics_errors(device, name, measured)]
    assert len(errors) == 14
    assert statistics.median(errors) <= 0.01, errors
    (name, measured), = by_shape.items()
    shape = model_shape(load_spec(bench.spec_for(*bench.GPU_SHAPES[name])))
    physics = Physics(shape, device)
    calibrated = leave_one_out_errors(shape, device, 1, measured)
    assert statistics.median(calibrated) <= 0.02
    for (c, bytes_), error in zip(measured, calibrated, strict=True):
        assert physics.reserved_peak(c) is not None, c.label()
        assert error <= 0.01, (c.label(), error)
        uncalibrated = abs(physics.physics(c).total_bytes - bytes_) / bytes_
        assert uncalibrated <= 0.01, (c.label(), uncalibrated)
    # The measured bf16 family is concave (1480 then 1273 MiB per sample from batch 4 to
    # 8 to 16), and so is the replay.
    peak = {c.per_device_train_batch_size: physics.reserved_peak(c) for c, _ in measured
            if c.label() in ("b4x8 bf16 adamw_torch", "b8x4 bf16 adamw_torch",
                             "b16x2 bf16 adamw_torch")}
    assert (peak[8] - peak[4]) / 4 > 1.1 * (peak[16] - peak[8]) / 8, peak
    # ZeRO-1 over ZeRO-2 by about what they measured apart (1096 MiB), from the engine's
    # emulation: ZeRO-1 keeps its bucket and the gradients through the accumulation, and
    # ZeRO-2's partition comes from the reduction stream's pool (one pool: level).
    zero = {c.zero_stage: physics.physics(c).total_bytes for c, _ in measured
            if c.zero_stage in (1, 2) and c.offload == "none"}
    assert 0.85 * 1096 * 2**20 < zero[1] - zero[2] < 1.15 * 1096 * 2**20, zero


def test_the_toolbox_file_is_read_back_with_each_groups_model():
    """`memory_accuracy.py --from memory_accuracy_toolbox.txt` re-predicts each group as
    it ran: its sections are "SHAPE: GROUP", and the LoRA group's model has adapters (it
    had found no section and stopped on an empty median)."""
    bench = _bench()
    device, by_section = bench.recorded(str(ROOT / "benchmarks"
                                            / "memory_accuracy_toolbox.txt"))
    assert not device.is_cuda
    assert {k: len(v) for k, v in by_section.items()} == {
        "gpt2-4x256-s256: attention (eager and sdpa)": 7,
        "gpt2-4x256-s256: full fine-tuning": 5, "gpt2-4x256-s256: LoRA r=8 all-linear": 5}
    lora = bench.section_shape("gpt2-4x256-s256: LoRA r=8 all-linear", device)
    full = bench.section_shape("gpt2-4x256-s256: full fine-tuning", device)
    assert lora.lora is not None and full.lora is None
    assert lora.trainable_parameters < full.num_parameters / 10


def test_the_gpu_benchmark_sets_the_replay_beside_the_allocators_peaks():
    bench = _bench()
    shape = shape_from_hf_config(load_hf_config({"config": GPT2}), S)
    c = TrialConfig.of(4, 4, precision="bf16")
    out = Outcome("ok", measured=Measurement(peaks_by_step=[[20 * 2**20, 32 * 2**20],
                                                             [30 * 2**20, 40 * 2**20]]),
                  gpu_memory=GpuMemory(allocator_peak_allocated=30 * 2**20))
    note = bench._allocator_note(out, c, shape, named_device("H100"))
    assert "reserved 40 MiB, peak set at step 2" in note and "allocator replay" in note
