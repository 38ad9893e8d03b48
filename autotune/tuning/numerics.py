"""Whether a precision trains the same model: each trial's first losses against a
full-precision reference on the same data and seed.

Every trial starts from the same weights (one seed) and sees the same samples in the same
order at the same effective batch, but 16-bit kernels round differently and need not
draw dropout's masks as fp32's do (SDPA takes a flash kernel for bf16), so step losses
agree only to within that noise: on an H200, BERT-large's bf16 steps were up to 15% off
its fp32 steps (random labels, dropout 0.1) while their mean was 3.7% off; its tf32 steps,
under ZeRO-1 against a plain fp32 reference, matched to 0.003%. So a precision is rejected (told
`nan`, with the figures) only where its losses leave the range the reference's own steps
span, or where their mean difference from the reference's is past the tolerance plus the
95% interval of the paired differences (their spread read from step-to-step changes, as
von Neumann's estimator does, so that a steady drift, such as a loss that stalls, is not
taken for noise). Two such trials write its value off like any failure."""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from autotune import knobs
from autotune.config import Family, TrialConfig
from autotune.records import NAN, Outcome, Record

# The reference precision, in order of preference: the most exact that has run.
REFERENCE_PRECISIONS = ("fp32", "tf32", "bf16")
# How close a first step's loss ratio must be to the accumulation ratio to be read as a
# loss logged summed over micro-batches (dropout alone moved first steps 8% on an H200).
ACCUMULATION_MATCH = 0.25
# Student's t, two-sided 95%, by degrees of freedom (the steps compared less one), the
# last standing for more. With two or three steps it is wide: the range check then
# carries the review.
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18)


def reference(history: Sequence[Record], target: int, world_size: int) -> Record | None:
    """The first successful trial at the full effective batch in the most exact precision
    measured (a baseline that auto_find_batch_size shrank sees other batches)."""
    full = [r for r in history if r.outcome.ok and r.outcome.measured.losses
            and r.config.samples_per_rank * r.config.data_parallel(world_size) == target]
    for precision in REFERENCE_PRECISIONS:
        found = next((r for r in full if r.config.precision == precision), None)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class Drift:
    """A trial's losses against the reference's, relative to the reference's mean loss."""

    mean: float  # |the mean paired difference|, a share of the reference's mean loss
    noise: float  # half the 95% interval of that mean (0 for one step)
    outside: tuple[int, float] | None  # the first step whose loss leaves the range

    def past(self, tolerance: float) -> bool:
        return self.outside is not None or self.mean > tolerance + self.noise


def drift(losses: Sequence[float], ref: Sequence[float], tolerance: float) -> Drift:
    """How far `losses` are from `ref`, step for step, over the steps both logged. The
    range a step may reach is the reference's lowest to highest, widened by `tolerance`
    of its mean."""
    pairs = list(zip(losses, ref, strict=False))
    if not pairs:
        return Drift(0.0, 0.0, None)
    scale = max(statistics.fmean(abs(b) for _, b in pairs), 1e-12)
    diffs = [a - b for a, b in pairs]
    noise = 0.0
    if len(diffs) > 1:  # from step-to-step changes, so a steady drift is not noise
        jumps = [b - a for a, b in itertools.pairwise(diffs)]
        sigma = math.sqrt(sum(j * j for j in jumps) / (2 * len(jumps)))
        t = _T95[min(len(diffs) - 2, len(_T95) - 1)]
        noise = t * sigma / math.sqrt(len(diffs)) / scale
    low = min(b for _, b in pairs) - tolerance * scale
    high = max(b for _, b in pairs) + tolerance * scale
    outside = next(((i, a) for i, (a, _) in enumerate(pairs)
                    if not low <= a <= high), None)
    return Drift(abs(statistics.fmean(diffs)) / scale, noise, outside)


def accumulation_scale(record: Record, ref: Record) -> float:
    """How many times its reference's scale a trial logs its loss at: its accumulation
    over the reference's where its first step (the same weights and samples) shows that
    ratio, else 1. Transformers' Trainer leaves a loss unscaled for accumulation when the
    model takes loss kwargs, and BERT's classifier takes them but ignores
    `num_items_in_batch`: on an H200 its b8x2 trials logged twice the b16x1 loss at
    step 1 (1.27 against 0.62) and were rejected for it."""
    ratio = (record.config.gradient_accumulation_steps
             / max(1, ref.config.gradient_accumulation_steps))
    first, ref_first = record.outcome.measured.losses[0], ref.outcome.measured.losses[0]
    if ratio == 1 or not ref_first or not first / ref_first > 0:
        return 1.0
    seen = math.log(first / ref_first)
    # Nearer the ratio than 1 (an accumulation of 5 against 4 is no sum), and close to it.
    near = abs(seen - math.log(ratio)) < abs(seen)
    return ratio if near and abs(first / ref_first / ratio - 1) <= ACCUMULATION_MATCH else 1.0


def review(record: Record, history: Sequence[Record], target: int, world_size: int,
           tolerance: float) -> None:
    """Reject `record`'s outcome in place when its losses drift from the reference's."""
    o: Outcome = record.outcome
    ref = reference(history, target, world_size)
    if not o.ok or ref is None or ref.config.precision == record.config.precision:
        return
    losses, ref_losses = o.measured.losses, ref.outcome.measured.losses
    if (record.config.samples_per_rank * record.config.data_parallel(world_size) != target
            or not losses or not ref_losses):
        return
    scale = accumulation_scale(record, ref)
    d = drift([x / scale for x in losses], ref_losses, tolerance)
    o.measured.loss_drift, o.measured.loss_drift_noise = d.mean, d.noise
    if scale != 1:
        o.measured.loss_accumulation_scale = scale
    if not d.past(tolerance):
        return
    o.status = NAN
    prec, n = ref.config.precision, ref.number
    steps = min(len(losses), len(ref_losses))  # the steps compared
    if d.outside is not None:
        step, loss = d.outside
        seen = ref_losses[:steps]
        o.error = (f"step {step + 1}'s loss {loss:.4g}{_scaled(scale)} is outside the "
                   f"{prec} reference's steps (trial #{n}), {min(seen):.4g} to "
                   f"{max(seen):.4g}, widened by {tolerance:.0%} of their mean "
                   "(measure.loss_tolerance)")
    else:
        o.error = (f"loss{_scaled(scale)} drifts {d.mean:.1%} from the {prec} reference "
                   f"(trial #{n}) over the first {steps} steps; tolerance {tolerance:.0%} "
                   f"(measure.loss_tolerance) + the steps' noise {d.noise:.1%}")

def _scaled(scale: float) -> str:
    return "" if scale == 1 else f" (logged {scale:g}x, as a sum over micro-batches)"


# How far a lever's first step may depart from its twin's (relative, loss and gradient
# norm alike). In exact arithmetic they are equal; what a lever changes is the order of
# sums (a sequence split's all-to-all, a tiled loss's shards: 1e-6 here on CPU in fp32)
# and, in 16-bit, the rounding. The errors this catches are factors: Ulysses under ZeRO-1
# and 2 doubles the gradient at sp_size 2 (benchmarks/sp_gradient_scale.py), a tiled loss
# normalised outside its forward multiplies it by the token count, axolotl's ring
# attention inflated the loss 1.83x on packed data (axolotl#3608).
PARITY_TOLERANCE = {"fp32": 0.02, "tf32": 0.02}
PARITY_TOLERANCE_16BIT = 0.10


def twin_family(config: TrialConfig) -> Family | None:
    """The family the lever's first step must match: the same knobs with every parity
    lever at its baseline (None: the config has none). Any batch of it trains the same
    samples in its first optimizer step: the effective batch is the target's."""
    levers = knobs.parity_levers(config)
    return config.family.replace(**{k: knobs.knob(k).baseline for k in levers}) \
        if levers else None


def twin(record: Record, history: Sequence[Record]) -> Record | None:
    """The twin that ran with both figures of its first step, at the record's per-device
    batch where it ran, else at the smallest that did."""
    family = twin_family(record.config)
    if family is None:
        return None
    ran = [r for r in history if r.config.family == family and r.outcome.ok
           and r.outcome.measured.losses and r.outcome.measured.grad_norms]
    same = [r for r in ran if r.config.per_device_train_batch_size
            == record.config.per_device_train_batch_size]
    return (same or sorted(ran, key=lambda r: r.config.per_device_train_batch_size)
            or [None])[0]


def parity(record: Record, history: Sequence[Record]) -> None:
    """Reject `record`'s outcome in place where a parity lever's first step (loss or
    gradient norm) departs from its twin's: the config is wrong, not slow, and the error
    gives both figures. Where it matches, the largest relative gap and the twin's trial
    are kept; where no twin ran (it ran out of memory: what such levers are for), the
    record says so by leaving them unset."""
    o: Outcome = record.outcome
    ref = twin(record, history) if o.ok else None
    m = o.measured
    if ref is None or not m.losses or not m.grad_norms:
        return
    r = ref.outcome.measured
    pairs = {"loss": (m.losses[0], r.losses[0]), "gradient norm": (m.grad_norms[0],
                                                                   r.grad_norms[0])}
    gaps = {what: abs(a - b) / max(abs(b), 1e-12) for what, (a, b) in pairs.items()}
    m.parity_gap, m.parity_twin = max(gaps.values()), ref.number
    tolerance = PARITY_TOLERANCE.get(record.config.precision, PARITY_TOLERANCE_16BIT)
    off = {what: gap for what, gap in gaps.items() if gap > tolerance}
    if not off:
        return
    o.status = NAN
    levers = ", ".join(f"{k}={v}" for k, v in knobs.parity_levers(record.config).items())
    figures = "; ".join(f"{what} {pairs[what][0]:.6g} vs {pairs[what][1]:.6g}"
                        for what in pairs)
    o.error = (f"{levers} changes the maths: its first step's {' and '.join(off)} "
               f"departs from the twin's without it (trial #{ref.number}) by "
               f"{max(off.values()):.1%}, past {tolerance:.0%}: {figures}")
