"""`autotune search`: spec -> space -> strategy <-> executor -> study -> exports.

This module wires the pieces; each piece lives in its own module.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.config import Outcome, TrialConfig
from autotune.device import DeviceSpec, local_device
from autotune.errors import SpecError
from autotune.export import export_config
from autotune.loop import Executor, drive
from autotune.shape import ModelShape
from autotune.space import SpaceResult, build_space
from autotune.spec import Spec, load_spec, parse_duration
from autotune.strategies.base import Proposal, Record, SearchContext
from autotune.study import load_history, open_study, record_trial, save_summary

WALL_KEY = "autotune_wall_seconds"
CPU_BUDGET_SHARE = 0.5  # default trial budget on CPU: half the RAM free when the search starts


@dataclass
class TrialRecord:
    number: int
    config: TrialConfig
    outcome: Outcome
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "config": self.config.to_dict(),
                "outcome": self.outcome.to_dict(), "reason": self.reason}


@dataclass
class SearchResult:
    """What a search found; `.training_arguments()` and `.deepspeed_config()` hand the
    winner back as objects ready for a Trainer."""

    spec: Spec
    device: DeviceSpec
    memory_limit_bytes: int
    trials: list[TrialRecord]
    output: Path
    wall_seconds: float = 0.0
    shape: ModelShape | None = None
    pruned_by_rules: dict[str, str] = field(default_factory=dict)
    study_name: str = ""
    storage: str = ""
    exports: dict[str, str | None] = field(default_factory=dict)

    @property
    def best(self) -> TrialRecord | None:
        ok = [t for t in self.trials if t.outcome.ok]
        return max(ok, key=lambda t: t.outcome.samples_per_second or 0.0) if ok else None

    @property
    def baseline(self) -> TrialRecord | None:
        """Trainer defaults with auto_find_batch_size: the largest baseline batch that ran."""
        ok = [t for t in self.trials if t.reason == "baseline" and t.outcome.ok]
        return max(ok, key=lambda t: t.config.per_device_train_batch_size) if ok else None

    @property
    def speedup(self) -> float | None:
        best, base = self.best, self.baseline
        if best is None or base is None or not base.outcome.samples_per_second:
            return None
        return (best.outcome.samples_per_second or 0.0) / base.outcome.samples_per_second

    @property
    def ooms(self) -> int:
        return sum(1 for t in self.trials if t.outcome.is_oom)

    @property
    def trials_run(self) -> int:
        return sum(1 for t in self.trials if t.outcome.status != "pruned")

    def _best_config(self) -> TrialConfig:
        if self.best is None:
            raise SpecError("no trial succeeded, so there is no configuration to export; "
                            "see the trial errors in summary.json")
        return self.best.config

    def training_arguments(self, output_dir: str, **overrides: Any):
        """The winner as a real `transformers.TrainingArguments`."""
        from transformers import TrainingArguments

        from autotune.trainargs import deepspeed_config, training_arguments_kwargs

        cfg = self._best_config()
        kwargs = training_arguments_kwargs(
            cfg, output_dir=output_dir, on_cpu=not self.device.is_cuda,
            deepspeed=deepspeed_config(cfg, world_size=self.spec.world_size))
        return TrainingArguments(**(kwargs | overrides))

    def deepspeed_config(self) -> dict[str, Any] | None:
        from autotune.trainargs import deepspeed_config

        return deepspeed_config(self._best_config(), world_size=self.spec.world_size)

    def summary(self) -> dict[str, Any]:
        best, base = self.best, self.baseline
        return {
            "autotune_version": __version__,
            "model": self.shape.to_dict() if self.shape else {"name": self.spec.model
                                                              .display_name()},
            "device": {"name": self.device.name, "kind": self.device.kind,
                       "memory_bytes": self.device.memory_bytes,
                       "compute_capability": self.device.compute_capability,
                       "count": self.device.count},
            "memory_limit_bytes": self.memory_limit_bytes,
            "target_batch_size": self.spec.target_batch_size,
            "world_size": self.spec.world_size,
            "seq_len": self.spec.data.seq_len,
            "best": (best.to_dict() | {"memory_components": self._components(best.config)})
            if best else None,
            "baseline": base.to_dict() if base else None,
            "speedup": self.speedup,
            "trials": [t.to_dict() for t in self.trials],
            "pruned_by_rules": self.pruned_by_rules,
            "search": {"wall_seconds": self.wall_seconds, "trials_run": self.trials_run,
                       "ooms": self.ooms, "study_name": self.study_name,
                       "storage": self.storage},
            "exports": self.exports,
            "projection": self.spec.run.model_dump(),
        }

    def _components(self, config: TrialConfig) -> dict[str, int] | None:
        """The winner's memory by component, from the model calibrated on every trial."""
        if self.shape is None:
            return None
        from autotune.memory import MemoryModel

        model = MemoryModel(self.shape, self.device, self.spec.world_size)
        for t in self.trials:
            if t.outcome.ok:
                model.observe(t.config, t.outcome.peak_memory_bytes)
        return dict(model.predict(config).components)


def memory_limit(spec: Spec, device: DeviceSpec) -> int:
    budget = spec.hardware.budget_bytes()
    if budget is not None:
        return budget
    if device.is_cuda:
        return device.memory_bytes
    import psutil

    return int(psutil.virtual_memory().available * CPU_BUDGET_SHARE)


def model_shape(spec: Spec) -> ModelShape | None:
    """The architecture figures for the memory model; None for a bare factory model."""
    from autotune.model_builder import load_hf_config

    hf_config = load_hf_config(spec.model.model_dump())
    if hf_config is None:
        return None
    from autotune.memory import shape_from_hf_config

    return shape_from_hf_config(hf_config, spec.data.seq_len, spec.model.task,
                                spec.model.attn_implementation)


def _storage(spec: Spec, output: Path) -> str:
    return spec.search.storage or f"sqlite:///{(output / 'study.db').resolve()}"


Callback = Callable[..., None]


def run_search(
    spec_or_path: str | Path | dict | Spec,
    *,
    address: str | None = None,
    executor: Executor | None = None,
    device: DeviceSpec | None = None,
    on_start: Callback | None = None,
    on_record: Callback | None = None,
    **overrides: Any,
) -> SearchResult:
    """Run (or resume) a search; `overrides` use dotted spec keys ('search.n_trials')."""
    started = time.time()
    spec = load_spec(spec_or_path, **overrides)
    device = device or local_device()
    space = build_space(spec, device)
    if not space.candidates:
        raise SpecError("the search space has no config this device can run: "
                        + "; ".join(f"{k}: {v}" for k, v in space.pruned.items()))
    output = Path(spec.output)
    output.mkdir(parents=True, exist_ok=True)
    limit = memory_limit(spec, device)
    shape = model_shape(spec)
    storage = _storage(spec, output)
    study_name = spec.search.study_name or f"autotune-{spec.fingerprint()[:12]}"
    study = open_study(storage, study_name, spec.fingerprint())
    history = load_history(study)
    numbers = list(range(len(history)))
    ctx = SearchContext(space.candidates, device, spec.world_size, spec.target_batch_size,
                        limit, shape, spec.search.n_trials, spec.search.seed, space.pruned)
    from autotune.strategies.registry import make_strategy

    strategy = make_strategy("autotune", ctx)
    owns_executor = executor is None
    if executor is None:
        from autotune.executor import RayExecutor

        executor = RayExecutor(
            spec.model_dump(), address=address,
            gpus_per_trial=spec.world_size if device.is_cuda else 0,
            trial_kwargs={"shape": shape.to_dict() if shape else None,
                          "memory_budget_bytes": spec.hardware.budget_bytes() or (
                              None if device.is_cuda else limit),
                          "timeout_s": parse_duration(spec.search.trial_timeout),
                          "seed": spec.search.seed, "world_size": spec.world_size})

    def _recorded(record: Record, proposal: Proposal) -> None:
        numbers.append(record_trial(study, record, space.space, limit))
        if on_record is not None:
            on_record(record, len(numbers) - 1)

    try:
        drive(strategy, executor, history, max_trials=spec.search.n_trials,
              deadline=started + parse_duration(spec.search.timeout),
              on_record=_recorded, on_start=on_start)
    finally:
        if owns_executor:
            executor.close()
    result = _result(spec, device, limit, history, numbers, output, shape, space, study_name,
                     storage)
    # Wall time over every session of this study: a resumed search adds to it.
    result.wall_seconds = study.user_attrs.get(WALL_KEY, 0.0) + time.time() - started
    study.set_user_attr(WALL_KEY, result.wall_seconds)
    save_summary(study, write_outputs(result))
    return result


def _result(spec, device, limit, history, numbers, output, shape, space: SpaceResult,
            study_name, storage) -> SearchResult:
    trials = [TrialRecord(n, r.config, r.outcome, r.reason)
              for n, r in zip(numbers, history, strict=True)]
    return SearchResult(spec, device, limit, trials, output, shape=shape,
                        pruned_by_rules=space.pruned, study_name=study_name, storage=storage)


def write_outputs(result: SearchResult) -> dict[str, Any]:
    """Exports, summary.json and the report; nothing here reruns anything. Returns the
    summary written."""
    if result.best is not None:
        result.exports = export_config(result.best.config, result.output,
                                       on_cpu=not result.device.is_cuda,
                                       world_size=result.spec.world_size)
    summary = result.summary()
    (result.output / "summary.json").write_text(json.dumps(summary, indent=2, default=str)
                                                + "\n")
    from autotune.report import write_report

    write_report(result.output)
    return summary
