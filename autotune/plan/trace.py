"""Activation memory counted from the model's own code: one traced forward and backward.

Korthikanti's formula counts Megatron's kernels; an HF model keeps what its own code
keeps (fp32 LayerNorm outputs and softmax under autocast, GELU as several ops, dropout
masks, the loss's fp32 copies of the logits), 1.5-2x the formula on an H100. So the
model is built from its config under FakeTensorMode (no bytes allocated, a 70B model
traces in seconds) and trained one step while a dispatch mode follows every storage
alive; the peak beyond the parameters and gradients is the activation memory.

The target device's rules are imitated where the CPU build cannot run them: CUDA
autocast's op lists (16-bit matmuls with cached weight copies, fp32 norms, softmax and
losses) and its fused attention kernels (flash or memory-efficient: the output and a
log-sum-exp kept, never the scores). On a CPU target the real CPU autocast and kernel
choice run instead. The trace takes one and two layers at two batch sizes, and the peak
is read as bilinear in layers and batch, so its cost does not grow with depth.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from autotune.plan.gc_pause import collector_paused

log = logging.getLogger(__name__)

# How a trial runs its compute: fp32 (fp32, tf32); "autocast16": fp32 parameters under
# autocast (Trainer's AMP, FSDP without a mixed-precision policy); "native16": the model
# cast to 16 bits (DeepSpeed's fp16/bf16 engines).
MODES = ("fp32", "autocast16", "native16")
# CUDA autocast's lists, by the function names a model calls (torch function level, so
# the casts are autograd ops and what the backward keeps is what a GPU run keeps).
LOW_PRECISION = {"linear", "matmul", "__matmul__", "mm", "bmm", "addmm", "baddbmm",
                 "addbmm", "conv1d", "conv2d", "einsum", "scaled_dot_product_attention"}
FULL_PRECISION = {"layer_norm", "group_norm", "softmax", "log_softmax", "cross_entropy",
                  "nll_loss", "mse_loss", "binary_cross_entropy_with_logits", "pow", "rsqrt",
                  "exp", "log", "logsumexp", "cumsum", "softplus", "sum", "norm"}


# The aten ops that run on cuBLAS on a GPU, and those of them that take cuBLASLt's path
# (a matmul with a bias: the H100's history shows its workspace made at the first addmm).
LT_OPS = frozenset({"aten::addmm", "aten::_addmm_activation"})
BLAS_OPS = LT_OPS | {f"aten::{n}" for n in ("mm", "bmm", "baddbmm", "addbmm", "addmv", "mv",
                                            "dot", "addr")}


# Micro-batches traced. Large enough that the saved activations make the peak: with one
# layer at batch 1 the peak can be a fixed transient instead (BERT-large's word-embedding
# gradient outweighs one layer's activations), and the bilinear reading breaks. A fake
# tensor costs the same at any size.
BATCHES = (8, 16)


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes beyond parameters and gradients at a training step's peak, per rank:
    `per_sample` times the micro-batch plus `fixed` (the 16-bit weight copies autocast
    keeps, buffers the step allocates once)."""

    per_sample: float
    fixed: float


class _LiveBytes:
    """Bytes of every storage created inside, alive now and at the peak. Storages are
    followed by weak reference, so a tensor counts from its creation to its release,
    and views count once. With `events`, each allocation and free is also recorded, in
    order, under a key of its own (what the allocator replay takes)."""

    def __init__(self, events: list | None = None, existing: Any = (),
                 region: list | None = None) -> None:
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self
        device = torch.ops.prim.device.default

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if func is device:  # a fake tensor's `.device`, two calls in three
                    return out
                tracker._count(out)
                if tracker.events is not None and func.name() in BLAS_OPS:
                    tracker._blas(func.name())
                return out

        self.mode = Mode()
        self.live = self.peak = 0
        self.events = events
        self.region = region  # where the model is (one item, moved by step_trace's hooks)
        self._alive: dict[int, weakref.ref] = {}
        self._keys = 0
        self._handles: set[tuple[str, str]] = set()  # cuBLAS workspaces made, by thread
        self.key_of: dict[int, int] = {}  # storage id -> its key in `events`
        # Storages from before (parameters, buffers, gradients): a view of one, such as
        # an fp32 matmul's transposed weight, is not a new tensor.
        self._existing = {id(t.untyped_storage()): weakref.ref(t.untyped_storage())
                          for t in existing}

    def _count(self, out: Any) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        for t in (out,) if isinstance(out, torch.Tensor) else tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            st = t.untyped_storage()
            key = id(st)
            ref = self._alive.get(key) or self._existing.get(key)
            if ref is not None and ref() is st:
                continue
            n = st.nbytes()
            self.live += n
            self.peak = max(self.peak, self.live)
            self._keys += 1
            self.key_of[key] = self._keys
            if self.events is not None:
                self.events.append(("alloc", self._keys, n, self._where()))
            self._alive[key] = weakref.ref(
                st, lambda _r, n=n, key=key, k=self._keys: self._free(n, key, k))

    def _blas(self, op: str) -> None:
        """Marks where a thread's first cuBLAS call (and first cuBLASLt call) would make
        its workspace: torch keeps one per handle, and handles are per thread, so the
        forward (the caller's thread) and the backward (autograd's device thread on a GPU)
        each get their own, kept for the process. The replay sizes them for the device
        (allocator.blas_workspaces); the H100's history shows both, one fragmenting a
        freed logits segment."""
        import torch

        in_backward = getattr(torch._C, "_current_graph_task_id", lambda: -1)() >= 0
        thread = "backward" if in_backward else "forward"
        for handle in ("cublas", "cublaslt") if op in LT_OPS else ("cublas",):
            if (handle, thread) not in self._handles:
                self._handles.add((handle, thread))
                self.events.append(("workspace", (handle, thread), 0, self._where()))

    def _free(self, n: int, key: int, k: int) -> None:
        self.live -= n
        self._alive.pop(key, None)
        self.key_of.pop(key, None)
        if self.events is not None:
            self.events.append(("free", k, 0, self._where()))

    def _where(self) -> Any:
        return self.region[0] if self.region is not None else None


class _CudaAutocast:
    """CUDA autocast's casting rules at the torch-function level (the CPU build cannot
    autocast a CUDA tensor): 16-bit matmuls, each weight cast once per forward, and fp32
    for the ops CUDA keeps in fp32. It stays on through the backward, as checkpointing's
    recompute runs under the forward's autocast state, but without the weight cache,
    which real autocast empties when each recomputed region ends."""

    def __init__(self, dtype) -> None:
        import torch
        from torch.overrides import TorchFunctionMode

        cache: dict[int, Any] = {}
        self.cache = cache

        def cast(x, to, cached):
            if not (isinstance(x, torch.Tensor) and x.is_floating_point()) or x.dtype == to:
                return x
            if cached and x.is_leaf and x.requires_grad and self.caching:
                if id(x) not in cache:
                    cache[id(x)] = x.to(to)
                return cache[id(x)]
            return x.to(to)

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in LOW_PRECISION:
                    args = [cast(a, dtype, True) for a in args]
                    kwargs = {k: cast(v, dtype, True) for k, v in kwargs.items()}
                elif name in FULL_PRECISION:
                    args = [cast(a, torch.float32, False) for a in args]
                    kwargs = {k: cast(v, torch.float32, False) for k, v in kwargs.items()}
                return func(*args, **kwargs)

        self.mode, self.caching = Mode(), True

    def end_forward(self) -> None:
        self.cache.clear()
        self.caching = False


def _fused_attention():
    """`scaled_dot_product_attention` as a GPU's fused kernels hold it: the output and a
    fp32 log-sum-exp per query kept for the backward, the scores never materialised
    (flash and memory-efficient attention alike; dropout is regenerated, not kept). A
    bias that trains (T5's relative positions) has an s^2 gradient whatever the kernel:
    the unfused path then stands."""
    import torch
    import torch.nn.functional as F

    real = F.scaled_dot_product_attention

    def fused(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, **_):
        if attn_mask is not None and attn_mask.requires_grad:
            return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and k.shape[-3] != q.shape[-3]:
            k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
            v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]

    @contextlib.contextmanager
    def patched():
        F.scaled_dot_product_attention = fused
        try:
            yield
        finally:
            F.scaled_dot_product_attention = real

    return patched()


def _cuda_dropout():
    """`dropout` as CUDA runs it: one kernel (`native_dropout`) that keeps a bool mask for
    the backward, where the CPU build keeps a noise tensor in the input's dtype: an H100's
    allocator history of GPT-2 at batch 8 shows 6 MiB masks where the CPU trace kept
    12 MiB, 150 MiB a micro-batch the replay had too many."""
    import torch
    import torch.nn.functional as F

    real = F.dropout

    def fused(input, p=0.5, training=True, inplace=False):  # noqa: A002 - F.dropout's names
        if not training or p == 0.0 or inplace or not 0.0 < p < 1.0:
            return real(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    @contextlib.contextmanager
    def patched():
        F.dropout = fused
        try:
            yield
        finally:
            F.dropout = real

    return patched()


def _build(hf_config, task: str, layers: int, mode: str, checkpointing: bool,
           attention: str, lora: dict[str, Any] | None, *, decoder_layers: int | None = None,
           pairs: bool = False):
    """The model at `layers` layers (an encoder-decoder's decoder at `decoder_layers`, or
    as many); under DPO (`pairs`) with TRL's chunked LM head and no dropout, as
    DPOTrainer runs it."""
    import copy

    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from autotune.plan.shape import _LAYER_KEYS
    from autotune.tasks import task as named_task
    from autotune.tasks.models import auto_class

    kind = named_task(task)
    cfg = kind.prepare_config(copy.deepcopy(hf_config))
    for key in _LAYER_KEYS:
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, layers)
    for key in kind.second_stack_keys:
        if getattr(cfg, key, None) is not None:
            setattr(cfg, key, decoder_layers or layers)
    cfg.use_cache = False
    cfg._attn_implementation = attention
    default = torch.get_default_dtype()
    if mode == "native16":  # built in 16 bits (a cast would swap fake parameters)
        torch.set_default_dtype(torch.bfloat16)
    auto = auto_class({"task": task})
    try:
        try:
            model = auto.from_config(cfg)
        except DataDependentOutputException:
            # An init that reads values (ViT's truncated normal) cannot run on fake tensors;
            # fake values need none.
            with _no_init():
                model = auto.from_config(cfg)
    finally:
        torch.set_default_dtype(default)
    if pairs:
        from trl.trainer.utils import add_fused_lm_head, disable_dropout_in_model

        disable_dropout_in_model(model)
        add_fused_lm_head(model, outputs=DPO_OUTPUTS)
    if lora is not None:
        from autotune.tasks.lora import with_lora

        model = with_lora(model, lora, task)
    if checkpointing:  # as the trials ask for it (knobs.py), under this version's name
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.train()
    return model


def _no_init():
    """transformers' context that skips the weights' init, where this version has one."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        return contextlib.nullcontext()
    return no_init_weights()


def _peak(hf_config, task: str, seq_len: int, layers: int, batch: int, mode: str,
          checkpointing: bool, attention: str, cuda: bool,
          lora: dict[str, Any] | None, fake: bool = True, *, target_len: int = 0,
          pairs: bool = False, decoder_layers: int | None = None) -> int:
    """The step's peak bytes beyond parameters and gradients; `fake=False` runs it on real
    CPU tensors (how the tests hold the fake trace to a real step). `target_len`: an
    encoder-decoder's target tokens; `pairs`: a DPO step of `batch` pairs."""
    return _peaks(hf_config, task, seq_len, layers, (batch,), mode, checkpointing, attention,
                  cuda, lora, fake, target_len=target_len, pairs=pairs,
                  decoder_layers=decoder_layers)[0]


def _peaks(hf_config, task: str, seq_len: int, layers: int, batches: tuple[int, ...],
           mode: str, checkpointing: bool, attention: str, cuda: bool,
           lora: dict[str, Any] | None, fake: bool = True, *, target_len: int = 0,
           pairs: bool = False, decoder_layers: int | None = None) -> list[int]:
    """`_peak` at each micro-batch of `batches`, one after the other on one model (a
    build costs a tenth of a micro-batch's trace): each starts from fresh zero
    gradients."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        model = _build(hf_config, task, layers, mode, checkpointing, attention, lora,
                       decoder_layers=decoder_layers, pairs=pairs)
        peaks = []
        for batch in batches:
            for p in model.parameters():
                if p.requires_grad:  # as under accumulation: gradients exist before the step
                    p.grad = torch.zeros_like(p)
            tracker = _LiveBytes(existing=_state_tensors(model))
            _micro_step(model, hf_config, task, seq_len, batch, mode, cuda, tracker,
                        target_len=target_len, pairs=pairs)
            peaks.append(tracker.peak)
        return peaks


def _state_tensors(model) -> list:
    return [*model.parameters(), *model.buffers(),
            *(p.grad for p in model.parameters() if p.grad is not None)]


def _inputs(hf_config, task: str, seq_len: int, batch: int, target_len: int,
            pairs: bool) -> dict[str, Any]:
    """A micro-batch's inputs as its trainer hands them to the model: token ids (both rows
    of every pair under DPO) and labels; an encoder-decoder's labels are its targets, an
    image model's input its pixels (the task's `trace_inputs`)."""
    from autotune.tasks import task as named_task

    return named_task(task).trace_inputs(hf_config, seq_len, batch, target_len,
                                         2 if pairs else 1)


# What DPOTrainer asks its chunked LM head to compute per token (TRL 1.16, no weighting).
DPO_OUTPUTS = ("log_probs", "entropy", "mean_logits", "is_top1")


def _light_head():
    """TRL's chunked LM head replaced, for the step's trace, by one that keeps only what
    any head keeps (the scored hidden states): its own tiles and temporaries, whose size
    depends on the micro-batch's tokens and not linearly, are traced apart at each batch
    (`chunked_head_bytes`) and added where they peak, at the start of the backward."""
    import torch

    class Light(torch.autograd.Function):
        @staticmethod
        def forward(ctx, hidden, weight, bias, targets, *_):
            ctx.save_for_backward(hidden, weight)
            out = hidden.new_zeros(hidden.shape[0], dtype=torch.float32)
            return out, out.clone(), out.clone(), out.clone(), out.clone()

        @staticmethod
        def backward(ctx, grad, *_):
            hidden, weight = ctx.saved_tensors
            return (grad.to(hidden.dtype).unsqueeze(-1).expand_as(hidden).clone(), None,
                    None, None, None, None, None, None, None)

    import trl.trainer.utils as utils

    real = utils._ChunkedLogProbFunction

    @contextlib.contextmanager
    def patched():
        utils._ChunkedLogProbFunction = Light
        try:
            yield
        finally:
            utils._ChunkedLogProbFunction = real

    return patched()


def _triton_tiles():
    """TRL's Triton kernels as they hold memory: each folds a tile into per-token running
    sums in place, allocating nothing (the torch fallback a CPU runs keeps several fp32
    copies of the tile instead)."""
    import trl.kernels.chunked_logprob as kernels

    real = kernels._forward_tile, kernels._backward_tile

    @contextlib.contextmanager
    def patched():
        kernels._forward_tile = kernels._backward_tile = lambda *a, **k: None
        try:
            yield
        finally:
            kernels._forward_tile, kernels._backward_tile = real

    return patched()


@lru_cache(maxsize=512)
def chunked_head_bytes(tokens: int, vocab: int, hidden: int, autocast16: bool, cuda: bool,
                       head_trains: bool) -> int:
    """Peak bytes of TRL's chunked LM head (DPO's log-probs) over its forward and backward
    for `tokens` scored tokens, beyond its inputs and the head's weight, traced on fake
    tensors: its tile of at most 4096 tokens by 32768 columns in the compute dtype, the
    weight's copy in that dtype, the hidden states' gradient and, where the head trains,
    the weight's, both fp32; on a GPU its Triton kernels fold each tile in place, on a
    CPU torch's fallback keeps several fp32 copies of the tile."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    with FakeTensorMode(), _triton_tiles() if cuda else contextlib.nullcontext():
        dtype = torch.bfloat16 if autocast16 and not cuda else torch.float32
        h = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
        w = torch.randn(vocab, hidden, requires_grad=head_trains)
        targets = torch.randint(0, vocab, (tokens,))
        tracker = _LiveBytes(existing=[h, w, targets])
        with tracker.mode, (torch.autocast("cpu", dtype=torch.bfloat16) if autocast16
                            else contextlib.nullcontext()):
            out = ChunkedLogProbFunction.apply(h, w, None, targets, 1.0,
                                               _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0,
                                               DPO_OUTPUTS)
            out[0].sum().backward()
        return tracker.peak


def _dpo_loss(model, inputs: dict[str, Any]):
    """DPO's sigmoid loss as DPOTrainer computes it: the policy's log-probs of both rows
    of every pair through TRL's chunked head, then the reference's forward without
    gradients (the same model here: a second copy's weights are model states, and under
    LoRA the reference is the base with the adapters off), compared with beta 0.1."""
    import torch
    import torch.nn.functional as F

    logps = model(**inputs, fused_lm_head=True).log_probs.sum(dim=1)
    with torch.no_grad():
        ref = model(**inputs, fused_lm_head=True).log_probs.sum(dim=1)
    chosen, rejected = (logps - ref).chunk(2, dim=0)
    return -F.logsigmoid(0.1 * (chosen - rejected)).mean()


def _micro_step(model, hf_config, task: str, seq_len: int, batch: int, mode: str,
                cuda: bool, tracker: _LiveBytes, before_backward: Any = None, *,
                target_len: int = 0, pairs: bool = False) -> None:
    """One forward and backward of a micro-batch, followed by `tracker`."""
    import torch

    inputs = _inputs(hf_config, task, seq_len, batch, target_len, pairs)
    cuda_autocast = _CudaAutocast(torch.bfloat16) if mode == "autocast16" and cuda else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(tracker.mode)
        if cuda:
            stack.enter_context(_fused_attention())
            stack.enter_context(_cuda_dropout())
        if pairs:
            stack.enter_context(_light_head())
        if cuda_autocast is not None:
            stack.enter_context(cuda_autocast.mode)
        with (torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast16"
              and not cuda else contextlib.nullcontext()):
            loss = _dpo_loss(model, inputs) if pairs else model(**inputs).loss
        if cuda_autocast is not None:
            cuda_autocast.end_forward()
        if before_backward is not None:
            before_backward()
        # The engine, not `loss.backward()`: a torch-function mode steps aside while
        # it handles a call, and checkpointing's recompute must run under it.
        from torch.autograd.graph import _engine_run_backward

        _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (),
                             allow_unreachable=True, accumulate_grad=True)
        del loss, inputs


# Traces made in this process, by `_key`: a search predicts every candidate after every
# trial, and a plan every config, from a handful of traces.
_TRACES: dict[tuple, ActivationTrace | None] = {}
_TRACES_KEPT = 256


def _trace_cached(*key) -> ActivationTrace | None:
    """None, remembered, where the model cannot be traced: an architecture whose code
    fake tensors cannot run, or LoRA (PEFT moves its adapters with `.to()`, which cannot
    swap fake parameters)."""
    if key not in _TRACES:
        if len(_TRACES) >= _TRACES_KEPT:
            _TRACES.pop(next(iter(_TRACES)))
        _TRACES[key] = _traced_or_none(key)
    return _TRACES[key]


def _traced_or_none(key: tuple) -> ActivationTrace | None:
    try:
        with collector_paused():
            return _trace(*key)
    except Exception as exc:
        log.info("activations of this model are not traced (%s: %s); the formulas stand",
                 type(exc).__name__, str(exc)[:200])
        return None


def prefetch(calls: list[tuple], workers: int) -> int:
    """Make the traces of `trace_activations(*args)` for each of `calls` not made yet,
    `workers` at a time in forked processes (each trace runs on one core; a 70B plan
    needs four). Forks only a process that has started no threads of its own: a
    search's driver runs Ray's. Returns how many it made in forked processes."""
    import multiprocessing
    import threading

    keys = list(dict.fromkeys(_key(*args) for args in calls))
    # The longest first, so the workers end together: checkpointing traces the forward
    # twice, 16 bits casts every weight.
    missing = sorted((k for k in keys if k not in _TRACES),
                     key=lambda k: (not k[4], k[3] == "fp32"))
    if len(missing) < 2 or workers < 2 or threading.active_count() > 1:
        for k in missing:
            _trace_cached(*k)
        return 0
    with multiprocessing.get_context("fork").Pool(min(workers, len(missing))) as pool:
        for k, value in zip(missing, pool.map(_traced_or_none, missing), strict=True):
            _TRACES[k] = value
    return len(missing)


def _trace(config_json: str, task: str, seq_len: int, mode: str, checkpointing: bool,
           attention: str, cuda: bool, lora_json: str | None, target_len: int = 0,
           pairs: bool = False) -> ActivationTrace:
    import json

    from autotune.plan.shape import _first
    from autotune.tasks import task as named_task
    from autotune.tasks.models import load_hf_config

    raw = json.loads(config_json)
    hf_config = load_hf_config({"config": raw})
    layers = next((int(raw[k]) for k in ("num_hidden_layers", "n_layer", "num_layers")
                   if k in raw), None) or int(getattr(hf_config, "num_hidden_layers", 1) or 1)
    # An encoder-decoder's decoder is a stack of its own: linear in each stack's depth.
    second = named_task(task).second_stack_keys
    decoder = int(_first(hf_config, second) or layers) if second else None
    lora = json.loads(lora_json) if lora_json else None
    b1, b2 = BATCHES
    depths = [(1, 1), (2, 1)] + ([(1, 2)] if decoder else [])
    peak = {(n, d, b): p for n, d in depths for b, p in zip(BATCHES, _peaks(
        hf_config, task, seq_len, n, BATCHES, mode, checkpointing, attention, cuda, lora,
        target_len=target_len, pairs=pairs, decoder_layers=d if decoder else None),
        strict=True)}
    # Linear in each stack's layers, times the batch b: peak = f(n, d) + b * s(n, d).
    slope = {nd: (peak[(*nd, b2)] - peak[(*nd, b1)]) / (b2 - b1) for nd in depths}
    fixed = {nd: peak[(*nd, b1)] - b1 * slope[nd] for nd in depths}

    def extend(term: dict) -> float:
        out = term[1, 1] + (term[2, 1] - term[1, 1]) * (layers - 1)
        return out + ((term[1, 2] - term[1, 1]) * (decoder - 1) if decoder else 0.0)

    return ActivationTrace(per_sample=max(0.0, extend(slope)), fixed=max(0.0, extend(fixed)))


def trace_activations(config: dict[str, Any], task: str, seq_len: int, mode: str,
                      checkpointing: bool, attention: str, cuda: bool,
                      lora: dict[str, Any] | None = None, target_len: int = 0,
                      pairs: bool = False) -> ActivationTrace | None:
    """The traced activation memory of the model `config` (a transformers config as a
    dict with its model_type) in one compute mode, with `attention` "eager" or "sdpa";
    an encoder-decoder's with `target_len` target tokens, DPO's (`pairs`: a sample is two
    rows and the reference's forward). None where it cannot be traced. Memoised per
    process, failures too."""
    return _trace_cached(*_key(config, task, seq_len, mode, checkpointing, attention, cuda,
                               lora, target_len=target_len, pairs=pairs))


def _key(config: dict[str, Any], task: str, seq_len: int, mode: str, checkpointing: bool,
         attention: str, cuda: bool, lora: dict[str, Any] | None = None,
         target_len: int = 0, pairs: bool = False) -> tuple:
    """What a trace depends on, hashable: the arguments `_trace` takes."""
    import json

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: allowed {MODES}")
    return (json.dumps(config, sort_keys=True), task, seq_len, mode, checkpointing,
            attention, cuda, json.dumps(lora, sort_keys=True) if lora else None, target_len,
            pairs)

