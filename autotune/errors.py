"""One root exception, so callers can catch everything autotune raises on purpose."""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of the errors autotune raises for conditions a user can act on."""


class SpecError(AutotuneError):
    """The spec (model.yaml), a search space or an override is invalid."""


class TrialError(AutotuneError):
    """A trial could not be set up (not: a trial that ran and failed; that is an Outcome)."""
