"""A throughput model with the problem's structure, for choosing the next trial.

log(samples/s) is modelled as additive effects of each knob group of the table (ZeRO
sharding as one group) and of batch size, with a per-value batch curve for the knobs
the table says saturate differently (16-bit kernels fill a device at other batch sizes
than fp32). Bayesian linear regression gives every unmeasured config a mean and an
uncertainty: one trial of a knob value informs every config that shares it, and a value
never tried stays uncertain, so expected improvement explores it. The prior means are
the table's general knowledge (16-bit tensor cores beat fp32, checkpointing costs about
a third more compute, sharding costs communication), not figures of any
particular machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune import knobs
from autotune.config import TrialConfig
from autotune.device import DeviceSpec
from autotune.plan.shape import ModelShape

NOISE_FLOOR = 0.02  # relative run-to-run noise assumed before residuals say otherwise
# A micro-step carries fixed costs (kernel launches, Python, the step's bookkeeping) worth
# about this long at peak: a micro-batch whose compute takes as long runs at half speed.
FIXED_STEP_SECONDS = 0.02
DEFAULT_HALF_BATCH = 2.0  # when the device's peak FLOP/s is not known (CPU)


@dataclass
class _Group:
    name: str
    levels: list
    prior_sd: float


class ThroughputModel:
    """Posterior over log throughput; `predict` gives mean and sd per config."""

    def __init__(self, candidates: Sequence[TrialConfig], device: DeviceSpec,
                 world_size: int = 1, shape: ModelShape | None = None) -> None:
        self.device, self.world_size, self.shape = device, world_size, shape
        self.candidates = list(candidates)
        batches = sorted({c.per_device_train_batch_size for c in self.candidates})
        self.groups: list[_Group] = []
        self._known: dict[str, set] = {}
        for c in self.candidates:
            for g, lv in c.family.levels():
                self._known.setdefault(g, set()).add(lv)
        for group, members in knobs.groups().items():
            levels = sorted({lv for c in self.candidates for g, lv in c.family.levels()
                             if g == group}, key=repr)
            if self._constant(group, levels):
                continue
            self.groups.append(_Group(group, levels, max(k.speed.sd for k in members)))
        self._kins = []
        for k in knobs.table():
            kins = sorted({k.speed.kin(getattr(c, k.name)) for c in self.candidates}
                          ) if k.speed.kin else []
            if len(kins) > 1:
                self._kins.append(k)
                self.groups.append(_Group(f"{k.name} kin", kins, k.speed.kin_sd or 0.0))
        self.groups.append(_Group("batch", batches, 0.6))
        self._curves = []
        for k in knobs.table():
            values = sorted({getattr(c, k.name) for c in self.candidates}, key=repr)
            levels = [(v, b) for v in values for b in batches]
            width = k.speed.batch_sd
            if width is None and world_size > 1:
                width = k.speed.ranks_batch_sd
            if width is None or self._constant(f"{k.name} x batch", levels):
                continue
            self._curves.append(k)
            self.groups.append(_Group(f"{k.name} x batch", levels, width))
        self._index: dict[tuple[str, object], int] = {}
        prior_mean, prior_sd = [], []
        for g in self.groups:
            for level in g.levels:
                self._index[(g.name, level)] = len(prior_mean)
                prior_mean.append(self._prior_mean(g.name, level))
                prior_sd.append(g.prior_sd)
        self.prior_mean = np.array(prior_mean)
        self.prior_prec = np.diag(1.0 / np.square(prior_sd))
        self.X = self.features(self.candidates)
        self.row = {c: i for i, c in enumerate(self.candidates)}

    def _constant(self, group: str, levels: list) -> bool:
        """A knob the space does not vary, whose prior says nothing either: its column
        would be one more intercept, loosening every prediction for nothing."""
        if group.endswith(" x batch"):
            single = len({v for v, _ in levels}) <= 1
        else:
            single = len(levels) <= 1
        return single and all(self._prior_mean(group, lv) == 0.0 for lv in levels)

    def _prior_mean(self, group: str, level: object) -> float:
        if group == "batch":
            return self._log_efficiency(float(level), None)  # type: ignore[arg-type]
        if group.endswith(" kin"):
            return 0.0  # the values' own priors carry the mean
        if group.endswith(" x batch"):
            value, b = level  # type: ignore[misc]
            if group == "precision x batch":  # the curve follows that precision's peak
                return (self._log_efficiency(float(b), str(value))
                        - self._log_efficiency(float(b), None))
            return 0.0
        members = knobs.groups()[group]
        return sum(k.speed.prior(v, self.device, self.world_size)
                   for k, v in zip(members, level, strict=True))  # type: ignore[arg-type]

    def _half_batch(self, precision: str | None) -> float:
        """The micro-batch at which compute equals the fixed cost of a micro-step: large
        models fill a GPU with one sample, small ones need many."""
        flops = self.device.peak_flops
        peak = flops.get(precision) if precision else max(flops.values(), default=None)
        if not peak or self.shape is None:
            return DEFAULT_HALF_BATCH
        work = 6.0 * self.shape.num_parameters * self.shape.seq_len  # FLOPs per sample
        return peak * FIXED_STEP_SECONDS / work

    def _log_efficiency(self, b: float, precision: str | None) -> float:
        """Larger batches fill the device better, with diminishing returns."""
        half = self._half_batch(precision)
        return math.log(b / (b + half))

    def features(self, configs: Sequence[TrialConfig]) -> np.ndarray:
        X = np.zeros((len(configs), len(self.prior_mean)))
        for i, c in enumerate(configs):
            b = c.per_device_train_batch_size
            cols = [*c.family.levels(), ("batch", b)]
            cols += [(f"{k.name} x batch", (getattr(c, k.name), b)) for k in self._curves]
            cols += [(f"{k.name} kin", k.speed.kin(getattr(c, k.name))) for k in self._kins]
            for key in cols:
                j = self._index.get(key)
                if j is not None:
                    X[i, j] = 1.0
        return X

    def knows(self, c: TrialConfig) -> bool:
        """Whether every knob value of `c` is one the candidates take (its batch may not
        be: the baseline's chain). A measurement of a value the space does not search (the
        recipe's torch.compile where the space has none) would be put down to the rest."""
        return all(lv in self._known.get(g, ()) for g, lv in c.family.levels())

    def fit(self, configs: Sequence[TrialConfig], samples_per_second: Sequence[float]) -> None:
        """Posterior given measured configs; y is log throughput, centred on its mean."""
        y = np.log(np.asarray(samples_per_second, dtype=float))
        self.offset = float(np.mean(y)) if len(y) else 0.0
        Xo = np.zeros((len(configs), self.X.shape[1]))
        for i, c in enumerate(configs):
            Xo[i] = self.X[self.row[c]] if c in self.row else self.features([c])[0]
        # The intercept is the data's mean; prior means are relative, so centre them too.
        prior_centre = float(np.mean(Xo @ self.prior_mean)) if len(y) else 0.0
        yc = y - self.offset + prior_centre
        noise = NOISE_FLOOR
        for _ in range(2):  # re-estimate noise from residuals once
            precision = self.prior_prec + Xo.T @ Xo / noise**2
            cov = np.linalg.inv(precision)
            mean = cov @ (self.prior_prec @ self.prior_mean + Xo.T @ yc / noise**2)
            if len(y) > len(self.groups) + 2:
                resid = yc - Xo @ mean
                noise = max(NOISE_FLOOR, float(np.sqrt(np.mean(resid**2))))
        self.mean, self.cov, self.noise = mean, cov, noise
        self.prior_centre = prior_centre

    def predict(self, rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(mean, sd) of log samples/s for candidate rows (all when None); sd includes the
        run-to-run noise a measurement of the config would carry."""
        X = self.X if rows is None else self.X[rows]
        mu = X @ self.mean + self.offset - self.prior_centre
        var = ((X @ self.cov) * X).sum(axis=1) + self.noise**2
        return mu, np.sqrt(var)


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """E[max(0, Y - best)] for Y ~ N(mu, sd^2), in log throughput (relative gain)."""
    z = (mu - best) / sd
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (mu - best) * _normal_cdf(z) + sd * pdf


def probability_of_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """P(Y > best) for Y ~ N(mu, sd^2), in log throughput: a near tie's question."""
    return _normal_cdf((mu - best) / sd)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
