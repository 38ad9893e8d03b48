"""One trial, in its own process: build the model, train a few real Trainer steps, measure.

Run as `python -m autotune.trials.worker REQUEST.json RESULT.json`. It writes the result
itself for every outcome it can see (ok, oom, nan, error); a crash or a kill leaves no
file, and the launcher classifies that from the exit status. Of several ranks (forked by
the warm launcher's leader, or under torchrun) every rank writes its own file
(RESULT.json.rankR, merged by the launcher), and a rank that failed exits non-zero so that
the leader or torchrun takes the others down instead of leaving them blocked in a
collective until the time limit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import resource
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from autotune.records import (
    ERROR,
    LOST,
    NAN,
    OK,
    OOM,
    Compile,
    Failure,
    Lengths,
    Measurement,
    ModelBuild,
    Outcome,
    Phases,
)
from autotune.trials.compile_clock import CompileClock, cache_state
from autotune.trials.gpu_memory import allocator_peaks, gpu_memory, nvml_pids, record_history
from autotune.trials.protocol import (
    SPAWNED_AT,
    TrialRequest,
    compile_clock_path,
    rank_result_path,
    rss_path,
    write_result,
)

if TYPE_CHECKING:
    from autotune.config import TrialConfig

ERROR_TAIL_LINES = 25
# How far a watched trial's host RSS moves before the figure the launcher reads is
# rewritten, where no budget sets the scale.
WATCH_GRANULARITY = 64 * 2**20
# Trial-only settings: how long to run and what not to do; never a knob. Nothing is
# logged: Trainer's logging reads the loss and the grad norm on the host at every logged
# step, a device sync per step inside the timed window; StepReadings keeps them on the
# device instead. (Trainer's NaN filter, a host read per micro-batch, would also hide a
# real divergence.)
TRIAL_ONLY = {"logging_strategy": "no", "save_strategy": "no", "disable_tqdm": True,
              "log_level": "error", "remove_unused_columns": False,
              "logging_nan_inf_filter": False}


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class HostWatch(threading.Thread):
    """Watches the trial's RSS growth and keeps the latest figure where the launcher reads
    it, should something outside kill the trial (the host's OOM killer). With a budget (a
    CPU trial, where nothing else stops one), it also ends the trial as an OOM the moment
    its growth passes the budget, before it can swap the machine."""

    def __init__(self, base_rss: int, budget: int | None, result_path: str, started: float,
                 shape: dict | None):
        super().__init__(daemon=True)
        self.base, self.budget, self.path, self.started = base_rss, budget, result_path, started
        self.shape = shape
        self._done = threading.Event()

    def stop(self) -> None:
        """The trial has ended: nothing more to watch (a trial run in-process, by a test,
        leaves no thread behind)."""
        self._done.set()

    def run(self) -> None:
        said: int | None = None
        # A budget is checked often; a GPU trial's host figure only needs to be recent,
        # and its host thread is better left to launch the GPU's work.
        step = self.budget / 50 if self.budget else WATCH_GRANULARITY
        pause = 0.01 if self.budget else 0.1
        while not self._done.is_set():
            grown = _rss() - self.base
            if said is None or abs(grown - said) > step:
                said = grown
                with contextlib.suppress(OSError):
                    Path(rss_path(self.path)).write_text(str(grown))
            if self.budget and grown > self.budget:
                write_result(self.path, Outcome(
                    OOM, peak_memory_bytes=grown, wall_seconds=time.time() - self.started,
                    shape=self.shape,
                    error=f"memory budget exceeded: {exceeded(grown, self.budget)} "
                          "(host RSS growth)"))
                os._exit(0 if _world() == 1 else 1)
            self._done.wait(pause)


HOST_STANDS_IN_FOR_GPU = "AUTOTUNE_TEST_HOST_AS_GPU"


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


class MicroBatches:
    """The micro-batch sizes this rank trained on and their real (non-pad) tokens: a
    trial's samples per step are counted, not assumed (an unevenly split dataset once
    overstated throughput). Counted as the training step prepares its inputs, which it
    does for every batch whatever process loaded it. A packed micro-batch is one row of
    its samples' tokens, whose count the position ids restarting at 0 tell. Sums over a
    batch on the GPU stay there until the run has ended: reading one on the host each
    micro-batch would wait for the GPU every time, removing the host/device overlap the
    step timer keeps and charging configs with much accumulation for it."""

    def __init__(self, trainer, packed: bool, count=None) -> None:
        self._sizes: list = []
        self._tokens: list = []
        prepare = trainer._prepare_inputs

        def counted(inputs):
            # Counted as the step gets them: prepared (a generating trainer's completions
            # are made here, from a batch of prompts).
            inputs = prepare(inputs)
            ids = inputs.get("input_ids", inputs.get("labels"))
            if count is not None:  # its task's or trainer's (autotune/tasks/): pairs, images
                size, tokens = count(inputs)
                self._sizes.append(size)
                self._tokens.append(tokens)
            elif packed and "position_ids" in inputs:
                self._sizes.append((inputs["position_ids"] == 0).sum())
                self._tokens.append(ids.numel())
            else:
                self._sizes.append(ids.shape[0] if ids is not None else 0)
                mask = inputs.get("attention_mask")
                self._tokens.append(mask.sum() if mask is not None else ids.numel())
            return inputs

        trainer._prepare_inputs = counted

    @staticmethod
    def _ints(values: list) -> list[int]:
        return [int(v) for v in values]  # a device's sums read once, after the run

    def sizes(self) -> list[int]:
        return self._ints(self._sizes)

    def tokens(self) -> list[int]:
        return self._ints(self._tokens)


class StepReadings:
    """Each optimizer step's loss and gradient norm as the Trainer computed them, kept as
    they are (tensors on the device) until the run has ended and then read at once, for
    the numerics checks: no host read per step inside the timed window, as a long run
    logging every few hundred steps has none. A step's loss is the sum of its
    micro-batches' (what Trainer logs), averaged over the ranks as Trainer's logging
    gathers it; its grad norm what Trainer's clipping returned through accelerate (under
    DeepSpeed already a float: accelerate reads the engine's norm every step, in a long
    run too)."""

    def __init__(self, trainer) -> None:
        self._losses: list[tuple[int, Any]] = []
        self._norms: dict[int, Any] = {}
        step = trainer.training_step

        def kept(*args, **kwargs):
            loss = step(*args, **kwargs)
            self._losses.append((trainer.state.global_step, loss))
            return loss

        trainer.training_step = kept
        accelerator = trainer.accelerator
        clip = accelerator.clip_grad_norm_

        def clipped(*args, **kwargs):
            norm = clip(*args, **kwargs)
            self._norms[trainer.state.global_step] = norm
            return norm

        accelerator.clip_grad_norm_ = clipped

    def history(self, world: int) -> list[dict[str, Any]]:
        """[{"step", "loss", "grad_norm"}] per optimizer step, as Trainer's log_history
        has them: the device's values read here, once."""
        import torch

        steps = sorted({s for s, _ in self._losses})
        if not steps:
            return []
        per_step = torch.stack([sum(t.detach().float() for s, t in self._losses if s == step)
                                for step in steps])
        dist = torch.distributed
        if world > 1 and dist.is_available() and dist.is_initialized():
            dist.all_reduce(per_step)
            per_step /= world
        norms = [self._norms.get(step) for step in steps]
        on_device = [n for n in norms if isinstance(n, torch.Tensor)]
        read = iter(torch.stack([n.detach().float().reshape(()) for n in on_device]
                                ).to(per_step.device).tolist() if on_device else [])
        values = per_step.tolist()
        out = []
        for i, (step, norm) in enumerate(zip(steps, norms, strict=True)):
            entry: dict[str, Any] = {"step": step + 1, "loss": values[i]}
            if norm is not None:
                entry["grad_norm"] = next(read) if isinstance(norm, torch.Tensor) else norm
            out.append(entry)
        return out


def _packing_collator():
    """Padding-free packing: each sample's real tokens, concatenated, position ids
    restarting per sample (transformers' DataCollatorWithFlattening)."""
    from transformers import DataCollatorWithFlattening

    flatten = DataCollatorWithFlattening()

    def collate(features):
        rows = []
        for f in features:
            keep = f["attention_mask"].bool()
            rows.append({"input_ids": f["input_ids"][keep].tolist(),
                         "labels": f["labels"][keep].tolist()})
        return flatten(rows)

    return collate


def _step_timer(sync, warmup: int, memory=None):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time per optimizer step. The device is synchronised only where the timed
        window starts and ends (after the warm-up, after the last step): a sync after every
        step would remove the overlap of host and device work that a long run keeps.
        With `memory` (a GPU's allocator counters, read on the host without a sync), the
        running peaks after each step too: which step set the peak, and how far reserved
        ran over allocated (the H100 figures left both open: an 8-bit optimizer peaked
        where AdamW did, ZeRO-2 1.1 GiB under ZeRO-1)."""

        def __init__(self) -> None:
            self.marks: list[float] = []
            self.peaks: list[tuple[int, int]] = []
            self.compiled: list[int] = []  # graphs torch.compile had compiled, per step
            self.tf32: bool | None = None  # float32 matmuls as TF32 when training began

        def on_train_begin(self, args, state, control, **kw):
            from autotune.trials.runtime import settle_tf32, tf32_state

            settle_tf32()  # as transformers and accelerate left it, readable both ways
            self.tf32 = tf32_state()
            sync()
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            if state.global_step in (warmup, state.max_steps):
                sync()
            self.marks.append(time.perf_counter())
            self.compiled.append(compiled_graphs())
            if memory is not None:
                self.peaks.append(memory())

        def durations(self) -> list[float]:
            return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

        def window(self) -> float:
            """Synchronised seconds from the end of the warm-up to the end of the run."""
            return self.marks[-1] - self.marks[warmup]

    return StepTimer()


def compiled_graphs() -> int:
    """Graphs torch.compile has handed its backend in this process: one per graph, and
    one more each time a guard fails and it recompiles. Not dynamo's frame count: that
    counts every frame it looked at, also those it found nothing in (a DeepSpeed
    engine's helpers, first called at the second step, made a compiled ZeRO trial look
    like one that recompiles every step)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    return int(dynamo.counters["stats"]["unique_graphs"]) if dynamo is not None else 0


def recompiles(durations: list[float], compiled: list[int],
               warmup: int) -> tuple[list[int], float]:
    """(timed steps in which torch.compile compiled again, the seconds those steps took
    beyond the median of the others): a one-time cost, not the config's speed."""
    timed = durations[warmup:]
    before = [0, *compiled]  # what had been compiled as each step started
    hit = [i for i in range(len(timed)) if compiled[warmup + i] > before[warmup + i]]
    clean = [d for i, d in enumerate(timed) if i not in hit] or timed
    typical = sorted(clean)[len(clean) // 2]
    return hit, sum(max(0.0, timed[i] - typical) for i in hit)


# A compiled trial that compiles again in this share of its timed steps or more measures
# compilation, not training: its shapes or guards change every step.
RECOMPILING_EVERY_STEP = 0.5


def _finite(v) -> bool:
    return not isinstance(v, int | float) or math.isfinite(v)


def exceeded(used: int, limit: int) -> str:
    """`used GiB > limit GiB`, with the digits it takes for the two to differ (a peak
    just over 0.59 GiB read "0.59 GiB > 0.59 GiB")."""
    for digits in (2, 3, 4):
        a, b = f"{used / 2**30:.{digits}f}", f"{limit / 2**30:.{digits}f}"
        if a != b:
            return f"{a} GiB > {b} GiB"
    return f"{used} bytes > {limit} bytes"


def numerics(log_history: list[dict], precision: str) -> tuple[str | None, int]:
    """(why the run diverged, or None; loss-scale skips). Under fp16 the scaler skips a
    step whose gradients overflow (logged as grad_norm inf) and lowers the scale; a few
    such steps while it settles are normal. The run is `nan` when a loss is non-finite,
    or the gradients are still non-finite at the last step (the scale never settled);
    in other precisions, at any non-finite gradient norm."""
    steps = [e for e in log_history if "loss" in e]
    for e in steps:
        if not _finite(e["loss"]):
            return f"non-finite loss ({e['loss']}) at step {e.get('step')}", 0
    overflow = [e for e in steps if not _finite(e.get("grad_norm"))]
    if overflow and (precision != "fp16" or overflow[-1] is steps[-1]):
        e = overflow[-1] if precision == "fp16" else overflow[0]
        return (f"non-finite grad_norm ({e['grad_norm']}) at step {e.get('step')}"
                + (" after the loss scale had time to settle" if precision == "fp16" else ""),
                len(overflow))
    return None, len(overflow)


def _flops_per_token(n_params: int, trainable: int, shape: dict) -> float:
    """Model FLOPs per token by PaLM's appendix B (6N + 12·L·H·Q·T), as nanoGPT's
    estimate_mfu and torchtitan compute it: N the parameters a token's matmuls go through
    (flop_parameters); 2N forward and 2N for the backward's input gradients, and 2N more
    for weight gradients of the trainable ones only (6N in a full fine-tune; LoRA's frozen
    base has none); the attention scores' and values' 12 x layers x heads x head size x
    seq, counted whole as the convention does (not halved for a causal mask)."""
    return (4 * n_params + 2 * trainable
            + 12 * shape["num_layers"] * _attention_width(shape) * shape["seq_len"])


def _attention_width(shape: dict) -> int:
    """Heads x head size (PaLM's H·Q): the hidden size, unless the config sets a head
    size of its own (Gemma's, Qwen3's)."""
    config = shape.get("hf_config") or {}
    heads, head_dim = shape.get("num_attention_heads"), config.get("head_dim")
    return int(heads * head_dim) if heads and head_dim else int(shape["hidden_size"])


# The config keys that say how many experts an MoE has and how many a token goes through.
_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_PER_TOKEN = ("num_experts_per_tok", "moe_topk")


def flop_parameters(model) -> dict[str, int]:
    """N for MFU (PaLM's appendix B), counted on the built model: every parameter but the
    input embeddings (token, position, token type: lookups, not matmuls), except a token
    embedding tied to the LM head, which counts as the head's matmul (nanoGPT's count of
    GPT-2 124M: 123.65M); a 4-bit weight whole; an MoE's routed experts at the share of
    them each token goes through (num_experts_per_tok of them; a shared expert, always
    on, whole). `flop_trainable_parameters`: the same of the trainable ones."""
    import torch

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    tied = getattr(head, "weight", None)
    lookups = {id(m.weight) for m in model.modules()
               if isinstance(m, torch.nn.Embedding) and m.weight is not tied}
    config = getattr(model, "config", None)
    experts = next((getattr(config, k) for k in _EXPERTS if getattr(config, k, None)), None)
    per_token = next((getattr(config, k) for k in _PER_TOKEN if getattr(config, k, None)),
                     None)
    routed = per_token / experts if experts and per_token else 1.0
    n = trainable = 0.0
    for name, p in model.named_parameters():
        if id(p) in lookups:
            continue
        size = _whole(p) * (routed if "experts" in name.split(".") else 1.0)
        n += size
        trainable += size if p.requires_grad else 0.0
    return {"flop_parameters": int(n), "flop_trainable_parameters": int(trainable)}


def run(request: TrialRequest, result_path: str) -> Outcome:
    started = time.time()
    import torch
    from transformers import set_seed
    from transformers.utils import logging as hf_logging

    from autotune.config import TrialConfig
    from autotune.device import local_device
    from autotune.errors import SetupError
    from autotune.optimizers import optimizer
    from autotune.spec import Spec
    from autotune.tasks import task_of, trainer_of
    from autotune.trials.build_lock import install as guard_build_locks
    from autotune.trials.host_malloc import hold_mmap_threshold
    from autotune.trials.long_context import Levers
    from autotune.trials.model_builder import build_model, prepare_quantized
    from autotune.trials.oom import is_oom_exception
    from autotune.trials.runtime import (
        bitsandbytes_state,
        bitsandbytes_unfit,
        contradiction,
        ran_with,
    )
    from autotune.trials.trainargs import model_kwargs

    clock = PhaseClock()
    guard_build_locks()  # DeepSpeed loads its JIT ops in every trial: see build_lock.py
    hf_logging.set_verbosity_error()
    spec = Spec.model_validate(request.spec)  # the same validation the CLI ran
    task, trained_by = task_of(spec), trainer_of(spec)
    set_seed(request.seed)  # one seed: the same initial weights and data order everywhere
    cfg = TrialConfig.from_dict(request.config)
    levers = Levers(cfg, spec, request.on_cpu)  # sequence splits, tiling, checkpointing
    world = _world()
    cuda = not request.on_cpu and torch.cuda.is_available()
    # Never a CPU figure for a GPU config; only a test, where no GPU is here, lets the
    # host stand in for one to follow a GPU trial's host accounting (its budget is none).
    if not request.on_cpu and not cuda and not os.environ.get(HOST_STANDS_IN_FOR_GPU):
        return Outcome(LOST, wall_seconds=time.time() - started, error=(
            "the trial was to run on a GPU and its process sees none (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r}, torch "
            f"{torch.__version__}): the node's failure, not the config's"))
    # bitsandbytes without its CUDA library on a GPU runs its fallback kernels: refused
    # before anything is built, never timed as the GPU's figure.
    bnb = bitsandbytes_state() if (cfg.quantization != "none"
                                   or optimizer(cfg.optim).bitsandbytes) else None
    unfit = bitsandbytes_unfit(bnb, cuda)
    if unfit:
        return Outcome(ERROR, wall_seconds=time.time() - started, error=unfit,
                       diagnostics={"bitsandbytes": bnb})
    budget = request.memory_budget_bytes
    # A CPU trial's peak RSS is its tensors', not malloc's high-water: trials/host_malloc.py
    mmap_threshold = hold_mmap_threshold() if request.on_cpu else None
    # What a warm launcher imports before it forks, imported here where it did not: a CPU
    # trial's base holds the libraries, and its peak is the training's however it started.
    # (Not on a GPU, whose peak is the GPU's: there an import before set_device below, such
    # as bitsandbytes', could make a context on cuda:0. Not the model's module, a few MiB:
    # reading its config may ask the hub, each trial.)
    if request.on_cpu:
        from autotune.trials.forkserver import import_extras

        import_extras(trained_by.preload)
    base_rss = _rss()
    shape = request.shape
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else (
        torch.device("cpu"))
    # The processes on the GPUs before this one touches its device: at the end, the one
    # new on it is this trial's, where NVML's PIDs are not this namespace's.
    gpu_pids = nvml_pids() if cuda else None
    if cuda:
        torch.cuda.set_device(device)
        if budget:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(allocator_cap(budget, total, cfg, world))
    # On a GPU the budget is the GPU's (set above); the host is only watched.
    watch = HostWatch(base_rss, None if cuda else budget, result_path, started, shape)
    watch.start()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    history = cuda and record_history(cfg.zero_stage)
    timer = _step_timer(sync, spec.measure.warmup_steps, allocator_peaks if cuda else None)
    # A compiled trial's compile seconds, where the launcher reads them: not counted
    # against its time limit (trials/compile_clock.py).
    compiling = CompileClock(compile_clock_path(result_path)).start() if (
        cfg.torch_compile) else None
    built: ModelBuild | None = None  # how the model was built, once it was
    try:
        n_steps = spec.measure.warmup_steps + spec.measure.steps
        # Every rank gets b x gas micro-batch samples per step, for exactly n_steps steps.
        samples = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * n_steps
        samples *= cfg.data_parallel(world)  # a sequence split's ranks share their rows
        kwargs = request.training_args | TRIAL_ONLY | {
            "output_dir": str(Path.cwd() / "out"), "max_steps": n_steps} | levers.arguments()
        with clock.phase("engine"):
            # Before the model: under ZeRO-3 its DeepSpeed config makes transformers build
            # the model inside zero.Init, partitioned as it is made.
            args = trained_by.arguments(task, kwargs)
            if levers.joins_deepspeed:
                levers.join(args)
            elif cfg.zero_stage == 3:
                _join_deepspeed(args)
        with clock.phase("model"):
            model, how = build_model(spec.model.model_dump(), model_kwargs(cfg), device,
                                     (watch,))
            built = ModelBuild.from_dict(how)
            if cfg.quantization != "none":
                model = prepare_quantized(model)
            if spec.model.lora is not None and not trained_by.adds_adapters:
                from autotune.tasks.lora import with_lora

                model = with_lora(model, spec.model.lora.model_dump(), task)
            levers.model(model)

            def copy_of_policy():
                """The model built again as the policy was, from the same seed."""
                set_seed(request.seed)
                return build_model(spec.model.model_dump(), model_kwargs(cfg), device)[0]

            reference = trained_by.reference_model(spec, cfg, copy_of_policy)
        built.held_parameter_bytes, built.parameter_bytes = _held(model)
        built.host_peak_rss_bytes = max(0, _peak_rss() - base_rss)
        if cuda:
            built.device_peak_bytes = torch.cuda.max_memory_allocated()
        if shape is None:
            shape = _learned_shape(model, spec)
            watch.shape = shape  # even an OOM trial teaches the search the model's size
        with clock.phase("engine"):
            trainer, lengths = trained_by.make_trainer(
                spec, task, model, args, samples, timer, request.seed, reference,
                levers.collator(_packing_collator() if cfg.padding_free else None))
            levers.trainer(model, trainer)
            counted = MicroBatches(trainer, cfg.padding_free, trained_by.counter(task, shape))
            readings = StepReadings(trainer)
        clock.mark_engine_until(timer)  # Trainer.train() up to its first step is the engine's
        trainer.train()
        outcome = _measure(timer, spec, cfg, world, model, readings.history(world),
                           counted.tokens())
        trained_by.finish(spec, task, outcome, trainer)
        outcome.measured.micro_batches = counted.sizes()
        outcome.measured.mmap_threshold = mmap_threshold
        if lengths:  # the rows' real tokens: what padding and packing are judged on
            outcome.measured.lengths = Lengths.from_dict(lengths)
        if timer.peaks:  # running (allocated, reserved) peak bytes after each step
            outcome.measured.peaks_by_step = [list(p) for p in timer.peaks]
        # What the run really was: the Trainer's wrapper (DDP, FSDP, a DeepSpeed engine:
        # the proof that a sharding knob took effect), TF32, Liger, compile.
        facts = ran_with(trainer, timer.tf32, compiled_graphs())
        if bnb is not None:  # the native library its 4-bit or 8-bit ops ran in
            facts.bitsandbytes = Path(bnb["path"]).name if bnb["path"] else bnb["library"]
        levers.record(facts, trainer, model)
        outcome.ran_with = facts
        fallback = _sharding_fallback(cfg, facts.wrapped_as or "") or contradiction(
            cfg.precision, cfg.use_liger_kernel, cfg.torch_compile, facts, cuda) or (
            levers.contradiction(model, facts))
        if fallback:  # measured, but not the config asked for: never a figure for it
            outcome = Outcome(ERROR, error=fallback, **outcome.parts())
    except SetupError as exc:  # no config avoids it: the search stops on it
        outcome = Outcome(ERROR, error=str(exc),
                          failure=Failure(setup_field=exc.field, setup_message=exc.message))
    except Exception as exc:  # noqa: BLE001 - every failure becomes an outcome
        tail = "".join(traceback.format_exception(exc)).splitlines()[-ERROR_TAIL_LINES:]
        outcome = Outcome(OOM if is_oom_exception(exc) else ERROR, error="\n".join(tail))
    watch.stop()
    if compiling is not None:  # torch's own compile seconds, and Inductor's caches' state
        compiling.stop()
        outcome.compile = dataclasses.replace(outcome.compile,
                                              seconds=round(compiling.seconds, 3),
                                              **cache_state())
    outcome.shape = shape
    outcome.wall_seconds = time.time() - started
    outcome.launch.started_at, outcome.launch.ended_at = started, time.time()
    outcome.phases = clock.seconds(timer, spec.measure.warmup_steps)
    outcome.phases.model_build = built
    if cuda:
        peak, outcome.gpu_memory = gpu_memory(torch.cuda.current_device(), history,
                                              cfg.label(), gpu_pids)
        outcome.peak_memory_bytes = peak
    else:
        outcome.peak_memory_bytes = max(0, _peak_rss() - base_rss)
    if budget and (outcome.peak_memory_bytes or 0) > budget and outcome.ok:
        outcome.status = OOM
        outcome.error = ("memory budget exceeded: peak "
                         f"{exceeded(outcome.peak_memory_bytes or 0, budget)}")
    if outcome.ok:
        mfu = model_flops_utilisation(outcome, shape, local_device(), cfg.precision, world)
        if mfu is not None:
            outcome.measured.mfu = mfu
    return outcome


def allocator_cap(budget: int, total: int, cfg: TrialConfig, world: int) -> float:
    """The share of the device the caching allocator may hold: the trial's budget less
    what its process holds outside the allocator (the memory model's runtime term: the
    CUDA context, NCCL's communicator where there is a process group). Capped at the whole
    budget, a trial over it ran to its end before its peak, NVML's figure included, made
    it an OOM; capped so, it fails at the allocation that passes the budget. 0 where the
    budget cannot hold even the runtime: its first allocation fails."""
    from autotune.plan.memory import gpu_runtime_bytes

    return max(0.0, min(1.0, (budget - gpu_runtime_bytes(cfg, world)) / total))


class PhaseClock:
    """Times where a trial's seconds go (records.Phases): `launch` (from the launcher's
    start of the process to its imports done), `model` (built, quantized, adapters
    added), `engine` (the TrainingArguments, data, Trainer, and train() up to its first
    step: the optimizer and DeepSpeed's engine), `warmup` (the untimed steps, compilation
    included) and `steps` (the timed window). Only the phases the trial reached are
    given."""

    def __init__(self) -> None:
        self.ready = time.time()
        self.spent: dict[str, float] = {}
        self._engine_from: float | None = None

    @contextlib.contextmanager
    def phase(self, name: str):
        begun = time.perf_counter()
        try:
            yield
        finally:
            self.spent[name] = self.spent.get(name, 0.0) + time.perf_counter() - begun

    def mark_engine_until(self, timer) -> None:
        """From now to the step timer's first mark (Trainer's on_train_begin, after the
        optimizer and any DeepSpeed engine are made) is the engine's too."""
        self._engine_from = time.perf_counter()

    def seconds(self, timer, warmup: int) -> Phases:
        out: dict[str, float] = {}
        spawned = os.environ.get(SPAWNED_AT)
        if spawned:
            out["launch"] = max(0.0, self.ready - float(spawned))
        out |= {k: self.spent[k] for k in ("model", "engine") if k in self.spent}
        marks = timer.marks
        if self._engine_from is not None and marks:
            out["engine"] = out.get("engine", 0.0) + marks[0] - self._engine_from
        if len(marks) > warmup:
            out["warmup"] = marks[warmup] - marks[0]
        if len(marks) > warmup + 1:
            out["steps"] = marks[-1] - marks[warmup]
        return Phases(**{k: round(v, 4) for k, v in out.items()})


def _join_deepspeed(args) -> None:
    """The process group, joined by DeepSpeed's comm layer, before the model is built:
    zero.Init partitions over its ranks (and counts none without it). Trainer would join
    it later anyway; on CPU TrainingArguments sets up plain gloo ranks and leaves
    DeepSpeed's layer to the engine."""
    import deepspeed

    args.device  # noqa: B018 - TrainingArguments sets up the devices and process group
    deepspeed.init_distributed()


def _sharding_fallback(cfg: TrialConfig, wrapped_as: str) -> str | None:
    """Why the run was not sharded as the config says, where the Trainer fell back to
    something else (accelerate ignores FSDP on CPU ranks and trains with DDP)."""
    if cfg.fsdp != "none" and "FSDP" not in wrapped_as and "FullySharded" not in wrapped_as:
        return (f"fsdp={cfg.fsdp} did not take effect: the Trainer wrapped the model in "
                f"{wrapped_as} (accelerate runs FSDP only on GPUs)")
    if cfg.zero_stage > 0 and wrapped_as != "DeepSpeedEngine":
        return (f"zero_stage={cfg.zero_stage} did not take effect: the Trainer wrapped the "
                f"model in {wrapped_as}, not a DeepSpeed engine")
    return None


def model_flops_utilisation(outcome: Outcome, shape: dict[str, Any] | None, device,
                            precision: str, world: int) -> float | None:
    """Achieved over peak FLOP/s, by PaLM's appendix B (_flops_per_token); None where the
    device's peak or the model's shape (a factory model without a config) is unknown: a
    missing figure, never a failed trial."""
    peak = device.peak_flops.get(precision)
    n = outcome.measured.flop_parameters
    if (not peak or not shape or "num_layers" not in shape or not outcome.tokens_per_second
            or n is None):
        return None
    trainable = outcome.measured.flop_trainable_parameters
    trainable = n if trainable is None else trainable
    return _flops_per_token(n, trainable, shape) * outcome.tokens_per_second / (peak * world)


def _learned_shape(model, spec) -> dict[str, Any] | None:
    """A factory model's shape, for the search's memory model."""
    from autotune.plan.shape import shape_from_model
    from autotune.tasks import task_of, trainer_of

    kinds = ({"trainer": spec.trainer} | task_of(spec).shape_fields(spec.target_len)
             | trainer_of(spec).shape_fields(spec))
    shape = shape_from_model(model, spec.data.seq_len, spec.model.task, **kinds)
    return shape.to_dict() if shape is not None else None


def _measure(timer, spec, cfg, world, model, history: list[dict[str, Any]],
             tokens: list[int]) -> Outcome:
    import statistics

    import torch

    warmup, durations = spec.measure.warmup_steps, timer.durations()
    timed = durations[warmup:]
    if not timed:
        return Outcome(ERROR, error=f"only {len(durations)} steps ran")
    window = timer.window()
    again, recompile_seconds = recompiles(durations, timer.compiled, warmup)
    if cfg.torch_compile and len(again) >= RECOMPILING_EVERY_STEP * len(timed):
        return Outcome(ERROR, error=(
            f"torch.compile compiled again in {len(again)} of {len(timed)} timed steps "
            f"({recompile_seconds:.1f} s): the graph's shapes or guards change from step to "
            "step, so every step pays a compile; this measures compilation, not training "
            "speed"), step_seconds=durations, timed_seconds=window,
            compile=Compile(recompiled_steps=len(again)))
    window -= recompile_seconds  # a recompile is paid once, like the first compile
    gas = cfg.gradient_accumulation_steps
    # A sequence split's ranks share a batch: the samples are the data-parallel ranks'.
    per_step = cfg.per_device_train_batch_size * gas * cfg.data_parallel(world)
    samples_per_s = per_step * len(timed) / window
    # Real (non-pad) tokens of the timed steps, this rank's times the ranks.
    real_tokens_per_s = sum(tokens[warmup * gas:]) * world / window
    bad, skips = numerics(history, cfg.precision)
    measured = Measurement(
        num_parameters=_parameters(model), cpu_threads=torch.get_num_threads(),
        trainable_parameters=_parameters(model, trainable=True), **flop_parameters(model),
        warmup_seconds=sum(durations[:warmup]), loss_scale_skips=skips,
        losses=[e["loss"] for e in history if "loss" in e],
        grad_norms=[e["grad_norm"] for e in history if e.get("grad_norm") is not None] or None)
    compiled = Compile()
    if cfg.torch_compile:  # the warm-up pays compilation; a long run pays it once
        compiled.charged_seconds = max(0.0, sum(durations[:warmup]) - warmup
                                       * statistics.median(timed)) + recompile_seconds
        compiled.recompiled_steps = len(again)
        if spec.run.steps:  # charged once against the long run: the objective amortises it
            compiled.run_seconds = spec.run.steps * window / len(timed)
    return Outcome(
        NAN if bad else OK, error=bad, samples_per_second=samples_per_s,
        tokens_per_second=real_tokens_per_s, step_seconds=durations,
        timed_seconds=window, measured=measured, compile=compiled)


def _held(model) -> tuple[int, int]:
    """The bytes of parameters this rank holds after the build, and the model's whole: a
    ZeRO-3 rank holds its partitions only (`ds_tensor`, the parameter itself emptied)."""
    held = whole = 0
    for p in model.parameters():
        size = p.element_size()
        part = getattr(p, "ds_tensor", None)
        held += part.numel() * part.element_size() if part is not None else p.numel() * size
        whole += (getattr(p, "ds_numel", 0) or p.numel()) * size
    return held, whole


def _parameters(model, trainable: bool = False) -> int:
    """Every parameter (or the trainable ones), counted whole: ZeRO-3 leaves each rank a
    0-element placeholder and keeps the real size in `ds_numel`; a 4-bit weight packs two
    per element and keeps its shape in its quant state."""
    return sum(_whole(p) for p in model.parameters() if p.requires_grad or not trainable)


def _whole(p) -> int:
    state = getattr(p, "quant_state", None)
    if state is not None and getattr(state, "shape", None) is not None:
        return int(math.prod(state.shape))
    return getattr(p, "ds_numel", 0) or p.numel()


def main(argv: list[str]) -> int:
    from autotune.trials.cpu_info import remember_cpu_info
    from autotune.trials.reaper import die_with_parent

    die_with_parent()  # a rank dies with its leader or torchrun, however it dies
    remember_cpu_info()  # a cold trial too reads this boot's answer (the warm ones do)
    request_path, result_path = argv[1], argv[2]
    request = TrialRequest.from_json(Path(request_path).read_text())
    # The trial runs in a scratch folder; model factories import from the spec's folder
    # and from where the user ran.
    sys.path[:0] = request.import_paths
    world, rank = _world(), int(os.environ.get("RANK", "0"))
    path = rank_result_path(result_path, rank, world)
    outcome = run(request, path)
    outcome.launch.rank = rank
    write_result(path, outcome)
    return 0 if world == 1 or outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
