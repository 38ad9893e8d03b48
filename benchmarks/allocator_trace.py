"""A GPU trial's allocator history beside the replay of the same trial, on a machine
without a GPU: where the replay's segments part from the device's.

    python benchmarks/allocator_trace.py TRACE.jsonl.gz "b8x4 bf16 adamw_torch z2 off:optimizer"
        [--shape gpt2-124m-s1024] [--capability 9.0]

TRACE is what the GPU proof's memory step brings back under allocator-traces/ (a ZeRO
row's history, trials/gpu_memory.save_trace); benchmarks/allocator_traces/ keeps two from
an H100. It prints the large segments (512 MiB or more) each grew, in order, the blocks
never freed (the workspaces torch keeps for the process among them), and the segment
sizes whose counts differ. The replay is the physics' own: the ZeRO emulation's where
the config has one, else the plain Trainer step's.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory_accuracy import GPU_SHAPES, spec_for  # noqa: E402

from autotune.config import TrialConfig  # noqa: E402
from autotune.device import DeviceSpec  # noqa: E402
from autotune.plan.allocator import CachingAllocator, blas_workspaces  # noqa: E402
from autotune.plan.shape import model_shape  # noqa: E402
from autotune.spec import load_spec  # noqa: E402
from autotune.trials.gpu_memory import load_trace  # noqa: E402

MiB = 2**20
LARGE = 512 * MiB


def device_segments(events: list[list]) -> list[tuple[str, int]]:
    """(stream, bytes) of each segment the device grew, in order."""
    return [(e[3], e[2]) for e in events if e[0] == "segment_alloc"]


def never_freed(events: list[list], at_least: int = MiB) -> list[tuple[int, list]]:
    """The allocations the history never saw freed, of `at_least` bytes: (index, event)."""
    live: dict[int, int] = {}
    for i, e in enumerate(events):
        if e[0] == "alloc":
            live[e[1]] = i
        elif e[0] == "free_requested":
            live.pop(e[1], None)
    return [(i, events[i]) for i in sorted(live.values()) if events[i][2] >= at_least]


def replayed(label: str, shape_name: str, capability: tuple[int, int]) -> CachingAllocator:
    """The physics' own replay of the trial (Physics.replay_allocator)."""
    from autotune.plan.memory import Physics

    shape = model_shape(load_spec(spec_for(*GPU_SHAPES[shape_name])))
    allocator = Physics(shape, DeviceSpec("gpu", "cuda", 80 * 2**30, capability)
                        ).replay_allocator(TrialConfig.from_label(label))
    if allocator is None:
        raise SystemExit(f"{label}: no allocator replay applies to this config")
    return allocator


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("config", help="the trial's label, as the memory step prints it")
    ap.add_argument("--shape", default="gpt2-124m-s1024", choices=sorted(GPU_SHAPES))
    ap.add_argument("--capability", default="9.0", help="the GPU's, major.minor")
    args = ap.parse_args()
    capability = tuple(int(x) for x in args.capability.split("."))
    events = load_trace(Path(args.trace))
    allocator = replayed(args.config, args.shape, capability)  # type: ignore[arg-type]
    device = device_segments(events)
    replay = [("default" if s == 0 else "side", n) for s, n, _ in allocator.grown]
    print(f"{args.config} on {args.shape}: device grew {sum(n for _, n in device) / MiB:.0f}"
          f" MiB in {len(device)} segments, the replay {sum(n for _, n in replay) / MiB:.0f}"
          f" MiB in {len(replay)} (its reserved peak {allocator.peak_reserved / MiB:.0f} MiB)")
    print("large segments, MiB: device "
          f"{[round(n / MiB) for _, n in device if n >= LARGE]}, replay "
          f"{[round(n / MiB) for _, n in replay if n >= LARGE]}")
    print("never freed (1 MiB or more) on the device:")
    for i, e in never_freed(events):
        print(f"  #{i} {e[2] / MiB:.1f} MiB on {e[3]} from {e[4] or 'no Python frame'}")
    sizes = {k: f"{n / MiB:.1f} MiB" for k, n in blas_workspaces(capability).items()}
    print(f"the replay's workspaces, one per thread that runs a matmul: {sizes}")
    have = Counter((s != "default", n // MiB) for s, n in device)
    want = Counter((s != "default", n // MiB) for s, n in replay)
    print("segment sizes whose counts differ (device, replay):")
    for side, size in sorted(set(have) | set(want)):
        if have[side, size] != want[side, size]:
            print(f"  {'side stream' if side else 'default'} {size:5d} MiB: "
                  f"{have[side, size]:3d} {want[side, size]:3d}")


if __name__ == "__main__":
    main()
