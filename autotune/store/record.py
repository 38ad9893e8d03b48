"""One confirmed search as the store keeps it: evidence with a date and versions.

A record is a JSON object (a line of `autotune results export`). Its `schema` says which
autotune can read it: a record of a newer schema is skipped with a note, never guessed at.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

from autotune.errors import AutotuneError

# 1: the first layout (2026-11-27).
SCHEMA_VERSION = 1
# What a line must hold to be stored at all (a newer schema may add to it).
REQUIRED = ("schema", "uid", "key", "near_key", "created")


class RecordError(AutotuneError):
    """A line that is not an autotune record."""


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


@dataclass
class StoredResult:
    key: str  # the exact fingerprint's digest
    near_key: str
    fingerprint: dict[str, Any]  # the exact fingerprint itself, to say what differs
    near: dict[str, Any]
    summary: dict[str, Any]  # summary.json as the search wrote it
    output: str  # where the search wrote its files
    # The memory model's term scales fitted on the search's trials (plan/calibration.py):
    # a near match starts its own model from them.
    calibration: dict[str, float] | None = None
    created: str = field(default_factory=now)
    autotune_version: str = "unknown"
    schema: int = SCHEMA_VERSION
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)

    # --- what listings and lookups read ---------------------------------------------
    @property
    def model(self) -> str:
        return str((self.summary.get("model") or {}).get("name") or "model")

    @property
    def device(self) -> str:
        d = self.summary.get("device") or {}
        count = int(d.get("count") or 1)
        return f"{count}x {d.get('name', '?')}" if count > 1 else str(d.get("name", "?"))

    @property
    def seq_len(self) -> int | None:
        return self.summary.get("seq_len")

    @property
    def target_batch_size(self) -> int | None:
        return self.summary.get("target_batch_size")

    @property
    def versions(self) -> dict[str, str]:
        return dict(self.fingerprint.get("versions") or {})

    @property
    def date(self) -> str:
        return self.created[:10]

    # --- JSON ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StoredResult:
        """A record of this autotune's schema or an older one."""
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise RecordError(f"not an autotune record (no {', '.join(missing)})")
        if int(d["schema"]) > SCHEMA_VERSION:
            raise RecordError(f"record schema {d['schema']} is newer than this autotune's "
                              f"{SCHEMA_VERSION}")
        try:
            return cls(key=str(d["key"]), near_key=str(d["near_key"]),
                       fingerprint=dict(d.get("fingerprint") or {}),
                       near=dict(d.get("near") or {}), summary=dict(d["summary"]),
                       output=str(d.get("output") or ""), calibration=d.get("calibration"),
                       created=str(d["created"]),
                       autotune_version=str(d.get("autotune_version") or "unknown"),
                       schema=int(d["schema"]), uid=str(d["uid"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise RecordError(f"not an autotune record ({exc!r})") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, default=str)
