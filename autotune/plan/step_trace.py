"""A whole training step's allocations, in order, for the allocator replay.

The replay (plan/allocator.py) needs every allocation and free of a micro-batch, not a
peak, so the step is traced under fake tensors as in trace.py, with each event labelled
by where the model was: before the layers, in layer i's forward or backward, or around
the head. A deep model repeats its layers, so a few layers are traced and the middle one
is repeated to the model's depth, its tensors renamed per copy and each free pointed at
the copy of the layer that holds the tensor. The cost then does not grow with depth: a
80-layer model traces as fast as a 4-layer one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from autotune.plan.allocator import TracedStep
from autotune.plan.gc_pause import collector_paused
from autotune.plan.trace import BATCHES, MODES, _build, _LiveBytes, _micro_step

log = logging.getLogger(__name__)

# Layers traced: two before the repeated one (the first layer may differ, and the one
# after it shows how a layer's backward frees its predecessor's tensors), the repeated
# one, and the last (it meets the head).
TRACED_LAYERS = 4
REPEATED = 2

Labelled = tuple[str, Any, int, Any]  # (kind, key, bytes, region)


class _Regions:
    """Hooks that move `region[0]` as the step passes through the decoder layers:
    "pre" (embeddings), ("f", i) in layer i's forward, "mid" from the last layer's end
    through the head, the loss and back, ("b", i) from the moment the gradient of layer
    i's output is complete, and "post" once the gradient of the first layer's input is.
    A checkpointed layer's recompute in the backward keeps its backward's label."""

    def __init__(self, layers: Any) -> None:
        self.region: list[Any] = ["pre"]
        self.backward = False
        self._handles = []
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(
                lambda _m, args, kwargs, i=i: self._enter(i, args, kwargs), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(
                lambda _m, _a, _k, out, i=i: self._leave(i, out, i == last), with_kwargs=True))

    def _set(self, value: Any) -> Callable:
        def hook(_grad):
            self.region[0] = value
        return hook

    def _enter(self, i: int, args: tuple, kwargs: dict) -> None:
        if self.backward:
            return
        self.region[0] = ("f", i)
        if i == 0:
            hidden = _first_tensor((*args, kwargs.get("hidden_states")))
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(self._set("post"))

    def _leave(self, i: int, out: Any, last: bool) -> None:
        if self.backward:
            return
        if last:
            self.region[0] = "mid"
        out = _first_tensor(out if isinstance(out, tuple) else (out,))
        if out is not None and out.requires_grad:
            out.register_hook(self._set(("b", i)))

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _first_tensor(items: Any) -> Any:
    import torch

    return next((t for t in items if isinstance(t, torch.Tensor)), None)


def _decoder_layers(model: Any, n: int) -> Any:
    """The model's stack of `n` identical layers (a ModuleList), or None."""
    import torch

    for module in model.modules():
        if (isinstance(module, torch.nn.ModuleList) and len(module) == n
                and len({type(m) for m in module}) == 1):
            return module
    return None


def _release_all_but(tracker: _LiveBytes, kept: frozenset[int]) -> None:
    """Records as freed what outlives a micro-batch besides its gradients (the CPU build's
    leftovers; a GPU keeps none), which would otherwise sit in the replay for good. The
    recording stops here."""
    events, tracker.events = tracker.events, None
    for k in sorted(set(tracker.key_of.values()) - kept):
        events.append(("free", k, 0, "post"))


def _record(hf_config, task: str, seq_len: int, batch: int, mode: str, checkpointing: bool,
            attention: str, cuda: bool, layers: int):
    """A `layers`-deep model's micro-batch that creates the gradients and one that adds to
    them, labelled; the parameters' bytes and trainable elements in load order, each with
    the index of the layer it belongs to (None outside the layers)."""
    return _records(hf_config, task, seq_len, (batch,), mode, checkpointing, attention, cuda,
                    layers)[0]


def _records(hf_config, task: str, seq_len: int, batches: tuple[int, ...], mode: str,
             checkpointing: bool, attention: str, cuda: bool, layers: int) -> list:
    """`_record` at each micro-batch of `batches`, on one model built for them all (a
    build costs a tenth of a micro-batch's trace): the gradients go before each, as a
    fresh model has none."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.plan.trace import _state_tensors

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _build(hf_config, task, layers, mode, checkpointing, attention, None)
        stack = _decoder_layers(model, layers)
        if stack is None:
            raise LookupError(f"no stack of {layers} identical layers in the model")
        owner = {id(p): i for i, layer in enumerate(stack) for p in
                 [*layer.parameters(), *layer.buffers()]}
        seen: set[int] = set()
        params = []
        for t in [*model.parameters(), *model.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                params.append((t.untyped_storage().nbytes(), owner.get(id(t))))
        embedding = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding)
                     for p in m.parameters()}
        trainable = tuple(((p.numel(), id(p) in embedding), owner.get(id(p)))
                          for p in model.parameters() if p.requires_grad)
        out = []
        for batch in batches:
            for p in model.parameters():
                p.grad = None
            recordings = []
            for _ in range(2):
                regions = _Regions(stack)
                events: list[Labelled] = []
                tracker = _LiveBytes(events, _state_tensors(model), regions.region)
                _micro_step(model, hf_config, task, seq_len, batch, mode, cuda, tracker,
                            before_backward=lambda r=regions: setattr(r, "backward", True))
                regions.remove()
                grads = {id(p.grad.untyped_storage()) for p in model.parameters()
                         if p.grad is not None}
                kept = frozenset(tracker.key_of[g] for g in grads if g in tracker.key_of)
                _release_all_but(tracker, kept)
                recordings.append((events, kept))
            (first, persistent), (later, _) = recordings
            out.append((tuple(params), trainable, first, later, persistent))
    return out


class _Deepen:
    """Maps an n-layer recording onto a `depth`-layer model: layers 0 and 1 as traced,
    layer REPEATED once per middle layer, the last as traced. Each event of a layer's
    block refers to tensors by the layer that holds them, relative to itself, so a copy
    refers to its own neighbours."""

    def __init__(self, events: list[Labelled], n: int, depth: int) -> None:
        self.n, self.depth = n, depth
        self.owner: dict[Any, Any] = {}
        self.blocks: dict[tuple[str, int], list] = {}
        for kind, key, _, region in events:
            if kind == "alloc":
                self.owner[key] = region
                if isinstance(region, tuple):
                    self.blocks.setdefault(region, []).append(key)
        self.position = {key: i for block in self.blocks.values()
                         for i, key in enumerate(block)}

    def template(self, j: int) -> int:
        return j if j < REPEATED else self.n - 1 if j == self.depth - 1 else REPEATED

    def copies(self, i: int) -> range:
        """Synthesised layers a traced layer's block stands for."""
        if i == REPEATED:
            return range(REPEATED, self.depth - (self.n - 1 - REPEATED))
        return range(i, i + 1) if i < REPEATED else range(self.depth - 1, self.depth)

    def key(self, key: Any, j: int | None) -> tuple:
        """`key` as seen from synthesised layer j (None: outside the layers)."""
        region = self.owner.get(key)
        if not isinstance(region, tuple):
            return (key, 0)
        phase, o = region
        if j is None:
            if o == REPEATED:
                raise LookupError("the head refers to a middle layer's tensor")
            target = o if o < REPEATED else self.depth - 1
        else:
            i = self.template(j)
            target = j + (o - i)
            if not 0 <= target < self.depth or abs(o - i) > 1:
                raise LookupError("a layer refers to a tensor beyond its neighbours")
        t = self.template(target)
        if t != o:
            key = self.blocks[phase, t][self.position[key]]
        return (key, target)

    def events(self, events: list[Labelled]) -> list[tuple[str, Any, int]]:
        out: list[tuple[str, Any, int]] = []
        segment: list[Labelled] = []

        def flush() -> None:
            if not segment:
                return
            region = segment[0][3]
            if isinstance(region, tuple):
                phase, i = region
                order = self.copies(i)
                for j in (order if phase == "f" else reversed(order)):
                    out.extend((kind, self.key(key, j), n) for kind, key, n, _ in segment)
            else:  # outside the layers; what it frees of the repeated layer, it frees per copy
                for kind, key, n, _ in segment:
                    region = self.owner.get(key)
                    if isinstance(region, tuple) and region[1] == REPEATED:
                        out.extend((kind, (key, j), n) for j in self.copies(REPEATED))
                    else:
                        out.append((kind, self.key(key, None), n))
            segment.clear()

        for event in events:
            if segment and event[3] != segment[0][3]:
                flush()
            segment.append(event)
        flush()
        return out

    def check(self, events: list[Labelled]) -> None:
        """The layers next to the repeated one must allocate alike, tensor for tensor, or
        a copy's references to its neighbours cannot be renamed."""
        size = {key: n for kind, key, n, _ in events if kind == "alloc"}
        for phase in ("f", "b"):
            shapes = {tuple(size[k] for k in self.blocks.get((phase, i), []))
                      for i in range(1, self.n)}
            if len(shapes) != 1:
                raise LookupError(f"layers 1-{self.n - 1} allocate differently ({phase})")


def _deepened(hf_config, task: str, seq_len: int, batch: int, mode: str, checkpointing: bool,
              attention: str, cuda: bool, depth: int):
    """(params, trainable, first, later, persistent) of the `depth`-layer model."""
    n = min(depth, TRACED_LAYERS)
    return _deepen(_record(hf_config, task, seq_len, batch, mode, checkpointing, attention,
                           cuda, n), n, depth)


def _deepen(recording: tuple, n: int, depth: int):
    """An `n`-layer recording (`_record`) as the `depth`-layer model's."""
    params, trainable, first, later, persistent = recording
    if depth == n:
        plain = lambda evs: [(k, (key, 0), b) for k, key, b, _ in evs]  # noqa: E731
        return (tuple(b for b, _ in params), tuple(e for e, _ in trainable), plain(first),
                plain(later), frozenset((k, 0) for k in persistent))
    deep_first, deep_later = _Deepen(first, n, depth), _Deepen(later, n, depth)
    deep_first.check(first)
    deep_later.check(later)
    first_events = deep_first.events(first)
    owner = deep_first.owner
    deep_persistent = frozenset(
        deep_first.key(k, j) for k in persistent
        for j in (deep_first.copies(owner[k][1]) if isinstance(owner[k], tuple) else [None]))
    return (_repeat(params, deep_first), _repeat(trainable, deep_first), first_events,
            deep_later.events(later), deep_persistent)


def _repeat(items: tuple, deep: _Deepen) -> tuple:
    """Per-parameter figures of the traced layers, the repeated layer's once per copy."""
    out: list = []
    block = [x for x, layer in items if layer == REPEATED]
    done = False
    for x, layer in items:
        if layer == REPEATED:
            if not done:
                out += block * len(deep.copies(REPEATED))
                done = True
        else:
            out.append(x)
    return tuple(out)


@lru_cache(maxsize=64)
def _trace_step_cached(config_json: str, task: str, seq_len: int, mode: str,
                       checkpointing: bool, attention: str, cuda: bool) -> TracedStep | None:
    import json

    from autotune.plan.shape import _LAYER_KEYS
    from autotune.tasks.models import load_hf_config

    try:
        hf_config = load_hf_config({"config": json.loads(config_json)})
        depth = next(int(getattr(hf_config, k)) for k in _LAYER_KEYS
                     if getattr(hf_config, k, None) is not None)
        traced = min(depth, TRACED_LAYERS)
        with collector_paused():
            at_b1, at_b2 = (_deepen(r, traced, depth) for r in _records(
                hf_config, task, seq_len, BATCHES, mode, checkpointing, attention, cuda,
                traced))
        params, per_param, f1, l1, persistent = at_b1
        _, _, f2, l2, persistent2 = at_b2
    except Exception as exc:
        log.info("the step of this model is not traced (%s: %s); no allocator replay",
                 type(exc).__name__, str(exc)[:200])
        return None

    def paired(a: list, b: list):
        if [(k, key) for k, key, _ in a] != [(k, key) for k, key, _ in b]:
            return None  # the step's shape depends on the batch: sizes cannot be read
        return tuple((k, key, n1, n2) for (k, key, n1), (_, _, n2) in zip(a, b, strict=True))

    first, later = paired(f1, f2), paired(l1, l2)
    if first is None or later is None or persistent != persistent2:
        return None
    return TracedStep(params, tuple(n for n, _ in per_param), first, later, BATCHES,
                      persistent, tuple(emb for _, emb in per_param))


def trace_step(config: dict[str, Any], task: str, seq_len: int, mode: str,
               checkpointing: bool, attention: str, cuda: bool) -> TracedStep | None:
    """Every allocation of a Trainer micro-batch of the whole model (`TracedStep`), for
    the allocator replay; None where it cannot be traced. Memoised per process."""
    import json

    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: allowed {MODES}")
    return _trace_step_cached(json.dumps(config, sort_keys=True), task, seq_len, mode,
                              checkpointing, attention, cuda)
