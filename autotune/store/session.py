"""What a search asks of the results store, called from a few lines of tuning/run.py:

1. `StoreSession.open`: the fingerprints and the store (unreachable: one line, and the
   search goes on without it);
2. `answer`: an exact match, checked on read (reconfirm.py): its summary with
   `remembered`, or None and the search runs (saying why in one line);
3. `calibration` and `seeded`: a near match's memory calibration and its winners first;
4. `annotate` and `finish`: `seeded_by` in the summary, and the confirmed result recorded
   (a read-only store: one line).
Nothing here may stop a search: every failure of the store is a warning.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.store.db import ResultStore, StoreError, shown, store_url
from autotune.store.fingerprint import Fingerprint, fingerprint_of
from autotune.store.record import StoredResult
from autotune.summary import BASELINE, RECIPE, Summary, autotune_version

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.plan.device import DeviceSpec
    from autotune.plan.shape import ModelShape
    from autotune.records import Record
    from autotune.space import SpaceResult
    from autotune.spec import Spec
    from autotune.trials.executor import Executor
    from autotune.tuning.strategies.base import Proposal, SearchContext, Strategy
    from autotune.tuning.study import StudyLog

logger = logging.getLogger("autotune.store")

NEAR_RECORDS = 2  # near matches a search is seeded from, the closest first
MAX_RUNNER_UPS = 2  # behind each record's winner (the confirmation keeps at most two)


def _say(text: str) -> None:
    logger.warning("results store: %s", text)


@dataclass
class StoreSession:
    spec: Spec
    device: DeviceSpec
    output: Path
    store: ResultStore | None = None
    fp: Fingerprint | None = None
    fresh: bool = False
    # A remembered result that failed its check: said in the summary of the search that
    # replaces it, and its winners seed that search.
    not_reconfirmed: dict[str, Any] | None = None
    seeded_by: list[dict[str, Any]] = field(default_factory=list)
    prior: dict[str, float] | None = None  # the memory term scales the search started from
    _near: list[StoredResult] | None = None
    _retired: StoredResult | None = None

    # 1) --------------------------------------------------------------------------------
    @classmethod
    def open(cls, spec: Spec, device: DeviceSpec, space: SpaceResult, shape: ModelShape | None,
             output: Path, *, fresh: bool = False) -> StoreSession:
        session = cls(spec, device, output, fresh=fresh)
        url = store_url(spec.search.store)
        if url is None:
            return session
        try:
            session.fp = fingerprint_of(spec, device, space, shape)
        except SetupError as exc:  # the data cannot be read: the first trial says so
            logger.info("results store: not used (%s)", exc)
            return session
        except Exception as exc:  # noqa: BLE001 - the store may never stop a search
            _say(f"not used: this setup could not be fingerprinted ({type(exc).__name__}: "
                 f"{' '.join(str(exc).split())[:200]})")
            return session
        try:
            session.store = ResultStore.open(url)
        except StoreError as exc:
            _say(f"{exc}; searching without it")
        return session

    def _found(self, found: Any) -> list[StoredResult]:
        for note in found.notes:
            _say(note)
        return found.records

    # 2) --------------------------------------------------------------------------------
    def _exact(self) -> StoredResult | None:
        if self.store is None or self.fp is None or self.fresh:
            return None
        try:
            records = self._found(self.store.exact(self.fp.key))
        except StoreError as exc:
            _say(f"{exc}; searching without it")
            self.store = None
            return None
        return next((r for r in records if _confirmed(r.summary)), None)

    def answer(self, ctx: SearchContext, executor: Executor, log: StudyLog, storage: str,
               started: float, on_start: Callable[[Proposal], None] | None = None,
               on_record: Callable[[Record], None] | None = None) -> Summary | None:
        """The exact match's result where its winner and baseline still run as recorded
        (exports, summary.json and the report written); None where the search must run:
        no match, --fresh, a study in the output that already has trials (a resume), or a
        check that failed."""
        from autotune.outputs.export import write_outputs
        from autotune.spec import parse_duration
        from autotune.store import reconfirm

        if any(r.counted for r in log.history()):
            return None
        record = self._exact()
        if record is None:
            return None
        summary = Summary.from_dict(record.summary)
        checking = time.time()
        checks = reconfirm.run_checks(
            summary, self.spec, ctx, executor, self.output / "confirm",
            started + parse_duration(self.spec.search.timeout), on_start, on_record)
        why = reconfirm.verdict(checks, record.versions)
        said = {"from": record.created, "output": record.output,
                "autotune_version": record.autotune_version, "key": record.key[:12],
                "checks": [c.to_dict() for c in checks],
                "check_seconds": round(time.time() - checking, 1)}
        if why is not None:
            self.not_reconfirmed = said | {"reconfirmed": False, "why": why}
            self._retired = record
            _say(f"the result of {record.date} ({record.output}) was not reconfirmed: "
                 f"{why}; searching again")
            return None
        # The summary stays the recorded search's (its trials, its wall time); this call's
        # own cost and study are the `remembered` part's.
        summary.remembered = said | {
            "reconfirmed": True, "wall_seconds": round(time.time() - started, 1),
            "study_name": log.study.study_name, "storage": storage}
        log.add_wall_seconds(time.time() - started)
        summary.projection = self.spec.run.model_dump()
        write_outputs(summary, self.output, self.spec, on_cpu=not self.device.is_cuda)
        log.save_summary(summary.to_dict())
        self.close()
        return summary

    # 3) --------------------------------------------------------------------------------
    def _near_records(self) -> list[StoredResult]:
        """Up to NEAR_RECORDS near matches, one per exact fingerprint, the closest first:
        the same device, then the nearest seq_len and target batch, then the newest. The
        exact match is one only where its check failed."""
        if self._near is not None:
            return self._near
        self._near = []
        if self.store is None or self.fp is None or self.fresh:
            return self._near
        try:
            records = self._found(self.store.near(self.fp.near_key))
        except StoreError as exc:
            _say(f"{exc}; searching without it")
            return self._near
        newest: dict[str, StoredResult] = {}
        for r in records:  # newest first
            retired = self._retired is not None and r.uid == self._retired.uid
            if _confirmed(r.summary) and r.key not in newest and (
                    r.key != self.fp.key or retired):
                newest[r.key] = r
        self._near = sorted(newest.values(), key=self._distance)[:NEAR_RECORDS]
        return self._near

    def _distance(self, r: StoredResult) -> tuple:
        import math

        seq, target = r.seq_len or 1, r.target_batch_size or 1
        same_device = (r.fingerprint.get("device") or {}).get("name") == self.device.name
        return (not same_device, abs(math.log(seq / self.spec.data.seq_len))
                + abs(math.log(target / self.spec.target_batch_size)),
                [-ord(ch) for ch in r.created])

    def calibration(self) -> dict[str, float] | None:
        """The closest near match's memory term scales, to start the memory model from."""
        self.prior = next((r.calibration for r in self._near_records()[:1] if r.calibration),
                          None)
        return self.prior

    def seeded(self, strategy: Strategy, ctx: SearchContext) -> Strategy:
        """`strategy`, with the near matches' winners and runner-ups first."""
        from autotune.tuning.strategies.seeded import Seeded, runnable, translate

        groups: list[list[TrialConfig]] = []
        for r in self._near_records():
            ratio = (r.seq_len or self.spec.data.seq_len) / self.spec.data.seq_len
            translated = [c for c in (translate(d, ctx, ratio) for d in _winners(r.summary))
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
                "calibration": self.prior is not None and r is self._near_records()[0],
                "versions_differ": sorted(k for k, v in r.versions.items()
                                          if self.fp and self.fp.exact["versions"].get(k) != v)})
        if self.seeded_by:
            _say(f"seeded by {len(self.seeded_by)} similar search"
                 f"{'es' if len(self.seeded_by) > 1 else ''} ("
                 + "; ".join(f"{s['from'][:10]}, seq_len {s['seq_len']}, {s['device']}"
                             for s in self.seeded_by)
                 + f"): {sum(1 for g in groups if g)} recorded winner"
                 f"{'s' if sum(1 for g in groups if g) != 1 else ''} run first"
                 + (", its memory calibration the start" if self.prior else ""))
        return Seeded(strategy, groups) if any(groups) else strategy

    # 4) --------------------------------------------------------------------------------
    def annotate(self, summary: Summary) -> None:
        summary.seeded_by = list(self.seeded_by)
        if self.not_reconfirmed is not None:
            summary.remembered = self.not_reconfirmed

    def finish(self, summary: Summary, history: list[Record], shape: ModelShape | None,
               limit: int, world_size: int) -> None:
        """Record a confirmed result, then let the store go."""
        if self.store is None or self.fp is None or not _confirmed(summary.to_dict()):
            self.close()
            return
        record = StoredResult(
            key=self.fp.key, near_key=self.fp.near_key, fingerprint=self.fp.exact,
            near=self.fp.near, summary=summary.to_dict(), output=str(self.output.resolve()),
            calibration=_calibration(history, shape, self.device, world_size, limit,
                                     self.prior),
            autotune_version=autotune_version())
        try:
            self.store.put(record)
        except StoreError as exc:
            _say(f"this result is not recorded ({exc}); its files are in {self.output}")
        self.close()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None

    @property
    def where(self) -> str | None:
        return shown(self.store.url) if self.store is not None else None


def _confirmed(summary: dict[str, Any]) -> bool:
    """A result worth recording (and answering from): a confirmed winner with its repeats."""
    c = summary.get("confirmation") or {}
    return bool(c.get("winner")) and summary.get("best") is not None and any(
        row.get("samples_per_second") for row in c.get("configs") or [])


def _winners(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded winner, then the other contenders that are no reference, fastest first."""
    c = summary.get("confirmation") or {}
    winner = c.get("winner")
    rows = sorted((r for r in c.get("configs") or [] if r.get("median")
                   and r.get("role") not in (BASELINE, RECIPE)),
                  key=lambda r: -(r.get("median") or 0.0))
    out = [winner] if winner else []
    return out + [r["config"] for r in rows if r["config"] != winner]


def _calibration(history: list[Record], shape: ModelShape | None, device: DeviceSpec,
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
