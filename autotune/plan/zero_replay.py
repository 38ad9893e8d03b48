"""DeepSpeed ZeRO's own device allocations beside a traced step, for the allocator.

DeepSpeed's engine allocates outside the model's code (a flat 16-bit copy of the weights,
an fp32 master partition, gradient buckets of `reduce_bucket_size` elements), so no model
trace sees it. `zero_events` emulates that stream as DeepSpeed 0.19's stage_1_and_2.py
(ZeRO-1/2) and stage3.py (ZeRO-3) make it on a GPU, around a micro-batch of the model
traced in native 16-bit (the engine casts the model; accelerate runs no autocast under
DeepSpeed). A test holds it to the real engine on CPU, micro-batch by micro-batch, and the
engine as a trial runs it (HF Trainer with the trial's TrainingArguments) to the engine
driven directly (benchmarks/deepspeed_allocations.py records both).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.plan.allocator import (
    DEFAULT_STREAM,
    REPLAYED,
    CachingAllocator,
    Event,
    TracedStep,
    blas_workspaces,
    replay,
    workspace_event,
)
from autotune.tasks.causal_lm import CAUSAL_LM

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.plan.shape import ModelShape

# DeepSpeed's default `reduce_bucket_size` (elements); the trial's JSON leaves it unset.
DEFAULT_BUCKET = 500_000_000
Marks = list[tuple[str, int]]  # (phase, events before its end)
# The optimizers whose states the emulation's flat partition takes (torch AdamW, as Trainer
# hands it to the engine without offload; offload names DeepSpeed's CPU Adam).
EMULATED_OPTIMIZERS = ("adamw_torch", "adamw_torch_fused")


# What stage_1_and_2.py allocates inside `reduce_ipg_grads`'s `with stream(...)`: the 16-bit
# gradient partition (and the next micro-batch's, added to it), and offload's per-parameter
# fp64 norm input and fp32 copy. On the reduction stream under overlap_comm.
# stage3.py reduces each filled bucket inside its reduce_and_partition_stream ("reduce"),
# and in fp16 looks there for an overflow in the gradient partition ("overflow").
REDUCTION_STREAM_ALLOCATIONS = frozenset({"partition", "partition add", "offload norm",
                                          "fp32 copy", "reduce", "overflow"})
REDUCTION_STREAM = 1


def on_reduction_stream(stage: int) -> Callable[[object], int]:
    """The stream each of `zero_events`'s allocations is made on: DeepSpeed's reduction
    stream for what its reduction allocates when overlap_comm is on (from ZeRO-2 on in
    the trial's JSON), else the default stream. On a GPU a block is cached for the stream
    that allocated it, so those segments are a pool the model's tensors cannot reuse: on
    the H100 file that put ZeRO-2 1096 MiB under ZeRO-1, as measured, where one pool for
    all put the two level."""
    overlap = overlap_comm(stage)

    def stream(key: object) -> int:
        head = key[0] if isinstance(key, tuple) and key else key
        return (REDUCTION_STREAM if overlap and head in REDUCTION_STREAM_ALLOCATIONS
                else DEFAULT_STREAM)

    return stream


def overlap_comm(stage: int) -> bool:
    """Whether the trial's DeepSpeed JSON turns overlap_comm on (trials/trainargs.py, from
    ZeRO-2 on; DeepSpeed's default is off at stage 1). A test holds the two together."""
    return stage >= 2


def bucket_buffers(stage: int) -> int:
    """DeepSpeed's reduction buffers of `reduce_bucket_size` elements: at stages 1-2 two
    under overlap_comm, else one; at stage 3 one per dtype, made with the optimizer and
    kept (stage3.py), whatever overlap_comm."""
    return 2 if stage < 3 and overlap_comm(stage) else 1


def applies(shape: ModelShape, c: TrialConfig, world_size: int = 1) -> bool:
    """Where the emulation's assumptions hold: one rank (it does not divide the
    partitions, and ZeRO-3 gathers nothing), a causal LM trained whole (no LoRA, no Liger
    kernels), ZeRO-1/2, or ZeRO-3 without offload, in 16-bit with torch AdamW and no
    checkpointing (what the engine was recorded with, in bf16; fp16 takes the same code
    path, with a loss scaler's few scalars beside it, and at stage 3 its overflow check),
    and no more parameters than one bucket holds (above that the engine reduces a bucket
    within the backward, which the emulation does not)."""
    causal = shape.kind.causal if shape.task else shape.causal_lm
    stage_ok = c.zero_stage in (1, 2) or (c.zero_stage == 3 and c.offload == "none")
    return (world_size == 1 and stage_ok and c.precision in ("bf16", "fp16")
            and c.optim in EMULATED_OPTIMIZERS and not c.gradient_checkpointing
            and not c.use_liger_kernel and c.fsdp == "none" and shape.hf_config is not None
            and shape.lora is None and causal and shape.num_parameters <= DEFAULT_BUCKET)


def zero_events(step: TracedStep, batch: int, accumulation: int, stage: int, offload: str,
                states_of: Callable[[int, bool], tuple[float, ...]],
                step_temporary_bytes: float, bucket: int = DEFAULT_BUCKET,
                steps: int = REPLAYED, marks: Marks | None = None,
                workspaces: dict[str, int] | None = None, nccl: bool = True,
                fp16: bool = False) -> list[Event]:
    """A ZeRO trial's device allocations on one rank (`zero3_events` at stage 3; `nccl`
    and `fp16` only matter there). At stages 1-2, as stage_1_and_2.py makes them:

    - at initialize, the 16-bit weights flattened into one buffer (the parameters become
      views of it), and the master partition made from a 16-bit clone: without offload the
      fp32 partition on the device (and a zeroed fp32 gradient, at once freed), with
      offload on the host, keeping a 16-bit staging buffer of the largest parameter on the
      device. Between them, without offload, the cache is emptied: DeepSpeed empties it
      as it flattens each parameter group, and Trainer's optimizer has two (decay and
      none; the second, biases and norms, is left in the one flat buffer here), where
      offload's, made by DeepSpeed from the model's parameters, has one. On an H100 that
      released the parameters' own segments and the clone's, and nothing under offload;
    - at a micro-batch's first gradient, the reduction bucket (`bucket` 16-bit elements;
      two under overlap_comm, ZeRO-2 here): ZeRO-2 every micro-batch, freed at its end;
      ZeRO-1 once per step, live until the boundary. Autograd's gradients are copied into
      it and freed (ZeRO-2), or kept and added to until the boundary's backward (ZeRO-1);
    - at the end of a backward without offload, the 16-bit gradient partition (ZeRO-2:
      created at the first, added to through a temporary after; ZeRO-1: at the boundary);
      with offload, the boundary's per-parameter fp64 norm and fp32 copy;
    - at the step without offload: the fp64 norm of the largest gradient, the flattened
      gradients and their fp32 copy, the optimizer's states (first step) and temporaries.

    Under overlap_comm the partition and offload's copies are made on DeepSpeed's
    reduction stream (`on_reduction_stream` names them for the replay's pools). One thing
    of Trainer it leaves out: the first step, whose two parameter groups keep the 16-bit
    flat gradients alive while the optimizer's states are made (up to 2 bytes per
    parameter more, below the backward's peak wherever the activations are not tiny).
    `marks` gets phase ends as the recordings'. `workspaces` sizes cuBLAS's
    (allocator.blas_workspaces), made where the trace marks them, once.
    """
    if stage >= 3:
        return zero3_events(step, batch, accumulation, states_of, step_temporary_bytes,
                            bucket, steps, marks, workspaces, nccl, fp16)
    p, largest = sum(step.trainable), max(step.trainable)
    made: set = set()
    offloaded = offload != "none"
    events = _initialize(step, p, largest, offloaded)
    _mark(marks, "init", events)
    for s in range(steps):
        kept: list[Any] = []  # ZeRO-1's gradients, until the boundary
        for m in range(accumulation):
            boundary = m == accumulation - 1
            fresh = stage >= 2 or m == 0  # autograd creates the gradients afresh
            buckets = [("bucket", s, m, j) for j in range(bucket_buffers(stage))]
            for kind, key, s1, s2 in step.first if fresh else step.later:
                if kind == "workspace":
                    events += workspace_event(key[0], made, workspaces)
                    continue
                size = step.bytes_at(s1, s2, batch) if kind == "alloc" else 0
                events.append((kind, (s, m, key), size))
                if kind == "alloc" and fresh and key in step.persistent:
                    events += [("alloc", b, 2 * bucket) for b in buckets]
                    buckets = []
                    if stage >= 2:  # copied into the bucket
                        events.append(("free", (s, m, key), 0))
                    else:
                        kept.append((s, m, key))
            if boundary:  # ZeRO-1's gradients go into the bucket as the backward ends
                events += [("free", g, 0) for g in kept]
            events += _epilogue(s, m, boundary, stage, offloaded, p, largest)
            if stage >= 2 or boundary:
                events += [("free", ("bucket", s, m if stage >= 2 else 0, j), 0)
                           for j in reversed(range(bucket_buffers(stage)))]
            _mark(marks, f"s{s}m{m} fwd+bwd", events)
            if not boundary:
                _mark(marks, f"s{s}m{m} step", events)
        if not offloaded:
            events += _optimizer_step(s, p, [8 * largest], states_of, step_temporary_bytes)
        _mark(marks, f"s{s}m{accumulation - 1} step", events)
    return events


def zero3_events(step: TracedStep, batch: int, accumulation: int,
                 states_of: Callable[[int, bool], tuple[float, ...]],
                 step_temporary_bytes: float, bucket: int = DEFAULT_BUCKET,
                 steps: int = REPLAYED, marks: Marks | None = None,
                 workspaces: dict[str, int] | None = None, nccl: bool = True,
                 fp16: bool = False) -> list[Event]:
    """A ZeRO-3 trial's device allocations on one rank, without offload, as stage3.py and
    partition_parameters.py make them:

    - at initialize, the 16-bit model on the device; each parameter's partition (the
      whole of it on one rank) copied out and the parameter freed; then `defragment`
      moves the partitions to the host, frees them, empties the cache and brings them
      back as one flat buffer, so the model's own segments go back to the device. Then
      the fp32 master partition (converted, cloned, the conversion freed), a zeroed fp32
      gradient made and freed, the reduction bucket (`bucket` 16-bit elements, kept for
      the run) and the 16-bit gradient partition (kept). Last, each parameter is gathered
      once as its gradient hook is registered, and released;
    - in the forward and backward nothing is gathered: on one rank the coordinator's
      gather makes a parameter a view of its partition (a model that touched a parameter
      outside its own module would have it gathered whole by `param.all_gather()`, which
      allocates; GPT-2 does not). Each gradient, as autograd completes it, is copied into
      the bucket and freed; the backward's end reduces the bucket through a flat copy of
      it on the reduction stream (gloo, on CPU, allocates a second one: `nccl=False`) and
      copies it into the gradient partition, or adds it there after the first;
    - at the step: in `fp16`, the partition's isinf and isnan masks (a byte per
      parameter each, one after the other, on the reduction stream); each gradient's fp64
      norm input, one at a time; the partition flattened and converted to fp32 (the flat
      copy freed); the optimizer's states (first step) and temporaries; then the fp32
      gradient freed.

    One difference from a trial left out: Trainer's optimizer has two parameter groups,
    which stage3.py steps one after the other, so its step temporaries are per group
    (smaller) where these are whole. `marks` and `workspaces` as `zero_events`'.
    """
    p = sum(step.trainable)
    made: set = set()
    events = _initialize3(step, p, bucket)
    _mark(marks, "init", events)
    for s in range(steps):
        for m in range(accumulation):
            for kind, key, s1, s2 in step.first:  # autograd makes every gradient afresh
                if kind == "workspace":
                    events += workspace_event(key[0], made, workspaces)
                    continue
                size = step.bytes_at(s1, s2, batch) if kind == "alloc" else 0
                events.append((kind, (s, m, key), size))
                if kind == "alloc" and key in step.persistent:  # copied into the bucket
                    events.append(("free", (s, m, key), 0))
            events.append(("alloc", ("reduce", s, m), 2 * p))
            if not nccl:
                events += [("alloc", ("gloo copy", s, m), 2 * p),
                           ("free", ("gloo copy", s, m), 0)]
            events.append(("free", ("reduce", s, m), 0))
            _mark(marks, f"s{s}m{m} fwd+bwd", events)
            if m < accumulation - 1:
                _mark(marks, f"s{s}m{m} step", events)
        if fp16:  # stage3.py's has_overflow
            events += [e for mask in ("isinf", "isnan")
                       for e in (("alloc", ("overflow", s, mask), p),
                                 ("free", ("overflow", s, mask), 0))]
        events += _optimizer_step(s, p, [8 * n for n in step.trainable], states_of,
                                  step_temporary_bytes, keeps_partition=True)
        _mark(marks, f"s{s}m{accumulation - 1} step", events)
    return events


def _initialize3(step: TracedStep, p: int, bucket: int) -> list[Event]:
    trained = range(len(step.trainable))
    events: list[Event] = [("alloc", ("param", i), n) for i, n in enumerate(step.params)]
    for i in trained:  # each partition copied out, the parameter freed
        events += [("alloc", ("param partition", i), step.params[i]),
                   ("free", ("param", i), 0)]
    events += [("free", ("param partition", i), 0) for i in trained]  # defragment: to host
    events += [("empty_cache", None, 0), ("alloc", "flat16", 2 * p),
               ("alloc", "fp32 convert", 4 * p), ("alloc", "master", 4 * p),
               ("free", "fp32 convert", 0), ("alloc", "zero grad", 4 * p),
               ("free", "zero grad", 0), ("alloc", "bucket", 2 * bucket),
               ("alloc", "gradient partition", 2 * p)]
    for i in trained:  # gathered as its gradient hook is registered, then released
        events += [("alloc", ("gather", i), step.params[i]), ("free", ("gather", i), 0)]
    return events


def _initialize(step: TracedStep, p: int, largest: int, offloaded: bool) -> list[Event]:
    events: list[Event] = [("alloc", ("param", i), n) for i, n in enumerate(step.params)]
    events.append(("alloc", "flat16", 2 * p))
    events += [("free", ("param", i), 0) for i in range(len(step.params))]
    events.append(("alloc", "buffers", max(0, sum(step.params) - 2 * p)))  # not flattened
    events.append(("alloc", "master clone", 2 * p))  # the 16-bit partition, cloned
    if offloaded:  # to the host, then the staging buffer (one parameter group: no emptying)
        return events + [("free", "master clone", 0),
                         ("alloc", "offload staging", 2 * largest)]
    return events + [("alloc", "master", 4 * p), ("free", "master clone", 0),
                     ("empty_cache", None, 0),  # as the second parameter group's turn starts
                     ("alloc", "zero grad", 4 * p), ("free", "zero grad", 0)]


def _epilogue(s: int, m: int, boundary: bool, stage: int, offloaded: bool, p: int,
              largest: int) -> list[Event]:
    """What a backward's end allocates: the gradient partition, or offload's copies."""
    if offloaded:
        return [("alloc", ("offload norm", s), 8 * largest), ("free", ("offload norm", s), 0),
                ("alloc", ("fp32 copy", s), 4 * largest),
                ("free", ("fp32 copy", s), 0)] if boundary else []
    if stage >= 2 and m > 0:
        return [("alloc", ("partition add", s, m), 2 * p),
                ("free", ("partition add", s, m), 0)]
    if (stage >= 2 and m == 0) or (stage < 2 and boundary):
        return [("alloc", ("partition", s), 2 * p)]
    return []


def _optimizer_step(s: int, p: int, norms: list[int],
                    states_of: Callable[[int, bool], tuple[float, ...]],
                    step_temporary_bytes: float, keeps_partition: bool = False) -> list[Event]:
    """A step without offload: the norm's fp64 inputs (`norms` bytes, one at a time), the
    16-bit gradients flattened and converted to fp32 (the flat copy freed; stages 1-2
    free their partition there, stage 3 keeps its), the optimizer's states (first step)
    and temporaries, then the fp32 gradient freed."""
    events: list[Event] = [e for i, n in enumerate(norms)
                           for e in (("alloc", ("norm", s, i), n), ("free", ("norm", s, i), 0))]
    events += [("alloc", ("flat", s), 2 * p), ("alloc", ("fp32 grad", s), 4 * p),
               ("free", ("flat", s), 0)]
    if not keeps_partition:
        events.append(("free", ("partition", s), 0))
    if s == 0:
        events += [("alloc", ("state", j), int(p * nbytes))
                   for j, nbytes in enumerate(states_of(p, False))]
    if step_temporary_bytes:
        events += [("alloc", ("temp", s), int(p * step_temporary_bytes)),
                   ("free", ("temp", s), 0)]
    return events + [("free", ("fp32 grad", s), 0)]


def _mark(marks: Marks | None, name: str, events: list[Event]) -> None:
    if marks is not None:
        marks.append((name, len(events)))


def emulated(hf_config: dict[str, Any], seq: int, batch: int, accumulation: int, stage: int,
             offload: str, cuda: bool, optim: str = "adamw_torch", attention: str = "sdpa",
             bucket: int = DEFAULT_BUCKET, marks: Marks | None = None,
             capability: tuple[int, int] | None = None,
             precision: str = "bf16") -> list[Event] | None:
    """`zero_events` for a causal LM's config: None where the model's step cannot be
    traced. (On a CPU the optimizer's step temporaries and cuBLAS's workspaces are left
    out, as CPU AdamW's differ and a CPU has none; on a GPU the workspaces are sized for
    `capability`.)"""
    from autotune.optimizers import optimizer
    from autotune.plan.step_trace import trace_step

    step = trace_step(hf_config, CAUSAL_LM.name, seq, "native16", False, attention, cuda)
    if step is None:
        return None
    opt = optimizer(optim)
    return zero_events(step, batch, min(accumulation, REPLAYED), stage, offload, opt.states_of,
                       opt.step_temporary_bytes if cuda else 0.0, bucket, marks=marks,
                       workspaces=blas_workspaces(capability) if cuda else None, nccl=cuda,
                       fp16=precision == "fp16")


def replayed(hf_config: dict[str, Any], seq: int, batch: int, accumulation: int, stage: int,
             offload: str, optim: str = "adamw_torch", attention: str = "sdpa",
             streams: bool = True, capability: tuple[int, int] | None = None,
             precision: str = "bf16") -> CachingAllocator | None:
    """A ZeRO GPU trial's allocations replayed through the caching allocator's rules,
    with a pool per stream (or, `streams=False`, one pool for all), on a GPU of
    `capability`; None where the model's step cannot be traced."""
    events = emulated(hf_config, seq, batch, accumulation, stage, offload, True, optim,
                      attention, capability=capability, precision=precision)
    if events is None:
        return None
    return replay(events, on_reduction_stream(stage) if streams else None)


def replayed_peaks(hf_config: dict[str, Any], seq: int, batch: int, accumulation: int,
                   stage: int, offload: str, optim: str = "adamw_torch",
                   attention: str = "sdpa", capability: tuple[int, int] | None = None,
                   precision: str = "bf16") -> tuple[float, float] | None:
    """(allocated, reserved) peak bytes of a ZeRO GPU trial (`replayed`)."""
    return _peaks(replayed(hf_config, seq, batch, accumulation, stage, offload, optim,
                           attention, capability=capability, precision=precision))


def trial_replay(shape: ModelShape, c: TrialConfig, attention: str,
                 capability: tuple[int, int] | None, streams: bool = True
                 ) -> CachingAllocator | None:
    """`replayed` for a trial's config (one where `applies`), with the attention kernel
    the physics resolved for it, on a GPU of `capability`."""
    return replayed(shape.hf_config, shape.seq_len, c.per_device_train_batch_size,
                    c.gradient_accumulation_steps, c.zero_stage, c.offload, c.optim,
                    attention, streams, capability, c.precision)


def trial_peaks(shape: ModelShape, c: TrialConfig, attention: str,
                capability: tuple[int, int] | None) -> tuple[float, float] | None:
    """(allocated, reserved) peak bytes of `trial_replay`."""
    return _peaks(trial_replay(shape, c, attention, capability))


def _peaks(allocator: CachingAllocator | None) -> tuple[float, float] | None:
    return (None if allocator is None
            else (float(allocator.peak_allocated), float(allocator.peak_reserved)))
