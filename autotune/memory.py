"""Peak memory per rank, predicted from the model's shape before anything runs.

The components follow the seeds' anatomy of training memory: weights, gradients,
optimizer states, activations (Korthikanti et al. per-layer figures), LM logits, and
what the runtime itself holds (CUDA context, cuBLAS workspace). ZeRO divides the model
states over the data-parallel world; offload moves them to host memory.

`MemoryModel.observe` takes each measured trial and refines the prediction: per family
a line through its own points; elsewhere a scale per physics term fitted to every
measured trial (Bayesian ridge around the physics), plus what that still missed, fitted
as additive effects of each knob value. Predictions for unmeasured configs tighten as a
search runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.config import TrialConfig
from autotune.shape import ModelShape

if TYPE_CHECKING:
    from autotune.device import DeviceSpec

MiB = 1024**2
GiB = 1024**3

# Optimizer state bytes per parameter (fp32 states unless 8-bit).
OPTIMIZER_STATE_BYTES: dict[str, float] = {
    "adamw_torch": 8, "adamw_torch_fused": 8, "adamw_torch_xla": 8, "adamw_apex_fused": 8,
    "adamw_hf": 8, "adamw_anyprecision": 8, "adamw_torch_npu_fused": 8, "lion_32bit": 4,
    "adamw_bnb_8bit": 2, "adamw_8bit": 2, "paged_adamw_8bit": 2, "lion_8bit": 1,
    "paged_lion_8bit": 1, "rmsprop_bnb_8bit": 1, "rmsprop": 4, "adagrad": 4,
    # Trainer's `sgd` is torch SGD without momentum: no state (with momentum it is 4).
    "sgd": 0,
}
DEFAULT_STATE_BYTES = 8  # an optimizer we have no entry for: assume Adam-like

CUDA_RUNTIME_BYTES = 768 * MiB  # CUDA context + cuBLAS/cuDNN workspaces (seed 003: ~0.5-1 GiB)
CPU_RUNTIME_BYTES = 64 * MiB  # allocator slack of a CPU trial beyond its tensors
# The caching allocator rounds and fragments: the reserved peak runs a few percent over
# the tensors live at the peak.
FRAGMENTATION = 0.05
# A CPU trial's peak RSS growth ran 1.2-2.8x (median 1.95x) the bytes of its tensors over
# 40 trials (benchmarks/memory_accuracy.txt): malloc arenas keep freed blocks and CPU
# kernels keep fp32 intermediates. Uncalibrated CPU predictions use the median.
CPU_OVERHEAD_FACTOR = 0.95
# Calibration scales each physics term (with its allocator slack) by a factor fitted to
# the measured trials, its prior centred on 1 with the width below: model states follow
# from parameter counts; the logits from the loss's autograd graph; the activations from
# how each model's code saves tensors (HF GPT-2 on an H100 saved 1.5-2x Korthikanti's
# figure for Megatron's kernels); the fixed runtime from the driver and libraries. Three
# more terms, centred on 0, let the checkpointed and the 4-byte activation formulas and
# the 4-byte logits stray from the shared scale where measurements say so.
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "runtime")
DEVIATIONS = ("activations|checkpointing", "activations|4-byte", "logits|4-byte")
FEATURES = COMPONENTS + DEVIATIONS
PRIOR_MEAN = np.array([1.0] * len(COMPONENTS) + [0.0] * len(DEVIATIONS))
PRIOR_SD = np.array([0.2, 0.2, 0.3, 1.0, 0.2, 1.0, 0.3, 0.3, 0.2])
PER_SAMPLE = [i for i, name in enumerate(FEATURES) if name.startswith(("activations", "logits"))]
MEASUREMENT_NOISE = 0.03  # a measured peak's relative noise (allocator, RSS)


@dataclass
class MemoryEstimate:
    components: dict[str, int]  # on the device, per rank
    host_bytes: int  # offloaded model states (per rank) that live in host RAM
    calibrated: bool = False
    known_oom: bool = False  # a measured OOM at this batch or a smaller one of the family

    @property
    def total_bytes(self) -> int:
        return sum(self.components.values())

    def to_dict(self) -> dict[str, Any]:
        return {"components": self.components, "host_bytes": self.host_bytes,
                "total_bytes": self.total_bytes, "calibrated": self.calibrated,
                "known_oom": self.known_oom}


def _compute_bytes(precision: str) -> int:
    return 2 if precision in ("fp16", "bf16") else 4


def _adafactor_state_bytes(shape: ModelShape) -> float:
    """Adafactor keeps a row and a column factor per matrix (no first moment by default)."""
    h, f = shape.hidden_size, shape.ffn_size
    per_layer = (h + 3 * h) + (h + h) + (h + f) + (f + h)
    return 4.0 * (shape.num_layers * per_layer + shape.vocab_size + h + shape.seq_len)


@dataclass
class MemoryModel:
    shape: ModelShape
    device: DeviceSpec
    world_size: int = 1
    # Calibration state (see observe / observe_oom).
    _points: dict[tuple, dict[int, int]] = field(default_factory=dict)
    _oom_at: dict[tuple, int] = field(default_factory=dict)
    _theta: np.ndarray = field(default_factory=lambda: PRIOR_MEAN.copy())
    _family_resid: dict[tuple, float] = field(default_factory=dict)
    _offsets: dict[tuple, float] = field(default_factory=dict)
    _effects: tuple[float, dict] | None = None
    _oom_resid: dict[tuple, float] = field(default_factory=dict)  # lower bounds from OOMs
    _cache: dict[TrialConfig, np.ndarray] = field(default_factory=dict)

    # ----------------------------------------------------------------- physics
    def _model_states(self, c: TrialConfig) -> tuple[dict[str, float], float]:
        """(device bytes by component, host bytes) of weights, gradients and optimizer."""
        p, n = float(self.shape.num_parameters), max(1, self.world_size)
        mixed = c.precision in ("fp16", "bf16")
        if c.optim == "adafactor":
            state = _adafactor_state_bytes(self.shape)
        else:
            state = OPTIMIZER_STATE_BYTES.get(c.optim, DEFAULT_STATE_BYTES) * p
        # The seeds' accounting, under Trainer AMP and DeepSpeed alike: fp32 weights plus
        # the 16-bit copies under mixed precision, fp32 gradients, the optimizer's states;
        # ZeRO divides states / +gradients / +weights over the world. (DeepSpeed itself
        # keeps 16-bit weights and gradients and moves the fp32 weights into the optimizer
        # partition, the ZeRO paper's 2 + 2 + 12/N bytes/param: at stage 1-2 over 8 ranks
        # half the figure here. One rank cannot tell the two apart, no multi-GPU run has
        # decided it yet, and calibration learns a stage's offset from its first trial.)
        weights = 4 * p + (2 * p if mixed else 0)
        grads, optim = 4 * p, state
        if c.zero_stage >= 1:
            optim /= n
        if c.zero_stage >= 2:
            grads /= n
        if c.zero_stage >= 3:
            weights /= n
        host = 0.0
        if c.offload in ("optimizer", "optimizer+param"):
            # ZeRO-Offload: the gradient partition, the optimizer states and the update
            # itself move to the CPU; the GPU keeps only reduction buckets of gradients.
            host += optim + grads
            optim = grads = 0.0
        if c.offload == "optimizer+param":
            host += weights
            weights = 0.0
        if c.zero_stage >= 3:
            # The layers being computed are gathered whole on every rank.
            weights += 2 * self._layer_params() * _compute_bytes(c.precision)
        return {"weights": weights, "gradients": grads, "optimizer": optim}, host

    def _layer_params(self) -> float:
        h, f = self.shape.hidden_size, self.shape.ffn_size
        return 4 * h * h + 2 * h * f

    def activation_bytes_per_sample(self, c: TrialConfig) -> float:
        """Korthikanti et al.: s*h*(34 + 5*a*s/h) bytes per layer in 16-bit; the a*s^2
        term (attention scores, softmax, dropout mask) only where attention is eager."""
        s, h, a, layers = (self.shape.seq_len, self.shape.hidden_size,
                           self.shape.num_attention_heads, self.shape.num_layers)
        scale = _compute_bytes(c.precision) / 2
        mlp = 34 * (1 + (self.shape.ffn_size / (4 * h) - 1) * 16 / 34)  # 16 of 34 scale with ffn
        quadratic = 5 * a * s / h if self.materialises_attention() else 0.0
        per_layer = s * h * (mlp + quadratic) * scale
        if c.gradient_checkpointing:
            # Layer inputs kept for every layer, plus one layer recomputed in full.
            return layers * s * h * _compute_bytes(c.precision) + per_layer
        return layers * per_layer

    def logits_bytes_per_sample(self, c: TrialConfig) -> float:
        """LM heads, at the peak (the loss's backward): the fp32 log-softmax the loss
        saved, the gradient flowing into it and the one it produces, all fp32, whatever
        the compute precision. (Trainer drops the model's output, and with it the logits,
        before the backward; the forward's logits, upcast and log-softmax sum to no more.)
        Classification heads are negligible."""
        if not self.shape.has_lm_logits:
            return 0.0
        return self.shape.seq_len * self.shape.vocab_size * (4 + 4 + 4)

    def materialises_attention(self) -> bool:
        """Eager attention keeps the seq x seq scores; SDPA/flash kernels do not. Where the
        shape does not say ("auto"), assume flash kernels exist from Ampere (8.0) on, and
        that older GPUs materialise the scores."""
        attn = self.shape.attn_implementation
        if attn == "auto":
            return self.device.is_cuda and (self.device.compute_capability or (0, 0)) < (8, 0)
        return attn == "eager"

    def physics(self, c: TrialConfig) -> MemoryEstimate:
        states, host = self._model_states(c)
        b = c.per_device_train_batch_size
        comps = states | {"activations": b * self.activation_bytes_per_sample(c),
                          "logits": b * self.logits_bytes_per_sample(c)}
        slack = self._slack_factor() * sum(comps.values())
        runtime = CUDA_RUNTIME_BYTES if self.device.is_cuda else CPU_RUNTIME_BYTES
        comps["runtime"] = runtime + slack
        return MemoryEstimate({k: int(comps[k]) for k in COMPONENTS}, int(host))

    # ------------------------------------------------------------- calibrated
    def predict(self, c: TrialConfig) -> MemoryEstimate:
        """The calibrated prediction by component; what calibration adds or removes is
        booked under runtime, the one component no formula pins down."""
        est = self.physics(c)
        est.known_oom, est.calibrated = self.known_oom(c), bool(self._points)
        est.components["runtime"] += int(self.predict_total(c)) - est.total_bytes
        return est

    def predict_total(self, c: TrialConfig) -> float:
        """The calibrated peak alone. (Uncalibrated, it equals the physics.)"""
        b = c.per_device_train_batch_size
        points = self._points.get(c.family(), {})
        per_sample = self._per_sample(c)
        if len(points) >= 2:
            slope, intercept = _line(points)
            return intercept + max(slope, 0.5 * per_sample) * b
        if len(points) == 1:
            (b1, m1), = points.items()
            return m1 + per_sample * (b - b1)
        offset = self._neighbour_offset(c.family())
        offset = max(offset, self._oom_resid.get(c.family(), offset))
        return self._regressed(c) + offset

    def known_oom(self, c: TrialConfig) -> bool:
        oom_at = self._oom_at.get(c.family())
        return oom_at is not None and c.per_device_train_batch_size >= oom_at

    def extrapolated_bytes(self, c: TrialConfig) -> float:
        """How much of the prediction is not pinned by a measurement: the activations
        between `c` and its family's nearest measured batch, or everything when the family
        has none. Headroom for error scales with it."""
        points = self._points.get(c.family())
        if not points:
            return self.predict_total(c)
        b = c.per_device_train_batch_size
        nearest = min(points, key=lambda p: abs(p - b))
        return abs(b - nearest) * self._per_sample(c)

    def _slack_factor(self) -> float:
        return FRAGMENTATION if self.device.is_cuda else CPU_OVERHEAD_FACTOR

    def features(self, c: TrialConfig) -> np.ndarray:
        """The physics' terms, each with its share of allocator slack, in FEATURES order:
        the COMPONENTS sum to the physics' total; the DEVIATIONS repeat a per-sample term
        where a knob changes which formula produced it. Memoised: a strategy predicts every
        candidate after every trial."""
        cached = self._cache.get(c)
        if cached is None:
            comps = self.physics(c).components
            slack = 1 + self._slack_factor()
            terms = {k: comps[k] * slack for k in COMPONENTS}
            terms["runtime"] = CUDA_RUNTIME_BYTES if self.device.is_cuda else CPU_RUNTIME_BYTES
            wide = _compute_bytes(c.precision) == 4
            terms["activations|checkpointing"] = terms["activations"] * c.gradient_checkpointing
            terms["activations|4-byte"] = terms["activations"] * wide
            terms["logits|4-byte"] = terms["logits"] * wide
            cached = self._cache[c] = np.array([terms[k] for k in FEATURES], float)
        return cached

    def _regressed(self, c: TrialConfig) -> float:
        return float(self._theta @ self.features(c))

    def _per_sample(self, c: TrialConfig) -> float:
        """Calibrated bytes per sample of the micro-batch (activations and logits)."""
        f = self.features(c)
        return float(self._theta[PER_SAMPLE] @ f[PER_SAMPLE]) / c.per_device_train_batch_size

    def _neighbour_offset(self, fam: tuple) -> float:
        """What the regression misses for an unmeasured family, as the sum of what each of
        its knob values missed in the measured families (ridge-regularised additive effects
        of precision, optimizer, checkpointing and ZeRO stage with offload); a value never
        measured contributes nothing."""
        cached = self._offsets.get(fam)
        if cached is not None:
            return cached
        if not self._family_resid:
            return 0.0
        if self._effects is None:
            self._effects = _additive_effects(self._family_resid)
        intercept, effects = self._effects
        value = intercept + sum(effects.get(level, 0.0) for level in _levels(fam))
        self._offsets[fam] = value
        return value

    def observe(self, c: TrialConfig, measured_bytes: int | None) -> None:
        """A trial that ran: its measured peak (device, per rank) refines the model."""
        if not measured_bytes:
            return
        self._points.setdefault(c.family(), {})[c.per_device_train_batch_size] = measured_bytes
        self._refit()

    def observe_oom(self, c: TrialConfig, limit_bytes: int) -> None:
        """A trial that ran out of memory: larger batches of its family will too, and if the
        family has no measurement, its offset is at least what reaches the limit."""
        fam, b = c.family(), c.per_device_train_batch_size
        self._oom_at[fam] = min(b, self._oom_at.get(fam, b))
        if fam not in self._points:
            floor = limit_bytes - self._regressed(c)
            self._oom_resid[fam] = max(floor, self._oom_resid.get(fam, floor))

    def _refit(self) -> None:
        # 1) A scale per physics term, from every measured trial (Bayesian ridge).
        measured = [(TrialConfig(b, 1, *fam), m) for fam, points in self._points.items()
                    for b, m in points.items()]
        X = np.array([self.features(c) for c, _ in measured])
        y = np.array([m for _, m in measured], float)
        self._theta = _fit_term_scales(X, y)
        # 2) What the scaled terms still miss, per measured family.
        self._family_resid, self._offsets, self._effects = {}, {}, None
        for fam, points in self._points.items():
            self._family_resid[fam] = statistics.median(
                m - self._regressed(TrialConfig(b, 1, *fam)) for b, m in points.items())


def _fit_term_scales(X: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Posterior mode of the term scales, given peaks measured to about MEASUREMENT_NOISE
    and the prior PRIOR_MEAN +- PRIOR_SD."""
    w = 1.0 / (MEASUREMENT_NOISE * y) ** 2
    prior = np.diag(1.0 / PRIOR_SD**2)
    theta = np.linalg.solve(X.T @ (X * w[:, None]) + prior, X.T @ (y * w) + prior @ PRIOR_MEAN)
    scales = slice(0, len(COMPONENTS))  # a term's scale stays positive; deviations may not
    theta[scales] = np.maximum(theta[scales], 0.05)
    return theta


def _levels(fam: tuple) -> list[tuple]:
    precision, optim, ckpt, zero, offload = fam
    return [("precision", precision), ("optim", optim), ("ckpt", ckpt),
            ("zero", (zero, offload))]


# Shrinkage of the knob effects, in units of one family's residual: a value seen once keeps
# 80% of its effect. The term scales already explain the bulk, so what is left is measured
# to within its noise; 0.25 was chosen on the recorded CPU and H100 trials and the landscapes
# (1.0, the earlier value, lost 0.3-0.8 points of landscape classification, and 0.8 of CPU error).
RIDGE = 0.25


def _additive_effects(residuals: dict[tuple, float]) -> tuple[float, dict]:
    """Intercept plus per-knob-value effects fitted to per-family residuals (ridge)."""
    fams = list(residuals)
    levels = sorted({lv for f in fams for lv in _levels(f)}, key=repr)
    index = {lv: i + 1 for i, lv in enumerate(levels)}
    X = np.zeros((len(fams), len(levels) + 1))
    X[:, 0] = 1.0
    for r, f in enumerate(fams):
        for lv in _levels(f):
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


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim")


def _first(cfg: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = getattr(cfg, k, None)
        if v is not None:
            return v
    return None


def count_parameters(hf_config: Any, task: str = "causal-lm") -> tuple[int, str]:
    """Parameters of the model the config describes, built on the meta device (no weights
    allocated, so a 70B model counts in seconds), and the attention implementation
    transformers resolves for it."""
    import torch
    import transformers

    from autotune.model_builder import AUTO_CLASSES

    auto = getattr(transformers, AUTO_CLASSES[task])
    with torch.device("meta"):
        model = auto.from_config(hf_config)
    n = sum(p.numel() for p in model.parameters())
    attn = getattr(model.config, "_attn_implementation", None) or "eager"
    return n, str(attn)


def _shape(cfg: Any, num_parameters: int, seq_len: int, task: str, name: str,
           attn_implementation: str) -> ModelShape:
    return ModelShape(
        num_parameters=int(num_parameters),
        num_layers=int(_first(cfg, _LAYER_KEYS) or 1),
        hidden_size=int(_first(cfg, _HIDDEN_KEYS) or 1),
        num_attention_heads=int(_first(cfg, _HEAD_KEYS) or 1),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
        seq_len=int(seq_len), causal_lm=task == "causal-lm", task=task,
        intermediate_size=_first(cfg, _FFN_KEYS), name=name,
        attn_implementation=attn_implementation)


def shape_from_model(model: Any, seq_len: int, task: str = "causal-lm") -> ModelShape | None:
    """The shape of a built model (a factory's, whose config the spec does not give), so a
    search can predict memory from its first trial on."""
    cfg = getattr(model, "config", None)
    if cfg is None or _first(cfg, _LAYER_KEYS) is None or _first(cfg, _HIDDEN_KEYS) is None:
        return None
    return _shape(cfg, sum(p.numel() for p in model.parameters()), seq_len, task,
                  str(getattr(cfg, "model_type", "model")),
                  str(getattr(cfg, "_attn_implementation", None) or "auto"))


def shape_from_hf_config(hf_config: Any, seq_len: int, task: str = "causal-lm",
                         attn_implementation: str | None = None) -> ModelShape:
    if attn_implementation:
        hf_config._attn_implementation = attn_implementation
    n_params, resolved = count_parameters(hf_config, task)
    name = str(getattr(hf_config, "name_or_path", "") or hf_config.model_type)
    return _shape(hf_config, n_params, seq_len, task, name, attn_implementation or resolved)


def leave_one_out_errors(shape: ModelShape, device: DeviceSpec, world_size: int,
                         measured: list[tuple[TrialConfig, int]]) -> list[float]:
    """Relative error of the calibrated prediction for each measured config, calibrated on
    all the others: how well measurements of some configs predict an unmeasured one."""
    errors = []
    for i, (config, actual) in enumerate(measured):
        model = MemoryModel(shape, device, world_size)
        for j, (other, bytes_) in enumerate(measured):
            if j != i:
                model.observe(other, bytes_)
        errors.append(abs(model.predict_total(config) - actual) / actual)
    return errors
