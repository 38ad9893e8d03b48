"""One trial, in its own process: build the model, train a few real Trainer steps, measure.

Run as `python -m autotune.trial_worker REQUEST.json RESULT.json`. It writes the result
file itself for every outcome it can see (ok, oom, nan, error); a crash or a kill leaves
no file, and the parent classifies that from the exit status.
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import psutil

ERROR_TAIL_LINES = 25


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _write(path: str, result: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


class BudgetWatch(threading.Thread):
    """On CPU nothing stops a trial at the budget, so watch RSS and end the trial as an
    OOM the moment its growth passes the budget (before it can swap the machine)."""

    def __init__(self, base_rss: int, budget: int, result_path: str, started: float):
        super().__init__(daemon=True)
        self.base, self.budget, self.path, self.started = base_rss, budget, result_path, started

    def run(self) -> None:
        while True:
            grown = _rss() - self.base
            if grown > self.budget:
                _write(self.path, {"status": "oom", "peak_memory_bytes": grown,
                                   "wall_seconds": time.time() - self.started,
                                   "error": f"memory budget exceeded: {grown / 2**30:.2f} GiB "
                                            f"> {self.budget / 2**30:.2f} GiB (host RSS growth)"})
                os._exit(0)
            time.sleep(0.01)


def _step_timer(sync):
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        """Wall time per optimizer step, device synchronised at each boundary."""

        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, args, state, control, **kw):
            sync()
            self.marks.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            sync()
            self.marks.append(time.perf_counter())

        def durations(self) -> list[float]:
            return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]

    return StepTimer()


def _non_finite(log_history: list[dict]) -> str | None:
    for entry in log_history:
        for key in ("loss", "grad_norm"):
            v = entry.get(key)
            if isinstance(v, int | float) and not math.isfinite(v):
                return f"non-finite {key} ({v}) at step {entry.get('step')}"
    return None


def _flops_per_token(n_params: int, shape: dict) -> float:
    # 6N for forward+backward matmuls, plus attention scores 12 * layers * hidden * seq.
    return 6 * n_params + 12 * shape["num_layers"] * shape["hidden_size"] * shape["seq_len"]


def run(request: dict[str, Any], result_path: str) -> dict[str, Any]:
    started = time.time()
    import torch
    from transformers import Trainer, TrainingArguments
    from transformers.utils import logging as hf_logging

    from autotune.config import TrialConfig
    from autotune.device import local_device
    from autotune.model_builder import build_dataset, build_model
    from autotune.oom import is_oom_exception
    from autotune.trainargs import deepspeed_config, training_arguments_kwargs

    hf_logging.set_verbosity_error()
    cfg = TrialConfig.from_dict(request["config"])
    spec, measure = request["spec"], request["spec"]["measure"]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    budget = request.get("memory_budget_bytes")
    base_rss = _rss()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        if budget:
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    elif budget:
        BudgetWatch(base_rss, budget, result_path, started).start()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    result: dict[str, Any] = {}
    shape: dict[str, Any] | None = None
    try:
        model = build_model(spec["model"], request["config"])
        shape = request.get("shape") or _report_shape(model, spec, result_path)
        n_steps = measure["warmup_steps"] + measure["steps"]
        samples = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * n_steps
        dataset = build_dataset(spec, model, samples, seed=request.get("seed", 0))
        kwargs = training_arguments_kwargs(cfg, output_dir=request["workdir"], on_cpu=not cuda,
                                           deepspeed=deepspeed_config(cfg, world_size=world),
                                           seed=request.get("seed", 42))
        # Trial-only settings: how long to run and what not to do; never the knobs.
        kwargs |= {"max_steps": n_steps, "logging_steps": 1, "save_strategy": "no",
                   "disable_tqdm": True, "dataloader_num_workers": 0, "log_level": "error",
                   "remove_unused_columns": False}
        timer = _step_timer(sync)
        trainer = Trainer(model=model, args=TrainingArguments(**kwargs), train_dataset=dataset,
                          callbacks=[timer])
        trainer.train()
        result = _measure(timer.durations(), measure, cfg, world, spec, model, trainer)
    except Exception as exc:  # noqa: BLE001 - every failure becomes an outcome
        tail = "".join(traceback.format_exception(exc)).splitlines()[-ERROR_TAIL_LINES:]
        result = {"status": "oom" if is_oom_exception(exc) else "error", "error": "\n".join(tail)}
    result["wall_seconds"] = time.time() - started
    if cuda:
        result |= _gpu_memory()
    else:
        result["peak_memory_bytes"] = max(0, _peak_rss() - base_rss)
    if budget and result.get("peak_memory_bytes", 0) > budget and result["status"] == "ok":
        result |= {"status": "oom", "error": f"memory budget exceeded: peak "
                   f"{result['peak_memory_bytes'] / 2**30:.2f} GiB > {budget / 2**30:.2f} GiB"}
    if result["status"] == "ok":
        mfu = model_flops_utilisation(result, shape, local_device(), cfg.precision, world)
        if mfu is not None:
            result["extra"]["mfu"] = mfu
    return result


def model_flops_utilisation(result: dict[str, Any], shape: dict[str, Any] | None, device,
                            precision: str, world: int) -> float | None:
    """Achieved over peak FLOP/s; None where the device's peak or the model's shape (a
    factory model without a config) is unknown: a missing figure, never a failed trial."""
    peak = device.peak_flops.get(precision)
    if not peak or not shape or "num_layers" not in shape:
        return None
    flops = _flops_per_token(result["extra"]["num_parameters"], shape)
    return flops * result["tokens_per_second"] / (peak * world)


def _report_shape(model, spec: dict[str, Any], result_path: str) -> dict[str, Any] | None:
    """A factory model's shape, written beside the result before training can run out of
    memory, so even an OOM trial teaches the search the model's size. Written atomically:
    the budget watch may end the process at any moment."""
    from autotune.memory import shape_from_model

    shape = shape_from_model(model, spec["data"]["seq_len"], spec["model"].get("task",
                                                                               "causal-lm"))
    if shape is None:
        return None
    _write(str(Path(result_path).with_name("shape.json")), shape.to_dict())
    return shape.to_dict()


def _measure(durations, measure, cfg, world, spec, model, trainer) -> dict[str, Any]:
    import torch

    timed = durations[measure["warmup_steps"]:]
    if not timed:
        return {"status": "error", "error": f"only {len(durations)} steps ran"}
    step = statistics.median(timed)
    samples_per_s = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * world / step
    bad = _non_finite(trainer.state.log_history)
    return {
        "status": "nan" if bad else "ok",
        "error": bad,
        "samples_per_second": samples_per_s,
        "tokens_per_second": samples_per_s * spec["data"]["seq_len"],
        "step_seconds": durations,
        "timed_seconds": sum(timed),
        "extra": {"num_parameters": sum(p.numel() for p in model.parameters()),
                  "cpu_threads": torch.get_num_threads(),
                  "warmup_seconds": sum(durations[:measure["warmup_steps"]])},
    }


def _gpu_memory() -> dict[str, Any]:
    """Allocator peak plus what the allocator does not see (CUDA context, cuBLAS
    workspaces), which NVML reports for the process."""
    import torch

    reserved_peak = torch.cuda.max_memory_reserved()
    extra = 0
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        mine = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                if p.pid == os.getpid()]
        if mine and mine[0].usedGpuMemory:
            extra = max(0, mine[0].usedGpuMemory - torch.cuda.memory_reserved())
    except Exception:  # noqa: BLE001 - NVML is optional; allocator figures still stand
        extra = 0
    return {"peak_memory_bytes": reserved_peak + extra,
            "extra_gpu": {"allocator_peak_reserved": reserved_peak, "nvml_overhead": extra}}


def main(argv: list[str]) -> int:
    request_path, result_path = argv[1], argv[2]
    with open(request_path) as f:
        request = json.load(f)
    os.environ["AUTOTUNE_TRIAL_CONFIG"] = json.dumps(request["config"])
    # The trial runs in a scratch folder; model factories import from where the user ran.
    sys.path.insert(0, request.get("import_path", os.getcwd()))
    result = run(request, result_path)
    if int(os.environ.get("RANK", "0")) == 0:
        _write(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
