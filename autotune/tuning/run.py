"""`autotune search`: spec -> space -> strategy <-> executor -> study -> summary -> exports.

This module wires the pieces; each piece lives in its own module.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune import knobs, versions
from autotune.config import Family
from autotune.dburl import shown
from autotune.device import DeviceSpec, local_device, memory_limit
from autotune.errors import SetupError, SpecError
from autotune.outputs.export import write_outputs
from autotune.plan.calibration import MemoryModel
from autotune.plan.estimate import resolve_longest
from autotune.plan.shape import ModelShape, model_shape
from autotune.records import CONFIRM_REASON
from autotune.space import Space, build_space, divisors, few_splits, load_space
from autotune.spec import Spec, load_spec, parse_duration
from autotune.summary import Summary
from autotune.tasks import objective_of, trainer_of
from autotune.trials.executor import Executor, RayExecutor
from autotune.trials.host_malloc import measured_under
from autotune.tuning import confirm, numerics
from autotune.tuning.loop import Limits, drive
from autotune.tuning.recipe import available_values, recipe_rungs
from autotune.tuning.remembered import Remembered
from autotune.tuning.result import SearchResult
from autotune.tuning.strategies.base import Resume, SearchContext, Twins
from autotune.tuning.strategies.probe import baseline_chain, recipe_chains
from autotune.tuning.strategies.registry import make_strategy, sampler_for
from autotune.tuning.study import StudyLog

if TYPE_CHECKING:
    from autotune.records import Record
    from autotune.tuning.strategies.base import Proposal

def fingerprint(spec: Spec, device: DeviceSpec, space: Space) -> str:
    """What makes the measurements of two searches comparable, so a resume never mixes
    them: the spec's model, data, target and measurement, the device, the space's
    contents and the measuring libraries' versions (the results store's list: an upgrade
    that makes a record a near match also refuses a resume)."""
    key = {"spec": spec.fingerprint(), "device": [device.name, device.kind, device.memory_bytes,
                                                  device.compute_capability, device.count]
           + ([device.nodes] if device.nodes > 1 else []),
           "space": space.choices(), "versions": versions.library_versions()}
    if heap := measured_under(device.is_cuda):  # a CPU's peaks: trials/host_malloc.py
        key["heap"] = heap
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


logger = logging.getLogger(__name__)


def run_search(
    spec_or_path: str | Path | dict | Spec,
    *,
    address: str | None = None,
    executor: Executor | None = None,
    device: DeviceSpec | None = None,
    on_start: Callable[[Proposal], None] | None = None,
    on_record: Callable[[Record], None] | None = None,
    fresh: bool = False,
    **overrides: Any,
) -> SearchResult:
    """Run (or resume) a search; `overrides` use dotted spec keys ('search.n_trials').
    `fresh`: search even where the results store remembers this setup, and seed nothing."""
    started = time.time()
    spec = load_spec(spec_or_path, **overrides)
    owns_executor = executor is None
    if executor is None:
        executor = RayExecutor(spec, address=address,
                               timeout_s=parse_duration(spec.search.trial_timeout))
    try:
        # What the spec alone decides and costs nothing to check fails before Ray
        # starts: the space, the output.
        space = load_space(spec.search.space, spec.target_batch_size, spec.world_size)
        output = Path(spec.output)
        if output.exists() and not output.is_dir():
            raise SpecError(f"output: {spec.output!r} is a file, not a folder")
        # Reading the model imports transformers: on a CPU machine, between another
        # search's trials, and while this search's own Ray starts.
        if spec.data.seq_len == "longest":  # a length for this device, said once
            device = device or (executor.discover() if owns_executor else local_device())
            limit = memory_limit(device, spec.hardware.budget_bytes(),
                                 parallel=executor.capacity)
            with executor.driver_work("finding the longest length"):
                spec, said = resolve_longest(spec, device, limit)
            logger.warning(said)
            executor.use_spec(spec)  # the trials' requests carry the length found
        shape = executor.read_while_starting("reading the model", lambda: model_shape(spec))
        if owns_executor:
            device = device or executor.discover()  # where trials run, not the driver
        device = device or local_device()
        return _search(spec, shape, space, device, executor, started, on_start, on_record,
                       fresh)
    finally:
        if owns_executor:
            executor.close()


def _say_resumed(history: list[Record], study_name: str, storage: str,
                 n_trials: int) -> None:
    """A search that finds its study already run says so: a rerun of a finished search
    otherwise shows the old result as if it were new."""
    if not history:
        return
    ran = sum(r.counted for r in history)
    where = shown(storage).removeprefix("sqlite:///")
    note = f"resuming study {study_name} in {where}: {ran} trials ran before"
    if ran >= n_trials:
        note += (f"; search.n_trials {n_trials} is reached, so no new trial runs (raise "
                 "--trials to search on, or give another --output for a new search)")
    logger.warning(note)


def _search(spec: Spec, shape: ModelShape | None, space_file: Space, device: DeviceSpec,
            executor: Executor, started: float,
            on_start: Callable[[Proposal], None] | None,
            on_record: Callable[[Record], None] | None, fresh: bool = False) -> SearchResult:
    space = build_space(spec, device, space_file)
    if not space.candidates:
        raise SpecError("the search space has no config this device can run: "
                        + "; ".join(f"{k}: {v}" for k, v in space.pruned.items()))
    if note := few_splits(spec.target_batch_size // spec.world_size):
        logger.warning(note)
    output = Path(spec.output)
    output.mkdir(parents=True, exist_ok=True)
    limit = memory_limit(device, spec.hardware.budget_bytes(), parallel=executor.capacity)
    executor.prepare(shape.to_dict() if shape else None, limit)
    storage = spec.search.storage or f"sqlite:///{(output / 'study.db').resolve()}"
    key = fingerprint(spec, device, space.space)
    study_name = spec.search.study_name or f"autotune-{key[:12]}"
    log = StudyLog.open(storage, study_name, key, space.space.choices(), limit,
                        sampler_for(spec.search.sampler, spec.search.seed),
                        objective=objective_of(spec))
    log.recover_abandoned()
    trained_by = trainer_of(spec)
    ctx = SearchContext(space.candidates, device, spec.world_size, spec.target_batch_size,
                        limit, shape, spec.search.seed,
                        baseline_family=Family.baseline().replace(**trained_by.defaults))
    chain = baseline_chain(ctx)  # auto_find_batch_size's, where the trainer takes it
    ctx.baseline_chain = chain if trained_by.auto_find_batch_size else chain[:1]
    ctx.recipe_chains = recipe_chains(ctx, recipe_rungs(
        device, available_values(spec), world_size=spec.world_size,
        real_data=spec.data.source != "synthetic"), divisors(spec.per_rank_batch))
    # The results store: an exact match answers (checked on read), a near one seeds.
    memory = Remembered.open(spec, device, space, shape, output, fresh=fresh)
    remembered = memory.answer(ctx, executor, log, storage, started, on_start, on_record)
    if remembered is not None:
        return SearchResult(spec, device, remembered, output)
    ctx.memory_prior = memory.calibration()
    history = log.history()
    ctx.resumed_records = len(history)
    strategy = Twins(memory.seeded(make_strategy(spec.search.sampler, ctx, log), ctx))
    owed = [(c, why) for c, why in log.abandoned() if why != CONFIRM_REASON]
    if owed:
        strategy = Resume(strategy, owed)
    deadline = started + parse_duration(spec.search.timeout)
    repeats = spec.search.confirm_repeats
    _say_resumed(history, study_name, storage, spec.search.n_trials)
    # The confirmation's trials are paid from the same time budget: the search leaves room
    # for the repeats of the contenders it has so far, priced at their own trials' times
    # and the recent trials' waits for another search's, and for the next trial, its wait
    # too.
    limits = Limits(max_trials=spec.search.n_trials, deadline=deadline,
                    reserve=lambda: confirm.cost_seconds(
                        confirm.contenders(history, spec.per_rank_batch), repeats,
                        executor.capacity, history),
                    wait=lambda: confirm.lease_wait_seconds(history))

    def recorded(record: Record) -> None:
        if on_record is not None:
            on_record(record)
        _stop_on_setup_error(record)

    def review(record: Record, seen: list[Record]) -> None:
        numerics.review(record, seen, spec.target_batch_size, spec.world_size,
                        spec.measure.loss_tolerance)
        numerics.parity(record, seen)

    try:
        drive(strategy, executor, log, limits, history=history, on_start=on_start,
              on_record=recorded,
              review=review if trainer_of(spec).comparable_loss else None)
        picked = confirm.contenders(history, spec.per_rank_batch) if repeats else []
        if picked:
            confirmer = confirm.ConfirmStrategy(ctx, spec, output / "confirm", picked, repeats,
                                                on_cpu=not device.is_cuda, deadline=deadline)
            drive(confirmer, executor, log, Limits(deadline=deadline), history=history,
                  on_start=on_start, on_record=recorded)
    finally:
        # Whatever finished is written, even when the search was interrupted or stopped.
        search_info = {"wall_seconds": log.add_wall_seconds(time.time() - started),
                       "study_name": study_name, "storage": shown(storage),
                       "sampler": spec.search.sampler, "slots": executor.capacity}
        summary = summarise(spec, device, limit, shape, history, space.pruned, search_info)
        memory.annotate(summary)
        write_outputs(summary, output, spec, on_cpu=not device.is_cuda)
        log.save_summary(summary.to_dict())
    memory.finish(summary, history, shape, limit, spec.world_size)
    return SearchResult(spec, device, summary, output)


def _stop_on_setup_error(record: Record) -> None:
    """A failure to load what every config shares (model, data, tokenizer) stops the
    search at once, naming the field; unless a knob that changes how the model is built
    is off its baseline, when the config may be at fault and the search goes on."""
    failure = record.outcome.failure
    if failure.setup_field and all(getattr(record.config, k.name) == k.baseline
                                   for k in knobs.table() if k.affects_model):
        raise SetupError(failure.setup_field, failure.setup_message or "")


def summarise(spec: Spec, device: DeviceSpec, limit: int, shape: ModelShape | None,
              history: list[Record], pruned_by_rules: dict[str, str],
              search_info: dict[str, Any]) -> Summary:
    learned = shape or next((ModelShape.from_dict(r.outcome.shape) for r in history
                             if r.outcome.shape), None)
    summary = Summary(
        model=learned.to_dict() if learned else {"name": spec.model.display_name()},
        device=device,
        memory_limit_bytes=limit, target_batch_size=spec.target_batch_size,
        world_size=spec.world_size, seq_len=spec.data.seq_len, trials=history,
        pruned_by_rules=pruned_by_rules, search=search_info,
        projection=spec.run.model_dump(),
        confirmation=confirm.summarise(history, spec.search.confirm_repeats,
                                       spec.measure.steps * confirm.STEPS_FACTOR,
                                       spec.per_rank_batch,
                                       spec.search.seed))
    if summary.best is not None and learned is not None:
        model = MemoryModel.from_history(learned, device, spec.world_size, history, limit)
        summary.memory_components = dict(model.predict(summary.best.config).components)
    return summary
