"""`autotune search`: spec -> space -> strategy <-> executor -> study -> summary -> exports.

This module wires the pieces; each piece lives in its own module.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import SpecError
from autotune.plan.calibration import MemoryModel
from autotune.plan.device import DeviceSpec, local_device, memory_limit
from autotune.plan.shape import ModelShape, model_shape
from autotune.search.loop import Limits, drive
from autotune.search.result import SearchResult
from autotune.search.strategies.base import SearchContext
from autotune.search.strategies.registry import make_strategy, sampler_for
from autotune.search.study import StudyLog
from autotune.space import Space, build_space
from autotune.spec import Spec, load_spec, parse_duration
from autotune.summary import Summary

if TYPE_CHECKING:
    from autotune.records import Record
    from autotune.search.strategies.base import Proposal
    from autotune.trials.executor import Executor

# Libraries whose version changes what a trial measures.
MEASURING_LIBRARIES = ("torch", "transformers", "accelerate", "deepspeed", "bitsandbytes")


def _versions() -> dict[str, str]:
    out = {}
    for name in MEASURING_LIBRARIES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


def fingerprint(spec: Spec, device: DeviceSpec, space: Space) -> str:
    """What makes the measurements of two searches comparable, so a resume never mixes
    them: the spec's model, data, target and measurement, the device, the space's
    contents and the measuring libraries' versions."""
    key = {"spec": spec.fingerprint(), "device": [device.name, device.kind, device.memory_bytes,
                                                  device.compute_capability, device.count],
           "space": space.choices(), "versions": _versions()}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def run_search(
    spec_or_path: str | Path | dict | Spec,
    *,
    address: str | None = None,
    executor: Executor | None = None,
    device: DeviceSpec | None = None,
    on_start: Callable[[Proposal], None] | None = None,
    on_record: Callable[[Record], None] | None = None,
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
    limit = memory_limit(device, spec.hardware.budget_bytes())
    shape = model_shape(spec)
    storage = spec.search.storage or f"sqlite:///{(output / 'study.db').resolve()}"
    key = fingerprint(spec, device, space.space)
    study_name = spec.search.study_name or f"autotune-{key[:12]}"
    log = StudyLog.open(storage, study_name, key, space.space.choices(), limit,
                        sampler_for(spec.search.sampler, spec.search.seed))
    log.recover_abandoned()
    ctx = SearchContext(space.candidates, device, spec.world_size, spec.target_batch_size,
                        limit, shape, spec.search.seed)
    strategy = make_strategy(spec.search.sampler, ctx, log)
    owns_executor = executor is None
    if executor is None:
        from autotune.trials.executor import RayExecutor

        executor = RayExecutor(spec, on_cpu=not device.is_cuda, address=address,
                               shape=shape.to_dict() if shape else None,
                               memory_budget_bytes=limit,
                               timeout_s=parse_duration(spec.search.trial_timeout))
    limits = Limits(max_trials=spec.search.n_trials,
                    deadline=started + parse_duration(spec.search.timeout))
    try:
        history = drive(strategy, executor, log, limits, on_start=on_start,
                        on_record=on_record)
    finally:
        if owns_executor:
            executor.close()
    search_info = {"wall_seconds": log.add_wall_seconds(time.time() - started),
                   "study_name": study_name, "storage": storage,
                   "sampler": spec.search.sampler}
    summary = summarise(spec, device, limit, shape, history, space.pruned, search_info)
    from autotune.outputs.export import write_outputs

    write_outputs(summary, output, spec, on_cpu=not device.is_cuda)
    log.save_summary(summary.to_dict())
    return SearchResult(spec, device, summary, output)


def summarise(spec: Spec, device: DeviceSpec, limit: int, shape: ModelShape | None,
              history: list[Record], pruned_by_rules: dict[str, str],
              search_info: dict[str, Any]) -> Summary:
    learned = shape or next((ModelShape(**r.outcome.shape) for r in history
                             if r.outcome.shape), None)
    summary = Summary(
        model=learned.to_dict() if learned else {"name": spec.model.display_name()},
        device={"name": device.name, "kind": device.kind, "memory_bytes": device.memory_bytes,
                "compute_capability": device.compute_capability, "count": device.count},
        memory_limit_bytes=limit, target_batch_size=spec.target_batch_size,
        world_size=spec.world_size, seq_len=spec.data.seq_len, trials=history,
        pruned_by_rules=pruned_by_rules, search=search_info,
        projection=spec.run.model_dump())
    if summary.best is not None and learned is not None:
        model = MemoryModel.from_history(learned, device, spec.world_size, history, limit)
        summary.memory_components = dict(model.predict(summary.best.config).components)
    return summary
