"""What a search asks of the results store, answered as data (tuning/remembered.py acts
on it, as Optuna's storages answer its samplers):

1. `StoreSession.open`: the fingerprints and the store (unreachable: one line, and the
   search goes on without it);
2. `exact`: the exact match's record, or None (no match, --fresh, a store gone);
   `retire`: an exact match whose check failed, a near match from then on;
3. `seeds` and `calibration`: the near matches' recorded winners (config dicts, the
   closest record first) and the closest one's memory term scales;
4. `record`: the confirmed result kept (a read-only store: one line).
Nothing here may stop a search: every failure of the store is a warning.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.store.db import ResultStore, StoreError, store_url
from autotune.store.fingerprint import Fingerprint, fingerprint_of
from autotune.store.record import StoredResult
from autotune.summary import BASELINE, RECIPE, Summary, autotune_version

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.plan.shape import ModelShape
    from autotune.space import SpaceResult
    from autotune.spec import Spec

logger = logging.getLogger("autotune.store")

NEAR_RECORDS = 2  # near matches a search is seeded from, the closest first


def say(text: str) -> None:
    """One line of what the store did, as the CLI shows it ("results store: ...")."""
    logger.warning("results store: %s", text)


@dataclass
class Seed:
    """A near match's recorded winners, as its record has them."""

    record: StoredResult
    configs: list[dict[str, Any]]  # the winner, then the runner-ups, fastest first
    seq_len_ratio: float  # the record's seq_len over this search's
    versions_differ: list[str]  # the libraries whose version differs from this machine's


@dataclass
class StoreSession:
    spec: Spec
    device: DeviceSpec
    output: Path
    store: ResultStore | None = None
    fp: Fingerprint | None = None
    fresh: bool = False
    _near: list[StoredResult] | None = None
    _retired: StoredResult | None = field(default=None, repr=False)

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
            say(f"not used: this setup could not be fingerprinted ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())[:200]})")
            return session
        try:
            session.store = ResultStore.open(url)
        except StoreError as exc:
            say(f"{exc}; searching without it")
        return session

    def _found(self, found: Any) -> list[StoredResult]:
        for note in found.notes:
            say(note)
        return found.records

    # 2) --------------------------------------------------------------------------------
    def exact(self) -> StoredResult | None:
        """The newest confirmed record of this exact fingerprint; None under --fresh."""
        if self.store is None or self.fp is None or self.fresh:
            return None
        try:
            records = self._found(self.store.exact(self.fp.key))
        except StoreError as exc:
            say(f"{exc}; searching without it")
            self.store = None
            return None
        return next((r for r in records if confirmed(r.summary)), None)

    def retire(self, record: StoredResult) -> None:
        """`record` failed its check: its winners seed the search that replaces it."""
        self._retired, self._near = record, None

    # 3) --------------------------------------------------------------------------------
    def near_records(self) -> list[StoredResult]:
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
            say(f"{exc}; searching without it")
            return self._near
        newest: dict[str, StoredResult] = {}
        for r in records:  # newest first
            retired = self._retired is not None and r.uid == self._retired.uid
            if confirmed(r.summary) and r.key not in newest and (
                    r.key != self.fp.key or retired):
                newest[r.key] = r
        self._near = sorted(newest.values(), key=self._distance)[:NEAR_RECORDS]
        return self._near

    def _distance(self, r: StoredResult) -> tuple:
        seq, target = r.seq_len or 1, r.target_batch_size or 1
        same_device = (r.fingerprint.get("device") or {}).get("name") == self.device.name
        return (not same_device, abs(math.log(seq / self.spec.data.seq_len))
                + abs(math.log(target / self.spec.target_batch_size)),
                [-ord(ch) for ch in r.created])

    def calibration(self) -> dict[str, float] | None:
        """The closest near match's memory term scales, to start the memory model from."""
        return next((r.calibration for r in self.near_records()[:1] if r.calibration), None)

    def seeds(self) -> list[Seed]:
        """Each near match's recorded winners, the closest record first."""
        here = self.fp.exact["versions"] if self.fp else {}
        return [Seed(r, winners(r.summary),
                     (r.seq_len or self.spec.data.seq_len) / self.spec.data.seq_len,
                     sorted(k for k, v in r.versions.items() if here.get(k) != v))
                for r in self.near_records()]

    # 4) --------------------------------------------------------------------------------
    def record(self, summary: Summary, calibration: dict[str, float] | None) -> None:
        """Keep a confirmed result with the memory term scales its trials fitted, then
        let the store go."""
        if self.store is None or self.fp is None or not confirmed(summary.to_dict()):
            self.close()
            return
        record = StoredResult(
            key=self.fp.key, near_key=self.fp.near_key, fingerprint=self.fp.exact,
            near=self.fp.near, summary=summary.to_dict(), output=str(self.output.resolve()),
            calibration=calibration, autotune_version=autotune_version())
        try:
            self.store.put(record)
        except StoreError as exc:
            say(f"this result is not recorded ({exc}); its files are in {self.output}")
        self.close()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def confirmed(summary: dict[str, Any]) -> bool:
    """A result worth recording (and answering from): a confirmed winner with its repeats."""
    c = summary.get("confirmation") or {}
    return bool(c.get("winner")) and summary.get("best") is not None and any(
        row.get("samples_per_second") for row in c.get("configs") or [])


def winners(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The recorded winner, then the other contenders that are no reference, fastest first."""
    c = summary.get("confirmation") or {}
    winner = c.get("winner")
    rows = sorted((r for r in c.get("configs") or [] if r.get("median")
                   and r.get("role") not in (BASELINE, RECIPE)),
                  key=lambda r: -(r.get("median") or 0.0))
    out = [winner] if winner else []
    return out + [r["config"] for r in rows if r["config"] != winner]
