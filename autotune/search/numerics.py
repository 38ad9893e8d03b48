"""Whether a precision trains the same model: each trial's first losses against a
full-precision reference on the same data and seed.

Every trial starts from the same weights (one seed) and sees the same samples in the same
order at the same effective batch, so its losses step for step should match a reference
trial's to within rounding. A precision whose losses drift past the tolerance is rejected
(told `nan`, with the figures), and two such trials write its value off like any failure.
"""

from __future__ import annotations

from collections.abc import Sequence

from autotune.records import NAN, Outcome, Record

# The reference precision, in order of preference: the most exact that has run.
REFERENCE_PRECISIONS = ("fp32", "tf32", "bf16")


def reference(history: Sequence[Record], target: int, world_size: int) -> Record | None:
    """The first successful trial at the full effective batch in the most exact precision
    measured (a baseline that auto_find_batch_size shrank sees other batches)."""
    full = [r for r in history if r.outcome.ok and r.outcome.extra.get("losses")
            and r.config.samples_per_rank * world_size == target]
    for precision in REFERENCE_PRECISIONS:
        found = next((r for r in full if r.config.precision == precision), None)
        if found is not None:
            return found
    return None


def drift(losses: Sequence[float], ref: Sequence[float]) -> float:
    """The largest relative difference of the step losses both runs logged."""
    pairs = list(zip(losses, ref, strict=False))
    return max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=0.0)


def review(record: Record, history: Sequence[Record], target: int, world_size: int,
           tolerance: float) -> None:
    """Reject `record`'s outcome in place when its losses drift from the reference's."""
    o: Outcome = record.outcome
    ref = reference(history, target, world_size)
    if not o.ok or ref is None or ref.config.precision == record.config.precision:
        return
    if record.config.samples_per_rank * world_size != target or not o.extra.get("losses"):
        return
    off = drift(o.extra["losses"], ref.outcome.extra["losses"])
    o.extra["loss_drift"] = off
    if off > tolerance:
        o.status = NAN
        o.error = (f"loss drifts {off:.1%} from the {ref.config.precision} reference (trial "
                   f"#{ref.number}) over the first {len(o.extra['losses'])} steps; tolerance "
                   f"{tolerance:.0%} (measure.loss_tolerance)")
