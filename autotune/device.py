"""What the trial runs on: the local device, or a named one to plan for.

Device rules (which precisions and optimizers can run) and MFU both need the compute
capability and peak FLOP/s, which torch does not report; they live in one table here.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from autotune.errors import SpecError

log = logging.getLogger("autotune")
MiB, GiB = 1024**2, 1024**3
# The default trial budget on CPU: half the RAM free when the search starts, so the
# machine keeps room for everything else on it.
CPU_BUDGET_SHARE = 0.5


@dataclass(frozen=True)
class DeviceSpec:
    name: str
    kind: str  # "cuda" or "cpu"
    memory_bytes: int
    compute_capability: tuple[int, int] | None = None
    count: int = 1
    # Dense peak FLOP/s by precision; empty where unknown (MFU is then not reported).
    peak_flops: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    # A CPU with bf16 instructions (AVX512-BF16 or AMX): bf16 runs fast there, not only
    # runs. On GPUs the compute capability says it.
    native_bf16: bool = False
    # The nodes one trial's ranks span (count is then all of them): collectives that cross
    # a node run over the network, an order of magnitude slower than NVLink inside one.
    nodes: int = 1
    # How the ranks are linked, as far as the probe could read it: {"intra": "NVLink"|
    # "PCIe", "inter": "InfiniBand 400 Gb/s"|"Ethernet 100 Gb/s"|...}; for the report.
    links: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def per_node(self) -> int:
        """Devices on each node a trial's ranks span (`count` is all of them)."""
        return self.count // max(1, self.nodes)

    def to_dict(self) -> dict[str, Any]:
        """Every field, as JSON has them: the one form a device travels in, from the node
        that probed it to the driver and into summary.json. `gpus_per_node` is there for
        people reading summary.json; being derived, `from_dict` ignores it."""
        d = asdict(self)
        cc = self.compute_capability
        return d | {"compute_capability": list(cc) if cc else None,
                    "gpus_per_node": self.per_node}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DeviceSpec:
        """The device `to_dict` wrote, its tuple restored; a key it does not know (a newer
        autotune's) is ignored, one an older autotune did not write takes its default."""
        raw = {k: v for k, v in d.items() if k in {f.name for f in fields(cls)}}
        cc = raw.get("compute_capability")
        return cls(**raw | {
            "compute_capability": (int(cc[0]), int(cc[1])) if cc else None,
            "peak_flops": {str(k): float(v) for k, v in (raw.get("peak_flops") or {}).items()},
            "links": {str(k): str(v) for k, v in (raw.get("links") or {}).items()}})

    def supports_bf16(self) -> bool:
        # bf16 tensor cores arrived with Ampere (8.0); PyTorch on CPU runs bf16 too. A GPU
        # whose capability is not known (a landscape's device we have no entry for) is
        # given the benefit of the doubt: trying costs one trial, ruling out may cost the best.
        cc = self.compute_capability
        return not self.is_cuda or cc is None or cc >= (8, 0)

    def supports_tf32(self) -> bool:
        cc = self.compute_capability
        return self.is_cuda and (cc is None or cc >= (8, 0))

    def supports_fp16(self) -> bool:
        # Trainer refuses fp16 mixed precision without CUDA (no GradScaler path on CPU).
        return self.is_cuda


T = 1e12
# Dense peak FLOP/s by precision of GPUs sold in more than one memory size.
_V100 = {"fp32": 15.7 * T, "fp16": 125 * T}
_A100 = {"fp32": 19.5 * T, "tf32": 156 * T, "fp16": 312 * T, "bf16": 312 * T}
_HOPPER = {"fp32": 67 * T, "tf32": 495 * T, "fp16": 989 * T, "bf16": 989 * T}


def _ampere_plus(fp32: float, tf32: float, half: float) -> dict[str, float]:
    return {"fp32": fp32 * T, "tf32": tf32 * T, "fp16": half * T, "bf16": half * T}


# name: (memory in MiB as nvidia-smi reports the card's total, compute capability,
# {precision: dense peak FLOP/s}). The GB in a card's name is a round number: an L4 "24GB"
# holds 22.5 GiB, and planning for 24 would call fits what is not. On the card a search
# reads torch's total_memory, which on some cards is a little lower still (ECC's reserve).
KNOWN_DEVICES: dict[str, tuple[int, tuple[int, int], dict[str, float]]] = {
    "V100-16GB": (16160, (7, 0), _V100),
    "V100-32GB": (32510, (7, 0), _V100),
    "T4-16GB": (15360, (7, 5), {"fp32": 8.1 * T, "fp16": 65 * T}),
    "A10G-24GB": (23028, (8, 6), _ampere_plus(31.2, 62.5, 125)),
    "L4-24GB": (23034, (8, 9), _ampere_plus(30.3, 60, 121)),
    "A100-40GB": (40960, (8, 0), _A100),
    "A100-80GB": (81920, (8, 0), _A100),
    "A6000-48GB": (49140, (8, 6), _ampere_plus(38.7, 77.4, 155)),
    "RTX3090-24GB": (24576, (8, 6), _ampere_plus(35.6, 35.6, 71)),
    "RTX4090-24GB": (24564, (8, 9), _ampere_plus(82.6, 82.6, 165)),
    "L40S-48GB": (46068, (8, 9), _ampere_plus(91.6, 183, 362)),
    "H100-80GB": (81559, (9, 0), _HOPPER),
    "H200-141GB": (143771, (9, 0), _HOPPER),
    # The same chip on a card's power budget: fewer SMs or lower clocks, peaks 15-25%
    # under the SXM part's, so an MFU against those would read low by as much.
    "H100PCIE-80GB": (81559, (9, 0), _ampere_plus(51, 378, 756)),
    "H100NVL-94GB": (95830, (9, 0), _ampere_plus(60, 418, 835)),
    "H200NVL-141GB": (143771, (9, 0), _ampere_plus(60, 418, 835)),
}


def named_device(name: str, count: int = 1) -> DeviceSpec:
    """A device to plan for, by name ("A100-80GB", "a100", "V100-16GB"); a size the table
    does not list ("A100-64GB") is taken as that many GiB."""
    key = _match_known(name)
    if key is None:
        allowed = ", ".join(KNOWN_DEVICES)
        raise SpecError(f"--device: unknown device {name!r}; known: {allowed}")
    mib, cc, flops = KNOWN_DEVICES[key]
    size = _stated_size(name)
    memory = mib * MiB if size is None or key.endswith(f"-{size}GB") else int(size) * GiB
    return DeviceSpec(key, "cuda", memory, cc, count, dict(flops))


def _stated_size(name: str) -> str | None:
    """The GB a device's name states ("A100 80GB PCIe", "V100-32GB"), read before the name
    is flattened (else "A100 80GB" would read as 10080)."""
    size = re.search(r"(?<![0-9])(\d+)\s*GB", name, re.IGNORECASE)
    return size.group(1) if size else None


def _match_known(name: str) -> str | None:
    upper = name.upper().replace("NVIDIA", "").strip()
    exact = upper.replace(" ", "").replace("_", "-")
    if exact in KNOWN_DEVICES:
        return exact
    size = _stated_size(name)
    flat = re.sub(r"[\s_-]", "", upper)  # "H100-PCIe", "H100 PCIe", "h100_pcie" alike
    # Longest model names first, so "L40S" is not taken for an "L4".
    keys = sorted(KNOWN_DEVICES, key=lambda k: -len(k.split("-")[0]))
    for key in keys:
        model = key.split("-")[0]
        if model in flat and (size is None or key.endswith(f"-{size}GB")):
            return key
    for key in keys:  # a size we do not list: keep the model's rules
        if key.split("-")[0] in flat:
            return key
    return None


def node_cpus() -> int:
    """Cores this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def peak_flops_of(name: str) -> dict[str, float]:
    """The dense peak FLOP/s of the card a CUDA device name names; {} where not known, and
    for a MIG slice ("... MIG 3g.40gb"), which has a share of the card's SMs that its name
    does not give exactly (the card's peak would put MFU several times too low)."""
    if re.search(r"\bMIG\b", name, re.IGNORECASE):
        return {}
    key = _match_known(name)
    return dict(KNOWN_DEVICES[key][2]) if key else {}


def local_device(gpu_index: int = 0) -> DeviceSpec:
    """The device trials here run on: GPU `gpu_index` if CUDA is up, else the CPU. A CPU
    build of torch is not imported to ask (1-2 s of a CPU search's driver): it has no GPU
    on any machine."""
    from autotune.versions import torch_gpu_build

    torch = None
    if "torch" in sys.modules or torch_gpu_build():
        import torch
    if torch is not None and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(gpu_index)
        cc = (props.major, props.minor)
        flops = peak_flops_of(props.name)
        count = torch.cuda.device_count()
        link = gpu_link() if count > 1 else None
        return DeviceSpec(props.name, "cuda", props.total_memory, cc, count, flops,
                          links={"intra": link} if link else {})
    import psutil

    return DeviceSpec("cpu", "cpu", psutil.virtual_memory().total, None, 1, {},
                      native_bf16=cpu_has_native_bf16())


def _cpu_flags(path: str = "/proc/cpuinfo") -> set[str] | None:
    """The CPU's feature flags as Linux lists them; None where it does not."""
    try:
        with open(path, encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        return None
    return None


def gpu_link() -> str | None:
    """How this node's GPUs reach each other, from `nvidia-smi topo -m` ("NV12" entries are
    NVLink); None with fewer than two GPUs or without nvidia-smi."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    rows = [line.split() for line in out.splitlines() if line.startswith("GPU")]
    if len(rows) < 2:
        return None
    cells = {c for row in rows for c in row[1:len(rows) + 1] if c != "X"}
    return "NVLink" if any(c.startswith("NV") for c in cells) else "PCIe"


def network_link(root: str = "/sys/class") -> str | None:
    """The fastest way off this node, as the kernel lists it: an InfiniBand (or RoCE) port's
    rate, else the fastest Ethernet interface's speed; None where nothing says."""
    from pathlib import Path

    best: tuple[float, str] | None = None
    for rate in sorted(Path(root, "infiniband").glob("*/ports/*/rate")):
        try:  # "400 Gb/sec (4X NDR)"
            gbps = float(rate.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        if best is None or gbps > best[0]:
            best = (gbps, f"InfiniBand {gbps:g} Gb/s")
    if best:
        return best[1]
    for speed in sorted(Path(root, "net").glob("*/speed")):
        if speed.parent.name == "lo":
            continue
        try:  # Mb/s; -1 or unreadable for virtual interfaces
            mbps = int(speed.read_text().strip())
        except (OSError, ValueError):
            continue
        if mbps > 0 and (best is None or mbps / 1000 > best[0]):
            best = (mbps / 1000, f"Ethernet {mbps / 1000:g} Gb/s")
    return best[1] if best else None


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver's device nodes are here, without importing torch (1 s): a
    machine without them runs its trials on the CPU."""
    return os.path.exists("/dev/nvidiactl")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes in bf16 natively (AVX512-BF16 or AMX tiles); without,
    torch emulates bf16 through fp32 and autocast runs slower than fp32. Read from the
    kernel's flags where it lists them (torch's own probe reads the same CPUID bits)."""
    flags = _cpu_flags()
    if flags is not None:
        return bool(flags & {"avx512_bf16", "amx_tile"})
    import torch

    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, p, lambda: False)()) for p in probes)


def memory_limit(device: DeviceSpec, budget: int | None = None, parallel: int = 1) -> int:
    """Per-rank memory a trial may use: the user's budget, never more than the device has.
    On CPU the host is the device: the budget is capped at the RAM available now, shared
    among the `parallel` trials that run at once (with a warning), so each trial's own
    budget watch ends a trial that grows too large, not the kernel or Ray's memory
    monitor; without a budget, a share of it."""
    if device.is_cuda:
        if budget is not None and budget > device.memory_bytes:
            log.warning("hardware.memory_budget %.2f GiB is more than the %s has (%.2f GiB); "
                        "using the device's memory", budget / GiB, device.name,
                        device.memory_bytes / GiB)
        return min(budget or device.memory_bytes, device.memory_bytes)
    import psutil

    available = psutil.virtual_memory().available // max(1, parallel)
    if budget is None:
        return int(available * CPU_BUDGET_SHARE)
    if budget > available:
        log.warning("hardware.memory_budget %.2f GiB is more than the %.2f GiB of RAM "
                    "available to each of %d trial(s) at once; trials are capped at that",
                    budget / GiB, available / GiB, parallel)
        return int(available)
    return budget
