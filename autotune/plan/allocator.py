"""PyTorch's CUDA caching allocator, replayed: what a traced step reserves on a GPU.

A GPU trial's peak is the allocator's reserved bytes, not its live tensors: freed blocks
stay cached and are reused only where a request fits, so the same tensors reserve more or
less depending on the sizes and order of what came before. On the H100 the bf16 GPT-2
family took 1480 then 1273 MiB per sample from batch 4 to 8 to 16 while its tensors grew
evenly; replaying its traced steps through these rules gives 1494 and 1297.

The rules are CUDACachingAllocator's defaults: requests rounded to 512 bytes; those up
to 1 MiB from a small pool of 2 MiB segments; larger ones from 20 MiB segments when under
10 MiB, else from segments rounded to 2 MiB; the smallest cached block that fits; a
block split when the rest is over 1 MiB (at least 512 bytes in the small pool);
neighbours merged on free; and a pool per CUDA stream: a block is cached for the stream
that allocated it (use on another stream, `record_stream`, only delays its return), so a
stream of DeepSpeed's (its reductions) keeps segments the model's stream cannot reuse. No
expandable segments, no `max_split_size_mb`, and no segment is released but by an
explicit `empty_cache` (DeepSpeed's, at initialisation): where
cudaMalloc fails, torch frees every stream's unused cached segments and retries, so near
the device's limit the replayed peak overstates what a trial needs (pools per stream hold
more idle segments, which makes that likelier).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20
DDP_FIRST_BUCKET = 1 << 20  # torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET = 25 << 20  # DDP's bucket_cap_mb default, which Trainer keeps
# Micro-batches and steps replayed: past the second of each the allocator repeats itself.
REPLAYED = 2

# A traced step as the allocator sees it: ("alloc", key, bytes) or ("free", key, 0).
Event = tuple[str, object, int]
DEFAULT_STREAM = 0
# cuBLASLt's workspace (CUBLASLT_WORKSPACE_SIZE's default, 1024 KiB): the H100's history
# (torch 2.11) shows it beside cuBLAS's at the forward's first matmul with a bias.
CUBLASLT_WORKSPACE = 1 << 20


def blas_workspaces(capability: tuple[int, int] | None,
                    environ: dict[str, str] | None = None) -> dict[str, int]:
    """The bytes of the cuBLAS and cuBLASLt workspaces torch allocates through the caching
    allocator, one per thread that runs a matmul (CublasHandlePool.cpp): 32 MiB on Hopper
    and Blackwell (compute capability 9, 10, 12), else `:4096:2:16:8` (8 MiB + 128 KiB),
    or what CUBLAS_WORKSPACE_CONFIG and CUBLASLT_WORKSPACE_SIZE (KiB) say. They live for
    the process, so the training step's two (forward and backward threads) sit in the
    segments the activations use: on the H100 the backward's split a freed 1570 MiB logits
    block, and the next micro-batch grew a segment the replay without them reused.
    Measured with torch 2.11; a torch that keeps cuBLAS's workspace out of the caching
    allocator (a build option upstream is moving towards) would hold none of this here."""
    import os
    import re

    env = os.environ if environ is None else environ
    major = capability[0] if capability else 0
    cublas = (4096 * 8 if major in (9, 10, 12) else 4096 * 2 + 16 * 8) * 1024
    pairs = re.findall(r":([0-9]+):([0-9]+)", env.get("CUBLAS_WORKSPACE_CONFIG", ""))
    if pairs:
        cublas = sum(int(size) * int(count) for size, count in pairs) * 1024
    lt = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    return {"cublas": cublas,
            "cublaslt": int(lt) * 1024 if lt.isdigit() else CUBLASLT_WORKSPACE}


def workspace_event(key: tuple[str, str], made: set, workspaces: dict[str, int] | None
                    ) -> list[Event]:
    """A traced workspace mark as an allocation: the first time each thread's is met in
    the replayed steps (a process makes it once), never freed; none without `workspaces`
    (what replays made before the marks, and tests of other rules, leave out)."""
    if workspaces is None or key in made:
        return []
    made.add(key)
    return [("alloc", ("workspace", key), workspaces[key[0]])]


class _Block:
    __slots__ = ("addr", "size", "free", "prev", "next", "small", "stream", "pool")

    def __init__(self, addr: int, size: int, small: bool, stream: int, pool: list) -> None:
        self.addr, self.size, self.small, self.stream = addr, size, small, stream
        self.pool = pool  # the free blocks of its stream and size class, where it goes freed
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None


class CachingAllocator:
    """Reserved and allocated bytes of a sequence of allocations and frees, and the
    reserved bytes per stream (what `torch.cuda.memory_snapshot()`'s segments sum to)."""

    def __init__(self) -> None:
        # free blocks by (size, addr), per (stream, small pool)
        self._pools: dict[tuple[int, bool], list] = {}
        self._blocks: dict[object, _Block] = {}
        self._next_addr = 0
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.reserved_by_stream: dict[int, int] = {}
        self.grown: list[tuple[int, int, object]] = []  # (stream, bytes, key) per segment

    def malloc(self, key: object, nbytes: int, stream: int = DEFAULT_STREAM) -> None:
        if nbytes <= 0:
            return  # torch hands out no block for an empty tensor
        assert key not in self._blocks, f"{key!r} allocated twice"
        size = -(-nbytes // MIN_BLOCK) * MIN_BLOCK
        small = size <= SMALL_SIZE
        pool = self._pools.get((stream, small))
        if pool is None:
            pool = self._pools[stream, small] = []
        i = bisect_left(pool, (size,))  # the smallest that fits, at the lowest address
        if i < len(pool):
            block = pool.pop(i)[2]
        else:
            block = _Block(self._next_addr, _segment_size(size), small, stream, pool)
            self._next_addr += block.size
            self.reserved += block.size
            self.reserved_by_stream[stream] = self.reserved_by_stream.get(stream, 0) + block.size
            self.grown.append((stream, block.size, key))
            if self.reserved > self.peak_reserved:
                self.peak_reserved = self.reserved
        rest = block.size - size
        if rest > (MIN_BLOCK - 1 if small else SMALL_SIZE):
            tail = _Block(block.addr + size, rest, small, stream, pool)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            insort(pool, (rest, tail.addr, tail))
        block.free = False
        self._blocks[key] = block
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated

    def free(self, key: object) -> None:
        block = self._blocks.pop(key, None)
        if block is None:
            return
        self.allocated -= block.size
        block.free = True
        pool = block.pool
        left, right = block.prev, block.next
        if left is not None and left.free:
            del pool[bisect_left(pool, (left.size, left.addr))]
            block = self._absorb(left, block)
        if right is not None and right.free:
            del pool[bisect_left(pool, (right.size, right.addr))]
            block = self._absorb(block, right)
        insort(pool, (block.size, block.addr, block))

    def copy(self) -> CachingAllocator:
        """An independent allocator in the same state: its segments, blocks, pools, counters
        and growth record (what a replay that continues from here needs, and reads)."""
        twin = CachingAllocator()
        twin._next_addr, twin.reserved, twin.allocated = (
            self._next_addr, self.reserved, self.allocated)
        twin.peak_reserved, twin.peak_allocated = self.peak_reserved, self.peak_allocated
        twin.reserved_by_stream = dict(self.reserved_by_stream)
        twin.grown = list(self.grown)
        twins: dict[int, _Block] = {}
        pools = {id(pool): [] for pool in self._pools.values()}

        def twin_of(block: _Block | None) -> _Block | None:
            if block is None:
                return None
            copied = twins.get(id(block))
            if copied is None:
                copied = twins[id(block)] = _Block(block.addr, block.size, block.small,
                                                   block.stream, pools[id(block.pool)])
                copied.free = block.free
            return copied

        for k, pool in self._pools.items():
            twin._pools[k] = pools[id(pool)]
            twin._pools[k].extend((size, addr, twin_of(b)) for size, addr, b in pool)
        twin._blocks = {key: twin_of(b) for key, b in self._blocks.items()}
        for block in [*self._blocks.values(), *(e[2] for p in self._pools.values() for e in p)]:
            copied = twins[id(block)]
            copied.prev, copied.next = twin_of(block.prev), twin_of(block.next)
        return twin

    def empty_cache(self) -> None:
        """`torch.cuda.empty_cache()`: every segment with nothing allocated in it goes
        back to the device (DeepSpeed's ZeRO-1/2 calls it at each parameter group's turn;
        from the second on it finds the parameters' own segments free and releases them;
        ZeRO-3's `defragment` calls it with every partition moved to the host)."""
        for (stream, _), pool in self._pools.items():
            whole = [entry for entry in pool if entry[2].prev is None and entry[2].next is None]
            for entry in whole:
                pool.remove(entry)
                self.reserved -= entry[2].size
                self.reserved_by_stream[stream] -= entry[2].size

    @staticmethod
    def _absorb(left: _Block, right: _Block) -> _Block:
        """`right`, the block after `left` in its segment, merged into `left`."""
        left.size += right.size
        left.next = right.next
        if right.next is not None:
            right.next.prev = left
        return left


def _segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-size // ROUND_LARGE) * ROUND_LARGE


def replay(events: Iterable[Event], stream_of: Callable[[object], int] | None = None,
           allocator: CachingAllocator | None = None) -> CachingAllocator:
    """The allocator after `events` (an ("empty_cache", None, 0) event releases the unused
    segments), from an empty one or from `allocator`, which it changes; `stream_of(key)`
    names the stream an allocation is made on (the default stream's where None)."""
    allocator = CachingAllocator() if allocator is None else allocator
    malloc, free = allocator.malloc, allocator.free
    for kind, key, nbytes in events:
        if kind == "alloc":
            malloc(key, nbytes, stream_of(key) if stream_of else DEFAULT_STREAM)
        elif kind == "empty_cache":
            allocator.empty_cache()
        else:
            free(key)
    return allocator


@dataclass(frozen=True)
class TracedStep:
    """One training step's allocations, as Trainer makes them, with every size linear in
    the micro-batch: `sizes[b1]`, `sizes[b2]` per event. `first` is a micro-batch with no
    gradients yet (its gradients stay until the optimizer has stepped), `later` one that
    adds to them."""

    params: tuple[int, ...]  # bytes of each parameter and buffer, in load order
    trainable: tuple[int, ...]  # elements of each trainable parameter
    first: tuple[tuple[str, int, int, int], ...]  # (kind, key, bytes at b1, bytes at b2)
    later: tuple[tuple[str, int, int, int], ...]
    batches: tuple[int, int]
    persistent: frozenset[int]  # keys of `first` alive at its end: the gradients
    embedding: tuple[bool, ...] = ()  # per trainable parameter: an nn.Embedding's

    def bytes_at(self, s1: int, s2: int, batch: int) -> int:
        """An event's bytes at `batch`, read off the line through its two traced sizes."""
        b1, b2 = self.batches
        return max(0, round(s1 + (s2 - s1) * (batch - b1) / (b2 - b1)))


def training_events(step: TracedStep, batch: int, accumulation: int,
                    states_of: Callable[[int, bool], tuple[float, ...]],
                    step_temporary_bytes: float, steps: int = REPLAYED,
                    ddp: bool = False, workspaces: dict[str, int] | None = None
                    ) -> list[Event]:
    """The allocations of a trial: the model loaded, then `steps` (at least one) optimizer
    steps of `accumulation` micro-batches each. The optimizer's states come at the first
    step (`states_of(elements, is_embedding)`: bytes per element of each state tensor a
    parameter gets), its temporaries (bytes per element, one tensor per parameter) live
    through each step, and the gradients go at `zero_grad`. Under `ddp`, DDP's fp32
    buckets are allocated with the model, as DDP wraps it. Past the second micro-batch
    and the second step the allocator repeats itself (GPT-2 124M, 24 configs of batch
    1-32 in three modes: the same peak with 2 as with up to 32 micro-batches and 3 steps),
    so no more are replayed. `workspaces` (`blas_workspaces`) sizes cuBLAS's.
    """
    trial = _TrialEvents(step, batch, accumulation, workspaces)
    start, grads = trial.start(ddp)
    return start + trial.rest(grads, states_of, step_temporary_bytes, steps)


class _TrialEvents:
    """`training_events` in two parts, cut where the optimizer first acts (its states):
    the model loaded, DDP's buckets and the first step's micro-batches, which every
    optimizer's trial shares, then the rest. Each traced event's size at the micro-batch
    is read once."""

    def __init__(self, step: TracedStep, batch: int, accumulation: int,
                 workspaces: dict[str, int] | None) -> None:
        self.step, self.workspaces = step, workspaces
        self.accumulation = min(accumulation, REPLAYED)
        self.made: set = set()  # the workspaces made by the end of `start`
        # Each traced tensor numbered: a micro-batch's keys are these numbers plus its
        # offset (ints hash faster than the traced keys' nested tuples).
        number: dict = {}

        def sized(kind: str, key: object, s1: int, s2: int) -> tuple[str, object, int]:
            if kind == "workspace":
                return kind, key, 0
            size = step.bytes_at(s1, s2, batch) if kind == "alloc" else 0
            return kind, number.setdefault(key, len(number)), size

        self.sized = [[sized(*e) for e in template] for template in (step.first, step.later)]
        self.persistent = frozenset(number[k] for k in step.persistent if k in number)
        self.tensors = len(number)

    def start(self, ddp: bool) -> tuple[list[Event], list]:
        """The events before the optimizer's states, and the first step's gradients."""
        step = self.step
        events: list[Event] = [("alloc", ("param", i), n) for i, n in enumerate(step.params)]
        if ddp:
            events += [("alloc", ("bucket", i), n)
                       for i, n in enumerate(ddp_buckets([4 * n for n in step.trainable]))]
        micro_batches, grads = self._micro_batches(0, self.made)
        return events + micro_batches, grads

    def rest(self, grads: list, states_of: Callable[[int, bool], tuple[float, ...]],
             step_temporary_bytes: float, steps: int = REPLAYED) -> list[Event]:
        """The events from the optimizer's states on, after `start` (whose `grads` the
        first step's `zero_grad` frees); `start` is left as it was, for another optimizer."""
        step, made = self.step, set(self.made)
        embedding = step.embedding or (False,) * len(step.trainable)
        events: list[Event] = [
            ("alloc", ("state", i, j), int(n * nbytes))
            for i, (n, emb) in enumerate(zip(step.trainable, embedding, strict=True))
            for j, nbytes in enumerate(states_of(n, emb))]
        events += self._step_end(0, grads, step_temporary_bytes)
        for s in range(1, steps):
            micro_batches, grads = self._micro_batches(s, made)
            events += micro_batches + self._step_end(s, grads, step_temporary_bytes)
        return events

    def _micro_batches(self, s: int, made: set) -> tuple[list[Event], list]:
        """Step `s`'s micro-batches, and the gradients its first one creates."""
        events: list[Event] = []
        grads = []
        persistent = self.persistent
        for m in range(self.accumulation):
            offset = (s * REPLAYED + m) * self.tensors
            for kind, key, size in self.sized[m > 0]:
                if kind == "workspace":
                    events += workspace_event(key[0], made, self.workspaces)
                    continue
                events.append((kind, offset + key, size))
                if m == 0 and kind == "alloc" and key in persistent:
                    grads.append(offset + key)
        return events, grads

    def _step_end(self, s: int, grads: list, step_temporary_bytes: float) -> list[Event]:
        """The optimizer's temporaries through step `s`, then `zero_grad`."""
        events: list[Event] = []
        if step_temporary_bytes:
            temps = [("temp", s, i) for i in range(len(self.step.trainable))]
            events += [("alloc", t, int(n * step_temporary_bytes))
                       for t, n in zip(temps, self.step.trainable, strict=True)]
            events += [("free", t, 0) for t in temps]
        return events + [("free", g, 0) for g in grads]


class TrialReplay:
    """The replays of a traced step's trials at one micro-batch and accumulation, one per
    optimizer, each continuing from a copy of one replay of what they all allocate first:
    the model, DDP's buckets and the first step's micro-batches, about half of a trial's
    allocations. The same allocator as `replay(training_events(...))` (a test holds the
    two together), for about two thirds of the time over three optimizers."""

    def __init__(self, step: TracedStep, batch: int, accumulation: int, *,
                 ddp: bool = False, workspaces: dict[str, int] | None = None,
                 steps: int = REPLAYED) -> None:
        self._events = _TrialEvents(step, batch, accumulation, workspaces)
        events, self._grads = self._events.start(ddp)
        self._started = replay(events)
        self._steps = steps

    def replay(self, states_of: Callable[[int, bool], tuple[float, ...]],
               step_temporary_bytes: float) -> CachingAllocator:
        """The allocator after the trial with this optimizer (as `training_events`)."""
        rest = self._events.rest(self._grads, states_of, step_temporary_bytes, self._steps)
        return replay(rest, allocator=self._started.copy())


def ddp_buckets(grad_bytes: list[int]) -> list[int]:
    """DDP's bucket sizes for gradients of these sizes (in parameter order): filled from
    the last parameter back, a bucket closing once it holds at least its cap, 1 MiB for
    the first and 25 MiB after (`_compute_bucket_assignment_by_size`; Trainer keeps the
    defaults). DDP rebuilds them in the order the first backward produced the gradients,
    which for a stack of layers is about the same."""
    buckets, current, cap = [], 0, DDP_FIRST_BUCKET
    for n in reversed(grad_bytes):
        current += n
        if current >= cap:
            buckets.append(current)
            current, cap = 0, DDP_BUCKET
    if current:
        buckets.append(current)
    return buckets
