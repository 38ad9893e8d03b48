"""The memory model calibrated by measured trials: predictions tighten as a search runs.

Per family (every knob but the batch) with measurements, a line through its own points.
Elsewhere the physics' terms, each scaled by a factor fitted to every measured trial (a
Bayesian ridge around 1), plus what that still missed, fitted as additive effects of each
knob group's values.

An OOM is a bound, not a measurement: the peak passed the limit by an unknown amount
(docs/memory.md, "What an OOM teaches"). It never moves the scales of the terms every
config holds. Where the measurements still put it under its limit, it may raise only what
is particular to it: a deviation (what one lever changes of a term) that OOMs of two
families hold, then a factor on its family (and families the physics cannot tell apart
from it) at its batch and above, and on a lever combination it shares with an OOM of
another family, which configs holding that combination carry and no other. An OOM whose
every knob value ran elsewhere bounds the configs one knob from it that need more. Any OOM
bounds the configs, measured or not, one knob group from it that the physics puts no more
than NEAR_OOM below it.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np

from autotune import knobs
from autotune.config import Family, TrialConfig
from autotune.plan.memory import COMPONENTS, DEVIATIONS, FEATURES, GiB, MemoryEstimate, Physics
from autotune.plan.shape import ModelShape

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.records import Record

# Each term's scale has a prior centred on 1 with the width below: model states follow
# from parameter counts; the logits from the loss's autograd graph; the activations from
# how each model's code saves tensors (HF GPT-2 on an H100 saved 1.5-2x Korthikanti's
# figure for Megatron's kernels); the fixed runtime from the driver and libraries. The
# deviations are centred on 0.
PRIOR_MEAN = np.array([1.0] * len(COMPONENTS) + [0.0] * len(DEVIATIONS))
# The attention deviation is a yes-or-no in bytes (0: fused kernels, 1: eager, whatever the
# physics assumed), so its width is one whole term. Compile's share of the activations
# is known to a few tens of percent; the share of the whole logits Liger keeps (0 in the
# physics, its chunk aside) to about a tenth.
# A quantized base's packed bytes follow from its format, to a tenth. What compiled Liger
# keeps rests on one measurement: its whole term is in doubt. A generating trainer's KV
# cache follows from the model's shape, to a third (what generate keeps beside it varies).
PRIOR_SD = np.array([{
    "weights": 0.2, "quantized": 0.1, "gradients": 0.2, "optimizer": 0.3, "activations": 1.0,
    "logits": 0.2, "generation": 0.3, "runtime": 1.0, "activations|checkpointing": 0.3,
    "activations|4-byte": 0.3, "logits|4-byte": 0.2, "activations|attention": 1.0,
    "states|replicated": 1.0, "activations|compile": 0.2, "logits|liger": 0.1,
    "logits|liger compiled": 1.0}[name]
    for name in FEATURES])
# An OOM says the peak passed the limit, not by how much (a censored observation): a config
# whose prediction stays under the limit is lifted this far over it, no further.
OOM_OVERSHOOT = 0.05
# The relative error of a prediction for an unmeasured family, before any family tells
# otherwise; each measured family counts as one observation of it, this prior as PRIOR_WEIGHT.
PRIOR_FAMILY_ERROR = 0.10
PRIOR_WEIGHT = 3
MIN_FAMILY_ERROR = 0.03
PER_SAMPLE = [i for i, name in enumerate(FEATURES) if name.startswith(("activations", "logits"))]
MEASUREMENT_NOISE = 0.03  # a measured peak's relative noise (allocator, RSS)
# What an OOM may raise of the fit: the deviations, each held only by the configs with one
# lever's value (checkpointing, 4-byte compute, ZeRO, compile, Liger) or, the attention
# term, by those that leave the kernel to the model ("auto"), which may keep the s^2
# scores unannounced. Never the terms every config holds.
RAISED_BY_OOMS = np.array([name in DEVIATIONS for name in FEATURES])
# Families whose physics terms differ by less than this share are one to the memory model
# (two fused attention kernels, say): an OOM of one is an OOM of the other.
SAME_MEMORY = 0.01
# A config one knob group from an OOM that the shared fit puts no more than this share
# below it (or above it) runs out too (`_floor`): the OOM passed the limit, and the physics
# orders that group's bytes closely (ZeRO-1 beside ZeRO-2 on one GPU: 1.8% less, a bucket).
NEAR_OOM = 0.05


class MemoryModel(Physics):
    """Physics, calibrated by `observe` (a measured peak) and `observe_oom`."""

    def __init__(self, shape: ModelShape, device: DeviceSpec, world_size: int = 1,
                 prior: dict[str, float] | None = None) -> None:
        """`prior`: term scales another search fitted (`term_scales`), the centre of this
        fit's prior in place of 1 (a near match in the results store: the same model at
        another seq_len, or on a kin device)."""
        super().__init__(shape, device, world_size)
        self._points: dict[Family, dict[int, int]] = {}
        self._configs: dict[tuple[Family, int], TrialConfig] = {}  # each point's config
        self._oom_at: dict[Family, int] = {}
        self._theta = PRIOR_MEAN.copy()
        self._family_resid: dict[Family, float] = {}
        self._errors: list[float] = []  # each measured family's relative residual
        self._offsets: dict[Family, float] = {}
        self._effects: tuple[float, dict] | None = None
        # Until the next update: predict_total, extrapolated_bytes and the stand-ins.
        self._memo: dict[TrialConfig, float] = {}
        self._extrapolated: dict[TrialConfig, float] = {}
        self._stand_ins: dict[TrialConfig, TrialConfig] = {}
        self.family_error = PRIOR_FAMILY_ERROR  # see _refit
        self._ooms: dict[TrialConfig, int] = {}  # each OOM and the limit it passed
        # What OOMs the fit leaves under their limit teach (`_bound`): each such OOM with
        # the factor it asks; per lever combination OOMs of two families share, (levels,
        # least batch, factor).
        self._unexplained: list[tuple[TrialConfig, float]] = []
        self._combos: list[tuple[frozenset, int, float]] = []
        self._cleared: set[TrialConfig] = set()  # see `_above`
        self._alike: dict[tuple[Family, TrialConfig], bool] = {}  # see `_same_memory`
        self._twins: dict[Family, Family | None] = {}  # see `_stand_in`
        # See `_sibling`: the measured families in order, and per family how many of them
        # it was checked against and those that keep its bytes a sample.
        self._measured: list[Family] = []
        self._siblings: dict[Family, tuple[int, list[Family]]] = {}
        # Until the next update: each family's sibling, and how far each sibling's line
        # runs from its residual at a batch (`_unmeasured`).
        self._best_siblings: dict[Family, Family | None] = {}
        self._sibling_lines: dict[TrialConfig, float] = {}
        # Facts of the knob table about pairs of families, which no fit changes: asked for
        # every candidate after every trial, they took a quarter of a replayed search.
        self._free_groups = _memory_free_groups()
        self._pairs: dict[tuple[Family, Family, str], bool] = {}
        # Bounds of the fit: scales stay positive; the attention deviation adds the s^2
        # term where the physics left it out (>= 0), or takes it away where it put it in
        # (>= -1); the other deviations may take away at most their whole term.
        self._lower = np.array([0.05] * len(COMPONENTS) + [-1.0] * len(DEVIATIONS))
        self._lower[FEATURES.index("activations|attention")] = (
            -1.0 if self.materialises_attention() else 0.0)
        self._lower[FEATURES.index("logits|liger")] = 0.0  # the physics holds none of it
        self._prior = PRIOR_MEAN.copy()
        for name, scale in (prior or {}).items():
            if name in FEATURES:  # a term this version no longer has is ignored
                i = FEATURES.index(name)
                self._prior[i] = max(float(scale), self._lower[i])
        self._theta = self._prior.copy()
        # What OOMs raised of the deviations (`_censored`), on top of the measured fit:
        # only predictions of unmeasured families carry it.
        self._raised = np.zeros(len(FEATURES))

    @classmethod
    def from_history(cls, shape: ModelShape, device: DeviceSpec, world_size: int,
                     records: Iterable[Record], limit_bytes: int,
                     prior: dict[str, float] | None = None) -> MemoryModel:
        """The model calibrated on every measured trial of a search."""
        model = cls(shape, device, world_size, prior)
        for r in records:
            model.learn(r, limit_bytes)
        return model

    def term_scales(self) -> dict[str, float]:
        """The fitted scale of each physics term and deviation, by name: what a record
        keeps of this calibration (the per-family residuals are bytes at this seq_len
        and device, and stay behind)."""
        return {name: float(v) for name, v in zip(FEATURES, self._theta, strict=True)}

    def learn(self, record: Record, limit_bytes: int) -> None:
        """What one record teaches: a measured peak, or an OOM at the limit. A GPU
        trial's host running out (offloaded states) says nothing of the GPU's memory."""
        if record.outcome.ok:
            self.observe(record.config, record.outcome.peak_memory_bytes)
        elif record.outcome.is_oom and not record.outcome.failure.host_memory:
            self.observe_oom(record.config, limit_bytes)

    def predict(self, c: TrialConfig) -> MemoryEstimate:
        """The calibrated prediction by component; what calibration adds or removes is
        booked under runtime, the one component no formula pins down."""
        est = self.physics(c)
        est.known_oom, est.calibrated = self.known_oom(c), bool(self._points)
        est.components["runtime"] += int(self.predict_total(c)) - est.total_bytes
        return est

    def _forget(self) -> None:
        """Drops what was memoised of the last fit (a strategy asks every candidate after
        every update)."""
        self._memo.clear()
        self._extrapolated.clear()
        self._stand_ins.clear()
        self._sibling_lines.clear()
        self._best_siblings.clear()

    def predict_total(self, c: TrialConfig) -> float:
        """The calibrated peak alone. (Uncalibrated, it equals the physics.)"""
        cached = self._memo.get(c)
        if cached is None:
            cached = self._predict_total(c)
            # A memory twin's floor holds for `c` as its measurements do (`_stand_in`).
            stand_in = self._stand_in(c)
            floor = max(self._floor(c), self._floor(stand_in) if stand_in is not c else 0.0)
            cached = self._memo[c] = max(cached, floor) if floor else cached
        return cached

    def _predict_total(self, c: TrialConfig, lifted: bool = True) -> float:
        """`lifted`: with what a memory twin's OOM puts on a measured family
        (`_twin_oom`)."""
        b = c.per_device_train_batch_size
        stand_in = self._stand_in(c)
        if stand_in.family != c.family:  # not identity: a memoised twin may be an equal copy
            # Its memory twin's measurements answer for it; so does the twin's OOM.
            predicted = self._predict_total(stand_in, lifted)
            if any(oom is not None and b >= oom for oom in (
                    self._oom_at.get(stand_in.family), self._oom_at.get(c.family))):
                predicted = max(predicted, max(self._ooms.values()) * (1 + OOM_OVERSHOOT))
            return predicted
        points = self._points.get(c.family, {})
        if not points:
            return self._unmeasured(c) * self.oom_factor(c)
        per_sample = self._per_sample(c)
        if self.reserved_peak(c) is not None:
            # The replay (Trainer's step, or ZeRO's engine beside it) knows how the
            # allocator's reserved peak moves with the batch (unevenly): the family's
            # nearest measurement carries over as an offset from it.
            nearest = min(points, key=lambda p: abs(p - b))
            here = self._configs[c.family, nearest]
            line = self._regressed(c) + points[nearest] - self._regressed(here)
        elif len(points) >= 2:
            slope = self._family_slope(points, per_sample)
            nearest = min(points, key=lambda p: abs(p - b))
            line = points[nearest] + slope * (b - nearest)
        else:
            (b1, m1), = points.items()
            line = m1 + per_sample * (b - b1)
        least = min(points)
        if b < least:
            # Below its least measurement the line keeps the bytes no sample adds, as the
            # shared fit has them (or that measurement, if less): Llama-3B's offloaded ZeRO-1
            # Liger family, measured at b64 alone (74 GiB), put b1 at -182 GiB at the
            # shared fit's bytes a sample; 27 GiB now.
            line = max(line, min(self._regressed(c) - per_sample * b, points[least]))
        return max(line, self._twin_oom(c, points)) if lifted else line

    def _twin_oom(self, c: TrialConfig, points: dict[int, int]) -> float:
        """What an OOM of a memory twin (`_same_memory`: fp16 beside bf16, two AdamW
        implementations) at `c`'s batch or below leaves a measured family that never ran
        there: the OOM, as `_bound` lifts one. Its line alone knows nothing of the twin
        (Qwen2-1.5B on an H100: bf16 ran out at batch 64, then fp16, measured at batch 2
        alone, was predicted 60 GiB there and ran out too)."""
        b, out = c.per_device_train_batch_size, 0.0
        for oom, limit in self._ooms.items():
            least = oom.per_device_train_batch_size
            if (oom.family != c.family and least <= b and max(points) < least
                    and self._same_memory(c.family, oom)):
                out = max(out, limit * (1 + OOM_OVERSHOOT))
        return out

    def _unmeasured(self, c: TrialConfig) -> float:
        """A config of a family without measurements, as the measured trials predict it
        (the scaled terms, and what each of its knob values missed elsewhere), with the
        deviations OOMs raised, and where a measured family keeps its bytes a sample
        (`_sibling`), how far that family's own line runs from its residual at `c`'s
        batch: what a sample adds is measured there, not split between the terms by their
        priors. The line as lifted by its memory twin's OOM (`_twin_oom`): a bound on the
        sibling's bytes bounds `c`'s, less the states between them (Qwen2-1.5B on an H100:
        unlifted, an 8-bit family ran out at batch 64 where its AdamW sibling's twin had)."""
        raised = float(self._raised @ self.features(c)) if self._raised.any() else 0.0
        sibling, deviation = self._sibling(c), 0.0
        if sibling is not None:
            deviation = self._sibling_lines.get(sibling)
            if deviation is None:
                deviation = self._sibling_lines[sibling] = (
                    self._predict_total(sibling) - self._regressed(sibling)
                    - self._family_resid[sibling.family])
        return self._regressed(c) + raised + self._neighbour_offset(c.family) + deviation

    def _sibling(self, c: TrialConfig) -> TrialConfig | None:
        """`c`'s batch of the measured family whose bytes a sample (activations and
        logits) the physics puts within SAME_MEMORY of `c`'s, the most measured. The
        shared fit splits what a sample adds between the terms as their priors say
        (Qwen2-1.5B on an H100: checkpointed Liger under ZeRO-2 took 0.94 GiB a sample
        from batch 8 to 32, and the same without ZeRO and with 8-bit Adam was predicted
        74.5 GiB at batch 64 by the shared fit, and ran out at 80). Checked against the
        families measured since the last ask only."""
        fam, b = c.family, c.per_device_train_batch_size
        if fam not in self._best_siblings:
            seen, near = self._siblings.get(fam, (0, []))
            if seen < len(self._measured):
                here = self.features(c)[PER_SAMPLE]
                size = max(float(np.abs(here).sum()), 1.0)
                near = near + [other for other in self._measured[seen:] if float(np.abs(
                    here - self.features(TrialConfig(b, c.gradient_accumulation_steps,
                                                     other))[PER_SAMPLE]).sum())
                    <= SAME_MEMORY * size]
                self._siblings[fam] = (len(self._measured), near)
            self._best_siblings[fam] = min(near, key=lambda other: (
                -len(self._points[other]), other.label())) if near else None
        best = self._best_siblings[fam]
        return None if best is None else TrialConfig(b, c.gradient_accumulation_steps, best)

    def oom_factor(self, c: TrialConfig) -> float:
        """The factor OOMs put on `c`'s prediction (1 where none applies; see `_bound`):
        the largest of an OOM of its family's memory at `c`'s batch or below, and of the
        lever combinations it holds from their batch up. None falls as the batch grows, so
        neither does a family's prediction; none reaches a smaller batch of an OOM's own."""
        b, out = c.per_device_train_batch_size, self._above(c)
        for oom, need in self._unexplained:
            if b >= oom.per_device_train_batch_size and self._same_memory(c.family, oom):
                out = max(out, need)
        if self._combos:
            levels = c.family.levels()
            for combo, least, need in self._combos:
                if b >= least and combo.issubset(levels):
                    out = max(out, need)
        return out

    def _stand_in(self, c: TrialConfig) -> TrialConfig:
        """`c`, or where its family has no measurement, `c`'s batch of the measured family
        whose physics terms are `c`'s within SAME_MEMORY (the nearest): knob values that
        change no memory (two fused attention kernels, fp16 and bf16, two AdamW
        implementations) share what was measured, rather than the one never run being
        predicted from the shared fit alone (Qwen2-1.5B on an A10G: 23.4 GiB for SDPA
        beside 21.7 measured with flash-attention 2, the same kernel's memory)."""
        cached = self._stand_ins.get(c)
        if cached is None:
            cached = self._stand_ins[c] = self._find_stand_in(c)
        return cached

    def _find_stand_in(self, c: TrialConfig) -> TrialConfig:
        fam = c.family
        if fam in self._points or not self._points:
            return c
        if fam not in self._twins:
            near = []
            for twin, points in self._points.items():
                if not self._pair(fam, twin, "twins"):
                    continue
                b = min(points)
                ref = self._configs[twin, b]
                here = self.features(TrialConfig(b, ref.gradient_accumulation_steps, fam))
                d = float(np.abs(here - self.features(ref)).sum())
                if d <= SAME_MEMORY * max(float(np.abs(self.features(ref)).sum()), 1.0):
                    near.append((d, -len(points), twin.label(), twin))
            self._twins[fam] = min(near)[-1] if near else None
        twin = self._twins[fam]
        return c if twin is None else TrialConfig(
            c.per_device_train_batch_size, c.gradient_accumulation_steps, twin)

    def _same_memory(self, fam: Family, oom: TrialConfig) -> bool:
        """Whether `fam` is `oom`'s family to the memory model: its own, or one whose every
        term the physics puts within a percent of `oom`'s at `oom`'s batch (values of knobs
        that change no memory, such as two fused attention kernels)."""
        if fam == oom.family:
            return True
        key = (fam, oom)
        alike = self._alike.get(key)
        if alike is None:
            here = self.features(TrialConfig(oom.per_device_train_batch_size,
                                             oom.gradient_accumulation_steps, fam))
            there = self.features(oom)
            alike = self._alike[key] = bool(
                np.abs(here - there).sum() <= SAME_MEMORY * np.abs(there).sum())
        return alike

    def _family_slope(self, points: dict[int, int], per_sample: float) -> float:
        """Bytes per sample of a measured family: its own line's slope and the pooled
        calibrated figure, each weighted by its precision. Two peaks a few samples apart
        pin a slope only loosely (each is good to MEASUREMENT_NOISE, and the allocator's
        blocks do not grow evenly: GPT-2 on the H100 took 1480 then 1273 MiB per sample
        from batch 4 to 8 to 16), while the pooled slope is good to about the error of an
        unmeasured family (as the measurements alone put it: an OOM widens the search's
        headroom, not the weights of a measured family's line)."""
        slope, _ = _line(points)
        xs = np.array(list(points), float)
        spread = float(((xs - xs.mean()) ** 2).sum())
        line_var = (MEASUREMENT_NOISE * statistics.mean(points.values())) ** 2 / spread
        pooled_var = (self._family_error([]) * per_sample) ** 2
        weight = pooled_var / (pooled_var + line_var) if pooled_var + line_var else 1.0
        return weight * max(slope, 0.5 * per_sample) + (1 - weight) * per_sample

    def known_oom(self, c: TrialConfig) -> bool:
        oom_at = self._oom_at.get(c.family)
        return oom_at is not None and c.per_device_train_batch_size >= oom_at

    def extrapolated_bytes(self, c: TrialConfig) -> float:
        """How much of the prediction is not pinned by a measurement: the activations
        between `c` and its family's nearest measured batch, or everything when the family
        has none. Headroom for error scales with it."""
        cached = self._extrapolated.get(c)
        if cached is None:
            cached = self._extrapolated[c] = self._extrapolate(c)
        return cached

    def _extrapolate(self, c: TrialConfig) -> float:
        c = self._stand_in(c)
        points = self._points.get(c.family)
        if not points:
            return self.predict_total(c)
        b = c.per_device_train_batch_size
        nearest = min(points, key=lambda p: abs(p - b))
        return abs(b - nearest) * self._per_sample(c)

    def _regressed(self, c: TrialConfig) -> float:
        return float(self._theta @ self.features(c))

    def _per_sample(self, c: TrialConfig) -> float:
        """Calibrated bytes per sample of the micro-batch (activations and logits)."""
        f = self.features(c)
        return float(self._theta[PER_SAMPLE] @ f[PER_SAMPLE]) / c.per_device_train_batch_size

    def _neighbour_offset(self, fam: Family) -> float:
        """What the regression misses for an unmeasured family, as the sum of what each of
        its knob values missed in the measured families (ridge-regularised additive effects
        of each knob group of the table); a value never measured contributes nothing."""
        cached = self._offsets.get(fam)
        if cached is not None:
            return cached
        if not self._family_resid:
            return 0.0
        if self._effects is None:
            self._effects = _additive_effects(self._family_resid)
        intercept, effects = self._effects
        value = intercept + sum(effects.get(level, 0.0) for level in fam.levels())
        self._offsets[fam] = value
        return value

    def observe(self, c: TrialConfig, measured_bytes: int | None) -> None:
        """A trial that ran: its measured peak (device, per rank) refines the model."""
        if not measured_bytes:
            return
        if c.family not in self._points:
            self._twins.clear()
            self._measured.append(c.family)
        self._points.setdefault(c.family, {})[c.per_device_train_batch_size] = measured_bytes
        self._configs[c.family, c.per_device_train_batch_size] = c
        self._forget()
        self._refit()

    def observe_oom(self, c: TrialConfig, limit_bytes: int) -> None:
        """A trial that ran out of memory: larger batches of its family will too, and where
        the prediction stays under the limit, what is particular to it is lifted
        (`_censored`, `_bound`)."""
        fam, b = c.family, c.per_device_train_batch_size
        self._forget()
        self._oom_at[fam] = min(b, self._oom_at.get(fam, b))
        self._ooms[c] = limit_bytes
        self._refit()

    def _refit(self) -> None:
        # 1) A scale per physics term, from every measured trial (Bayesian ridge).
        measured = [(self._configs[fam, b], m) for fam, points in self._points.items()
                    for b, m in points.items()]
        X = np.array([self.features(c) for c, _ in measured]).reshape(-1, len(FEATURES))
        y = np.array([m for _, m in measured], float)
        self._theta = _fit_term_scales(X, y, self._lower, self._prior)
        # 1b) What OOMs the measured fit puts under their limit may raise of it.
        self._raised = self._censored(X, y) - self._theta
        # 2) What the scaled terms still miss, per measured family.
        self._family_resid, self._offsets, self._effects = {}, {}, None
        self._errors = []
        for fam, points in self._points.items():
            self._family_resid[fam] = statistics.median(
                m - self._regressed(self._configs[fam, b]) for b, m in points.items())
            self._errors.append(abs(self._family_resid[fam])
                                / statistics.median(points.values()))
        # 3) What they teach beyond the fit, and the error an unmeasured family may have.
        self._bound()

    def _censored(self, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The term scales with the OOMs the measured fit puts under their limit entered as
        peaks just over it. They may only raise a deviation (what one lever changes of a
        term) that OOMs of two families or more hold, from where the measurements put it:
        the lever those OOMs share. The scales every family shares and every other
        deviation stay as the measurements fitted them. (Kept apart from the measured fit,
        which the families' residuals and their knob effects are read against: a raised
        deviation must not move them, and through them every family.)"""
        theta = self._theta
        for _ in range(3):
            under = [(c, limit) for c, limit in self._ooms.items()
                     if c.family not in self._points and float(theta @ self.features(c)) < limit]
            held = np.zeros(len(FEATURES), int)
            for fam in {c.family for c, _ in under}:
                held += self.features(next(c for c, _ in under if c.family == fam)) > 0
            free = (held >= 2) & RAISED_BY_OOMS
            if not free.any():
                break
            X = np.vstack([X, [self.features(c) for c, _ in under]])
            y = np.append(y, [limit * (1 + OOM_OVERSHOOT) for _, limit in under])
            lower = np.where(free, np.maximum(self._lower, self._theta), self._lower)
            theta = _fit_term_scales(X, y, lower, self._prior,
                                     np.where(free, np.nan, self._theta))
        return theta

    def _family_error(self, ooms: list[float]) -> float:
        """How far off an unmeasured family may be: what the shared fit misses on the
        measured ones and, at least, on the unexplained OOMs (each a lower bound of its
        family's error), a high quantile shrunk toward the prior while they are few. An OOM
        thus widens the headroom the search keeps, never the prediction of another family."""
        errors = self._errors + ooms
        seen = float(np.quantile(errors, 0.8)) if errors else PRIOR_FAMILY_ERROR
        return max(MIN_FAMILY_ERROR, (len(errors) * seen + PRIOR_WEIGHT * PRIOR_FAMILY_ERROR)
                   / (len(errors) + PRIOR_WEIGHT))

    def _bound(self) -> None:
        """The OOMs as bounds, once the fit has taken what it may of them (`_censored`).
        An OOM of a family without measurements that the fit still puts under its limit
        asks for the factor that lifts it just over (OOM_OVERSHOOT): at its batch and above,
        for its family and any family of the same memory. Beyond those, an OOM lifts only
        a lever combination (one knob group's value, or two) that OOMs of at least two
        families hold, from a batch they ran at up, by the largest factor those OOMs ask
        (were the combination the cause, it would need that much), unless a config holding
        it measured there with less than half that excess. (An OOM of a measured family
        says only that its batch and larger ones do not fit: `known_oom`.) Every OOM
        predicted under its limit widens `family_error`, the headroom the search keeps."""
        self._forget()
        self._unexplained, self._combos, self._cleared = [], [], set()
        missed = []  # how far under its limit each OOM was predicted, relative
        for c, limit in self._ooms.items():
            # A twin's measurements, not the lift its own OOM puts on them: that it ran out
            # where they put it under the limit is a miss like any other.
            stand_in = self._stand_in(c)
            measured = stand_in.family in self._points
            predicted = (self._predict_total(stand_in, lifted=False) if measured
                         else self._unmeasured(c))
            need = limit * (1 + OOM_OVERSHOOT) / max(predicted, 1.0)
            if need <= 1.0:
                continue
            missed.append(need - 1.0)
            if not measured:
                self._unexplained.append((c, need))
        self.family_error = self._family_error(missed)
        if len({c.family for c, _ in self._unexplained}) >= 2:
            self._shared_levers()
        # An OOM every one of whose knob values a measurement cleared (`_refuted`, at any
        # batch): what ran out is the batch's bytes, or how the values meet.
        self._cleared = {c for c, need in self._unexplained if all(
            self._refuted(frozenset([lv]), 0, need) for lv in c.family.levels())}
        self._forget()

    def _above(self, c: TrialConfig) -> float:
        """The factor of an unexplained OOM on `c`, one knob group from it, at its batch or
        above, where the shared fit puts `c`'s family above the OOM's at the OOM's batch:
        `c` holds whatever else ran out, and more of the bytes that group adds. The group
        is one whose bytes the physics orders (`Knob.memory_ordered`); or any, at the
        OOM's memory or more, where every knob value of the OOM a measurement cleared
        (`_bound`): what ran out is the batch's bytes (BERT-base on a T4: SGD without ZeRO
        at batch 32, then with ZeRO-1, which on one GPU adds buffers and cuts nothing).
        Never across compile or Liger, whose bytes may be what ran out, nor out of an
        engine the OOM ran under (`Knob.memory_engine`), whose own bytes may be."""
        b, out = c.per_device_train_batch_size, 1.0
        for oom, need in self._unexplained:
            if b < oom.per_device_train_batch_size or need <= out:
                continue
            cleared = oom in self._cleared
            if not self._pair(oom.family, c.family, "any group" if cleared else "ordered"):
                continue
            here = self._regressed(_at_batch_of(oom, c.family))
            there = self._regressed(oom)
            if here > there or (cleared and here == there):
                out = need
        return out

    def _floor(self, c: TrialConfig) -> float:
        """The least an OOM one knob group from `c` leaves it, at the OOM's batch or above:
        the OOM taken as OOM_OVERSHOOT over its limit (as `_bound` lifts one), times what
        the shared fit puts `c`'s family at beside the OOM's there, where that is at least
        1 - NEAR_OOM (just below it, or above). Across a group whose bytes the physics
        orders (`Knob.memory_ordered`), inside the OOM's engine, as `_above`; for a
        measured family too, whose line knows nothing of its neighbours' OOMs, unless it
        (or its memory twin) ran at the OOM's batch or above, which refutes the ratio.
        (Mistral-7B on one H100: ZeRO-2 with its optimizer offloaded ran out at batch 2,
        then ZeRO-1 did, which one rank holds in the same bytes but a bucket.)"""
        b, out = c.per_device_train_batch_size, 0.0
        if not self._ooms:
            return out
        points = self._points.get(self._stand_in(c).family, {})
        for oom, limit in self._ooms.items():
            least = oom.per_device_train_batch_size
            if b < least or any(p >= least for p in points):
                continue
            if not self._pair(oom.family, c.family, "ordered"):
                continue
            ratio = self._regressed(_at_batch_of(oom, c.family)) / max(self._regressed(oom),
                                                                         1.0)
            if ratio >= 1.0 - NEAR_OOM:
                out = max(out, limit * (1 + OOM_OVERSHOOT) * ratio)
        return out

    def _pair(self, a: Family, b: Family,
              relation: Literal["twins", "any group", "ordered"]) -> bool:
        """Memoised: whether `b` is `a`'s memory twin (`_twins_in_memory`), or one knob
        group from OOM `a` (`_one_group_from`, across any group or an ordered one)."""
        key = (a, b, relation)
        known = self._pairs.get(key)
        if known is None:
            known = self._pairs[key] = (
                _twins_in_memory(a, b, self._free_groups) if relation == "twins"
                else _one_group_from(a, b, any_group=relation == "any group")
                or _one_group_from(a, self._as_twin_of(a, b), any_group=relation == "any group"))
        return known

    def _as_twin_of(self, a: Family, b: Family) -> Family:
        """`b` with `a`'s value in each group of memory twins (`Knob.memory_twins`) whose
        two values the physics holds in the same bytes: flash-attention beside SDPA is no
        knob group apart to an OOM."""
        out, probe = b, TrialConfig(1, 1, b)
        for group, members in knobs.groups().items():
            if group not in self._free_groups:
                continue
            swapped = out.replace(**{k.name: getattr(a, k.name) for k in members})
            # Against `b` itself, so that the swaps together stay within SAME_MEMORY.
            if swapped != out and self._same_memory(swapped, probe):
                out = swapped
        return out

    def _shared_levers(self) -> None:
        """The lever combinations `_bound` lifts: each knob group's value, and each pair,
        of an unexplained OOM's family that OOMs of two families or more hold."""
        combos: set[frozenset] = set()
        for c, _ in self._unexplained:
            levels = c.family.levels()
            combos.update(frozenset([lv]) for lv in levels)
            combos.update(frozenset(pair) for pair in itertools.combinations(levels, 2))
        for combo in combos:
            held = [(c, need) for c, need in self._unexplained
                    if combo.issubset(c.family.levels())]
            for least in sorted({c.per_device_train_batch_size for c, _ in held}):
                covered = [(c, need) for c, need in held
                           if c.per_device_train_batch_size >= least]
                if len({c.family for c, _ in covered}) < 2:
                    break
                need = max(need for _, need in covered)
                if not self._refuted(combo, least, need):
                    self._combos.append((combo, least, need))

    def _refuted(self, combo: frozenset, least_batch: int, factor: float) -> bool:
        """Whether a config holding every level of `combo`, at `least_batch` or more,
        measured less than half the excess `factor` puts on it over the shared fit: the
        combination is then not what ran out."""
        for fam, points in self._points.items():
            if not combo.issubset(fam.levels()):
                continue
            for b, m in points.items():
                if b < least_batch:
                    continue
                fitted = max(self._regressed(self._configs[fam, b]), 1.0)
                if m / fitted - 1.0 < (factor - 1.0) / 2:
                    return True
        return False


def _one_group_from(oom: Family, other: Family, *, any_group: bool = False) -> bool:
    """Whether `other` differs from `oom` in one knob group, whose bytes the physics
    orders (`Knob.memory_ordered`; any group where `any_group`), without leaving an engine
    `oom` ran under: what `_above` and `_floor` carry an OOM across."""
    apart = [g for (g, x), (_, y) in zip(oom.levels(), other.levels(), strict=True)
             if x != y]
    if len(apart) != 1:
        return False
    group = knobs.groups()[apart[0]]
    return ((any_group or all(k.memory_ordered for k in group))
            and not _leaves_engine(group, oom, other))


def _at_batch_of(oom: TrialConfig, family: Family) -> TrialConfig:
    return TrialConfig(oom.per_device_train_batch_size, oom.gradient_accumulation_steps,
                       family)


def _leaves_engine(group: Sequence[knobs.Knob], oom: Family, other: Family) -> bool:
    """Whether `other` runs outside an engine `oom` ran under (a `group` knob's
    `memory_engine`)."""
    a, b = oom.to_dict(), other.to_dict()
    return any(k.memory_engine and a[k.name] != k.baseline and b[k.name] == k.baseline
               for k in group)


def _memory_free_groups() -> set[str]:
    """The knob groups whose every value the physics may call equal in memory (the knob
    table's `memory_twins`)."""
    return {g for g, members in knobs.groups().items() if all(k.memory_twins for k in members)}


def _twins_in_memory(a: Family, b: Family, free: set[str]) -> bool:
    """Whether two families differ only in the `free` groups (`_memory_free_groups`)."""
    return all(x == y or g in free
               for (g, x), (_, y) in zip(a.levels(), b.levels(), strict=True))


def _fit_term_scales(X: np.ndarray, y: np.ndarray, lower: np.ndarray,
                     mean: np.ndarray = PRIOR_MEAN,
                     fixed: np.ndarray | None = None) -> np.ndarray:
    """Posterior mode of the term scales, given peaks measured to about MEASUREMENT_NOISE,
    the prior `mean` +- PRIOR_SD, and each coefficient at least `lower` (a term's scale
    stays positive; a deviation cannot remove more memory than its term holds); `fixed`:
    values to hold (NaN where a coefficient is free). Bounds by active set: a coefficient
    that would cross its bound is held there and the rest refitted, until none crosses."""
    w = 1.0 / (MEASUREMENT_NOISE * y) ** 2
    A = X.T @ (X * w[:, None]) + np.diag(1.0 / PRIOR_SD**2)
    b = X.T @ (y * w) + mean / PRIOR_SD**2
    at = np.full(len(lower), np.nan) if fixed is None else fixed.copy()
    theta = at.copy()
    for _ in range(len(lower) + 1):
        held = ~np.isnan(at)
        free = ~held
        theta = np.where(held, at, 0.0)
        theta[free] = np.linalg.solve(A[np.ix_(free, free)],
                                      b[free] - A[np.ix_(free, held)] @ theta[held])
        crossing = (theta < lower) & free
        if not crossing.any():
            break
        at[crossing] = lower[crossing]
    return theta


# Shrinkage of the knob effects, in units of one family's residual: a value seen once keeps
# 80% of its effect. The term scales already explain the bulk, so what is left is measured
# to within its noise; 0.25 was chosen on the recorded CPU and H100 trials and the landscapes
# (1.0, the earlier value, lost 0.3-0.8 points of landscape classification, and 0.8 of CPU error).
RIDGE = 0.25


def _additive_effects(residuals: dict[Family, float]) -> tuple[float, dict]:
    """Intercept plus per-knob-value effects fitted to per-family residuals (ridge)."""
    fams = list(residuals)
    levels = sorted({lv for f in fams for lv in f.levels()}, key=repr)
    index = {lv: i + 1 for i, lv in enumerate(levels)}
    X = np.zeros((len(fams), len(levels) + 1))
    X[:, 0] = 1.0
    for r, f in enumerate(fams):
        for lv in f.levels():
            X[r, index[lv]] = 1.0
    scale = GiB
    y = np.array([residuals[f] for f in fams]) / scale
    penalty = np.eye(len(levels) + 1) * RIDGE
    penalty[0, 0] = 1e-9  # the intercept is not shrunk
    beta = np.linalg.solve(X.T @ X + penalty, X.T @ y)
    return float(beta[0] * scale), {lv: float(beta[index[lv]] * scale) for lv in levels}


def _line(points: dict[int, int]) -> tuple[float, float]:
    """Least-squares slope and intercept through (batch, bytes) points."""
    xs, ys = list(points), list(points.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return slope, my - slope * mx


def leave_one_out_errors(shape: ModelShape, device: DeviceSpec, world_size: int,
                         measured: list[tuple[TrialConfig, int]],
                         model_type: type[MemoryModel] = MemoryModel) -> list[float]:
    """Relative error of the calibrated prediction for each measured config, calibrated on
    all the others: how well measurements of some configs predict an unmeasured one.
    (`model_type`: a variant of the model, to judge a change to it on the same trials.)"""
    errors = []
    for i, (config, actual) in enumerate(measured):
        model = model_type(shape, device, world_size)
        for j, (other, bytes_) in enumerate(measured):
            if j != i:
                model.observe(other, bytes_)
        errors.append(abs(model.predict_total(config) - actual) / actual)
    return errors
