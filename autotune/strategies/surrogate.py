"""A throughput model with the problem's structure, for choosing the next trial.

log(samples/s) is modelled as additive effects of precision, optimizer, checkpointing,
ZeRO stage with offload, and batch size (with a per-precision batch curve, since
16-bit kernels saturate at other batch sizes than fp32). Bayesian linear regression
gives every unmeasured config a mean and an uncertainty: one trial of a knob value
informs every config that shares it, and a knob value never tried stays uncertain, so
expected improvement explores it. The prior means are general knowledge from the seeds
(16-bit tensor cores beat fp32, checkpointing costs about a third more compute, offload
and ZeRO-3 cost communication), not figures of any particular machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autotune.config import TrialConfig
from autotune.device import DeviceSpec
from autotune.shape import ModelShape

NOISE_FLOOR = 0.02  # relative run-to-run noise assumed before residuals say otherwise
# A micro-step carries fixed costs (kernel launches, Python, the step's bookkeeping) worth
# about this long at peak: a micro-batch whose compute takes as long runs at half speed.
FIXED_STEP_SECONDS = 0.02
DEFAULT_HALF_BATCH = 2.0  # when the device's peak FLOP/s is not known (CPU)


def _zero_key(c: TrialConfig) -> str:
    return f"z{c.zero_stage}:{c.offload}"


def _precision_prior(p: str, device: DeviceSpec) -> float:
    if not device.is_cuda:
        return 0.0  # CPU: bf16 autocast can be slower or faster than fp32; no prior
    cc = device.compute_capability or (0, 0)
    if p in ("fp16", "bf16") and cc >= (7, 0):
        # Where both exist, bf16 skips fp16's loss scaling (unscale and overflow checks).
        return math.log(2.0) - (0.02 if p == "fp16" and device.supports_bf16() else 0.0)
    if p == "tf32" and cc >= (8, 0):
        return math.log(1.3)
    return 0.0


def _zero_prior(key: str, world_size: int) -> float:
    stage, offload = key[1:].split(":")
    prior = {"0": 0.0, "1": -0.02, "2": -0.04, "3": -0.15}[stage]
    if world_size > 1 and stage in ("1", "2"):
        prior = 0.0  # with data parallelism, partitioning is close to free
    prior += {"none": 0.0, "optimizer": -0.4, "optimizer+param": -1.0}[offload]
    return prior


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
        precisions = sorted({c.precision for c in self.candidates})
        optims = sorted({c.optim for c in self.candidates})
        zeros = sorted({_zero_key(c) for c in self.candidates})
        batches = sorted({c.per_device_train_batch_size for c in self.candidates})
        self.groups = [
            _Group("precision", precisions, 0.7),
            _Group("optim", optims, 0.15),
            _Group("ckpt", [True], 0.2),
            _Group("zero", zeros, 0.4),
            _Group("batch", batches, 0.6),
            _Group("precision x batch", [(p, b) for p in precisions for b in batches], 0.25),
            _Group("ckpt x batch", batches, 0.1),
        ]
        self._index: dict[tuple[str, object], int] = {}
        prior_mean, prior_sd = [], []
        for g in self.groups:
            for level in g.levels:
                self._index[(g.name, level)] = len(prior_mean)
                prior_mean.append(self._prior_mean(g.name, level, batches))
                prior_sd.append(g.prior_sd)
        self.prior_mean = np.array(prior_mean)
        self.prior_prec = np.diag(1.0 / np.square(prior_sd))
        self.X = self.features(self.candidates)
        self._row = {c: i for i, c in enumerate(self.candidates)}

    def _prior_mean(self, group: str, level: object, batches: list[int]) -> float:
        if group == "precision":
            return _precision_prior(str(level), self.device)
        if group == "optim":
            # The fused kernel does the step in one launch per parameter group.
            return 0.01 if level == "adamw_torch_fused" and self.device.is_cuda else 0.0
        if group == "ckpt":
            return math.log(0.75)  # one more forward pass per step: ~4/3 the compute
        if group == "zero":
            return _zero_prior(str(level), self.world_size)
        if group == "batch":
            return self._log_efficiency(float(level), None)  # type: ignore[arg-type]
        if group == "precision x batch":
            p, b = level  # type: ignore[misc]
            return self._log_efficiency(float(b), p) - self._log_efficiency(float(b), None)
        return 0.0

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
            cols = [("precision", c.precision), ("optim", c.optim), ("zero", _zero_key(c)),
                    ("batch", b), ("precision x batch", (c.precision, b))]
            if c.gradient_checkpointing:
                cols += [("ckpt", True), ("ckpt x batch", b)]
            for key in cols:
                j = self._index.get(key)
                if j is not None:
                    X[i, j] = 1.0
        return X

    def fit(self, configs: Sequence[TrialConfig], samples_per_second: Sequence[float]) -> None:
        """Posterior given measured configs; y is log throughput, centred on its mean."""
        y = np.log(np.asarray(samples_per_second, dtype=float))
        self.offset = float(np.mean(y)) if len(y) else 0.0
        Xo = np.zeros((len(configs), self.X.shape[1]))
        for i, c in enumerate(configs):
            Xo[i] = self.X[self._row[c]] if c in self._row else self.features([c])[0]
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
        var = np.einsum("ij,jk,ik->i", X, self.cov, X) + self.noise**2
        return mu, np.sqrt(var)


def expected_improvement(mu: np.ndarray, sd: np.ndarray, best: float) -> np.ndarray:
    """E[max(0, Y - best)] for Y ~ N(mu, sd^2), in log throughput (relative gain)."""
    z = (mu - best) / sd
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(z / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi)
    return (mu - best) * cdf + sd * pdf
