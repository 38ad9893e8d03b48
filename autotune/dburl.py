"""Database URLs as autotune opens them, for the results store and for Optuna's study."""

from __future__ import annotations

from typing import Any


def sqlalchemy_url(url: str) -> Any:
    """SQLAlchemy's URL for `url`: a bare `postgresql://` is psycopg 3's, the driver
    autotune installs, not psycopg2's, SQLAlchemy's default (name `postgresql+psycopg2://`
    to use that one). Raises sqlalchemy's ArgumentError for what is not a URL."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    return parsed


def driver_url(url: str) -> str:
    """`sqlalchemy_url` as a string to open (its password kept)."""
    return sqlalchemy_url(url).render_as_string(hide_password=False)


def url_problem(url: str, example: str) -> str | None:
    """Why `url` cannot be opened here, in one line (not a URL, a database SQLAlchemy does
    not know, a driver not installed; `example`: a URL to suggest), or None."""
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = sqlalchemy_url(url)
    except ArgumentError:
        return (f"{url!r} is not a database URL; use e.g. {example} or "
                "postgresql://user:password@host/db")
    try:
        parsed.get_dialect().import_dbapi()
    except NoSuchModuleError:
        return (f"{parsed.drivername!r} is no database SQLAlchemy knows (sqlite, "
                "postgresql, mysql, ...)")
    except ImportError as exc:
        return (f"the {parsed.drivername} driver is not installed ({exc.name}): pip install "
                f"it, or use postgresql:// (psycopg, installed with autotune) or {example}")
    return None


def shown(url: str) -> str:
    """`url` as it may be printed or written to an output: its password as ***. A URL
    without one is left as written (an Optuna storage a user copies into the dashboard)."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError:
        return url
    return url if parsed.password is None else parsed.render_as_string(hide_password=True)
