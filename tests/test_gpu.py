"""GPU-only paths (skipped without CUDA; run with `pytest -m gpu` on a GPU machine).

Ran once, on an H100 (reports/gpu-h100-2026-11-23.md): the OOM test passed; the other
four trained and then failed on an MFU bug fixed since. benchmarks/gpu_proof.sh runs them
first when a GPU is lent."""

from __future__ import annotations

import copy
import os

import pytest

from autotune.config import TrialConfig
from autotune.device import local_device
from autotune.trials.launch import run_trial
from tests.conftest import TINY_SPEC, trial_request

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

BIG = {"model": {"config": {"model_type": "gpt2", "n_layer": 12, "n_embd": 1024,
                            "n_head": 16, "vocab_size": 50257, "n_positions": 1024}},
       "data": {"seq_len": 1024}, "target_batch_size": 4096,
       "measure": {"warmup_steps": 1, "steps": 2}}


def _spec(tmp_path, base=TINY_SPEC) -> dict:
    return copy.deepcopy(base) | {"output": str(tmp_path)}


def test_cuda_oom_is_an_oom_outcome(tmp_path):
    out = run_trial(trial_request(_spec(tmp_path, BIG), TrialConfig(4096, 1), timeout_s=600))
    assert out.status == "oom", out.error


@pytest.mark.parametrize("precision,optim", [("bf16", "adamw_torch_fused"),
                                             ("fp16", "adamw_torch"), ("tf32", "adamw_torch")])
def test_mixed_precision_and_fused_trials_run(tmp_path, precision, optim):
    dev = local_device()
    if precision in ("bf16", "tf32") and not dev.supports_bf16():
        pytest.skip("needs compute capability 8.0+")
    out = run_trial(trial_request(_spec(tmp_path), TrialConfig.of(4, 4, precision=precision,
                                                                  optim=optim), timeout_s=600))
    assert out.ok, out.error
    assert out.peak_memory_bytes and out.gpu_memory.allocator_peak_reserved
    # The running peaks after each step end where the trial's own figures do.
    steps = out.measured.peaks_by_step
    assert len(steps) == len(out.step_seconds)
    assert steps[-1] == [out.gpu_memory.allocator_peak_allocated,
                         out.gpu_memory.allocator_peak_reserved]
    assert all(a <= r for a, r in steps)
    # nvidia-ml-py is a dependency: on a GPU the process's NVML figure must be there.
    assert isinstance(out.gpu_memory.nvml_overhead, int), out.gpu_memory.nvml_overhead
    # The cache's segments at the end, per stream's pool: the model's own stream holds them.
    held = out.gpu_memory.reserved_by_stream
    assert held.get("default"), held
    assert 0 < sum(held.values()) <= out.gpu_memory.allocator_peak_reserved
    if dev.peak_flops.get(precision):
        assert 0 < out.measured.mfu < 1


def test_deepspeed_zero2_trial_on_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_MEMORY_HISTORY", "1")  # as the proof's memory step sets it
    out = run_trial(trial_request(_spec(tmp_path), TrialConfig.of(4, 4, zero_stage=2),
                                  timeout_s=600))
    assert out.ok, out.error
    # Where the allocator's segments came from: DeepSpeed's gradient buckets among them.
    grown = out.gpu_memory.segment_growth
    assert isinstance(grown, list) and grown, grown
    assert any(r["where"].startswith("deepspeed/") for r in grown), grown


@pytest.mark.skipif(bool(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")),
                    reason="the replay follows the allocator's default settings")
def test_the_allocator_replay_keeps_torchs_rules_and_pools_per_stream():
    """The rules plan/allocator.py replays, held to this GPU's caching allocator, step by
    step: a 20 MiB segment for a request of 1-10 MiB, a 2 MiB one for a small request
    and the next small one in it, a cached block split for a request that fits it, freed
    neighbours merged into a block that takes what neither could, and a pool per stream
    (a block is cached for the stream that allocated it: what puts DeepSpeed's reduction
    stream beside the model's in the ZeRO replay), per stream as the snapshot sums it."""
    import torch

    from autotune.plan.allocator import CachingAllocator
    from autotune.trials.gpu_memory import reserved_by_stream

    MiB = 2**20
    side = torch.cuda.Stream()
    steps = [("alloc", "m", 3 * MiB, None),  # 20 MiB segment
             ("alloc", "a", 100 * MiB, None), ("free", "a", 0, None),
             ("alloc", "r", 60 * MiB, side),  # stream 0's cached 100 MiB is not its
             ("alloc", "b", 60 * MiB, None),  # split from it: 40 left
             ("free", "r", 0, None), ("alloc", "r2", 50 * MiB, side),
             ("alloc", "k", 4096, None), ("alloc", "k2", 4096, None),  # one 2 MiB segment
             ("alloc", "c", 30 * MiB, None),  # the 40, not the 17 left of the 20
             ("free", "b", 0, None), ("free", "c", 0, None),  # merged: 100 again
             ("alloc", "d", 95 * MiB, None),  # only the merged block takes it
             ("alloc", "e", 80 * MiB, None)]  # nothing cached fits: a new segment
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == 0, "a tensor of another test is still alive"
    base = torch.cuda.memory_reserved()
    live: dict[str, torch.Tensor] = {}
    replay = CachingAllocator()
    for kind, key, nbytes, stream in steps:
        if kind == "free":
            del live[key]
            replay.free(key)
            continue
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            live[key] = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        replay.malloc(key, nbytes, 1 if stream is not None else 0)
        assert torch.cuda.memory_reserved() - base == replay.reserved, (key, replay.reserved)
    torch.cuda.synchronize()
    assert replay.reserved == 262 * MiB
    held = reserved_by_stream(torch.cuda.memory_snapshot(), torch.cuda.current_device())
    assert sorted(held.values()) == sorted(replay.reserved_by_stream.values()), held
