"""The caching-allocator replay (plan/allocator.py): torch's rules for segments, reuse,
splitting and merging, and the replayed peak of a traced model's training steps."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config import TrialConfig
from autotune.device import DeviceSpec, named_device
from autotune.optimizers import ADAM, optimizer
from autotune.plan import zero_replay
from autotune.plan.allocator import (
    CachingAllocator,
    TracedStep,
    TrialReplay,
    blas_workspaces,
    ddp_buckets,
    replay,
    training_events,
)
from autotune.plan.memory import (
    COMPONENTS,
    CUDA_RUNTIME_BYTES,
    NCCL_COMM_BYTES,
    Physics,
)
from autotune.plan.shape import shape_from_hf_config
from autotune.plan.step_trace import _deepened, _record, trace_step
from autotune.tasks.models import load_hf_config
from autotune.trials.gpu_memory import load_trace

MiB = 2**20
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512,
        "n_positions": 64}


def test_segments_are_sized_by_the_request():
    a = CachingAllocator()
    a.malloc("tiny", 100)  # small pool: one 2 MiB segment
    assert a.reserved == 2 * MiB and a.allocated == 512
    a.malloc("mid", 3 * MiB)  # under 10 MiB: a 20 MiB segment
    assert a.reserved == 22 * MiB
    a.malloc("fits", 11 * MiB)  # the 17 MiB left of that segment take it
    assert a.reserved == 22 * MiB
    a.malloc("big", 11 * MiB + 1)  # its own segment, rounded up to 2 MiB
    assert a.reserved == 22 * MiB + 12 * MiB


def test_a_freed_block_is_reused_only_where_the_request_fits():
    a = CachingAllocator()
    a.malloc("x", 100 * MiB)
    a.free("x")
    a.malloc("y", 60 * MiB)  # split from the cached 100 MiB block
    a.malloc("z", 40 * MiB)  # the rest of it
    assert a.reserved == 100 * MiB
    a.free("y")
    a.malloc("w", 80 * MiB)  # 60 MiB cached, but not contiguous with anything free
    assert a.reserved == 180 * MiB and a.peak_allocated == 120 * MiB


def test_freed_neighbours_merge():
    a = CachingAllocator()
    a.malloc("x", 100 * MiB)
    a.free("x")
    a.malloc("y", 50 * MiB)
    a.malloc("z", 50 * MiB)
    a.free("y")
    a.free("z")
    a.malloc("w", 100 * MiB)  # y and z merged back into one block
    assert a.reserved == 100 * MiB


def test_emptying_the_cache_releases_only_segments_with_nothing_allocated():
    a = CachingAllocator()
    a.malloc("gone", 12 * MiB)
    a.malloc("kept", 12 * MiB)
    a.malloc("side", 30 * MiB, stream=1)
    a.malloc("beside", 1 * MiB + 512)  # in a 20 MiB segment, with a free tail
    a.free("gone")
    a.free("side")
    peak = a.peak_reserved
    a.empty_cache()
    assert a.reserved == 12 * MiB + 20 * MiB and a.peak_reserved == peak
    assert a.reserved_by_stream == {0: 32 * MiB, 1: 0}
    a.malloc("again", 30 * MiB, stream=1)  # a segment of its own again
    assert a.reserved == 62 * MiB
    assert replay([("alloc", "x", 12 * MiB), ("free", "x", 0), ("empty_cache", None, 0)]
                  ).reserved == 0


def test_a_block_is_cached_for_the_stream_that_allocated_it():
    """torch's pools per stream: a block freed goes back to its allocating stream's pool
    (whichever stream frees it), and another stream's request cannot take it."""
    a = CachingAllocator()
    a.malloc("model", 100 * MiB)
    a.free("model")
    a.malloc("reduction", 60 * MiB, stream=1)  # the 100 MiB cached block is stream 0's
    assert a.reserved == 160 * MiB
    a.free("reduction")
    a.malloc("again", 60 * MiB, stream=1)  # its own pool's block, reused
    a.malloc("model 2", 100 * MiB)  # and stream 0's
    assert a.reserved == 160 * MiB
    assert a.reserved_by_stream == {0: 100 * MiB, 1: 60 * MiB}
    # One pool for both would have reused the first block.
    assert replay([("alloc", "x", 100 * MiB), ("free", "x", 0),
                   ("alloc", "y", 60 * MiB)]).reserved == 100 * MiB


def test_the_zero_emulation_names_what_deepspeed_allocates_on_its_reduction_stream():
    """Under overlap_comm (from ZeRO-2 on in the trial's JSON) the gradient partition and
    offload's copies come from `reduce_ipg_grads`'s reduction stream, and ZeRO-3's flat
    copy of the bucket it reduces (and, in fp16, its overflow check's two byte masks of
    the gradient partition) from its reduce_and_partition_stream; ZeRO-1 runs without
    one, so everything is on the default stream."""
    events = zero_replay.emulated(GPT2, 64, 2, 2, 2, "none", True)
    offload = zero_replay.emulated(GPT2, 64, 2, 2, 2, "optimizer", True)
    zero1 = zero_replay.emulated(GPT2, 64, 2, 2, 1, "none", True)
    zero3 = zero_replay.emulated(GPT2, 64, 2, 2, 3, "none", True)
    zero3_fp16 = zero_replay.emulated(GPT2, 64, 2, 2, 3, "none", True, precision="fp16")
    assert events and offload and zero1 and zero3 and zero3_fp16

    def streams(events, stage):
        of = zero_replay.on_reduction_stream(stage)
        return {key[0] if isinstance(key, tuple) else key for kind, key, _ in events
                if kind == "alloc" and of(key) == zero_replay.REDUCTION_STREAM}

    assert streams(events, 2) == {"partition", "partition add"}
    assert streams(offload, 2) == {"offload norm", "fp32 copy"}
    assert streams(zero1, 1) == set()
    assert streams(zero3, 3) == {"reduce"}
    assert streams(zero3_fp16, 3) == {"reduce", "overflow"}
    masks = [n for kind, key, n in zero3_fp16 if kind == "alloc" and key[0] == "overflow"]
    flat = next(n for kind, key, n in zero3 if key == "flat16")  # 2 bytes a parameter
    assert masks == [flat // 2] * 4  # isinf and isnan at each of the two steps
    # Their blocks are a pool of their own: the same allocations, reserved per stream.
    one = replay(events)
    two = zero_replay.replayed(GPT2, 64, 2, 2, 2, "none")
    assert two is not None and two.peak_allocated == one.peak_allocated
    assert set(two.reserved_by_stream) == {0, zero_replay.REDUCTION_STREAM}
    assert sum(two.reserved_by_stream.values()) == two.reserved


def test_the_emulation_reads_the_trials_deepspeed_json():
    """The emulation's overlap_comm and bucket size are the trial JSON's: a change to one
    without the other fails here."""
    from autotune.trials.trainargs import deepspeed_config

    for stage in (1, 2, 3):
        zero = deepspeed_config(TrialConfig.of(4, 4, precision="bf16",
                                               zero_stage=stage))["zero_optimization"]
        assert zero.get("overlap_comm", False) == zero_replay.overlap_comm(stage), stage
        assert zero.get("contiguous_gradients", True)  # DeepSpeed's default: buckets
        assert "reduce_bucket_size" not in zero  # DEFAULT_BUCKET, DeepSpeed's own


def test_the_same_tensors_reserve_more_in_another_order():
    """What the replay is for: the peak of live tensors does not fix the reserved peak."""
    small_first = [("alloc", 1, 30 * MiB), ("free", 1, 0), ("alloc", 2, 40 * MiB)]
    large_first = [("alloc", 2, 40 * MiB), ("free", 2, 0), ("alloc", 1, 30 * MiB)]
    assert replay(small_first).peak_reserved == 70 * MiB
    assert replay(large_first).peak_reserved == 40 * MiB


def test_a_traced_step_replays_as_a_trial_allocates():
    step = trace_step(GPT2, "causal-lm", 64, "autocast16", False, "sdpa", True)
    assert step is not None and len(step.persistent) == len(step.trainable)
    adam = replay(training_events(step, 4, 2, ADAM.states_of, 4))
    n = sum(step.trainable)
    # Weights, gradients and both moments at least; no more than every event at once.
    assert adam.peak_allocated >= 16 * n
    assert adam.peak_reserved >= adam.peak_allocated
    sgd = replay(training_events(step, 4, 2, lambda n, e: (), 0))
    assert adam.peak_allocated - sgd.peak_allocated >= 8 * n  # the moments
    # Sizes are read linearly from two traced batches: a larger batch holds more.
    larger = replay(training_events(step, 12, 1, ADAM.states_of, 4))
    assert larger.peak_allocated > adam.peak_allocated


def test_physics_replays_plain_trainer_steps_on_a_gpu_only():
    shape = shape_from_hf_config(load_hf_config({"config": GPT2}), 64)
    h100 = Physics(shape, named_device("H100"))
    plain = TrialConfig.of(4, 4, precision="bf16")
    assert h100.reserved_peak(plain) is not None
    total = h100.physics(plain).total_bytes
    assert abs(total - h100.reserved_peak(plain) - CUDA_RUNTIME_BYTES) < 16  # the replay's
    # ZeRO-1/2 in 16-bit: the engine's emulation beside the native 16-bit step, replayed
    # with a pool per stream, and NCCL's communicator beside it.
    zero2 = TrialConfig.of(4, 4, precision="bf16", zero_stage=2)
    _, reserved = zero_replay.replayed_peaks(shape.hf_config, 64, 4, 4, 2, "none",
                                             capability=(9, 0))
    assert h100.reserved_peak(zero2) == reserved
    assert abs(h100.physics(zero2).total_bytes - h100.reserved_peak(zero2)
               - CUDA_RUNTIME_BYTES - NCCL_COMM_BYTES) < 16
    # Its two reduction buffers (overlap_comm) are booked under gradients, and the terms
    # calibration scales still sum to the total.
    assert h100.zero_bucket_bytes(zero2) == 2 * 2 * zero_replay.DEFAULT_BUCKET
    assert h100.physics(zero2).components["gradients"] > h100.zero_bucket_bytes(zero2) / 2
    features = h100.features(zero2)
    assert abs(features[: len(COMPONENTS)].sum() - h100.physics(zero2).total_bytes) < 64
    # ZeRO-3 without offload is emulated too (one bucket, kept from the optimizer's
    # creation on); with offload, and fp32 ZeRO, are not, and a CPU trial's peak is RSS:
    # no replay.
    zero3 = TrialConfig.of(4, 4, precision="bf16", zero_stage=3)
    _, reserved3 = zero_replay.replayed_peaks(shape.hf_config, 64, 4, 4, 3, "none",
                                              capability=(9, 0))
    assert h100.reserved_peak(zero3) == reserved3
    for other in (TrialConfig.of(4, 4, precision="bf16", zero_stage=3, offload="optimizer"),
                  TrialConfig.of(4, 4, zero_stage=2)):
        assert h100.reserved_peak(other) is None, other.label()
    # ZeRO-3's bucket is in its terms all the same (on a GPU: on a CPU its untouched
    # pages are not resident).
    assert h100.zero_bucket_bytes(zero3) == 2 * zero_replay.DEFAULT_BUCKET
    assert h100.physics(zero3).components["gradients"] > 2 * zero_replay.DEFAULT_BUCKET
    # Nor over several ranks, whose partitions the emulation does not divide.
    assert Physics(shape, named_device("H100"), world_size=2).reserved_peak(zero2) is None
    cpu = Physics(shape, DeviceSpec("cpu", "cpu", 64 * 2**30))
    assert cpu.reserved_peak(plain) is None and cpu.reserved_peak(zero2) is None
    assert cpu.zero_bucket_bytes(zero3) == 0


def _replayed(parts) -> tuple[int, int, int]:
    params, per_param, first, later, persistent = parts
    trainable = tuple(n for n, _ in per_param)  # (elements, an embedding's) per parameter
    step = TracedStep(params, trainable, tuple((k, key, n, n) for k, key, n in first),
                      tuple((k, key, n, n) for k, key, n in later), (8, 16), persistent)
    a = replay(training_events(step, 8, 3, ADAM.states_of, 4))
    return a.peak_reserved, a.peak_allocated, a.allocated


def test_a_deep_model_is_traced_from_four_layers():
    """Four layers traced, the third repeated: the same replay as tracing all seven."""
    llama = {"model_type": "llama", "num_hidden_layers": 7, "hidden_size": 64,
             "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512, "max_position_embeddings": 64}
    gpt2 = GPT2 | {"n_layer": 7}
    for raw, mode, ckpt in ((llama, "autocast16", False), (gpt2, "fp32", True)):
        cfg = load_hf_config({"config": raw})
        deep = _deepened(cfg, "causal-lm", 64, 8, mode, ckpt, "sdpa", True, 7)
        p, t, first, later, kept = _record(cfg, "causal-lm", 64, 8, mode, ckpt, "sdpa",
                                           True, 7)
        plain = lambda evs: [(k, (key, 0), n) for k, key, n, _ in evs]  # noqa: E731
        direct = (tuple(b for b, _ in p), tuple(e for e, _ in t), plain(first),
                  plain(later), frozenset((k, 0) for k in kept))
        assert len(deep[0]) == len(direct[0]) and len(deep[2]) == len(direct[2])
        assert len(deep[4]) == len(direct[4]) == len(deep[1])  # one gradient per parameter
        assert _replayed(deep) == _replayed(direct), (raw["model_type"], mode, ckpt)


def _state(a: CachingAllocator) -> tuple:
    return (a.peak_reserved, a.peak_allocated, a.reserved, a.allocated,
            a.reserved_by_stream, a.grown)


def test_optimizers_continue_one_shared_replay_as_each_full_replay_ends():
    """`TrialReplay` replays what precedes the optimizer once and continues a copy of it
    per optimizer: each ends in the allocator a whole replay of its trial ends in, on a
    model deepened from four layers to nine, whatever was replayed from it before."""
    llama = {"model_type": "llama", "num_hidden_layers": 9, "hidden_size": 64,
             "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512, "max_position_embeddings": 64}
    optimizers = [optimizer(o) for o in ("adamw_torch", "adamw_torch_fused",
                                         "adamw_bnb_8bit", "sgd", "adamw_torch")]
    for raw, mode in ((llama, "autocast16"), (GPT2 | {"n_layer": 6}, "fp32")):
        step = trace_step(raw, "causal-lm", 64, mode, False, "sdpa", True)
        for batch, accumulation, ddp in ((4, 2, False), (12, 1, True), (2, 5, True)):
            trial = TrialReplay(step, batch, accumulation, ddp=ddp,
                                workspaces=blas_workspaces((9, 0)))
            for opt in optimizers:
                whole = replay(training_events(step, batch, accumulation, opt.states_of,
                                               opt.step_temporary_bytes, ddp=ddp,
                                               workspaces=blas_workspaces((9, 0))))
                shared = trial.replay(opt.states_of, opt.step_temporary_bytes)
                assert _state(shared) == _state(whole), (raw["model_type"], batch, opt)


def test_a_copied_allocator_goes_on_as_the_original_would():
    a = CachingAllocator()
    for i, n in enumerate((3 * MiB, 30 * MiB, 100, 12 * MiB, 700 * 1024)):
        a.malloc(i, n)
    a.free(1)
    a.free(3)
    b = a.copy()
    for x in (a, b):  # splits, merges with both neighbours, a new segment
        x.malloc("m", 20 * MiB)
        x.free(0)
        x.free("m")
        x.malloc("n", 50 * MiB)
    assert _state(a) == _state(b) and a.reserved > 0
    b.free("n")
    assert a.allocated - b.allocated == 50 * MiB  # independent after the copy


def test_ddp_holds_its_buckets_beside_the_gradients_over_several_ranks():
    shape = shape_from_hf_config(load_hf_config({"config": GPT2}), 64)
    one, two = Physics(shape, named_device("H100")), Physics(shape, named_device("H100"), 2)
    c = TrialConfig.of(4, 4, precision="bf16")
    t = shape.trainable_parameters or shape.num_parameters
    grads = lambda p, cfg: p.physics(cfg).components["gradients"]  # noqa: E731
    assert grads(two, c) - grads(one, c) == 4 * t
    assert two.replayed_peaks(c)[0] - one.replayed_peaks(c)[0] >= 4 * t  # allocated
    z2 = TrialConfig.of(4, 4, precision="bf16", zero_stage=2)  # ZeRO reduces its own way
    assert two.ddp_bucket_bytes(z2) == 0


def test_trainer_keeps_embedding_states_in_32_bits_under_8_bit_optimizers():
    shape = shape_from_hf_config(load_hf_config({"config": GPT2}), 64)
    emb = shape.embedding_parameters
    assert emb == GPT2["vocab_size"] * 64 + GPT2["n_positions"] * 64  # wte (tied), wpe
    h100 = Physics(shape, named_device("H100"))
    bnb = TrialConfig.of(4, 4, precision="bf16", optim="adamw_bnb_8bit")
    t = shape.trainable_parameters or shape.num_parameters
    assert h100.physics(bnb).components["optimizer"] == int(2 * (t - emb) + 8 * emb)
    step = trace_step(GPT2, "causal-lm", 64, "autocast16", False, "sdpa", True)
    assert sum(n for n, e in zip(step.trainable, step.embedding, strict=True) if e) == emb
    eight = optimizer("adamw_bnb_8bit")
    assert eight.states_of(10**6, False) == (1, 1) and eight.states_of(10**6, True) == (4, 4)
    assert eight.states_of(100, False) == (4, 4)  # under bitsandbytes' min_8bit_size
    plain = replay(training_events(step, 4, 1, lambda n, e: (1, 1), 0)).peak_allocated
    kept = replay(training_events(step, 4, 1, eight.states_of, 0))
    assert kept.peak_allocated - plain >= 6 * emb


def test_ddp_buckets_close_at_their_cap_from_the_last_parameter_back():
    MiB_ = 2**20
    assert ddp_buckets([30 * MiB_, 2 * MiB_, MiB_ // 2, MiB_ // 2]) == [MiB_, 32 * MiB_]
    assert ddp_buckets([10 * MiB_] * 6) == [10 * MiB_, 30 * MiB_, 20 * MiB_]
    assert sum(ddp_buckets([7, 3, 5])) == 15


def test_a_failing_replay_leaves_the_allowance_not_an_error(monkeypatch):
    from collections import OrderedDict

    import autotune.plan.memory as memory

    class Broken(TrialReplay):
        def replay(self, states_of, step_temporary_bytes):  # noqa: ANN001, ANN202
            return replay([("alloc", "x", 1024), ("alloc", "x", 1024)])

    shape = shape_from_hf_config(load_hf_config({"config": GPT2}), 64)
    monkeypatch.setattr(memory, "TrialReplay", Broken)
    monkeypatch.setattr(memory, "_REPLAYS", {})  # replays of earlier tests are shared
    monkeypatch.setattr(memory, "_TRIALS", OrderedDict())
    h100 = Physics(shape, named_device("H100"))
    c = TrialConfig.of(4, 4, precision="bf16")
    assert h100.reserved_peak(c) is None and h100.physics(c).total_bytes > 0


def test_cublas_workspaces_are_sized_as_torch_sizes_them():
    """CublasHandlePool.cpp: 32 MiB on Hopper and Blackwell, `:4096:2:16:8` elsewhere and
    where the device is not known; the environment variables override both."""
    assert blas_workspaces((9, 0), {}) == {"cublas": 32 * MiB, "cublaslt": MiB}
    assert blas_workspaces((10, 0), {})["cublas"] == blas_workspaces((12, 0), {})["cublas"]
    assert blas_workspaces((8, 0), {})["cublas"] == 8 * MiB + 128 * 1024
    assert blas_workspaces(None, {})["cublas"] == 8519680
    assert blas_workspaces((9, 0), {"CUBLAS_WORKSPACE_CONFIG": ":4096:2:16:8",
                                    "CUBLASLT_WORKSPACE_SIZE": "4096"}) == {
        "cublas": 8519680, "cublaslt": 4 * MiB}


def test_each_threads_first_matmul_makes_a_workspace_kept_for_the_process():
    """The trace marks the forward's first matmul (cuBLAS and, with a bias, cuBLASLt) and
    the backward's (autograd's own thread on a GPU), right after the op's output; the
    replay makes each once, in the first micro-batch, and never frees it."""
    step = trace_step(GPT2, "causal-lm", 64, "autocast16", False, "sdpa", True)
    marks = [(i, key[0]) for i, (kind, key, _, _) in enumerate(step.first)
             if kind == "workspace"]
    assert [m for _, m in marks] == [("cublas", "forward"), ("cublaslt", "forward"),
                                     ("cublas", "backward")]
    assert step.first[marks[0][0] - 1][0] == "alloc"  # the matmul's output came first
    sizes = blas_workspaces((9, 0), {})
    events = training_events(step, 4, 2, ADAM.states_of, 4, workspaces=sizes)
    made = [(kind, key) for kind, key, _ in events if isinstance(key, tuple)
            and key[:1] == ("workspace",)]
    assert made == [("alloc", ("workspace", m)) for _, m in marks]  # two steps, four passes
    without = replay(training_events(step, 4, 2, ADAM.states_of, 4))
    assert (replay(events).peak_allocated - without.peak_allocated
            == 2 * sizes["cublas"] + sizes["cublaslt"])


TRACES = Path(__file__).resolve().parents[1] / "benchmarks" / "allocator_traces"
GPT2_124M = {"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12,
             "vocab_size": 50257, "n_positions": 1024}


@pytest.mark.parametrize(("trace", "offload"), [
    ("h100-gpt2-124m-s1024-b8x4-z2-offload.jsonl.gz", "optimizer"),
    ("h100-gpt2-124m-s1024-b8x4-z2.jsonl.gz", "none")])
def test_the_replay_grows_the_large_segments_an_h100_grew(trace, offload):
    """Held to the allocator history of two ZeRO-2 trials on an H100 (the GPU proof's
    memory step): the workspaces the device kept are torch's for Hopper, and with them the
    replay grows the device's large segments in its order. Without the backward's
    workspace the offload row's next micro-batch reused the freed 1572 MiB logits segment
    the device could not (a 32 MiB block split it), one segment short."""
    events = load_trace(TRACES / trace)
    live: dict[int, list] = {}
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = e
        elif e[0] == "free_requested":
            live.pop(e[1], None)
    outside_deepspeed = sorted((e[2], e[4] is None) for e in live.values()
                               if MiB <= e[2] <= 64 * MiB)
    sizes = blas_workspaces((9, 0), {})
    assert outside_deepspeed == sorted([(sizes["cublaslt"], False), (sizes["cublas"], False),
                                        (sizes["cublas"], True)])  # True: autograd's thread
    # DeepSpeed empties the cache at init where the optimizer has two parameter groups
    # (Trainer's, without offload): the parameters' own segments go back, before any step.
    first_forward = next(i for i, e in enumerate(events) if "forward" in (e[4] or ""))
    released = [i for i, e in enumerate(events) if e[0] == "segment_free"]
    assert bool(released) == (offload == "none") and all(i < first_forward for i in released)
    emulated = zero_replay.emulated(GPT2_124M, 1024, 8, 4, 2, offload, True)
    assert (("empty_cache", None, 0) in emulated) == (offload == "none")
    large = [e[2] for e in events if e[0] == "segment_alloc" and e[2] >= 512 * MiB]
    shape = shape_from_hf_config(load_hf_config({"config": GPT2_124M}), 1024)
    config = TrialConfig.of(8, 4, precision="bf16", zero_stage=2, offload=offload)
    attention = Physics(shape, named_device("H100")).attention_kernel(config)
    replayed = zero_replay.trial_replay(shape, config, attention, (9, 0))
    assert [n for s, n, _ in replayed.grown if n >= 512 * MiB] == large
    grown = sum(e[2] for e in events if e[0] == "segment_alloc")
    assert abs(sum(n for _, n, _ in replayed.grown) - grown) < 0.03 * grown


def test_the_replay_holds_to_the_allocators_own_peaks_of_every_recorded_history():
    """The H100 rows whose notes recorded the allocator's own peaks (the proof's memory
    step and both holdout rounds, 18 trials): the replay's allocated peak within 0.5%,
    its reserved peak within -3% to +0.5%, apart from the runtime beyond the allocator."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "memory_accuracy", TRACES.parent / "memory_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = []
    for name in ("proof", "holdout", "holdout2"):
        path = str(TRACES.parent / f"memory_accuracy_h100_{name}.txt")
        rows += bench.replay_against_device(path, bench.recorded(path)[0])
    assert len(rows) == 18
    assert all(abs(allocated) <= 0.005 and -0.03 <= reserved <= 0.005
               for allocated, reserved in rows), rows


def test_every_recorded_memory_file_is_read_back_whole():
    """`memory_accuracy.py --from FILE` re-predicts a recorded file: each of its measured
    rows must land in a section it knows (a `--families` file's sections were unknown,
    and its replay stopped on an empty median)."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location(
        "memory_accuracy", TRACES.parent / "memory_accuracy.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for path in sorted(TRACES.parent.glob("memory_accuracy*.txt")):
        rows = len(re.findall(r"^\s+b\d+x\d+ .*?\s+measured\s+[\d.]+ MiB",
                              path.read_text(), re.MULTILINE))
        _, sections = bench.recorded(str(path))
        assert sum(map(len, sections.values())) == rows, path.name


def test_the_collector_is_held_off_inside_and_left_as_it_was_found():
    import gc

    from autotune.plan.gc_pause import collector_paused

    assert gc.isenabled()
    with collector_paused():
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()
    gc.disable()  # a caller's own choice is kept
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
