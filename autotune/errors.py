"""One root exception, so callers can catch everything autotune raises on purpose."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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


def not_allowed(value: object, allowed: Iterable[object], listed_in: str = "",
                many: int = 20) -> str:
    """"'x' is not allowed (did you mean 'y'?); allowed: ..." for a value outside a list.
    For a name, the close match comes first, since a typo is the usual cause; a list
    longer than `many` is named by where it is defined (`listed_in`: transformers'
    optimizers, its model types) with its nearest few, since the whole of it buries the
    one line that matters."""
    names = [str(a) for a in allowed]
    text = isinstance(value, str)
    close = difflib.get_close_matches(value, names, n=1, cutoff=0.6) if text else []
    said = f"{value!r} is not allowed" + (f" (did you mean {close[0]!r}?)" if close else "")
    if len(names) > many and listed_in:
        nearest = (difflib.get_close_matches(value, names, n=5, cutoff=0.0) if text
                   else names[:5])
        return f"{said}; allowed: the {len(names)} of {listed_in}, such as {', '.join(nearest)}"
    return f"{said}; allowed: {', '.join(names)}"
