"""The results store: records in one SQL table, through SQLAlchemy (Optuna's own
dependency), in a SQLite file by default or a team's PostgreSQL.

Where it is: `--store URL`, else the spec's `search.store`, else $AUTOTUNE_STORE, else
`results.db` in the user's cache folder ($XDG_CACHE_HOME/autotune, or ~/.cache/autotune).
`off` turns it off. Every record is one insert of one row, so two searches that finish
at once never lose each other's record: SQLite serialises them (a writer waits up to
BUSY_SECONDS for the other's lock), PostgreSQL takes both.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from autotune.dburl import url_problem
from autotune.errors import AutotuneError
from autotune.store.record import SCHEMA_VERSION, RecordError, StoredResult

ENV = "AUTOTUNE_STORE"
OFF = ("off", "none", "no", "false")
DEFAULT_FILE = "results.db"
TABLE = "autotune_results"
BUSY_SECONDS = 30  # SQLite: how long a writer waits for another's lock
CONNECT_SECONDS = 5  # PostgreSQL: how long to wait for an unreachable server


class StoreError(AutotuneError):
    """The results store cannot be opened, read or written; the message says which and why."""


def default_url() -> str:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return f"sqlite:///{cache / 'autotune' / DEFAULT_FILE}"


def store_url(configured: str | None = None) -> str | None:
    """The store's URL: `configured` (the flag or the spec), else $AUTOTUNE_STORE, else the
    default; None where it is turned off."""
    for said in (configured, os.environ.get(ENV)):
        if said is not None and said.strip():
            return None if said.strip().lower() in OFF else said.strip()
    return default_url()


def _url(url: str):
    """SQLAlchemy's URL: `postgresql://` is psycopg 3's (the driver autotune installs),
    not psycopg2's, SQLAlchemy's default."""
    from sqlalchemy.exc import ArgumentError

    from autotune.dburl import sqlalchemy_url

    try:
        return sqlalchemy_url(url)
    except ArgumentError:
        raise StoreError(f"{url!r} is not a database URL; use e.g. sqlite:///results.db or "
                         "postgresql://user:password@host/db") from None


def shown(url: str) -> str:
    """The URL as it may be printed: without its password."""
    try:
        return _url(url).render_as_string(hide_password=True)
    except StoreError:
        return url


def _why(exc: BaseException) -> str:
    """The first line of what the database said."""
    orig = getattr(exc, "orig", None) or exc
    text = " ".join(str(orig).split())
    return text[:200] + ("…" if len(text) > 200 else "")


@dataclass
class Found:
    """Records read, and notes on the ones skipped (a newer schema, a broken body)."""

    records: list[StoredResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class ResultStore:
    """Put, look up, list, export and import records. Every method raises StoreError
    (one line) where the database fails."""

    def __init__(self, url: str) -> None:
        import sqlalchemy as sa

        self.url = url
        problem = url_problem(url, "sqlite:///results.db")  # one line, not a traceback
        if problem:
            raise StoreError(f"{shown(url)}: {problem}")
        parsed = _url(url)
        is_sqlite = parsed.drivername.startswith("sqlite")
        if is_sqlite and url == default_url():
            Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
        args = {"timeout": BUSY_SECONDS} if is_sqlite else {"connect_timeout": CONNECT_SECONDS}
        try:
            self.engine = sa.create_engine(parsed, connect_args=args)
        except (sa.exc.SQLAlchemyError, TypeError, ValueError) as exc:
            raise StoreError(f"{shown(url)}: {_why(exc)}") from None
        meta = sa.MetaData()
        self.table = sa.Table(
            TABLE, meta,
            sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
            sa.Column("uid", sa.String(32), nullable=False, unique=True),
            sa.Column("schema", sa.Integer, nullable=False),
            sa.Column("key", sa.String(64), nullable=False, index=True),
            sa.Column("near_key", sa.String(64), nullable=False, index=True),
            sa.Column("created", sa.String(40), nullable=False),
            sa.Column("model", sa.String(200)), sa.Column("device", sa.String(200)),
            sa.Column("seq_len", sa.Integer), sa.Column("target_batch_size", sa.Integer),
            sa.Column("autotune_version", sa.String(40)),
            sa.Column("body", sa.Text, nullable=False))
        self._meta = meta

    @classmethod
    def open(cls, url: str) -> ResultStore:
        """Connect and make the table where it is missing."""
        store = cls(url)
        store._create()
        return store

    def _create(self) -> None:
        """The table, made once: two processes making it at once both try, and the loser
        finds it there on the next try. A read-only store with the table is read."""
        import sqlalchemy as sa

        for attempt in range(4):
            try:
                self._meta.create_all(self.engine, checkfirst=True)
                return
            except sa.exc.SQLAlchemyError as exc:
                try:
                    if sa.inspect(self.engine).has_table(TABLE):
                        return
                except sa.exc.SQLAlchemyError:
                    if attempt == 3:
                        raise StoreError(f"{shown(self.url)}: unreachable ({_why(exc)})") from None
                if attempt == 3:
                    raise StoreError(f"{shown(self.url)}: cannot make its table "
                                     f"({_why(exc)})") from None
                time.sleep(0.2 * (attempt + 1))

    def close(self) -> None:
        self.engine.dispose()

    # --- writing -----------------------------------------------------------------------
    def _row(self, r: StoredResult | dict[str, Any]) -> dict[str, Any]:
        d = r.to_dict() if isinstance(r, StoredResult) else r
        summary = d.get("summary") or {}
        device = summary.get("device") or {}
        return {"uid": str(d["uid"]), "schema": int(d["schema"]), "key": str(d["key"]),
                "near_key": str(d["near_key"]), "created": str(d["created"]),
                "model": str((summary.get("model") or {}).get("name") or "")[:200],
                "device": str(device.get("name") or "")[:200],
                "seq_len": summary.get("seq_len"),
                "target_batch_size": summary.get("target_batch_size"),
                "autotune_version": str(d.get("autotune_version") or "")[:40],
                "body": json.dumps(d, sort_keys=True, default=str)}

    def put(self, record: StoredResult | dict[str, Any]) -> bool:
        """Insert one record; False where a record with its uid is there already."""
        import sqlalchemy as sa

        try:
            with self.engine.begin() as conn:
                conn.execute(self.table.insert().values(**self._row(record)))
            return True
        except sa.exc.IntegrityError:
            return False
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"{shown(self.url)}: cannot write ({_why(exc)})") from None

    # --- reading -----------------------------------------------------------------------
    def _select(self, *where) -> Iterator[Any]:
        import sqlalchemy as sa

        t = self.table
        query = sa.select(t.c.schema, t.c.body, t.c.autotune_version).where(*where).order_by(
            t.c.created.desc(), t.c.id.desc())
        try:
            with self.engine.connect() as conn:
                yield from conn.execute(query).all()
        except sa.exc.SQLAlchemyError as exc:
            raise StoreError(f"{shown(self.url)}: cannot read ({_why(exc)})") from None

    def _parsed(self, rows: Iterable[Any]) -> Found:
        found = Found()
        newer: dict[str, int] = {}
        for schema, body, made_by in rows:
            if int(schema) > SCHEMA_VERSION:
                who = made_by or "(version not said)"
                newer[who] = newer.get(who, 0) + 1
                continue
            try:
                found.records.append(StoredResult.from_dict(json.loads(body)))
            except (RecordError, json.JSONDecodeError) as exc:
                found.notes.append(f"skipped a broken record: {exc}")
        for made_by, n in newer.items():
            found.notes.append(
                f"skipped {n} record{'s' if n > 1 else ''} written by autotune {made_by} "
                f"(a newer record schema than this autotune's {SCHEMA_VERSION}): upgrade "
                "autotune to use them")
        return found

    def exact(self, key: str) -> Found:
        """The records under an exact fingerprint, newest first."""
        return self._parsed(self._select(self.table.c.key == key))

    def near(self, near_key: str) -> Found:
        """The records under a near fingerprint (any exact one), newest first."""
        return self._parsed(self._select(self.table.c.near_key == near_key))

    def records(self, model: str | None = None, device: str | None = None) -> Found:
        """Every record, newest first; `model` / `device`: a part of the name, any case."""
        import sqlalchemy as sa

        t, where = self.table, []
        if model:
            where.append(sa.func.lower(t.c.model).contains(model.lower()))
        if device:
            where.append(sa.func.lower(t.c.device).contains(device.lower()))
        return self._parsed(self._select(*where))

    # --- moving records between stores --------------------------------------------------
    def export_lines(self) -> Iterator[str]:
        """Every record as a JSON line, a newer schema's too (export loses nothing)."""
        for _, body, _ in self._select():
            yield json.dumps(json.loads(body), sort_keys=True)

    def import_lines(self, lines: Iterable[str]) -> dict[str, Any]:
        """Put each JSON line's record; {added, present, newer, bad: [line notes]}. A
        record of a newer schema is stored as it is (a newer autotune reads it)."""
        counts: dict[str, Any] = {"added": 0, "present": 0, "newer": 0, "bad": []}
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                if not isinstance(d, dict):
                    raise RecordError("not a JSON object")
                missing = [k for k in ("schema", "uid", "key", "near_key", "created")
                           if k not in d]
                if missing:
                    raise RecordError(f"not an autotune record (no {', '.join(missing)})")
                if int(d["schema"]) <= SCHEMA_VERSION:
                    StoredResult.from_dict(d)  # a record this autotune reads must parse
                else:
                    counts["newer"] += 1
            except (RecordError, json.JSONDecodeError, ValueError, TypeError) as exc:
                counts["bad"].append(f"line {n}: {exc}")
                continue
            counts["added" if self.put(d) else "present"] += 1
        return counts
