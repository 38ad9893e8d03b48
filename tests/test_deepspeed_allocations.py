"""The emulation of DeepSpeed ZeRO's allocations against the real engine, on CPU."""

from __future__ import annotations

import multiprocessing
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import deepspeed_allocations as da  # noqa: E402

from autotune.plan import zero_replay  # noqa: E402
from autotune.records import GpuMemory, Measurement, Outcome  # noqa: E402

BUCKET = 2_000_000  # above the small model's 1.05M parameters: one fill per backward
PARAMETERS = 1_063_680  # of da.SMALL_GPT2 (GPT-2, 4 layers of 128, vocabulary 2048)


Phases = list[tuple[str, int, int]]


def _recorded() -> list[tuple[Phases, Phases]]:
    """Per config: the engine driven directly, and the same engine as a trial runs it."""
    return [(da.phases(*da.record(stage, offload, da.SMALL_GPT2, 64, 2, 2, bucket=BUCKET)),
             da.phases(*da.record_trial(stage, offload, da.SMALL_GPT2, 64, 2, 2,
                                        bucket=BUCKET)))
            for stage, offload in da.CONFIGS]


def test_settled_returns_once_another_thread_has_let_go_of_its_tensor():
    """`_settled`'s contract, without gloo: a thread still working outside the GIL with a
    tensor (one matmul, about 0.04 s here) is waited for, and the tensor is freed by then;
    also when the matmul's threads fault their first pages in (state D, not R: a fresh
    process's first matmul returned early so, once in 8 runs, before D counted)."""
    import threading
    import weakref

    import torch

    started, freed = threading.Event(), []

    def work() -> None:
        held = torch.empty(1 << 18)
        weakref.finalize(held.untyped_storage(), freed.append, True)
        a = torch.randn(1536, 1536)
        started.set()
        torch.mm(a, a)  # as gloo's worker: C++, the GIL released
        del held

    worker = threading.Thread(target=work)
    worker.start()
    started.wait()
    try:
        assert da._settled()
        assert freed
    finally:
        worker.join()


def _late_frees(settle: bool, n: int = 3000) -> int:
    """How many of `n` one-rank gloo all-reduces left their tensor's storage alive after
    its last Python reference went (and `da._settled()` where `settle`)."""
    import os
    import socket
    import weakref

    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_PORT"] = str(port)  # _one_rank keeps one already set
    da._one_rank(port)
    dist.init_process_group("gloo")
    late = 0
    for _ in range(n):
        bucket, freed = torch.empty(1000, dtype=torch.bfloat16), []
        weakref.finalize(bucket.untyped_storage(), freed.append, True)
        dist.all_reduce(bucket.narrow(0, 0, 500))
        del bucket
        if settle:
            da._settled()
        late += not freed
    dist.destroy_process_group()
    return late


def test_a_mark_waits_for_gloos_worker_to_drop_the_reduced_bucket():
    """gloo's worker thread holds an all-reduced tensor a moment past the caller's wait:
    the recordings' marks wait for it (`_settled`), so what a phase leaves behind does
    not depend on that thread's timing (it failed CI once)."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply_async(_late_frees, (True,)).get(timeout=120) == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_emulation_follows_the_real_engine_through_each_backward():
    """ZeRO-1 and ZeRO-2, each with and without optimizer offload, and ZeRO-3 without
    (its bucket and gradient partition kept from initialize on): each micro-batch's
    forward and backward as the real engine allocates it (gloo, one rank, in a process of its own so
    torch.distributed stays out of this one): the peak above the phase's start, and
    (without offload, whose host buffers share the CPU) what the phase leaves behind.
    Catches a bucket at the wrong time or size, gradients kept or freed wrongly (ZeRO-1
    keeps them to the boundary, ZeRO-2 copies them out), and the gradient partition's
    lifetime. The steps themselves differ (CPU AdamW's temporaries) and are not held.
    And the engine as a trial runs it (HF Trainer, the trial's TrainingArguments) holds
    what the engine driven directly holds, micro-batch by micro-batch and step by step,
    so the emulation stands for the trials the H100 file measured; only the first step's
    peak may differ: at stages 1-2 higher, by at most the 16-bit gradients (2 bytes per
    parameter); at stage 3 each step's lower, as stage3.py steps Trainer's two groups one
    by one."""
    # A pool whose exit kills its worker: a hung engine fails the test at its timeout,
    # where an executor's exit would wait on the worker for good.
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        recorded = pool.apply_async(_recorded).get(timeout=280)
    for (stage, offload), (engine, trial) in zip(da.CONFIGS, recorded, strict=True):
        assert [name for name, *_ in trial] == ["init", "s0m0", "s0 step", "s1m0", "s1 step"]
        assert trial[0][1] == pytest.approx(engine[0][1], abs=64 * 1024), \
            f"ZeRO-{stage} {offload}: init"
        # The engine's phases, two per micro-batch (forward and backward, the step), grouped
        # as the trial's: each micro-batch before the boundary, then the boundary's with
        # the optimizer step.
        for i, (name, live, peak) in enumerate(trial[1:]):
            mine = engine[1 + 2 * i:3 + 2 * i]
            label = f"ZeRO-{stage} {offload}: {name}"
            assert live == pytest.approx(mine[-1][1], abs=64 * 1024), label
            if stage == 3 and name.endswith("step"):  # stepped group by group
                assert 0 <= max(p for *_, p in mine) - peak <= 2 * PARAMETERS, label
            elif name != "s0 step":
                assert peak == pytest.approx(max(p for *_, p in mine), abs=64 * 1024), label
            else:  # Trainer's two parameter groups: see record_trial
                assert 0 <= peak - max(p for *_, p in mine) <= 2 * PARAMETERS + 64 * 1024, label
        marks: zero_replay.Marks = []
        events = zero_replay.emulated(da.SMALL_GPT2, 64, 2, 2, stage, offload, False,
                                      bucket=BUCKET, marks=marks)
        assert events is not None
        emulated = da.phases(events, marks)
        assert [name for name, *_ in engine] == [name for name, *_ in emulated]
        if stage == 3:  # its engine keeps no copy of the weights beside its own on CPU
            for i in range(len(engine)):  # so what each phase holds is the emulation's
                assert emulated[i][1] == pytest.approx(engine[i][1], abs=64 * 1024), \
                    engine[i][0]
            # Its init's peak, unlike a phase's end, cannot wait for other threads: it
            # may count a tensor another thread (gloo's worker, at ZeRO-3's partitioning)
            # has not freed yet when this one allocates the next. Once in a fresh-clone
            # CI run beside other tests' processes the engine's was 98,305 bytes above
            # the emulation's (2026-11-28); 3 runs alone and 3 beside busy processes
            # matched within 64 KiB.
            assert emulated[0][2] == pytest.approx(engine[0][2], abs=192 * 1024)
        for i in range(1, len(engine)):
            name = f"ZeRO-{stage} {offload}: {engine[i][0]}"
            if not name.endswith("fwd+bwd"):
                continue
            (_, start, _), (_, end, peak) = engine[i - 1], engine[i]
            (_, e_start, _), (_, e_end, e_peak) = emulated[i - 1], emulated[i]
            assert e_peak - e_start == pytest.approx(peak - start, rel=0.02), name
            if offload == "none":
                assert e_end - e_start == pytest.approx(end - start, abs=64 * 1024), name


def test_the_gpu_note_prints_the_zero_replay_and_what_lies_outside_the_allocator():
    """A 16-bit ZeRO-2 + offload trial's note on a GPU (its figures made up here, where no
    GPU is): the emulation's replayed peaks beside NVML's and the pinned host peak."""
    import importlib.util

    from autotune.config import TrialConfig
    from autotune.device import named_device
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec

    spec = importlib.util.spec_from_file_location("memory_accuracy",
                                                  ROOT / "benchmarks" / "memory_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = model_shape(load_spec(bench.spec_for(4, 128, 4, 256, 8192, 16)))
    config = TrialConfig.of(8, 2, precision="bf16", zero_stage=2, offload="optimizer")
    gpu = {"allocator_peak_allocated": 950 << 20, "nvml_overhead": 600 << 20,
           "pinned_host_peak": 48 << 20,
           "reserved_by_stream": {"0x5a1f00": 80 << 20, "default": 1020 << 20},
           "history_events": 5210,
           "segment_growth": [{"stream": "default", "bytes": 954 << 20, "segments": 1,
                               "where": "deepspeed/runtime/zero/stage_1_and_2.py:3266 "
                                        "setup_buckets"}],
           "large_segments": [{"event": 812, "segment": 1572 << 20, "request": 1646821376,
                               "stream": "default", "largest_free": 1572 << 20,
                               "fits": [1572 << 20], "pending": [],
                               "after": "transformers/trainer.py:2090 training_step",
                               "occupied": [{"segment": 1572 << 20, "blocks": [
                                   [1 << 30, "deepspeed/runtime/zero/stage_1_and_2.py:3266 "
                                             "setup_buckets", False],
                                   [2 << 20, "a smaller block", True]]}]}]}
    out = Outcome("ok", measured=Measurement(peaks_by_step=[[900 << 20, 1000 << 20],
                                                             [950 << 20, 1100 << 20]]),
                  gpu_memory=GpuMemory(**gpu))
    note = bench._allocator_note(out, config, shape, named_device("H100-80GB"))
    assert "allocator replay: allocated" in note
    assert "(by stream at the end: default " in note and " + reduction stream " in note
    assert "outside the allocator (NVML) 600 MiB" in note
    assert "pinned host peak 48 MiB" in note
    assert "reserved by stream default 1020 + 0x5a1f00 80 MiB" in note  # the model's first
    assert "segments grown (5210 allocator events kept):" in note
    assert "954 MiB in   1 on        default  deepspeed/runtime/zero/stage_1_and_2.py:3266" in note
    assert ("#812 1572 MiB on default for 1570.5 MiB: it fit in [1572.0], largest free "
            "1572.0, free waiting []; after transformers/trainer.py:2090 training_step") in note
    assert ("\n          in its 1572 MiB segment: 1024.0 MiB from deepspeed/runtime/zero/"
            "stage_1_and_2.py:3266 setup_buckets; 2.0 MiB from a smaller block (free "
            "waiting)") in note
    h100 = named_device("H100-80GB").compute_capability
    peaks = zero_replay.replayed_peaks(shape.hf_config, 256, 8, 2, 2, "optimizer",
                                       capability=h100)
    assert peaks is not None and f"reserved {peaks[1] / 2**20:.0f} MiB" in note
    # Without offload the fp32 master partition and the 16-bit gradients stay on the device.
    kept = zero_replay.replayed_peaks(shape.hf_config, 256, 8, 2, 2, "none", capability=h100)
    assert kept is not None and kept[0] > peaks[0] + 6 * shape.num_parameters
