"""DeepSpeed ZeRO-1/2's own allocations: the real engine recorded on CPU, and an emulation.

The allocator replay (autotune/plan/allocator.py) covers plain Trainer steps. DeepSpeed's
engine allocates outside the model's code (a flat 16-bit copy of the weights, an fp32
master partition, gradient buckets of `reduce_bucket_size` elements), so no model trace
sees it. This module:

- `record`: runs the real engine (gloo, one rank, on CPU) on a GPT-2 and follows every
  storage it allocates and frees from `deepspeed.initialize` on, phase by phase;
- `record_trial`: the same engine as a trial runs it, inside HF Trainer with the trial's
  TrainingArguments (it holds what the bare engine holds, but for the first step);
- `zero_events`: emulates the same stream beside a traced micro-batch of the model in
  native 16-bit (plan/step_trace.py), as DeepSpeed 0.19's stage_1_and_2.py allocates it
  on a GPU, for the allocator replay;
- `main`: prints both, phase by phase, and (with --gpt2-124m) the replayed peaks of the
  H100 file's DeepSpeed rows beside their measurements.

Not in the physics yet: on the H100 file the emulation explains ZeRO-1 > ZeRO-2 only in
allocated bytes, and ZeRO-2 + optimizer offload measured 3.5 GiB over its reserved peak,
where Trainer rows measure 0.9-1.6 GiB over theirs (see README).
The GPU proof's ZeRO step prints each row's allocated, reserved, NVML and pinned-host
figures beside this emulation, which decides where that memory is.

    .venv/bin/python benchmarks/deepspeed_allocations.py          # small GPT-2, 3 configs
    .venv/bin/python benchmarks/deepspeed_allocations.py --gpt2-124m   # H100 file, 30 s
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.plan.allocator import Event, TracedStep, replay  # noqa: E402

# DeepSpeed's default `reduce_bucket_size` (elements); Trainer's JSON leaves it unset.
DEFAULT_BUCKET = 500_000_000
SMALL_GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4,
              "vocab_size": 2048, "n_positions": 64}
Marks = list[tuple[str, int]]


def _one_rank(port: int) -> None:
    """torch.distributed's environment for one rank on this machine, and set-up's built
    DeepSpeed ops (a default extensions folder would rebuild them: 100 s)."""
    from autotune.trials.launch import extensions_dir

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("TORCH_EXTENSIONS_DIR", extensions_dir())):
        os.environ.setdefault(key, value)


def _model(hf_config: dict[str, Any]) -> Any:
    """The causal LM of `hf_config`, with the same initial weights every time."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    fields = {k: v for k, v in hf_config.items() if k != "model_type"}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(hf_config["model_type"],
                                                                 **fields))


def _recorded_config(stage: int, offload: str, batch: int, accumulation: int) -> Any:
    """The trial config every recording runs: bf16 and torch AdamW, as the emulation."""
    from autotune.config import Family, TrialConfig

    return TrialConfig(batch, accumulation, Family.of(
        precision="bf16", optim="adamw_torch", zero_stage=stage, offload=offload))


def record(stage: int, offload: str, hf_config: dict[str, Any], seq: int, batch: int,
           accumulation: int, bucket: int = DEFAULT_BUCKET,
           steps: int = 2) -> tuple[list[Event], Marks]:
    """The real engine's allocations and frees on CPU, with the event count at the end of
    `init` and of each micro-batch's forward and backward (`sSmM fwd+bwd`) and step."""
    import torch

    _one_rank(29650 + stage)
    import deepspeed

    from autotune.plan.trace import _LiveBytes
    from autotune.trials.trainargs import deepspeed_config

    config = _recorded_config(stage, offload, batch, accumulation)
    ds = deepspeed_config(config)
    ds["zero_optimization"]["reduce_bucket_size"] = bucket
    deepspeed.init_distributed(dist_backend="gloo")
    model = _model(hf_config)
    events: list = []
    marks: Marks = []
    tracker = _LiveBytes(events, existing=[*model.parameters(), *model.buffers()])
    with tracker.mode:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4) if offload == "none" else None
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=optim, config=ds,
            model_parameters=model.parameters() if optim is None else None)
        marks.append(("init", len(events)))
        ids = torch.randint(0, int(hf_config["vocab_size"]), (batch, seq))
        for s in range(steps):
            for m in range(accumulation):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                marks.append((f"s{s}m{m} fwd+bwd", len(events)))
                engine.step()
                del loss
                marks.append((f"s{s}m{m} step", len(events)))
    return [(kind, key, n) for kind, key, n, _ in events], marks


def record_trial(stage: int, offload: str, hf_config: dict[str, Any], seq: int, batch: int,
                 accumulation: int, bucket: int = DEFAULT_BUCKET,
                 steps: int = 2) -> tuple[list[Event], Marks]:
    """As `record`, but the way a trial runs it: HF Trainer with the trial's own
    TrainingArguments (autotune/trials/trainargs.py) wraps the engine; marks at the end of
    `init` (training begins), of each micro-batch before the boundary (`sSmM`: forward,
    backward and the engine's step, which does nothing there) and of each optimizer step
    (`sS step`: the boundary's micro-batch and the step).

    One difference from the engine driven directly, on CPU: Trainer gives the optimizer
    two parameter groups (with and without weight decay), and at the first step the
    16-bit flat gradients then outlive the making of the optimizer's states: that step's
    peak is up to 2 bytes per parameter higher. The emulation's step leaves it out; for every
    row of the H100 file the step's peak is far below the backward's."""
    import torch
    from torch.utils.data import Dataset
    from transformers import (
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from autotune.plan.trace import _LiveBytes
    from autotune.trials.trainargs import training_arguments_kwargs

    _one_rank(29650 + stage)
    config = _recorded_config(stage, offload, batch, accumulation)
    with tempfile.TemporaryDirectory() as out:
        kwargs = training_arguments_kwargs(config, seed=0, on_cpu=True, output_dir=out)
        kwargs["deepspeed"]["zero_optimization"]["reduce_bucket_size"] = bucket
        kwargs |= {"max_steps": steps, "save_strategy": "no", "disable_tqdm": True,
                   "dataloader_num_workers": 0, "remove_unused_columns": False}
        model = _model(hf_config)
        ids = torch.randint(0, int(hf_config["vocab_size"]), (batch * accumulation * steps,
                                                               seq))

        class Tokens(Dataset):
            def __len__(self) -> int:
                return len(ids)

            def __getitem__(self, i: int) -> dict[str, Any]:
                return {"input_ids": ids[i], "labels": ids[i]}

        events: list = []
        marks: Marks = []

        class Phases(TrainerCallback):
            def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
                marks.append(("init", len(events)))

            def on_substep_end(self, args: Any, state: Any, *more: Any, **kw: Any) -> None:
                micro = sum(name.startswith(f"s{state.global_step}m") for name, _ in marks)
                marks.append((f"s{state.global_step}m{micro}", len(events)))

            def on_step_end(self, args: Any, state: Any, *more: Any, **kw: Any) -> None:
                marks.append((f"s{state.global_step - 1} step", len(events)))

        tracker = _LiveBytes(events, existing=[*model.parameters(), *model.buffers(), ids])
        with tracker.mode:
            Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=Tokens(),
                    callbacks=[Phases()]).train()
    return [(kind, key, n) for kind, key, n, _ in events], marks


def zero_events(step: TracedStep, batch: int, accumulation: int, stage: int, offload: str,
                states_of: Callable[[int, bool], tuple[float, ...]],
                step_temporary_bytes: float, bucket: int = DEFAULT_BUCKET, steps: int = 2,
                marks: Marks | None = None) -> list[Event]:
    """A ZeRO-1/2 trial's device allocations on one rank, as stage_1_and_2.py makes them:

    - at initialize, the 16-bit weights flattened into one buffer (the parameters become
      views of it), and without offload the fp32 master partition (and a zeroed fp32
      gradient, at once freed); offload clones the 16-bit weights on the way to the host
      and keeps a 16-bit staging buffer of the largest parameter on the device;
    - at a micro-batch's first gradient, the reduction bucket (`bucket` 16-bit elements;
      two under overlap_comm, ZeRO-2 here): ZeRO-2 every micro-batch, freed at its end;
      ZeRO-1 once per step, live until the boundary. Autograd's gradients are copied into
      it and freed (ZeRO-2), or kept and added to until the boundary's backward (ZeRO-1);
    - at the end of a backward without offload, the 16-bit gradient partition (ZeRO-2:
      created at the first, added to through a temporary after; ZeRO-1: at the boundary);
      with offload, the boundary's per-parameter fp64 norm and fp32 copy;
    - at the step without offload: the fp64 norm of the largest gradient, the flattened
      gradients and their fp32 copy, the optimizer's states (first step) and temporaries.

    Two things of a GPU it leaves out, both candidates for what the H100 file's ZeRO-2 rows
    hold beyond it: the caching allocator keeps a pool per CUDA stream, and under
    overlap_comm the partition and offload's copies are allocated on DeepSpeed's reduction
    stream, which the single-pool replay lets share blocks with the model's; and with more
    parameters than one bucket holds, the bucket is reduced within the backward, so
    ZeRO-2's partition is made there (while activations live), not after it. `marks` gets
    phase ends as `record`'s.
    """
    p, largest = sum(step.trainable), max(step.trainable)
    offloaded = offload != "none"
    events = _initialize(step, p, largest, offloaded)
    _mark(marks, "init", events)
    for s in range(steps):
        kept: list[Any] = []  # ZeRO-1's gradients, until the boundary
        for m in range(accumulation):
            boundary = m == accumulation - 1
            fresh = stage >= 2 or m == 0  # autograd creates the gradients afresh
            buckets = [("bucket", s, m, j) for j in range(2 if stage >= 2 else 1)]
            for kind, key, s1, s2 in step.first if fresh else step.later:
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
                           for j in reversed(range(2 if stage >= 2 else 1))]
            _mark(marks, f"s{s}m{m} fwd+bwd", events)
            if not boundary:
                _mark(marks, f"s{s}m{m} step", events)
        if not offloaded:
            events += _optimizer_step(s, p, largest, states_of, step_temporary_bytes)
        _mark(marks, f"s{s}m{accumulation - 1} step", events)
    return events


def _initialize(step: TracedStep, p: int, largest: int, offloaded: bool) -> list[Event]:
    events: list[Event] = [("alloc", ("param", i), n) for i, n in enumerate(step.params)]
    events.append(("alloc", "flat16", 2 * p))
    events += [("free", ("param", i), 0) for i in range(len(step.params))]
    events.append(("alloc", "buffers", max(0, sum(step.params) - 2 * p)))  # not flattened
    if offloaded:
        return events + [("alloc", "host copy", 2 * p), ("free", "host copy", 0),
                         ("alloc", "offload staging", 2 * largest)]
    return events + [("alloc", "master", 4 * p), ("alloc", "zero grad", 4 * p),
                     ("free", "zero grad", 0)]


def _epilogue(s: int, m: int, boundary: bool, stage: int, offloaded: bool, p: int,
              largest: int) -> list[Event]:
    """What a backward's end allocates: the gradient partition, or offload's copies."""
    if offloaded:
        return [("alloc", ("norm", s), 8 * largest), ("free", ("norm", s), 0),
                ("alloc", ("fp32 copy", s), 4 * largest),
                ("free", ("fp32 copy", s), 0)] if boundary else []
    if stage >= 2 and m > 0:
        return [("alloc", ("partition add", s, m), 2 * p),
                ("free", ("partition add", s, m), 0)]
    if (stage >= 2 and m == 0) or (stage < 2 and boundary):
        return [("alloc", ("partition", s), 2 * p)]
    return []


def _optimizer_step(s: int, p: int, largest: int,
                    states_of: Callable[[int, bool], tuple[float, ...]],
                    step_temporary_bytes: float) -> list[Event]:
    events: list[Event] = [
        ("alloc", ("norm", s), 8 * largest), ("free", ("norm", s), 0),
        ("alloc", ("flat", s), 2 * p), ("alloc", ("fp32 grad", s), 4 * p),
        ("free", ("flat", s), 0), ("free", ("partition", s), 0)]
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


def phases(events: list[Event], marks: Marks) -> list[tuple[str, int, int]]:
    """(phase, live bytes at its end, peak live bytes within it) for each mark."""
    sizes: dict[Any, int] = {}
    live = peak = 0
    out, j = [], 0
    for i, (kind, key, n) in enumerate([*events, ("end", None, 0)]):
        while j < len(marks) and i >= marks[j][1]:
            out.append((marks[j][0], live, peak))
            peak, j = live, j + 1
        if kind == "alloc":
            sizes[key] = n
            live += n
            peak = max(peak, live)
        elif kind == "free":
            live -= sizes.pop(key, 0)
    return out


def emulated(hf_config: dict[str, Any], seq: int, batch: int, accumulation: int, stage: int,
             offload: str, cuda: bool, bucket: int = DEFAULT_BUCKET,
             marks: Marks | None = None) -> list[Event] | None:
    """`zero_events` for a model config with torch AdamW (Trainer's default): None where
    the model's step cannot be traced."""
    from autotune.optimizers import optimizer
    from autotune.plan.step_trace import trace_step

    step = trace_step(hf_config, "causal-lm", seq, "native16", False, "sdpa", cuda)
    if step is None:
        return None
    opt = optimizer("adamw_torch")
    return zero_events(step, batch, min(accumulation, 2), stage, offload, opt.states_of,
                       opt.step_temporary_bytes if cuda else 0.0, bucket, marks=marks)


def replayed_peaks(hf_config: dict[str, Any], seq: int, batch: int, accumulation: int,
                   stage: int, offload: str) -> tuple[float, float] | None:
    """(allocated, reserved) peak bytes of a ZeRO-1/2 GPU trial, replayed."""
    events = emulated(hf_config, seq, batch, accumulation, stage, offload, True)
    if events is None:
        return None
    allocator = replay(events)
    return float(allocator.peak_allocated), float(allocator.peak_reserved)


def trial_peaks(shape: Any, cfg: Any) -> tuple[float, float] | None:
    """The replay of a trial's config where the emulation's assumptions hold: a causal LM
    trained whole (no LoRA, no Liger kernels), ZeRO-1/2 in bf16/fp16 with torch AdamW,
    no checkpointing and SDPA (what the engine was recorded with); None elsewhere.
    `shape` is a ModelShape, `cfg` a TrialConfig."""
    causal = shape.task == "causal-lm" or (not shape.task and shape.causal_lm)
    if (cfg.zero_stage not in (1, 2) or cfg.precision not in ("bf16", "fp16")
            or cfg.optim != "adamw_torch" or cfg.gradient_checkpointing
            or cfg.attn_implementation != "auto" or cfg.use_liger_kernel
            or shape.hf_config is None or shape.lora is not None or not causal):
        return None
    return replayed_peaks(shape.hf_config, shape.seq_len, cfg.per_device_train_batch_size,
                          cfg.gradient_accumulation_steps, cfg.zero_stage, cfg.offload)


CONFIGS = ((1, "none"), (2, "none"), (2, "optimizer"))


def compare_small() -> None:
    print("GPT-2 4x128, seq 64, batch 2 x 2 micro-batches, bucket 2e6: MiB live at each "
          "phase's end / peak within it (the real engine on CPU holds its host-side "
          "offload buffers and a CPU copy of the weights too)")
    for stage, offload in CONFIGS:
        real = phases(*record(stage, offload, SMALL_GPT2, 64, 2, 2, bucket=2_000_000))
        marks: Marks = []
        events = emulated(SMALL_GPT2, 64, 2, 2, stage, offload, False, 2_000_000, marks)
        assert events is not None
        emu = phases(events, marks)
        print(f"ZeRO-{stage}, offload {offload}")
        for (name, live, peak), (_, elive, epeak) in zip(real, emu, strict=True):
            print(f"  {name:14s} engine {live / 2**20:7.2f} / {peak / 2**20:7.2f}   "
                  f"emulated {elive / 2**20:7.2f} / {epeak / 2**20:7.2f}")


def compare_h100() -> None:
    """The H100 file's rows: each replay (the Trainer's, or this emulation for ZeRO-1/2)
    against the measurement, then the leave-one-out errors with the emulation in the
    physics, which is why it is not there yet."""
    import statistics

    from memory_accuracy import GPU_SHAPES, recorded, spec_for

    from autotune.plan.calibration import MemoryModel, leave_one_out_errors
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec

    class WithZeroReplay(MemoryModel):
        def replayed_peaks(self, c):  # noqa: ANN001, ANN202 - Physics' own signature
            zero = trial_peaks(self.shape, c) if self.device.is_cuda else None
            return zero if zero is not None else super().replayed_peaks(c)

    device, by_shape = recorded(str(Path(__file__).resolve().parent
                                    / "memory_accuracy_h100.txt"))
    name = "gpt2-124m-s1024"
    measured = by_shape[name]
    shape = model_shape(load_spec(spec_for(*GPU_SHAPES[name])))
    model = WithZeroReplay(shape, device)
    print(f"{name} on the H100 file: replayed allocated / reserved MiB, measured, and the "
          "measurement's margin over the replayed reserved peak")
    for c, bytes_ in measured:
        peaks = model.replayed_peaks(c)
        if peaks is None:
            continue
        print(f"  {c.label():40s} {peaks[0] / 2**20:7.0f} / {peaks[1] / 2**20:7.0f}   "
              f"measured {bytes_ / 2**20:7.0f}   margin {(bytes_ - peaks[1]) / 2**20:+6.0f}")
    for label, kind in (("as shipped", MemoryModel), ("with the ZeRO replay", WithZeroReplay)):
        errors = leave_one_out_errors(shape, device, 1, measured, kind)
        worst = max(zip(errors, measured, strict=True), key=lambda e: e[0])
        print(f"leave-one-out, {label}: median {statistics.median(errors):.1%}, max "
              f"{worst[0]:.1%} ({worst[1][0].label()})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2-124m", action="store_true",
                    help="the H100 file's rows replayed, and the leave-one-out errors "
                    "with the emulation in the physics (no engine run)")
    if ap.parse_args().gpt2_124m:
        compare_h100()
    else:
        compare_small()


if __name__ == "__main__":
    main()
