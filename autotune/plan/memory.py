"""Peak memory per rank from physics, before anything runs.

The components follow the seeds' anatomy of training memory: weights, gradients,
optimizer states, activations (Korthikanti et al. per-layer figures), LM logits, and
what the runtime itself holds beyond the allocator (CUDA context, kernel images, NCCL's
communicator; cuBLAS's workspaces are allocator blocks, in the replay). ZeRO divides the model
states over the data-parallel world; offload moves them to host memory. Measured trials
refine these figures in calibration.py.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from autotune import knobs
from autotune.config import TrialConfig
from autotune.optimizers import optimizer
from autotune.plan import zero_replay
from autotune.plan.allocator import (
    REPLAYED,
    CachingAllocator,
    TrialReplay,
    blas_workspaces,
)
from autotune.plan.gc_pause import collector_paused
from autotune.plan.shape import ModelShape
from autotune.plan.step_trace import trace_step
from autotune.plan.trace import ActivationTrace, chunked_head_bytes, trace_activations

if TYPE_CHECKING:
    from autotune.device import DeviceSpec

log = logging.getLogger(__name__)

MiB = 1024**2
GiB = 1024**3

# What a GPU trial's process holds beyond the allocator's reserved bytes (NVML's figure
# less torch's): 1322 MiB in both trials without a process group on an H100 (CUDA 13.0,
# torch 2.11; benchmarks/memory_accuracy_h100_proof.txt), where seed 003 put the CUDA
# context at ~0.5-1 GiB. Another CUDA or driver differs (lazy module loading above all);
# calibration scales it with the rest of the runtime.
CUDA_RUNTIME_BYTES = 1322 * MiB
# A rank's NCCL communicator, outside the allocator: the 16 DeepSpeed trials on that H100
# held 390-392 MiB more there at one rank (484 MiB for NCCL 2.28 in NVIDIA/nccl PR 2366), more
# with peers (544-688 MB per rank for 2-4 A100s, NVIDIA/nccl issue 964). DeepSpeed makes
# one even at one rank.
NCCL_COMM_BYTES = 390 * MiB


def gpu_runtime_bytes(c: TrialConfig, world_size: int) -> int:
    """What a GPU trial's process holds outside the caching allocator: the CUDA context
    and workspaces, and NCCL's communicator where the trial has a process group (DeepSpeed
    at any world size, FSDP, or several ranks). The trial caps its allocator at its
    budget less this."""
    distributed = c.zero_stage > 0 or c.fsdp != "none" or world_size > 1
    return CUDA_RUNTIME_BYTES + (NCCL_COMM_BYTES if distributed else 0)


CPU_RUNTIME_BYTES = 64 * MiB  # allocator slack of a CPU trial beyond its tensors
# torch.compile's partitioner saves for the backward fewer tensors than eager autograd
# (pointwise chains fused, cheap ones recomputed): 0.62-0.66 of a GPT-2 body's saved
# bytes, 0.78 of a Llama body's, measured on CPU (Inductor's partitioner is the GPU's;
# benchmarks/compile_activations.txt, 2026-11-26, torch 2.13).
COMPILED_ACTIVATIONS = 0.7
# The caching allocator rounds and fragments: the reserved peak runs a few percent over
# the tensors live at the peak.
FRAGMENTATION = 0.05
# A CPU trial holds glibc's mmap threshold (trials/host_malloc.py), so its RSS is its
# tensors and the heap's small blocks. Fitted on the 40 GPT-2 trials of
# benchmarks/memory_accuracy.txt and the 1 GiB long-context bisection
# (benchmarks/longest_bisection_cpu.txt), 2026-11-29: 5% (uncalibrated median error 7.1%,
# worst longest length 5.7%); 0 gave 6.7% and 7.9%, 10% 10.7% and 10.0%. Before the
# threshold was held, RSS ran 1.2-2.6x the tensors (malloc's high-water mark) and this
# was 0.95.
CPU_OVERHEAD_FACTOR = 0.05
# Where a transformers config keeps its attention probabilities' dropout (GPT-2's,
# Llama's and BART's, BERT's).
ATTENTION_DROPOUT_KEYS = ("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob")
# An MLP activation's saved tensors, in its input's size, where transformers writes it in
# unfused torch ops (GELU's and SiLU's own kernels save their input alone, as Korthikanti
# counts): counted with saved_tensors_hooks, transformers 5.24. The config's key for it.
ACTIVATION_SAVES = {"gelu_new": 4, "gelu_fast": 7, "quick_gelu": 3}
ACTIVATION_KEYS = ("activation_function", "hidden_act", "hidden_activation")
COMPONENTS = ("weights", "quantized", "gradients", "optimizer", "activations", "logits",
              "generation", "runtime")
# TRL's chunked LM head (DPO's log-probs) projects at most this many tokens by this many
# vocabulary entries at a time (trl.kernels.chunked_logprob's TOKEN_CHUNK_SIZE and
# trl.trainer.utils' _CHUNKED_LOGPROB_CHUNK_SIZE, TRL 1.16).
TRL_TOKEN_TILE = 4096
TRL_VOCAB_TILE = 32768
PAGE = 4096  # a host page: what one written element makes resident of an untouched block
# A quantized base's bytes per quantized weight: NF4 packs two in a byte, with an 8-bit
# absmax per block of 64 and, double-quantized, an fp32 constant per 256 blocks (QLoRA's
# 0.127 bits); LLM.int8 one byte and an fp32 scale per output row (counted as nothing).
QUANTIZED_BYTES = {"nf4": 0.5 + 1 / 64 + 4 / (64 * 256), "int8": 1.0}
# Liger's fused cross-entropy compiled by torch.compile on CUDA no longer holds a chunk of
# the logits: per sample, this many times the eager loss's three fp32 copies. One
# measurement (benchmarks/qlora_compile_memory.py, H100, 2026-11-27): a Llama-3-8B-wide
# QLoRA step, 4 layers, seq 4096, batch 1, peaked at 34.3 GiB compiled with Liger, 13.1
# GiB compiled without it (5.9 GiB of it the logits' copies) and 7.7 GiB with Liger alone.
LIGER_COMPILED_LOGITS = (5.87 + (34.28 - 13.09)) / 5.87
# Per-sample terms a knob switches to another formula: calibration may let each stray
# from the shared scale where measurements say so. "activations|attention" is the s^2
# attention term (scores, softmax, dropout) where the physics assumed fused kernels that
# do not keep it: a model whose attention turns out eager (a config that does not say so)
# shows it in its measurements and OOMs, and calibration then prices it everywhere.
# "states|replicated" is the other accounting of ZeRO in circulation (the seeds': fp32 and
# 16-bit weights and fp32 gradients replicated, only states partitioned) less DeepSpeed's
# estimator's (its reduction buffers aside): a system that holds more than DeepSpeed's
# estimate shows it, and calibration moves toward it.
DEVIATIONS = ("activations|checkpointing", "activations|4-byte", "logits|4-byte",
              "activations|attention", "states|replicated", "activations|compile",
              "logits|liger", "logits|liger compiled")
FEATURES = COMPONENTS + DEVIATIONS
# Replayed (allocated, reserved) peaks by model and what the replay depends on, for the
# process: a few bytes each, and one search or benchmark meets a few hundred at most.
_REPLAYS: dict[tuple, tuple[float, float] | None] = {}
# The shared beginnings of plain Trainer replays (`TrialReplay`: a few MB each), by model,
# micro-batch and what else but the optimizer the replay depends on; the most recent few.
_TRIALS: OrderedDict[tuple, TrialReplay] = OrderedDict()
_TRIALS_KEPT = 16


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


def _replay_mode(c: TrialConfig) -> str:
    """How a plain Trainer trial computes, as the step trace takes it."""
    return "fp32" if _compute_bytes(c.precision) == 4 else "autocast16"


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
        self._shape_key: tuple | None = None
        # False: the formulas alone, no trace and no allocator replay (a bisection over
        # lengths anchors them to the traced model at one length: plan/longest.py).
        self.traced = True

    def _model_states(self, c: TrialConfig, *, least: bool = False
                      ) -> tuple[dict[str, float], float]:
        """(device bytes by component, host bytes) of weights, gradients and optimizer;
        `least`: without the 16-bit weight copies autocast keeps (which need the trace)."""
        p, n = float(self.shape.num_parameters), max(1, self.world_size)
        # Only trainable parameters (all, or LoRA's adapters) have gradients and states.
        t = float(self.shape.trainable_parameters or p)
        if c.optim == "adafactor":
            state = _adafactor_state_bytes(self.shape) * t / p
        else:
            opt = optimizer(c.optim)
            e = float(self.shape.embedding_parameters or 0) if self.shape.lora is None else 0.0
            state = opt.state_bytes * (t - e) + sum(opt.states_of(0, True)) * e
        if c.fsdp != "none":
            return self._fsdp_states(c, p, t, n, state)
        quantized = self.quantized_bytes(c)
        if quantized:  # the base's linear weights live in `quantized`, not in weights
            p -= float(self.shape.quantizable_parameters or 0)
        if c.zero_stage == 0:
            # Trainer's own AMP (the seeds' anatomy): fp32 weights, and under mixed
            # precision the 16-bit copies autocast keeps of them (or what the trace saw
            # the step hold once, those copies among it; a quantized base dequantizes its
            # own); fp32 gradients, and over several ranks DDP's buckets beside them.
            mixed = c.precision in ("fp16", "bf16")
            traced = None if quantized or least else self.trace(c)
            extra = traced.fixed if traced else (2 * p if mixed and not least else 0)
            grads = 4 * t + self.ddp_bucket_bytes(c)
            return {"weights": 4 * p + extra, "quantized": quantized, "gradients": grads,
                    "optimizer": state}, 0.0
        states, host = self._deepspeed_states(c, p, n, state, t)
        states["gradients"] += self.zero_bucket_bytes(c)
        return states | {"quantized": quantized}, host

    def quantized_bytes(self, c: TrialConfig) -> float:
        """A quantized base (QLoRA): the packed weights with their quantization constants,
        and the one weight a layer dequantizes to the compute dtype at a time."""
        per = QUANTIZED_BYTES.get(c.quantization)
        if per is None or not self.shape.quantizable_parameters:
            return 0.0
        return (per * self.shape.quantizable_parameters
                + _compute_bytes(c.precision) * float(self.shape.largest_linear or 0))

    def ddp_bucket_bytes(self, c: TrialConfig) -> float:
        """DDP's all-reduce buckets, one more copy of the gradients over several ranks
        without ZeRO or FSDP: accelerate wraps Trainer's model with
        `gradient_as_bucket_view=False`, so the gradients are copied in and out of
        buckets that DDP allocates when it wraps the model."""
        if self.world_size <= 1 or c.zero_stage or c.fsdp != "none":
            return 0.0
        return 4.0 * float(self.shape.trainable_parameters or self.shape.num_parameters)

    def _fsdp_states(self, c: TrialConfig, p: float, t: float, n: int,
                     state: float) -> tuple[dict[str, float], float]:
        """As FSDP holds them under Trainer (autocast, no FSDP mixed-precision policy):
        fp32 flat parameters, sharded under full_shard and whole under shard_grad_op;
        gradients and optimizer states sharded under both; one wrapped unit (a transformer
        block, or the embedding) gathered whole at a time, with its 16-bit autocast copy
        under mixed precision. Offload keeps parameters, gradients and states on the
        host."""
        mixed = c.precision in ("fp16", "bf16")
        full = c.fsdp.startswith("full_shard")
        weights = 4 * p / (n if full else 1)
        grads, optim = 4 * t / n, state / n
        host = 0.0
        if c.fsdp.endswith("+offload"):
            host, weights, grads, optim = weights + grads + optim, 0.0, 0.0, 0.0
        if full:
            weights += (4 + (2 if mixed else 0)) * self.largest_layer_params()
        elif mixed:
            weights += 2 * p  # autocast's 16-bit copies of the whole replicated model
        return {"weights": weights, "quantized": 0.0, "gradients": grads,
                "optimizer": optim}, host

    def _deepspeed_states(self, c: TrialConfig, p: float, n: int, state: float,
                          t: float | None = None) -> tuple[dict[str, float], float]:
        """As DeepSpeed holds them (its estimate_zero2/3_model_states_mem_needs): under
        mixed precision, 16-bit weights on every rank (divided at stage 3), and divided
        over the ranks 16-bit and fp32 gradients and the optimizer partition, which keeps
        the fp32 master weights beside the states (2 + 18/N bytes per parameter with
        Adam); in fp32, 4-byte weights, gradients and states. Stage 3 gathers the largest
        layer whole (4 bytes per parameter), and keeps no 16-bit gradient copy (2 + 16/N
        for its whole share). Optimizer offload moves the gradient and the
        optimizer partitions to the host, parameter offload the weights too."""
        mixed = c.precision in ("fp16", "bf16")
        t = p if t is None else t  # trainable: LoRA's adapters, or every parameter
        weights = (2 if mixed else 4) * p
        # Stages 1-2 keep a 16-bit gradient partition beside the fp32 one; stage 3
        # reduce-scatters straight into the fp32 partition.
        grads = (2 + 4 if mixed and c.zero_stage < 3 else 4) * t / n
        optim = ((4 if mixed else 0) * t + state) / n
        if c.zero_stage >= 3:
            weights /= n
        host = 0.0
        if c.offload in ("optimizer", "optimizer+param"):
            host += grads + optim
            grads = optim = 0.0
        if c.offload == "optimizer+param":
            host += weights
            weights = 0.0
        if c.zero_stage >= 3:
            weights += 4 * self.largest_layer_params()
        return {"weights": weights, "gradients": grads, "optimizer": optim}, host

    def replicated_difference(self, c: TrialConfig) -> float:
        """Device bytes of the seeds' ZeRO accounting less DeepSpeed's (0 without ZeRO)."""
        if c.zero_stage == 0:
            return 0.0
        p, n = float(self.shape.num_parameters), max(1, self.world_size)
        seeds = self._seeds_zero_states(c, p, n)
        ds, _ = self._deepspeed_states(c, p, n, 0.0)
        return seeds - sum(ds.values())

    def _seeds_zero_states(self, c: TrialConfig, p: float, n: int) -> float:
        """The seeds' accounting under ZeRO, optimizer states aside: fp32 weights with the
        16-bit copies and fp32 gradients, divided at stages 3 and 2, moved off the device
        by offload; stage 3 gathers two layers."""
        mixed = c.precision in ("fp16", "bf16")
        weights = (4 * p + (2 * p if mixed else 0)) / (n if c.zero_stage >= 3 else 1)
        grads = 4 * p / (n if c.zero_stage >= 2 else 1)
        if c.offload != "none":
            grads = 0.0
        if c.offload == "optimizer+param":
            weights = 0.0
        if c.zero_stage >= 3:
            h, f = self.shape.hidden_size, self.shape.ffn_size
            weights += 2 * (4 * h * h + 2 * h * f) * _compute_bytes(c.precision)
        return weights + grads

    def largest_layer_params(self) -> float:
        """The largest single module's parameters (what ZeRO-3 gathers whole): the
        embedding or LM head, or the widest projection of a layer."""
        h = self.shape.hidden_size
        return float(max(self.shape.vocab_size * h, h * self.shape.ffn_size))

    def trace(self, c: TrialConfig) -> ActivationTrace | None:
        """The model's own activations, traced for this config's compute mode, attention
        and checkpointing (plan/trace.py); None where the model's config is not known
        or its code cannot be traced (the formulas then stand alone). Only for a GPU: a
        CPU trial's peak is RSS, which grew 1.1-3.1x its traced tensor bytes over the 40
        recorded CPU trials when malloc's high-water set it, so tensor bytes predicted it
        no better than the formula. (With the mmap threshold held, trials/host_malloc.py,
        a CPU trace might now; not tried.)"""
        args = self.trace_args(c)
        return None if args is None else trace_activations(*args)

    def trace_args(self, c: TrialConfig) -> tuple | None:
        """`trace_activations`' arguments for `c`, or None where nothing is traced for it
        (`trace`): configs sharing them share the trace (`trace.prefetch` makes several at
        once)."""
        if (self.shape.hf_config is None or not self.device.is_cuda or self.beyond_device(c)
                or not self.shape.trained_by.traced or not self.traced):
            return None
        mode = ("fp32" if _compute_bytes(c.precision) == 4
                else "native16" if c.zero_stage > 0 else "autocast16")
        return (self.shape.hf_config, self.shape.kind.name, self.shape.seq_len,
                mode, c.gradient_checkpointing, self.attention_kernel(c), self.device.is_cuda,
                self.shape.lora, self.shape.target_len, self.shape.preference_pairs)

    def activation_bytes_per_sample(self, c: TrialConfig) -> float:
        """Traced where the model is known: the step's peak per sample less the logits
        term (booked apart). Otherwise Korthikanti et al.: s*h*(34 + 5*a*s/h) bytes per
        layer in 16-bit (`_layer_bytes`: a gated MLP's and an unfused activation's more);
        the a*s^2 term (attention scores, softmax, dropout mask) only where the scores are
        kept (`materialises_attention`)."""
        traced = self.trace(c)
        if traced is not None:
            return (max(0.0, traced.per_sample - self._logits_formula()) * self._compiled(c)
                    * self._untraced(c) / self.sequence_split(c))
        return self._formula_activations(c) * self._compiled(c) / self.sequence_split(c)

    def _untraced(self, c: TrialConfig) -> float:
        """What the levers the trace does not apply (the tiled MLP, the checkpointing
        variant) keep of its activations: the formula's ratio with and without them."""
        plain = {k: knobs.knob(k).baseline for k in ("tiled_mlp", "checkpointing_variant")
                 if getattr(c, k) != knobs.knob(k).baseline}
        if not plain:
            return 1.0
        without = self._formula_activations(c.family.replace(**plain).config(
            c.per_device_train_batch_size, c.samples_per_rank))
        return self._formula_activations(c) / without if without else 1.0

    @staticmethod
    def sequence_split(c: TrialConfig) -> int:
        """The ranks a sample's sequence is split over: each holds 1/k of its tokens'
        activations and logits (Ulysses' attention holds all tokens for 1/k of the heads,
        the same share), while ZeRO shards the model states over all ranks."""
        return c.sequence_parallel * c.context_parallel

    @staticmethod
    def _compiled(c: TrialConfig) -> float:
        """What torch.compile keeps of the eager step's activations (COMPILED_ACTIVATIONS;
        the trace follows eager autograd, and calibration fits the rest)."""
        return COMPILED_ACTIVATIONS if c.torch_compile else 1.0

    def _stacks(self) -> list[tuple[int, int, int]]:
        """(layers, tokens, tokens attended across) of each stack a sample runs through:
        the layers at seq_len; an encoder-decoder's encoder at seq_len and its decoder at
        target_len, attending the source too (cross-attention); under DPO each pair's
        two rows (chosen and rejected), each at seq_len; under GRPO a prompt and its
        completion (train_len)."""
        shape = self.shape
        if shape.decoder_layers:
            return [(shape.num_layers, shape.seq_len, 0),
                    (shape.decoder_layers, shape.target_len, shape.seq_len)]
        rows = 2 if shape.preference_pairs else 1
        return [(shape.num_layers, shape.train_len, 0)] * rows

    def _formula_activations(self, c: TrialConfig) -> float:
        """Korthikanti's per-layer bytes over the sample's stacks, and an image model's
        input: the fp32 pixels its patch embedding keeps (and their 16-bit copy under
        autocast)."""
        h, cb = self.shape.hidden_size, _compute_bytes(c.precision)
        linear = 0.0
        for layers, s, source in self._stacks():
            per_layer = self._layer_bytes(c, s, source)
            if c.gradient_checkpointing:
                # Layer inputs kept for every checkpointed layer, plus one layer
                # recomputed in full; `every-2` checkpoints every other layer (the rest keep
                # theirs), `selective` (TRL's) also keeps each attention's output.
                variant = c.checkpointing_variant
                kept = layers // 2 if variant == "every-2" else layers
                inputs = 2 if variant == "selective" else 1
                linear += kept * inputs * s * h * cb + (layers - kept + 1) * per_layer
            else:
                linear += layers * per_layer
        pixels = self.shape.pixels * (4 + (2 if cb == 2 else 0))
        return linear + pixels + (self.attention_bytes_per_sample(c)
                                  if self.materialises_attention(c) else 0.0)

    def _layer_bytes(self, c: TrialConfig, s: int, source: int) -> float:
        """One layer's saved bytes a sample at `s` tokens (Korthikanti's, without the s^2
        term): attention 11 s h, norms 4, the MLP 19 of which 16 scale with ffn; a gated
        MLP (SwiGLU) keeps its input and four ffn-wide tensors (the gate's and the up
        projection's outputs, the activation's, their product) and no dropout mask; a
        decoder layer's cross-attention its norm, query, output projection and dropout on
        its own tokens (11 s h, as self-attention's), keys and values of the source
        (4 source h)."""
        h, ffn = self.shape.hidden_size, self.shape.ffn_size
        mlp_part = (2 + 8 * ffn / h) if self.shape.gated_mlp else 19 + 16 * (ffn / (4 * h) - 1)
        mlp_part += 2 * (self.activation_saves() - 1) * ffn / h  # an unfused activation's
        # DeepSpeed's TiledMLP keeps only the MLP's input (2 s h) and recomputes the rest
        # shard by shard in the backward (about h tokens a shard: negligible at length).
        mlp = 15 + (2 if c.tiled_mlp else mlp_part)
        cross = 11 * s * h + 4 * source * h if source else 0
        return (s * h * mlp + cross) * _compute_bytes(c.precision) / 2

    def recomputed_bytes_per_sample(self, c: TrialConfig) -> float:
        """Under checkpointing, the one layer recomputed in full in the backward, a
        sample's share of a rank (the largest stack's layer): it lives after the loss's
        backward has freed the logits' gradients, never beside them (`physics`). Measured
        on a CPU only (the long-context bisection's checkpointed family peaked 11-14% under
        the sum, benchmarks/longest_bisection_cpu.txt); on a GPU the trace knows when each
        tensor lives where it runs, and where it cannot the sum stands (0 here), the side
        that does not OOM."""
        if not c.gradient_checkpointing or self.device.is_cuda:
            return 0.0
        layer = max(self._layer_bytes(c, s, source) for _, s, source in self._stacks())
        if self.materialises_attention(c):  # its scores, recomputed with it
            layer += self.attention_bytes_per_sample(c)
        return layer * self._compiled(c) / self.sequence_split(c)

    def attention_bytes_per_sample(self, c: TrialConfig) -> float:
        """The s^2 attention term alone: 5*a*s^2 bytes per layer in 16-bit (Korthikanti),
        in every layer, or in the one recomputed layer under checkpointing; a decoder's
        cross-attention 5*a*s*source more."""
        a, out = self.shape.num_attention_heads, 0.0
        for layers, s, source in self._stacks():
            kept = 1 if c.gradient_checkpointing else layers
            out += kept * 5 * a * s * (s + source) * _compute_bytes(c.precision) / 2
        return out

    def logits_bytes_per_sample(self, c: TrialConfig) -> float:
        """LM heads, at the peak (the loss's backward): the fp32 log-softmax the loss
        saved, the gradient flowing into it and the one it produces, all fp32, whatever
        the compute precision. (Trainer drops the model's output, and with it the logits,
        before the backward; the forward's logits, upcast and log-softmax sum to no more.)
        Classification heads are negligible."""
        if c.tiled_loss:
            return 0.0  # a shard at a time, whatever the batch: `logits_fixed_bytes`
        if self._liger_compiled(c):
            return LIGER_COMPILED_LOGITS * self._logits_formula() / self.sequence_split(c)
        if c.use_liger_kernel:
            # Liger's fused linear cross-entropy holds a chunk of the logits sized to about
            # the tokens' hidden states (its chunk_size), and the input's gradient, which
            # it computes in the forward; 4 bytes each where the input is fp32.
            return self.shape.seq_len * self.shape.hidden_size * (4 + 4) if (
                self.shape.has_lm_logits) else 0.0
        return self._logits_formula() / self.sequence_split(c)

    def _liger_compiled(self, c: TrialConfig) -> bool:
        return bool(c.use_liger_kernel and c.torch_compile and self.device.is_cuda)

    def logits_fixed_bytes(self, c: TrialConfig) -> float:
        """Liger computes the LM head's gradient in the forward, in the weight's dtype
        (fp32 under Trainer's AMP), and holds it until the backward hands it to the
        parameter: one more head-sized gradient at the peak, whatever the batch. Not for
        a frozen head (under LoRA): Liger makes no gradient for a weight that needs none
        (liger-kernel 0.8.5; the H100's 8B QLoRA trials peaked 2-8 GiB under the
        prediction that counted it, 2026-11-27)."""
        if c.tiled_loss and self.shape.has_lm_logits:
            return self.tiled_logits_bytes(c)
        if not (c.use_liger_kernel and self.shape.has_lm_logits) or self.shape.lora:
            return 0.0
        return 4.0 * self.shape.vocab_size * self.shape.hidden_size

    def tiled_logits_bytes(self, c: TrialConfig) -> float:
        """DeepSpeed's TiledFusedLogitsLoss: one shard's fp32 logits at a time (their
        three copies, as the whole's: `_logits_formula`), shards of at most
        trials/long_context.py's LOGITS_SHARD_BYTES and at least two per micro-batch,
        and the fp32 gradient of the hidden states it computes in its forward."""
        from autotune.trials.long_context import LOGITS_SHARD_BYTES

        logits = self._tiled_tokens(c) * self.shape.vocab_size * 4
        shard = min(logits / 2, LOGITS_SHARD_BYTES)
        return 3 * shard + self._tiled_hidden_bytes(c)

    def _tiled_tokens(self, c: TrialConfig) -> float:
        return (c.per_device_train_batch_size * (self.shape.target_len or self.shape.seq_len)
                / self.sequence_split(c))

    def _tiled_hidden_bytes(self, c: TrialConfig) -> float:
        return self._tiled_tokens(c) * self.shape.hidden_size * 4

    def chunked_head(self) -> bool:
        """TRL's chunked LM head computes the log-probs (DPO's rows, GRPO's completions):
        the logits are never whole."""
        return self.shape.preference_pairs or self.shape.generates

    def _logits_formula(self) -> float:
        """Per sample: an encoder-decoder's logits are its targets'; DPO's and GRPO's are
        never whole (TRL's chunked head: `chunked_logits_bytes`)."""
        if not self.shape.has_lm_logits or self.chunked_head():
            return 0.0
        tokens = self.shape.target_len or self.shape.seq_len
        return tokens * self.shape.vocab_size * (4 + 4 + 4)

    def chunked_logits_bytes(self, c: TrialConfig) -> float:
        """DPO's log-probs through TRL's chunked LM head, at its peak (its backward), traced
        apart at the micro-batch's tokens, both rows of every pair (trace.py's
        `chunked_head_bytes`: a tile of at most TRL_TOKEN_TILE tokens by TRL_VOCAB_TILE
        columns in the compute dtype, and on a CPU torch's fp32 copies of it, of which a
        vocabulary under TRL_VOCAB_TILE columns makes only its own pages resident). 0
        under another trainer. GRPO's are its completions' tokens alone (TRL keeps the
        logits of the last max_completion_length positions)."""
        if not self.chunked_head():
            return 0.0
        b = c.per_device_train_batch_size
        tokens = (b * self.shape.generated_len if self.shape.generates
                  else 2 * b * self.shape.seq_len)
        cuda, v = self.device.is_cuda, self.shape.vocab_size
        peak = chunked_head_bytes(tokens, v, self.shape.hidden_size,
                                  _compute_bytes(c.precision) == 2, cuda,
                                  self.shape.lora is None)
        if not cuda and v < TRL_VOCAB_TILE:
            cb = _compute_bytes(c.precision)
            touched = max(v, PAGE // cb)
            peak -= min(tokens, TRL_TOKEN_TILE) * (TRL_VOCAB_TILE - touched) * cb
        return float(peak)

    def mapped_bytes(self, c: TrialConfig) -> float:
        """Of the tensors, what a CPU's allocator maps for itself and unmaps when freed
        (RSS holds exactly them, no heap beside): the chunked head's vocabulary-wide
        temporaries, each far above glibc's mmap threshold. 0 on a GPU."""
        return 0.0 if self.device.is_cuda else self.chunked_logits_bytes(c)

    def reference_bytes(self, c: TrialConfig) -> float:
        """DPO's reference model without LoRA and without precomputed log-probs, or GRPO's
        where its beta > 0 without LoRA: a second
        copy of the weights, fp32 as built (Trainer prepares it for evaluation only),
        16-bit inside a DeepSpeed engine of its own under mixed precision (TRL's
        prepare_deepspeed), partitioned at ZeRO-3. Under LoRA the reference is the base
        with the adapters off; precomputed, the policy before its first step served."""
        kept = (self.shape.reference or (self.shape.preference_pairs
                                         and not c.precompute_ref_log_probs))
        if not kept or self.shape.lora is not None:
            return 0.0
        p, n = float(self.shape.num_parameters), max(1, self.world_size)
        if c.zero_stage == 0 and c.fsdp == "none":
            return 4 * p
        wide = 2 if c.precision in ("fp16", "bf16") and c.zero_stage else 4
        return wide * p / (n if c.zero_stage == 3 or c.fsdp.startswith("full") else 1)

    def attention_kernel(self, c: TrialConfig) -> str:
        """The kernel the trace imitates for `c`: eager where the scores are kept."""
        return "eager" if self.materialises_attention(c) else "sdpa"

    def zero_replayed(self, c: TrialConfig) -> bool:
        """Whether `c`'s peak comes from the ZeRO emulation (plan/zero_replay.py): on a
        GPU, for a model whose config is known, where the emulation applies."""
        return (self.device.is_cuda and self.replayable() and self.traced
                and zero_replay.applies(self.shape, c, self.world_size))

    def replayable(self) -> bool:
        """Whether the allocator replays can follow this model's step: a decoder-only or
        encoder-only model under Trainer (an encoder-decoder's two stacks, an image
        model's input, DPO's two forwards are not replayed; the fragmentation allowance
        stands)."""
        return (self.shape.kind.replayable and not self.shape.preference_pairs
                and not self.shape.generates)

    def zero_bucket_bytes(self, c: TrialConfig) -> float:
        """ZeRO's gradient reduction buffers (`zero_replay.bucket_buffers` of
        `reduce_bucket_size` elements of the model's dtype), allocated whole whatever the
        model's size: ZeRO-3's kept from the start, ZeRO-1/2's made at a backward's first
        gradient, beside nearly all the activations. Booked under gradients: where the
        engine's emulation replays the step its peak sets the total (when each lives
        decides it), elsewhere the formulas count them whole (the README has the H100
        figures of both). On a GPU only: a CPU trial's peak is RSS, and the buffers'
        untouched pages are not resident."""
        if not self.device.is_cuda or c.zero_stage == 0:
            return 0.0
        return (_compute_bytes(c.precision) * zero_replay.DEFAULT_BUCKET
                * zero_replay.bucket_buffers(c.zero_stage))

    def materialises_attention(self, c: TrialConfig | None = None) -> bool:
        """Eager attention keeps the seq x seq scores; SDPA/flash kernels do not, but for
        SDPA with dropout on a CPU (its math path). The config's attention knob decides;
        at "auto" the model's own, and where the shape does not say either, assume flash
        kernels exist from Ampere (8.0) on, and that older GPUs materialise the scores."""
        attn = c.attn_implementation if c is not None else "auto"
        if attn == "auto":
            attn = self.shape.attn_implementation
        if attn == "auto":
            return self.device.is_cuda and (self.device.compute_capability or (0, 0)) < (8, 0)
        if attn == "sdpa" and not self.device.is_cuda and self.attention_dropout() > 0:
            # torch's CPU flash kernel takes no dropout: SDPA falls back to its math path,
            # which keeps the scores, their softmax and the dropout mask (15 MiB saved
            # against 4 without dropout, a 4x4x256x64 fp32 call; torch 2.13).
            return True
        return attn == "eager"

    def activation_saves(self) -> int:
        """The MLP activation's saved tensors in its input's size (1 but for
        ACTIVATION_SAVES')."""
        cfg = self.shape.hf_config or {}
        act = next((cfg[k] for k in ACTIVATION_KEYS if isinstance(cfg.get(k), str)), "")
        return ACTIVATION_SAVES.get(act, 1)

    def attention_dropout(self) -> float:
        """The attention probabilities' dropout the model trains with (0: none, not known,
        or its trainer turns dropout off)."""
        if self.shape.trained_by.disables_dropout:
            return 0.0
        cfg = self.shape.hf_config or {}
        return float(next((cfg[k] for k in ATTENTION_DROPOUT_KEYS if cfg.get(k)), 0.0))

    def generation_bytes(self, c: TrialConfig) -> float:
        """A generating trainer's (GRPO's) generation, beyond what its training step holds
        at its peak (the two do not overlap: the completions are made, then trained on): the
        KV cache of every row of the step's generation batch, which TRL generates at once
        (b x accumulation rows a rank: the whole step), each a prompt and its completion
        long, keys and values of every layer in the compute dtype, and the last position's
        logits of each row in fp32."""
        shape = self.shape
        if not shape.generates:
            return 0.0
        rows = c.per_device_train_batch_size * c.gradient_accumulation_steps
        heads = int((shape.hf_config or {}).get("num_key_value_heads")
                    or shape.num_attention_heads)
        head_dim = shape.hidden_size // max(1, shape.num_attention_heads)
        cache = (2 * shape.num_layers * heads * head_dim * shape.train_len * rows
                 * _compute_bytes(c.precision))
        return cache + 4.0 * rows * shape.vocab_size

    def physics(self, c: TrialConfig) -> MemoryEstimate:
        states, host = self._model_states(c)
        b = c.per_device_train_batch_size
        comps = states | {"activations": b * self.activation_bytes_per_sample(c),
                          "logits": b * self.logits_bytes_per_sample(c)
                          + self.logits_fixed_bytes(c) + self.chunked_logits_bytes(c)}
        # The loss's peak (the logits and their gradients) comes before any layer is
        # recomputed: checkpointing's peak is the larger of the two, not their sum.
        comps["activations"] -= min(b * self.recomputed_bytes_per_sample(c), comps["logits"])
        if c.activation_offloading:
            # TRL's offloading moves what autograd saves to host memory as the forward goes
            # and brings it back layer by layer in the backward: about one layer's stays.
            kept = comps["activations"] / max(1, self.shape.num_layers)
            host += comps["activations"] - kept
            comps["activations"] = kept
        comps["generation"] = max(0.0, self.generation_bytes(c) - comps["activations"]
                                  - comps["logits"])
        comps["weights"] += self.reference_bytes(c)
        tensors = sum(comps.values())
        slack = self._slack_factor(c, tensors)
        if slack < 0:  # the replay's peak is below the components at once: scale them
            comps = {k: v * (1 + slack) for k, v in comps.items()}
            slack = 0.0
        comps["runtime"] = self.runtime_bytes(c) + slack * (tensors - self.mapped_bytes(c))
        return MemoryEstimate({k: int(comps[k]) for k in COMPONENTS}, int(host))

    def runtime_bytes(self, c: TrialConfig) -> float:
        """What a trial's process holds outside its tensors: on a GPU the CUDA context and
        workspaces, and NCCL's communicator where the trial has a process group (DeepSpeed
        at any world size, FSDP, or several ranks)."""
        if not self.device.is_cuda:
            return CPU_RUNTIME_BYTES
        return gpu_runtime_bytes(c, self.world_size)

    def _slack_factor(self, c: TrialConfig, tensors: float) -> float:
        """What the allocator holds beyond the tensors, as a fraction of them: on a GPU
        the replayed reserved peak where the step can be replayed, else FRAGMENTATION;
        on a CPU, the heap's small blocks (its mmap threshold held: trials/host_malloc.py).
        (Negative where the replay's peak, which knows when each tensor lives, is below
        the components' sum, which has them all at once; the components are then scaled
        to it.)"""
        if not self.device.is_cuda:
            return CPU_OVERHEAD_FACTOR
        reserved = None if self.beyond_device(c) else self.reserved_peak(c)
        return FRAGMENTATION if reserved is None or not tensors else reserved / tensors - 1

    def states_bytes(self, c: TrialConfig) -> float:
        """Device bytes of `c`'s weights, gradients and optimizer states, without the 16-bit
        copies only a trace knows of: arithmetic on parameter counts, the least `c` holds."""
        states, _ = self._model_states(c, least=True)
        return float(sum(states.values()))

    def beyond_device(self, c: TrialConfig) -> bool:
        """Whether `c`'s weights, gradients and optimizer states alone exceed the device's
        memory: no activation figure or allocator slack could make it fit, so neither is
        traced nor replayed for it (the formulas stand). A 70B plan's unsharded rows need
        1,000 GiB and more a rank; their traces and replays were half its seconds."""
        if not self.device.is_cuda:
            return False
        return self.states_bytes(c) > self.device.memory_bytes

    def reserved_peak(self, c: TrialConfig) -> float | None:
        """The caching allocator's reserved peak over a trial's steps (plan/allocator.py),
        replayed from the model's traced allocations; None where there is no such trace:
        a CPU, a model without config or one whose code the trace cannot run or repeat,
        LoRA, FSDP, the ZeRO configs its emulation does not cover (their engines allocate
        outside the model's code), Liger's kernels, or Adafactor."""
        replayed = self.replayed_peaks(c)
        return None if replayed is None else replayed[1]

    def replayed_peaks(self, c: TrialConfig) -> tuple[float, float] | None:
        """(allocated, reserved) peak bytes of the allocator replay (`replay_allocator`),
        or None. Memoised on what the replay depends on, so configs differing in other
        knobs share it; a replay that fails leaves the fragmentation allowance, never
        stops a search."""
        depends = self._replay_depends(c)
        if depends is None:
            return None
        key = self._replay_key(depends)
        if key not in _REPLAYS:
            value = None
            try:
                with collector_paused():
                    allocator = self.replay_allocator(c)
                if allocator is not None:
                    value = (float(allocator.peak_allocated), float(allocator.peak_reserved))
            except Exception as exc:  # noqa: BLE001 - a replay bug must not stop a search
                log.warning("allocator replay failed (%s: %s); the fragmentation allowance "
                            "stands for %s", type(exc).__name__, exc, c.label())
            _REPLAYS[key] = value
        return _REPLAYS[key]

    def replay_allocator(self, c: TrialConfig) -> CachingAllocator | None:
        """The caching allocator after `c`'s trial is replayed (plan/allocator.py), or None
        where no replay applies (`_replay_depends`) or the step cannot be traced. A plain
        Trainer step replays the traced micro-batches with the optimizer's states;
        ZeRO's engine (stages 1-2, and 3 without offload) is emulated beside the traced
        native 16-bit step (plan/zero_replay.py; its allocations held to the real engine
        on CPU), with a pool per CUDA stream: DeepSpeed's reduction stream keeps its own.
        One pool for all put ZeRO-2 level with ZeRO-1 on the H100 file, which measured
        1096 MiB apart; the pools per stream put them 1096 MiB apart. Not memoised:
        benchmarks read its segments."""
        if self._replay_depends(c) is None:
            return None
        attention, capability = self.attention_kernel(c), self.device.compute_capability
        if self.zero_replayed(c):
            return zero_replay.trial_replay(self.shape, c, attention, capability)
        trial = self._trial_replay(c, attention)
        if trial is None:
            return None
        opt = optimizer(c.optim)
        return trial.replay(opt.states_of, opt.step_temporary_bytes)

    def _trial_replay(self, c: TrialConfig, attention: str) -> TrialReplay | None:
        """The replay `c` shares with the configs that differ from it only in the optimizer
        (the allocations before the optimizer's states), or None where the step cannot be
        traced. Kept for the most recent few: a space lists its optimizers side by side."""
        ddp = self.ddp_bucket_bytes(c) > 0
        key = self._replay_key((c.per_device_train_batch_size,
                                min(c.gradient_accumulation_steps, REPLAYED), _replay_mode(c),
                                c.gradient_checkpointing, attention, ddp))
        if key in _TRIALS:
            _TRIALS.move_to_end(key)
            return _TRIALS[key]
        step = trace_step(self.shape.hf_config, self.shape.kind.name,
                          self.shape.seq_len, _replay_mode(c), c.gradient_checkpointing,
                          attention, True)
        if step is None:
            return None
        _TRIALS[key] = TrialReplay(step, c.per_device_train_batch_size,
                                   c.gradient_accumulation_steps, ddp=ddp,
                                   workspaces=blas_workspaces(self.device.compute_capability))
        if len(_TRIALS) > _TRIALS_KEPT:
            _TRIALS.popitem(last=False)
        return _TRIALS[key]

    def _replay_depends(self, c: TrialConfig) -> tuple | None:
        """What `c`'s replay depends on, or None where none applies: a CPU, a model without
        config, LoRA, FSDP, the ZeRO configs the emulation does not cover, Liger's
        kernels, Adafactor."""
        if not (self.device.is_cuda and self.shape.hf_config is not None
                and self.replayable() and self.traced):
            return None
        accumulation = min(c.gradient_accumulation_steps, REPLAYED)
        attention = self.attention_kernel(c)
        if self.zero_replayed(c):
            return ("zero", c.per_device_train_batch_size, accumulation, c.zero_stage,
                    c.offload, c.optim, attention, c.precision)
        if not (self.shape.lora is None and c.zero_stage == 0 and c.fsdp == "none"
                and not c.use_liger_kernel and c.optim != "adafactor"):
            return None
        return (c.per_device_train_batch_size, accumulation, _replay_mode(c),
                c.gradient_checkpointing, attention, optimizer(c.optim),
                self.ddp_bucket_bytes(c) > 0)

    def _replay_key(self, key: tuple) -> tuple:
        """`key` with the model's identity and the GPU's (its cuBLAS workspaces): replays
        are shared by every Physics of one process (a leave-one-out or a search's refits
        rebuild the model, not the model's allocations)."""
        if self._shape_key is None:
            self._shape_key = (json.dumps(self.shape.hf_config, sort_keys=True, default=str),
                               self.shape.task, self.shape.seq_len,
                               self.device.compute_capability)
        return (*self._shape_key, *key)

    def features(self, c: TrialConfig) -> np.ndarray:
        """The physics' terms, each with its share of allocator slack, in FEATURES order:
        the COMPONENTS sum to the physics' total; the DEVIATIONS repeat a per-sample term
        where a knob changes which formula produced it. Memoised: a strategy predicts every
        candidate after every trial."""
        cached = self._cache.get(c)
        if cached is None:
            comps = self.physics(c).components
            tensors = sum(comps[k] for k in COMPONENTS if k != "runtime")
            slack = 1 + self._slack_factor(c, tensors)
            terms = {k: comps[k] * slack for k in COMPONENTS}
            terms["logits"] -= (slack - 1) * self.mapped_bytes(c)  # no allocator slack
            terms["runtime"] = self.runtime_bytes(c)
            wide = _compute_bytes(c.precision) == 4
            terms["activations|checkpointing"] = terms["activations"] * c.gradient_checkpointing
            terms["activations|4-byte"] = terms["activations"] * wide
            terms["logits|4-byte"] = terms["logits"] * wide
            # Only where the kernel is the model's unstated own: a config that names its
            # attention kernel leaves the physics nothing to guess.
            terms["activations|attention"] = (c.per_device_train_batch_size * slack
                                               * self.attention_bytes_per_sample(c)
                                               * (c.attn_implementation == "auto"))
            terms["states|replicated"] = slack * self.replicated_difference(c)
            # What compile keeps of the activations, and what Liger keeps of the logits,
            # differ by system (kernels, fusion, chunking): calibration fits each.
            terms["activations|compile"] = terms["activations"] * c.torch_compile
            terms["logits|liger"] = (c.per_device_train_batch_size * slack
                                     * self._logits_formula() * c.use_liger_kernel)
            # Liger compiled: one measurement behind its physics (LIGER_COMPILED_LOGITS),
            # so calibration may take the term away where a system keeps less.
            terms["logits|liger compiled"] = terms["logits"] * self._liger_compiled(c)
            cached = self._cache[c] = np.array([terms[k] for k in FEATURES], float)
        return cached
