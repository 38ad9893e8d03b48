"""One root exception, so callers can catch everything autotune raises on purpose."""

from __future__ import annotations


class AutotuneError(Exception):
    """Root of the errors autotune raises for conditions a user can act on."""


class SpecError(AutotuneError):
    """The spec (model.yaml), a search space, a command-line option or an override is
    invalid; the message names the field, the value and what is allowed."""


class TrialError(AutotuneError):
    """A trial could not be set up (not: a trial that ran and failed; that is an Outcome)."""


class SetupError(TrialError):
    """Loading what every config shares (the model, the data, the tokenizer) failed: no
    config can avoid it, so a search stops at the first trial that meets it. `field` is
    the spec's field to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


class NoResultError(AutotuneError):
    """A search ended without a successful trial, so there is no winner to hand back."""


class ClusterError(AutotuneError):
    """Ray could not be reached, or cannot place what the search asks for."""
