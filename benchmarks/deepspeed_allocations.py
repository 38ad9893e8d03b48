"""DeepSpeed ZeRO's own allocations: the real engine recorded on CPU, beside the
emulation the physics replays (autotune/plan/zero_replay.py).

- `record`: runs the real engine (gloo, one rank, on CPU) on a GPT-2 and follows every
  storage it allocates and frees from `deepspeed.initialize` on, phase by phase;
- `record_trial`: the same engine as a trial runs it, inside HF Trainer with the trial's
  TrainingArguments (it holds what the bare engine holds, but for the first step);
- `main`: prints the engine and the emulation phase by phase, and (with --gpt2-124m) the
  H100 file's DeepSpeed rows: the emulation's allocated peak, its reserved peak replayed
  with one pool and with a pool per stream (as shipped), the physics' total and the
  measurement, then the leave-one-out errors as shipped and with the two figures the
  physics used before (one pool; the allocated peak plus 5%).

The GPU proof's ZeRO step prints each row's allocated, reserved, NVML and pinned-host
figures beside the emulation, which says where ZeRO-2 + offload's unexplained memory is.

    .venv/bin/python benchmarks/deepspeed_allocations.py          # small GPT-2, 5 configs
    .venv/bin/python benchmarks/deepspeed_allocations.py --gpt2-124m   # H100 file, 12 s
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.plan.allocator import Event  # noqa: E402
from autotune.plan.zero_replay import DEFAULT_BUCKET, Marks, emulated  # noqa: E402

SMALL_GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 128, "n_head": 4,
              "vocab_size": 2048, "n_positions": 64}


def _one_rank(port: int) -> None:
    """torch.distributed's environment for one rank on this machine, and set-up's built
    DeepSpeed ops (a default extensions folder would rebuild them: 100 s), loaded past
    any lock a killed process left (trials/build_lock.py)."""
    from autotune.trials.build_lock import install as guard_build_locks
    from autotune.trials.launch import extensions_dir

    guard_build_locks()

    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                       ("TORCH_EXTENSIONS_DIR", extensions_dir())):
        os.environ.setdefault(key, value)


def _running_threads() -> int | None:
    """How many of this process's other threads are running or in the kernel
    uninterruptibly (Linux's states R and D: a thread faulting its pages in, or freeing
    them, waits in D for the process's memory map); None where /proc lists no threads."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    running = 0
    for tid in tids:
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:  # the thread has ended
            continue
        if int(tid) != me and stat[stat.rindex(")") + 2] in "RD":
            running += 1
    return running


def _settled(limit_s: float = 1.0) -> bool:
    """Whether this process's other threads went idle within `limit_s` (seen idle twice, a
    sleep apart, so that one waiting for the GIL has run). gloo runs even a one-rank
    all-reduce on a worker thread that holds the reduced tensor (ZeRO's bucket) a moment
    after the caller's wait returns, and frees it there: a mark taken first counts a bucket
    ZeRO has dropped (docs/results.md, 2026-11-27). A thread that runs Python is not seen:
    it waits for the GIL, asleep, whenever this one looks."""
    end, idle = time.monotonic() + limit_s, 0
    while time.monotonic() < end:
        running = _running_threads()
        if running is None:
            return False
        idle = idle + 1 if running == 0 else 0
        if idle == 2:
            return True
        time.sleep(0.0002)
    return False


def _mark(marks: Marks, name: str, events: list) -> None:
    """The phase `name` ends here, once what other threads still free has been freed."""
    if not _settled():
        warnings.warn(f"{name}: this process's threads still ran after 1 s; the phase's "
                      "figures may count what they hold", stacklevel=2)
    marks.append((name, len(events)))


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
        _mark(marks, "init", events)
        ids = torch.randint(0, int(hf_config["vocab_size"]), (batch, seq))
        for s in range(steps):
            for m in range(accumulation):
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
                _mark(marks, f"s{s}m{m} fwd+bwd", events)
                engine.step()
                del loss
                _mark(marks, f"s{s}m{m} step", events)
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
                _mark(marks, "init", events)

            def on_substep_end(self, args: Any, state: Any, *more: Any, **kw: Any) -> None:
                micro = sum(name.startswith(f"s{state.global_step}m") for name, _ in marks)
                _mark(marks, f"s{state.global_step}m{micro}", events)

            def on_step_end(self, args: Any, state: Any, *more: Any, **kw: Any) -> None:
                _mark(marks, f"s{state.global_step - 1} step", events)

        tracker = _LiveBytes(events, existing=[*model.parameters(), *model.buffers(), ids])
        with tracker.mode:
            Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=Tokens(),
                    callbacks=[Phases()]).train()
    return [(kind, key, n) for kind, key, n, _ in events], marks


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


CONFIGS = ((1, "none"), (1, "optimizer"), (2, "none"), (2, "optimizer"), (3, "none"))


def compare_small() -> None:
    print("GPT-2 4x128, seq 64, batch 2 x 2 micro-batches, bucket 2e6: MiB live at each "
          "phase's end / peak within it (the real engine on CPU holds its host-side "
          "offload buffers and a CPU copy of the weights too)")
    for stage, offload in CONFIGS:
        real = phases(*record(stage, offload, SMALL_GPT2, 64, 2, 2, bucket=2_000_000))
        marks: Marks = []
        events = emulated(SMALL_GPT2, 64, 2, 2, stage, offload, False,
                          bucket=2_000_000, marks=marks)
        assert events is not None
        emu = phases(events, marks)
        print(f"ZeRO-{stage}, offload {offload}")
        for (name, live, peak), (_, elive, epeak) in zip(real, emu, strict=True):
            print(f"  {name:14s} engine {live / 2**20:7.2f} / {peak / 2**20:7.2f}   "
                  f"emulated {elive / 2**20:7.2f} / {epeak / 2**20:7.2f}")


def compare_h100() -> None:
    """The H100 file's DeepSpeed rows: the emulation's allocated peak, its reserved peak
    replayed with one pool for every stream and with a pool per stream (what the physics
    uses), the physics' total (beside it the CUDA runtime and NCCL's communicator) and
    the measurement with its margin over the total; then the leave-one-out errors as
    shipped, and with each figure the physics used before instead; then the ZeRO rows
    through the formulas alone (where the emulation does not apply: several ranks,
    checkpointing, fp32, ...), with and without the reduction buckets."""
    import statistics

    from memory_accuracy import GPU_SHAPES, recorded, spec_for

    from autotune.plan import zero_replay
    from autotune.plan.calibration import MemoryModel, leave_one_out_errors
    from autotune.plan.memory import FRAGMENTATION
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec

    def replay(model: MemoryModel, c: Any, streams: bool) -> Any:
        return zero_replay.trial_replay(model.shape, c, model.attention_kernel(c),
                                        model.device.compute_capability, streams)

    class OnePool(MemoryModel):  # the ZeRO rows' replay with one pool for all streams
        def replayed_peaks(self, c):  # noqa: ANN001, ANN202 - Physics' own signature
            if not self.zero_replayed(c):
                return super().replayed_peaks(c)
            a = replay(self, c, False)
            return None if a is None else (a.peak_allocated, a.peak_reserved)

    class AllocatedPlusAllowance(MemoryModel):  # the ZeRO rows' allocated peak plus 5%
        def replayed_peaks(self, c):  # noqa: ANN001, ANN202
            if not self.zero_replayed(c):
                return super().replayed_peaks(c)
            a = replay(self, c, True)
            return None if a is None else (a.peak_allocated,
                                           a.peak_allocated * (1 + FRAGMENTATION))

    device, by_shape = recorded(str(Path(__file__).resolve().parent
                                    / "memory_accuracy_h100.txt"))
    name = "gpt2-124m-s1024"
    measured = by_shape[name]
    shape = model_shape(load_spec(spec_for(*GPU_SHAPES[name])))
    model = MemoryModel(shape, device)
    print(f"{name} on the H100 file, MiB: the emulation's allocated peak; its reserved "
          "peak with one pool, and with a pool per stream (default + reduction stream); "
          "the physics' total; the measurement and its margin over the total")
    for c, bytes_ in measured:
        if not model.zero_replayed(c):
            continue
        one, pools = replay(model, c, False), replay(model, c, True)
        by_stream = " + ".join(f"{v / 2**20:.0f}"
                               for _, v in sorted(pools.reserved_by_stream.items()))
        total = model.predict_total(c)
        print(f"  {c.label():40s} {pools.peak_allocated / 2**20:7.0f} "
              f"{one.peak_reserved / 2**20:7.0f} {pools.peak_reserved / 2**20:7.0f} "
              f"({by_stream:>11s})  total {total / 2**20:7.0f}   measured "
              f"{bytes_ / 2**20:7.0f}   margin {(bytes_ - total) / 2**20:+6.0f}")
    for label, kind in (("as shipped (a pool per stream)", MemoryModel),
                        ("with one pool", OnePool),
                        ("with the allocated peak + 5%", AllocatedPlusAllowance)):
        errors = leave_one_out_errors(shape, device, 1, measured, kind)
        uncalibrated = [abs(kind(shape, device).predict_total(c) - m) / m
                        for c, m in measured]
        worst = max(zip(errors, measured, strict=True), key=lambda e: e[0])
        print(f"{label}: uncalibrated median {statistics.median(uncalibrated):.1%}, max "
              f"{max(uncalibrated):.1%}; leave-one-out median {statistics.median(errors):.1%},"
              f" max {worst[0]:.1%} ({worst[1][0].label()})")

    class Formulas(MemoryModel):
        def zero_replayed(self, c):  # noqa: ANN001, ANN202
            return False

    class FormulasWithoutBuckets(Formulas):
        def zero_bucket_bytes(self, c):  # noqa: ANN001, ANN202
            return 0.0 if c.zero_stage < 3 else super().zero_bucket_bytes(c)

    print("the ZeRO rows through the formulas alone, error against the measurement: with "
          "the reduction buckets (as shipped there), and without them")
    for c, bytes_ in measured:
        if c.zero_stage:
            with_, without = (kind(shape, device).predict_total(c) / bytes_ - 1
                              for kind in (Formulas, FormulasWithoutBuckets))
            print(f"  {c.label():40s} {with_:+7.1%} {without:+7.1%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpt2-124m", action="store_true",
                    help="the H100 file's DeepSpeed rows replayed, and the leave-one-out "
                    "errors (no engine run)")
    if ap.parse_args().gpt2_124m:
        compare_h100()
    else:
        compare_small()


if __name__ == "__main__":
    main()
