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
