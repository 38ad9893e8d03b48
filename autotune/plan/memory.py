"""Peak memory per rank from physics, before anything runs.

The components follow the seeds' anatomy of training memory: weights, gradients,
optimizer states, activations (Korthikanti et al. per-layer figures), LM logits, and
what the runtime itself holds (CUDA context, cuBLAS workspace). ZeRO divides the model
states over the data-parallel world; offload moves them to host memory. Measured trials
refine these figures in calibration.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune.config import TrialConfig
from autotune.optimizers import optimizer
from autotune.plan.shape import ModelShape

if TYPE_CHECKING:
    from autotune.plan.device import DeviceSpec

MiB = 1024**2
GiB = 1024**3

CUDA_RUNTIME_BYTES = 768 * MiB  # CUDA context + cuBLAS/cuDNN workspaces (seed 003: ~0.5-1 GiB)
CPU_RUNTIME_BYTES = 64 * MiB  # allocator slack of a CPU trial beyond its tensors
# The caching allocator rounds and fragments: the reserved peak runs a few percent over
# the tensors live at the peak.
FRAGMENTATION = 0.05
# A CPU trial's peak RSS growth ran 1.2-2.8x (median 1.95x) the bytes of its tensors over
# 40 trials (benchmarks/memory_accuracy.txt): malloc arenas keep freed blocks and CPU
# kernels keep fp32 intermediates. Uncalibrated CPU predictions use the median.
CPU_OVERHEAD_FACTOR = 0.95
COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "runtime")
# Per-sample terms a knob switches to another formula: calibration may let each stray
# from the shared scale where measurements say so.
DEVIATIONS = ("activations|checkpointing", "activations|4-byte", "logits|4-byte")
FEATURES = COMPONENTS + DEVIATIONS


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


class Physics:
    """The uncalibrated prediction for one model on one device and world size."""

    def __init__(self, shape: ModelShape, device: DeviceSpec, world_size: int = 1) -> None:
        self.shape, self.device, self.world_size = shape, device, world_size
        self._cache: dict[TrialConfig, np.ndarray] = {}

    def _model_states(self, c: TrialConfig) -> tuple[dict[str, float], float]:
        """(device bytes by component, host bytes) of weights, gradients and optimizer."""
        p, n = float(self.shape.num_parameters), max(1, self.world_size)
        mixed = c.precision in ("fp16", "bf16")
        if c.optim == "adafactor":
            state = _adafactor_state_bytes(self.shape)
        else:
            state = optimizer(c.optim).state_bytes * p
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
