"""What a search does with what the results store answers (store/session.py: records and
their figures, as data), in a few calls from run.py:

1. `Remembered.open`: the store's session (fingerprints, the store or a line why not);
2. `answer`: the exact match checked on read (reconfirm.py: its winner and baseline run
   once more) and, where it holds, written out as this search's result: its exports,
   summary.json with `remembered`, the report; None and the search runs (saying why);
3. `calibration` and `seeded`: a near match's memory term scales as the memory model's
   start, its winners first (strategies/seeded.py);
4. `annotate` and `finish`: `seeded_by` and `remembered` in the summary, and the
   confirmed result recorded with the memory term scales its trials fitted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.dburl import shown
from autotune.outputs.export import write_outputs
from autotune.spec import parse_duration
from autotune.store.session import StoreSession, confirmed, say
from autotune.summary import Summary
from autotune.tuning import reconfirm
from autotune.tuning.strategies.seeded import Seeded, runnable, translate

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.device import DeviceSpec
    from autotune.plan.shape import ModelShape
    from autotune.records import Record
    from autotune.space import SpaceResult
    from autotune.spec import Spec
    from autotune.trials.executor import Executor
    from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
    from autotune.tuning.study import StudyLog

logger = logging.getLogger("autotune.store")

MAX_RUNNER_UPS = 2  # behind each record's winner (the confirmation keeps at most two)


@dataclass
class Remembered:
    session: StoreSession
    # A remembered result that failed its check: said in the summary of the search that
    # replaces it, and its winners seed that search.
    not_reconfirmed: dict[str, Any] | None = None
    seeded_by: list[dict[str, Any]] = field(default_factory=list)
    prior: dict[str, float] | None = None  # the memory term scales the search started from

    @classmethod
    def open(cls, spec: Spec, device: DeviceSpec, space: SpaceResult, shape: ModelShape | None,
             output: Path, *, fresh: bool = False) -> Remembered:
        return cls(StoreSession.open(spec, device, space, shape, output, fresh=fresh))

    @property
    def spec(self) -> Spec:
        return self.session.spec

    # 2) --------------------------------------------------------------------------------
    def answer(self, ctx: SearchContext, executor: Executor, log: StudyLog, storage: str,
               started: float, on_start: Callable[[Proposal], None] | None = None,
               on_record: Callable[[Record], None] | None = None) -> Summary | None:
        """The exact match's result where its winner and baseline still run as recorded
        (exports, summary.json and the report written); None where the search must run:
        no match, --fresh, a study in the output that already has trials (a resume), or a
        check that failed."""
        if any(r.counted for r in log.history()):
            return None
        record = self.session.exact()
        if record is None:
            return None
        output = self.session.output
        summary = Summary.from_dict(record.summary)
        checking = time.time()
        checks = reconfirm.run_checks(
            summary, self.spec, ctx, executor, output / "confirm",
            started + parse_duration(self.spec.search.timeout), on_start, on_record)
        why = reconfirm.verdict(checks, record.versions)
        said = {"from": record.created, "output": record.output,
                "autotune_version": record.autotune_version, "key": record.key[:12],
                "checks": [c.to_dict() for c in checks],
                "check_seconds": round(time.time() - checking, 1)}
        if why is not None:
            self.not_reconfirmed = said | {"reconfirmed": False, "why": why}
            self.session.retire(record)
            say(f"the result of {record.date} ({record.output}) was not reconfirmed: "
                f"{why}; searching again")
            return None
        # The summary stays the recorded search's (its trials, its wall time); this call's
        # own cost and study are the `remembered` part's.
        summary.remembered = said | {
            "reconfirmed": True, "wall_seconds": round(time.time() - started, 1),
            "study_name": log.study.study_name, "storage": shown(storage)}
        log.add_wall_seconds(time.time() - started)
        summary.projection = self.spec.run.model_dump()
        write_outputs(summary, output, self.spec, on_cpu=not self.session.device.is_cuda)
        log.save_summary(summary.to_dict())
        self.session.close()
        return summary

    # 3) --------------------------------------------------------------------------------
    def calibration(self) -> dict[str, float] | None:
        """The closest near match's memory term scales, to start the memory model from."""
        self.prior = self.session.calibration()
        return self.prior

    def seeded(self, strategy: Strategy, ctx: SearchContext) -> Strategy:
        """`strategy`, with the near matches' winners and runner-ups first, translated to
        this space (`calibration()` first: the summary says whether it came along)."""
        groups: list[list[TrialConfig]] = []
        seeds = self.session.seeds()
        for seed in seeds:
            r = seed.record
            translated = [c for c in (translate(d, ctx, seed.seq_len_ratio)
                                      for d in seed.configs)
                          if c is not None][:1 + MAX_RUNNER_UPS]
            group = [c for c in runnable(translated, ctx) if all(c not in g for g in groups)]
            groups.append(group)
            self.seeded_by.append({
                "from": r.created, "output": r.output, "key": r.key[:12],
                "seq_len": r.seq_len, "target_batch_size": r.target_batch_size,
                "device": r.device,
                # The first runs first; each next only where the one before did not run.
                "configs": [c.label() for c in group],
                # Translated here to a config the references' probes run anyway.
                "left_to_the_probes": [c.label() for c in translated if c not in group],
                "calibration": self.prior is not None and seed is seeds[0],
                "versions_differ": seed.versions_differ})
        if self.seeded_by:
            ran = sum(1 for g in groups if g)
            say(f"seeded by {len(self.seeded_by)} similar search"
                f"{'es' if len(self.seeded_by) > 1 else ''} ("
                + "; ".join(f"{s['from'][:10]}, seq_len {s['seq_len']}, {s['device']}"
                            for s in self.seeded_by)
                + f"): {ran} recorded winner{'s' if ran != 1 else ''} run first"
                + (", its memory calibration the start" if self.prior else ""))
        return Seeded(strategy, groups) if any(groups) else strategy

    # 4) --------------------------------------------------------------------------------
    def annotate(self, summary: Summary) -> None:
        summary.seeded_by = list(self.seeded_by)
        if self.not_reconfirmed is not None:
            summary.remembered = self.not_reconfirmed

    def finish(self, summary: Summary, history: list[Record], shape: ModelShape | None,
               limit: int, world_size: int) -> None:
        """Record a confirmed result (with its trials' memory calibration), then let the
        store go."""
        calibration = None
        if self.session.store is not None and confirmed(summary.to_dict()):
            calibration = fitted_calibration(history, shape, self.session.device, world_size,
                                             limit, self.prior)
        self.session.record(summary, calibration)


def fitted_calibration(history: list[Record], shape: ModelShape | None, device: DeviceSpec,
                       world_size: int, limit: int,
                       prior: dict[str, float] | None) -> dict[str, float] | None:
    """The memory model's term scales fitted on the search's trials (not the confirmation's
    longer runs: the same configs again)."""
    from autotune.plan.calibration import MemoryModel
    from autotune.plan.shape import ModelShape as Shape

    learned = shape or next((Shape(**r.outcome.shape) for r in history if r.outcome.shape),
                            None)
    if learned is None:
        return None
    try:
        model = MemoryModel.from_history(learned, device, world_size,
                                         [r for r in history if not r.confirming], limit,
                                         prior)
        return model.term_scales()
    except Exception:  # noqa: BLE001 - a record without its calibration is still a record
        logger.debug("results store: no calibration recorded", exc_info=True)
        return None
