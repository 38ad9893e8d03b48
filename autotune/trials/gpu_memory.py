"""What a GPU trial's memory was: the caching allocator's peaks, its pools per stream,
where its segments were allocated from, and what NVML sees beyond it. Read in the trial's
own process (worker.py), on CUDA only; the summaries are plain functions of what torch
returns, so they are tested without a GPU."""

from __future__ import annotations

import bisect
import gzip
import json
import os
import re
from pathlib import Path
from typing import Any

from autotune.records import GpuMemory

# Allocation events the allocator's history keeps: a ring, whose oldest go first, and the
# first segments with them (a trial's `history_full` says so).
HISTORY_ENTRIES = 400_000
# A large-pool block is split only where more than this would be left: a stretch this size
# or less between blocks is a block's tail, not a free block (CUDACachingAllocator).
SMALL_TAIL = 1 << 20


def record_history(zero_stage: int) -> bool:
    """Start the allocator's history (Python stacks of every allocation) in a DeepSpeed
    trial when AUTOTUNE_MEMORY_HISTORY=1 (the GPU proof's memory step sets it): where each
    segment was allocated from says where ZeRO's memory beyond the emulation is. Not in
    other trials, nor by default: the stacks cost host time in every allocation."""
    if os.environ.get("AUTOTUNE_MEMORY_HISTORY") != "1" or zero_stage == 0:
        return False
    import torch

    try:
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")
    except Exception:  # noqa: BLE001 - a diagnosis, never the trial's failure
        return False
    return True


def allocator_peaks() -> tuple[int, int]:
    import torch

    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def reserved_by_stream(segments: list[dict[str, Any]], device: int) -> dict[str, int]:
    """The allocator's reserved bytes per CUDA stream, from its segments
    (`torch.cuda.memory_snapshot()`). A block freed on one stream is reused only by
    allocations on that stream, so a stream of DeepSpeed's (reductions, offload's copies)
    keeps a pool of its own beside the model's, which the ZeRO replay predicts
    (plan/zero_replay.py): this is what to hold it to. Read at the trial's end,
    when the cache still holds every segment it grew to (nothing here empties it)."""
    held: dict[str, int] = {}
    for segment in segments:
        if segment.get("device", device) != device:
            continue
        key = _stream_key(segment.get("stream"))
        held[key] = held.get(key, 0) + int(segment.get("total_size", 0))
    return held


def gpu_memory(index: int, history: bool = False, name: str = "",
               before: set[int] | None = None) -> tuple[int | None, GpuMemory]:
    """Allocator peak plus what the allocator does not see (CUDA context, cuBLAS
    workspaces, NCCL buffers), which NVML reports for the process. The GPU, or the MIG
    instance, is found in NVML by its UUID: torch's index differs from NVML's when
    CUDA_VISIBLE_DEVICES remaps them. The process is found by its PID, or, where NVML's
    PIDs are another namespace's (a container's), as the one process new on the device
    since `before` (nvml_pids() as the trial began). Where NVML cannot tell, the peak is
    None (unknown) and `nvml_overhead` says why: the allocator's figure alone would read
    the runtime's 1.3 GiB or more low. With `history` (record_history started it), where
    the allocator's segments were asked for too, and the history itself saved as `name`
    where AUTOTUNE_MEMORY_TRACES names a folder."""
    import torch

    reserved_peak = torch.cuda.max_memory_reserved()
    figures: dict[str, Any] = {"allocator_peak_reserved": reserved_peak,
                             "allocator_peak_allocated": torch.cuda.max_memory_allocated()}
    # Pinned host memory (offloaded optimizer states and their staging buffers, in the
    # pinned allocator's power-of-two blocks): host RAM, never in the peak, recorded so a
    # GPU run can set it beside what NVML reports.
    try:
        figures["pinned_host_peak"] = int(torch.cuda.host_memory_stats()["allocated_bytes.peak"])
    except Exception as exc:  # noqa: BLE001 - older torch: the device figures stand
        figures["pinned_host_peak"] = f"unavailable: {type(exc).__name__}"[:100]
    figures |= _segments(index, history, name)
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = nvml_handle(pynvml, str(torch.cuda.get_device_properties(index).uuid))
        used, found = process_memory(pynvml, handle, os.getpid(), before)
        overhead = max(0, used - torch.cuda.memory_reserved())
    except Exception as exc:  # noqa: BLE001 - unknown, said so, never the allocator's alone
        figures["nvml_overhead"] = f"unavailable: {type(exc).__name__}: {exc}"[:300]
        return None, GpuMemory.from_dict(figures)
    figures["nvml_overhead"] = overhead
    figures["nvml_process"] = found
    return reserved_peak + overhead, GpuMemory.from_dict(figures)


def nvml_handle(nvml: Any, uuid: str) -> Any:
    """NVML's handle for the device whose CUDA UUID is `uuid` (torch gives it bare, or
    with its prefix). A whole GPU's is "GPU-<uuid>"; a MIG instance's "MIG-<uuid>", which
    nvmlDeviceGetHandleByUUID takes on current drivers; where it does not, the MIG
    instances of each GPU in MIG mode are walked (nvmlDeviceGetMigDeviceHandleByIndex)
    for the one of that UUID."""
    bare = uuid.removeprefix("GPU-").removeprefix("MIG-")
    for prefixed in dict.fromkeys((uuid, f"GPU-{bare}", f"MIG-{bare}")):
        try:
            return nvml.nvmlDeviceGetHandleByUUID(prefixed)
        except nvml.NVMLError:
            continue
    for i in range(nvml.nvmlDeviceGetCount()):
        for mig in _mig_handles(nvml, nvml.nvmlDeviceGetHandleByIndex(i)):
            if _bare(nvml.nvmlDeviceGetUUID(mig)) == bare:
                return mig
    raise LookupError(f"NVML has no GPU or MIG instance of UUID {bare}")


def _bare(uuid: str | bytes) -> str:
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.removeprefix("GPU-").removeprefix("MIG-")


def _mig_handles(nvml: Any, gpu: Any) -> list[Any]:
    """The MIG instances of a GPU in MIG mode (none otherwise)."""
    try:
        current, _ = nvml.nvmlDeviceGetMigMode(gpu)
    except nvml.NVMLError:  # a GPU without MIG
        return []
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return []
    out = []
    for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)):
        try:
            out.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j))
        except nvml.NVMLError:  # an empty slot
            continue
    return out


def nvml_pids() -> set[int] | None:
    """The PIDs NVML lists on every GPU and MIG instance, before the trial touches one:
    the process new on the trial's device at its end is the trial's, whatever PID NVML
    gives it. None where NVML cannot say."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return running_pids(pynvml)
    except Exception:  # noqa: BLE001 - the figure will say NVML could not tell
        return None


def running_pids(nvml: Any) -> set[int]:
    pids: set[int] = set()
    for i in range(nvml.nvmlDeviceGetCount()):
        gpu = nvml.nvmlDeviceGetHandleByIndex(i)
        for handle in (gpu, *_mig_handles(nvml, gpu)):
            try:
                pids |= {p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            except nvml.NVMLError:  # a MIG parent may not answer for its instances
                continue
    return pids


def process_memory(nvml: Any, handle: Any, pid: int, before: set[int] | None) -> tuple[int, str]:
    """(the device memory NVML counts for this process, how it was found): by its PID;
    else, in a container's PID namespace (NVML lists the host's PIDs), as the one process
    on the device that was not there before the trial began. LookupError where neither
    tells, or NVML gives no figure for it (a MIG instance on some drivers)."""
    listed = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    mine, found = [p for p in listed if p.pid == pid], "pid"
    if not mine and before is not None:
        mine = [p for p in listed if p.pid not in before]
        found = "new on the device (NVML's PIDs are another namespace's)"
        if len(mine) != 1:
            raise LookupError(
                f"NVML lists no process of PID {pid} on the device (a container's PID "
                f"namespace), and {len(mine)} processes new since the trial began: which is "
                "this trial's is not known")
    if not mine:
        raise LookupError(f"NVML lists no process of PID {pid} on the device (a container's "
                          "PID namespace hides it)")
    used = mine[0].usedGpuMemory
    if not used:
        raise LookupError("NVML gives no memory figure for this process (a MIG instance "
                          "on some drivers)")
    return int(used), found


def _segments(index: int, history: bool, name: str = "") -> dict[str, Any]:
    """The cache's segments per stream's pool and, with `history`, where they were grown
    from (the history then stops). Figures beside the peak, never the trial's failure."""
    import torch

    figures: dict[str, Any] = {}
    try:  # DeepSpeed reduces and offloads on a stream of its own
        snapshot = (torch.cuda.memory._snapshot() if history
                    else {"segments": torch.cuda.memory_snapshot()})
        figures["reserved_by_stream"] = reserved_by_stream(snapshot["segments"], index)
        if history:
            traces = snapshot["device_traces"][index]
            figures |= {"segment_growth": segment_growth(traces),
                      "large_segments": _guarded(large_segments, traces),
                      "history_events": len(traces),
                      # a full ring has dropped its oldest events: the first segments' among them
                      "history_full": len(traces) >= HISTORY_ENTRIES}
            folder = os.environ.get("AUTOTUNE_MEMORY_TRACES")
            if folder:
                figures["trace_file"] = _guarded(
                    lambda t: str(save_trace(t, Path(folder), name or str(os.getpid()))), traces)
    except Exception as exc:  # noqa: BLE001
        said = f"unavailable: {type(exc).__name__}: {exc}"[:200]
        figures = {"reserved_by_stream": said} | ({"segment_growth": said} if history else {})
    finally:
        if history:
            torch.cuda.memory._record_memory_history(enabled=None)
    return figures


def save_trace(traces: list[dict[str, Any]], folder: Path, name: str) -> Path:
    """The allocator's history as gzipped JSON lines, one event each: [action, address,
    bytes, stream, the innermost frame outside torch, the innermost frame]. What the
    summaries above leave out (every block's place, in order), kept so a disagreement with
    the replay can be followed event by event on a machine without a GPU
    (benchmarks/allocator_trace.py), at about 200 KB per trial."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") + ".jsonl.gz")
    with gzip.open(path, "wt") as f:
        for event in traces:
            frames = event.get("frames") or []
            own = next((x for x in frames if "/torch/" not in str(x.get("filename", ""))), None)
            f.write(json.dumps([event.get("action"), event.get("addr"),
                                int(event.get("size", 0)), _stream_key(event.get("stream")),
                                _frame(own) if own else None,
                                _frame(frames[0]) if frames else None]) + "\n")
    return path


def load_trace(path: Path) -> list[list[Any]]:
    """`save_trace`'s events."""
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def _stream_key(stream: object) -> str:
    stream = int(stream or 0)  # type: ignore[call-overload]
    return "default" if stream == 0 else f"{stream:#x}"


def segment_growth(traces: list[dict[str, Any]], top: int = 12) -> list[dict[str, Any]]:
    """The allocator's history summed by where each new segment (a cudaMalloc) was asked
    for: the stream, and the innermost frame outside torch (DeepSpeed's, transformers',
    the model's); `freed` is what of it went back to the device later (an emptied cache, a
    retry after an OOM). Largest first, `top` of them; the rest in one row."""
    grown: dict[tuple[str, str], list[int]] = {}
    owner: dict[int, tuple[str, str]] = {}  # a live segment's address: its row
    for event in traces:
        action = event.get("action")
        if action == "segment_free" and event.get("addr") in owner:
            grown[owner.pop(event["addr"])][2] += int(event.get("size", 0))
        if action != "segment_alloc":
            continue
        frames = event.get("frames") or []
        caller = next((f for f in frames if "/torch/" not in str(f.get("filename", ""))),
                      frames[0] if frames else None)
        where = ("unknown" if caller is None else
                 f"{_short(caller.get('filename', '?'))}:{caller.get('line', '?')} "
                 f"{caller.get('name', '?')}")
        key = (_stream_key(event.get("stream")), where)
        row = grown.setdefault(key, [0, 0, 0])
        row[0] += int(event.get("size", 0))
        row[1] += 1
        owner[event.get("addr")] = key
    rows = sorted(({"stream": s, "where": w, "bytes": b, "segments": n, "freed": f}
                   for (s, w), (b, n, f) in grown.items()), key=lambda r: -r["bytes"])
    if len(rows) > top:
        rest = rows[top:]
        rows = rows[:top] + [{"stream": "*", "where": f"{len(rest)} more places",
                              **{k: sum(r[k] for r in rest) for k in
                                 ("bytes", "segments", "freed")}}]
    return rows


def _guarded(summary: Any, traces: list[dict[str, Any]]) -> Any:
    """A summary of the history, or why there is none: never the other figures' loss."""
    try:
        return summary(traces)
    except Exception as exc:  # noqa: BLE001 - a diagnosis
        return f"unavailable: {type(exc).__name__}: {exc}"[:200]


def large_segments(traces: list[dict[str, Any]], min_bytes: int = 512 << 20,
                   top: int = 12) -> list[dict[str, Any]]:
    """For each new segment of at least `min_bytes` (the first `top`): the request that
    grew it and what the cache held on that stream just before: its largest free block,
    the free blocks the request would have fit in, and the blocks whose free was asked
    for but not completed (a block used on another stream waits for that stream). The
    ZeRO replay reuses a freed 1570 MiB block where the H200 grew a segment; this says
    which allocator rule made the difference. `after`: the last allocation with a Python
    frame before it (the backward's own allocations have none). `occupied`: the stream's
    segments at least as large as the new one (the first four) and their largest blocks
    then (size, where each was allocated, whether its free waits): what took the space a
    reuse would have needed, such as the forward's freed fp32 logits' segment.

    Rebuilt from the history: allocations are rounded to 512 bytes as the allocator
    rounds them, and a stretch of 1 MiB or less between blocks of a large segment is
    taken for a block's unsplit tail, not a free block; a free block beside such a tail
    reads up to 1 MiB larger than it is. Segments grown before the history
    began (a full ring) are unknown, so free blocks may be missed; under expandable
    segments torch records no `segment_alloc`, and the list is empty."""
    segments: dict[int, tuple[int, Any]] = {}  # addr -> (size, stream)
    blocks: dict[int, int] = {}  # addr -> size, allocated or waiting to be freed
    where: dict[int, str] = {}  # addr -> the allocation's caller outside torch
    pending: set[int] = set()
    rows: list[dict[str, Any]] = []
    caller, asked, free_then = None, None, []
    for i, event in enumerate(traces):
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if asked is not None:  # the segment's own allocation comes next, inside it
            base = asked.pop("_addr")
            if action == "alloc" and base <= addr < base + asked["segment"]:
                asked["request"] = size
                asked["fits"] = sorted((f for f in free_then if f >= _rounded(size)),
                                       reverse=True)[:4]
            asked = None
        if action == "segment_alloc":
            if size >= min_bytes and len(rows) < top:
                stream = event.get("stream")
                free_then = _free_blocks(segments, blocks, stream)
                after = "start" if caller is None else _frame(caller)
                asked = {"event": i, "segment": size, "request": None, "fits": None,
                         "stream": _stream_key(stream), "after": after,
                         "largest_free": max(free_then, default=0),
                         "pending": sorted((blocks.get(a, 0) for a in pending
                                            if _in_stream(segments, a, stream)),
                                           reverse=True)[:4],
                         "occupied": _occupants(segments, blocks, where, pending, stream,
                                                size),
                         "_addr": addr}
                rows.append(asked)
            segments[addr] = (size, event.get("stream"))
        elif action == "segment_free":
            segments.pop(addr, None)
        elif action == "alloc":
            blocks[addr] = _rounded(size)
            frames = event.get("frames") or []
            own = next((f for f in frames if "/torch/" not in str(f.get("filename", ""))),
                       None)
            caller = own or caller  # named where a row is made: most allocations make none
            if size >= min_bytes // 8:  # only the blocks an `occupied` row can show
                where[addr] = _frame(own) if own else "no Python frame"
        elif action == "free_requested":
            pending.add(addr)
        elif action == "free_completed":
            pending.discard(addr)
            blocks.pop(addr, None)
            where.pop(addr, None)
    if asked is not None:
        asked.pop("_addr")
    return rows


def _frame(frame: dict[str, Any]) -> str:
    return (f"{_short(frame.get('filename', '?'))}:{frame.get('line', '?')} "
            f"{frame.get('name', '?')}")


def _occupants(segments: dict[int, tuple[int, Any]], blocks: dict[int, int],
               where: dict[int, str], pending: set[int], stream: object,
               size: int) -> list[dict[str, Any]]:
    """The stream's segments of at least `size` bytes (the first four by address) with
    their three largest blocks: [bytes, where allocated, free waiting]."""
    starts = sorted(blocks)
    out = []
    for base in sorted(a for a, (n, s) in segments.items() if s == stream and n >= size)[:4]:
        end = base + segments[base][0]
        inside = starts[bisect.bisect_left(starts, base):bisect.bisect_left(starts, end)]
        largest = sorted(inside, key=lambda a: blocks[a], reverse=True)[:3]
        out.append({"segment": segments[base][0],
                    "blocks": [[blocks[a], where.get(a, "a smaller block"), a in pending]
                               for a in largest]})
    return out


def _rounded(size: int) -> int:
    return -(-size // 512) * 512


def _in_stream(segments: dict[int, tuple[int, Any]], addr: int, stream: object) -> bool:
    return any(s == stream and a <= addr < a + n for a, (n, s) in segments.items())


def _free_blocks(segments: dict[int, tuple[int, Any]], blocks: dict[int, int],
                 stream: object) -> list[int]:
    """The free blocks of `stream`'s segments: what lies between their blocks, but for the
    unsplit tails (1 MiB or less) a large-pool block keeps."""
    starts = sorted(blocks)
    free = []
    for base, (size, s) in segments.items():
        if s != stream:
            continue
        at, end = base, base + size
        for addr in starts[bisect.bisect_left(starts, base):bisect.bisect_left(starts, end)]:
            if addr - at > SMALL_TAIL:
                free.append(addr - at)
            at = max(at, addr + blocks[addr])
        if end - at > SMALL_TAIL:
            free.append(end - at)
    return free


def _short(path: str) -> str:
    """A frame's file from its package on (.../site-packages/deepspeed/x.py, or DeepSpeed
    carried to the GPU in /tmp/site: deepspeed/x.py), by the longest import root it is
    under."""
    import sys

    for root in sorted((r.rstrip("/") for r in sys.path if r), key=len, reverse=True):
        if path.startswith(root + "/"):
            return path[len(root) + 1:]
    for marker in ("site-packages/", "dist-packages/"):  # another environment's
        if marker in path:
            return path.split(marker, 1)[1]
    return "/".join(path.split("/")[-3:])
