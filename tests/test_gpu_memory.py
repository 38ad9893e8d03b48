"""A GPU trial's memory readings (autotune/trials/gpu_memory.py), from the structures
torch returns on a GPU: its allocator's segments and its history's events."""

from __future__ import annotations

import sys

from autotune.trials.gpu_memory import (
    large_segments,
    load_trace,
    reserved_by_stream,
    save_trace,
    segment_growth,
)

SITE = "/venv/lib/python3.12/site-packages"
TORCH = {"filename": f"{SITE}/torch/nn/functional.py", "line": 10, "name": "gelu"}
BUCKET = {"filename": f"{SITE}/deepspeed/runtime/zero/stage_1_and_2.py", "line": 3266,
          "name": "setup_buckets"}
MODEL = {"filename": f"{SITE}/transformers/models/gpt2/modeling_gpt2.py", "line": 99,
         "name": "forward"}


def test_reserved_bytes_are_summed_per_streams_pool():
    """`torch.cuda.memory_snapshot()`'s segments (the fields it documents) summed per
    stream, this device's only: the default stream is 0 there, another stream its handle."""
    segments = [{"device": 0, "address": 1 << 30, "total_size": 20 << 20, "stream": 0,
                 "segment_type": "large", "allocated_size": 2 << 20, "blocks": []},
                {"device": 0, "address": 2 << 30, "total_size": 2 << 20, "stream": 0,
                 "segment_type": "small", "allocated_size": 0, "blocks": []},
                {"device": 0, "address": 3 << 30, "total_size": 64 << 20,
                 "stream": 0x55D0C0DE, "segment_type": "large", "allocated_size": 0,
                 "blocks": []},
                {"device": 1, "address": 4 << 30, "total_size": 8 << 20, "stream": 0,
                 "segment_type": "large", "allocated_size": 0, "blocks": []}]
    assert reserved_by_stream(segments, 0) == {"default": 22 << 20, "0x55d0c0de": 64 << 20}
    assert reserved_by_stream(segments, 1) == {"default": 8 << 20}
    assert reserved_by_stream([], 0) == {}


def test_a_saved_history_keeps_every_event_in_order_with_its_frames(tmp_path):
    """The history as it comes back from a GPU: every event, with the innermost frame
    outside torch and the innermost of all, under a file name made of the trial's label."""
    events = [{"action": "segment_alloc", "addr": 1 << 30, "size": 954 << 20, "stream": 0,
               "frames": [TORCH, BUCKET]},
              {"action": "alloc", "addr": 1 << 30, "size": 1000, "stream": 0x7F00,
               "frames": [BUCKET]},
              {"action": "free_requested", "addr": 1 << 30, "size": 1000, "stream": 0,
               "frames": []}]
    path = save_trace(events, tmp_path / "traces", "b8x4 bf16 z2 off:optimizer")
    assert path.name == "b8x4_bf16_z2_off_optimizer.jsonl.gz"
    bucket = "deepspeed/runtime/zero/stage_1_and_2.py:3266 setup_buckets"
    assert load_trace(path) == [
        ["segment_alloc", 1 << 30, 954 << 20, "default", bucket,
         "torch/nn/functional.py:10 gelu"],
        ["alloc", 1 << 30, 1000, "0x7f00", bucket, bucket],
        ["free_requested", 1 << 30, 1000, "default", None, None]]


def test_segments_grown_are_summed_by_the_caller_outside_torch_and_stream():
    """The allocator history's events (`torch.cuda.memory._snapshot()["device_traces"]`,
    frames innermost first): only new segments count, each under the innermost frame
    outside torch, largest first, the tail in one row; what an emptied cache gave back
    is counted beside it."""
    events = [{"action": "segment_alloc", "addr": 1, "size": 954 << 20, "stream": 0,
               "frames": [TORCH, BUCKET]},
              {"action": "alloc", "addr": 1, "size": 954 << 20, "stream": 0,
               "frames": [BUCKET]},
              {"action": "segment_alloc", "addr": 2, "size": 954 << 20, "stream": 0,
               "frames": [BUCKET]},
              {"action": "segment_alloc", "addr": 3, "size": 20 << 20, "stream": 0,
               "frames": [TORCH, MODEL]},
              {"action": "segment_alloc", "addr": 4, "size": 300 << 20, "stream": 0x7F00,
               "frames": [BUCKET]},
              {"action": "segment_free", "addr": 3, "size": 20 << 20, "stream": 0,
               "frames": [MODEL]}]
    rows = segment_growth(events)
    assert rows[0] == {"stream": "default", "bytes": 1908 << 20, "segments": 2, "freed": 0,
                       "where": "deepspeed/runtime/zero/stage_1_and_2.py:3266 setup_buckets"}
    assert rows[1]["stream"] == "0x7f00" and rows[1]["bytes"] == 300 << 20
    assert rows[2]["where"].startswith("transformers/models/gpt2/modeling_gpt2.py:99")
    assert rows[2]["freed"] == 20 << 20  # emptied from the cache later
    tail = segment_growth(events, top=1)
    assert tail[-1] == {"stream": "*", "where": "2 more places", "bytes": 320 << 20,
                        "segments": 2, "freed": 20 << 20}


def test_a_frame_is_named_from_the_import_root_it_was_loaded_from(monkeypatch):
    """On the GPU machine DeepSpeed is carried and imported from /tmp/site, not from a
    site-packages folder: its frames still read deepspeed/..., from the longest root."""
    monkeypatch.setattr(sys, "path", ["", "/tmp", "/tmp/site", *sys.path])
    carried = {**BUCKET, "filename": "/tmp/site/deepspeed/runtime/zero/stage_1_and_2.py"}
    rows = segment_growth([{"action": "segment_alloc", "addr": 1, "size": 1 << 20,
                            "stream": 0, "frames": [TORCH, carried]}])
    assert rows[0]["where"] == "deepspeed/runtime/zero/stage_1_and_2.py:3266 setup_buckets"


def test_a_large_segment_says_what_the_cache_held_when_it_was_grown():
    """The H200 grew a 1572 MiB segment in the backward where the replay reused the
    forward's freed block: each large segment's row says what was free on its stream just
    before and which of those blocks its request fit in (a fit names a rule the replay
    lacks), what was still waiting to be freed (a block used on another stream), and what
    allocation came last."""
    mib = 1 << 20
    logits = 1646821376  # 8 x 1024 x 50257 fp32: 1570.5 MiB, in a 1572 MiB segment
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 1572 * mib, "stream": 0},
        {"action": "alloc", "addr": 0, "size": logits, "stream": 0, "frames": [MODEL]},
        {"action": "segment_alloc", "addr": 4096 * mib, "size": 20 * mib, "stream": 0},
        {"action": "alloc", "addr": 4096 * mib, "size": 2 * mib, "stream": 0},
        {"action": "free_requested", "addr": 0, "size": logits, "stream": 0},
        {"action": "free_completed", "addr": 0, "size": logits, "stream": 0},
        {"action": "segment_alloc", "addr": 8192 * mib, "size": 1572 * mib, "stream": 0},
        {"action": "alloc", "addr": 8192 * mib, "size": logits, "stream": 0},
        {"action": "free_requested", "addr": 8192 * mib, "size": logits, "stream": 0},
        {"action": "segment_alloc", "addr": 16384 * mib, "size": 1572 * mib, "stream": 7},
        {"action": "segment_alloc", "addr": 20480 * mib, "size": 1572 * mib, "stream": 0},
        {"action": "alloc", "addr": 20480 * mib, "size": logits, "stream": 0},
        # A 600 MiB segment whose own allocation the history lacks: the next one, elsewhere,
        # is no request of it.
        {"action": "segment_alloc", "addr": 30000 * mib, "size": 600 * mib, "stream": 0},
        {"action": "alloc", "addr": 4098 * mib, "size": 2 * mib, "stream": 0}]
    rows = large_segments(events)
    assert [r["event"] for r in rows] == [0, 6, 9, 10, 12]  # 20 MiB is not large
    first, fit, other, waiting, unrecorded = rows
    assert first["largest_free"] == 0 and first["request"] == logits and first["fits"] == []
    # The freed block was there, whole (its 1.5 MiB tail merged back), and it fit:
    assert fit["fits"] == [1572 * mib] and fit["pending"] == []
    assert fit["largest_free"] == 1572 * mib
    assert fit["after"] == "transformers/models/gpt2/modeling_gpt2.py:99 forward"
    assert other["stream"] == "0x7" and other["largest_free"] == 0  # no segment there yet
    assert other["request"] is None  # the next event is another segment's
    # Now the second block's free waits (another stream used it): it is no free block.
    assert waiting["pending"] == [logits] and waiting["fits"] == [1572 * mib]
    assert unrecorded["request"] is None and unrecorded["fits"] is None
    # What is free at the end: segment 0 whole, the unrecorded 600 MiB segment, the
    # 20 MiB segment's 16 MiB, and the 1.5 MiB left of the last 1572 MiB segment (over
    # 1 MiB: the allocator split it off).
    probe = [*events, {"action": "segment_alloc", "addr": 1 << 50, "size": 1 << 30,
                       "stream": 0},
             {"action": "alloc", "addr": 1 << 50, "size": 1 << 20, "stream": 0}]
    assert large_segments(probe)[-1]["fits"] == [1572 * mib, 600 * mib, 16 * mib,
                                                 1572 * mib - 1646821376]
    # A block that leaves 1 MiB or less keeps it as its tail: that is no free block.
    tails = [{"action": "segment_alloc", "addr": 0, "size": 600 * mib, "stream": 0},
             {"action": "alloc", "addr": 0, "size": 600 * mib - mib // 2, "stream": 0},
             {"action": "segment_alloc", "addr": 1000 * mib, "size": 600 * mib, "stream": 0},
             {"action": "alloc", "addr": 1000 * mib, "size": 598 * mib, "stream": 0},
             {"action": "segment_alloc", "addr": 5000 * mib, "size": 1 << 30, "stream": 0},
             {"action": "alloc", "addr": 5000 * mib, "size": 512, "stream": 0}]
    assert large_segments(tails)[-1]["fits"] == [2 * mib]
    assert large_segments(events, top=1) == rows[:1]


def test_a_large_segment_says_what_fills_the_segments_it_could_have_reused():
    """The question the H200 left: the forward's fp32 logits freed their 1572 MiB segment,
    yet the backward grew another. Each row names what then occupied the stream's
    segments as large as the new one: here a reduction bucket carved from the logits'
    segment, so the backward's request (made with no Python frame) found no room."""
    mib = 1 << 20
    logits = 1646821376
    bucket = 1_000_000_000
    events = [
        {"action": "segment_alloc", "addr": 0, "size": 1572 * mib, "stream": 0},
        {"action": "alloc", "addr": 0, "size": logits, "stream": 0, "frames": [TORCH, MODEL]},
        {"action": "free_requested", "addr": 0, "size": logits, "stream": 0},
        {"action": "free_completed", "addr": 0, "size": logits, "stream": 0},
        {"action": "alloc", "addr": 0, "size": bucket, "stream": 0, "frames": [BUCKET]},
        {"action": "alloc", "addr": 1200 * mib, "size": 2 * mib, "stream": 0},
        {"action": "free_requested", "addr": 1200 * mib, "size": 2 * mib, "stream": 0},
        {"action": "segment_alloc", "addr": 4096 * mib, "size": 1572 * mib, "stream": 0},
        {"action": "alloc", "addr": 4096 * mib, "size": logits, "stream": 0}]
    first, backward = large_segments(events)
    assert first["occupied"] == []  # no segment of its size before it
    held, = backward["occupied"]  # the new segment is not among them
    assert held["segment"] == 1572 * mib
    assert held["blocks"] == [
        [bucket, "deepspeed/runtime/zero/stage_1_and_2.py:3266 setup_buckets", False],
        [2 * mib, "a smaller block", True]]
    assert backward["fits"] == [] and backward["pending"] == [2 * mib]


# --- NVML: the trial's device and process (NVML faked: the hardware is not here) --------

class FakeNVML:
    """NVML as nvidia-ml-py exposes it, over `gpus`: each a dict of `uuid`, `procs`
    ((pid, bytes) pairs), and `migs` (MIG instances, each a `uuid` and `procs`) when in
    MIG mode. `mig_uuids`: whether nvmlDeviceGetHandleByUUID takes a MIG instance's."""

    NVML_DEVICE_MIG_ENABLE = 1

    class NVMLError(Exception):
        pass

    def __init__(self, gpus: list[dict], mig_uuids: bool = True) -> None:
        self.gpus, self.mig_uuids = gpus, mig_uuids

    def _all(self) -> list[dict]:
        return [*self.gpus, *(m for g in self.gpus for m in g.get("migs", []))]

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802 - NVML's names
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict:  # noqa: N802
        return self.gpus[i]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> dict:  # noqa: N802
        for d in self._all():
            if d["uuid"] == uuid and (self.mig_uuids or d in self.gpus):
                return d
        raise self.NVMLError("Not Found")

    def nvmlDeviceGetUUID(self, handle: dict) -> str:  # noqa: N802
        return handle["uuid"]

    def nvmlDeviceGetMigMode(self, handle: dict) -> tuple[int, int]:  # noqa: N802
        if "migs" not in handle:
            raise self.NVMLError("Not Supported")
        return 1, 1

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: dict) -> int:  # noqa: N802
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: dict, j: int) -> dict:  # noqa: N802
        if j >= len(handle["migs"]):
            raise self.NVMLError("Not Found")
        return handle["migs"][j]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict) -> list:  # noqa: N802
        from types import SimpleNamespace

        if "migs" in handle:  # a MIG parent answers for none of its instances
            raise self.NVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, usedGpuMemory=used) for pid, used in handle["procs"]]


GIB = 2**30


def test_a_mig_instance_is_found_by_its_own_uuid():
    """torch gives a MIG instance's UUID bare, as a whole GPU's; NVML names it "MIG-…"
    (it was prefixed "GPU-", found nothing, and the runtime term read 1.3 GiB low). Where
    the driver's nvmlDeviceGetHandleByUUID takes no MIG UUID, the instances are walked."""
    import pytest

    from autotune.trials.gpu_memory import nvml_handle, process_memory, running_pids

    mig = {"uuid": "MIG-5c1d3f2e-0000-0000-0000-000000000001", "procs": [(4321, 3 * GIB)]}
    other = {"uuid": "MIG-5c1d3f2e-0000-0000-0000-000000000002", "procs": [(99, GIB)]}
    gpus = [{"uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000", "procs": [(7, GIB)]},
            {"uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000", "procs": [],
             "migs": [other, mig]}]
    for nvml in (FakeNVML(gpus), FakeNVML(gpus, mig_uuids=False)):
        assert nvml_handle(nvml, "5c1d3f2e-0000-0000-0000-000000000001") is mig
        assert nvml_handle(nvml, "aaaaaaaa-0000-0000-0000-000000000000") is gpus[0]
        assert nvml_handle(nvml, "GPU-aaaaaaaa-0000-0000-0000-000000000000") is gpus[0]
        assert process_memory(nvml, mig, 4321, None) == (3 * GIB, "pid")
        assert running_pids(nvml) == {7, 99, 4321}
        with pytest.raises(LookupError, match="no GPU or MIG instance"):
            nvml_handle(nvml, "cccccccc-0000-0000-0000-000000000000")
    mig["procs"] = [(4321, None)]  # NVML_VALUE_NOT_AVAILABLE: no figure, never 0
    with pytest.raises(LookupError, match="no memory figure"):
        process_memory(FakeNVML(gpus), mig, 4321, None)


def test_in_a_pid_namespace_the_trials_process_is_the_one_new_on_its_device():
    """In a container NVML lists the host's PIDs, so this process's own never matches and
    the runtime term went missing (the peak read 1.3 GiB or more low). The process new on
    the device since the trial began is the trial's; where that is not one process, the
    figure is unknown, not wrong."""
    import pytest

    from autotune.trials.gpu_memory import process_memory

    gpu = {"uuid": "GPU-aaaa", "procs": [(51234, 2 * GIB), (60017, 5 * GIB)]}
    nvml = FakeNVML([gpu])
    before = {51234}  # another user's process, there before the trial touched the GPU
    assert process_memory(nvml, gpu, 12, before) == (
        5 * GIB, "new on the device (NVML's PIDs are another namespace's)")
    with pytest.raises(LookupError, match="no process of PID 12"):
        process_memory(nvml, gpu, 12, None)  # nothing to tell it by
    gpu["procs"].append((60018, GIB))
    with pytest.raises(LookupError, match="2 processes new"):
        process_memory(nvml, gpu, 12, before)
