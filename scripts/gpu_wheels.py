"""Wheels for the GPU machine, which reaches no package registry, within what one call carries.

The device tool's machines hold PyTorch, transformers, accelerate, PEFT and NVML's
bindings, but not DeepSpeed, Ray, Optuna or bitsandbytes, and a call carries at most
64 MiB with the working tree. This puts in `.whl/` (ignored by git) the wheels of every
distribution autotune needs that the image lacks, at the versions this checkout is
tested with, for the image's Python (3.12, x86-64 Linux):

- the missing part of autotune's requirement closure, walked from this environment's
  installed metadata, stopping at what the image already has;
- DeepSpeed built from its sdist (PyPI has no wheel; its ops compile just in time);
- Ray without its Java jar, dashboard client and unused libraries (Tune, Train and AIR
  among them: neither the driver nor a worker imports them; 75.6 MiB to about 37);
- liger-kernel (pinned: no requirement of autotune's) and bitsandbytes (slimmed to the
  image's CUDA 13.0 kernels, 41 to about 4 MiB) last, only if they still fit (without
  them Liger, the 8-bit optimizers and a quantized base are pruned from the space, as on
  any machine without them).

    .venv/bin/python scripts/gpu_wheels.py            # then: run(carry=[".whl"], ...)

`benchmarks/gpu_proof.sh` installs whatever is in `.whl/` to a private target first.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
# The device tool's image 'cuda' (nvidia-h100-x1, nvidia-h200), as its KINDS.md listed it
# on 2026-11-17: carry only what is not here.
IMAGE_LISTED = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
IMAGE = {canonicalize_name(name) for name in IMAGE_LISTED.split()}
# The versions the image holds of the stack autotune drives, as KINDS.md's pip list read
# them (2026-11): what a proof on the GPU runs with, never carried. Not mirrored by
# --image-overlay: torch 2.11 (no CPU build of it is to be had here) and numpy 2.5 (it
# needs Python 3.12), so a rehearsal keeps this environment's; nor peft, whose version
# there no reading gave.
IMAGE_VERSIONS = {"transformers": "5.17.0", "accelerate": "1.15.0",
                  "huggingface-hub": "1.33.0", "tokenizers": "0.23.2", "safetensors": "0.8.0"}
TARGET = {"sys_platform": "linux",
          "platform_machine": "x86_64", "platform_system": "Linux", "os_name": "posix",
          "implementation_name": "cpython", "platform_python_implementation": "CPython"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_34_x86_64",
             "manylinux_2_35_x86_64", "manylinux_2_24_x86_64", "manylinux_2_31_x86_64"]
# Carried last, and required: without them Liger, the 8-bit optimizers and a 4-bit base
# would be pruned from the space and the proof would say nothing of them (the proof
# refuses to start without them). liger-kernel is no requirement of autotune's (its
# Triton kernels need a GPU), so its version is pinned here; it needs only torch and
# triton, which the image has. flash-attn has no wheel on PyPI (an sdist that compiles
# for hours against CUDA): it is not carried.
LAST = ("liger-kernel", "bitsandbytes")
GPU_ONLY = {"liger-kernel": "0.8.5"}
NO_WHEEL = ("deepspeed",)  # sdist only on PyPI
# Java workers, the dashboard's web client (autotune starts Ray without the dashboard),
# and libraries autotune does not use (Ray imports them lazily, on first use).
RAY_DROP = ("ray/jars/", "ray/dashboard/client/", "ray/rllib/", "ray/data/", "ray/serve/",
            "ray/llm/", "ray/tune/", "ray/train/", "ray/air/")
# Plotly's JupyterLab extension (the report embeds plotly.js from package_data).
# bitsandbytes ships a kernel library per CUDA and ROCm release (41 MiB): the image's
# torch is built for CUDA 13.0, whose library (and the CPU one) is all it loads.
BNB_DROP = ("libbitsandbytes_cuda11", "libbitsandbytes_cuda12", "libbitsandbytes_cuda132",
            "libbitsandbytes_rocm", "libbitsandbytes_xpu")
# Plotly's FigureWidget bundle (Jupyter's; the report embeds plotly.min.js).
SLIMMED = {"ray": RAY_DROP,
           "plotly": ("/labextension/", ".data/data/share/", "package_data/widgetbundle.js"),
           "bitsandbytes": BNB_DROP}
# Requirements of autotune's that a proof never loads: PostgreSQL's driver, for a team's
# results store (the proof's searches use the default SQLite one), 3.9 MiB with its
# OpenSSL and Kerberos libraries.
NOT_CARRIED = ("psycopg", "psycopg-binary", "psycopg-c")
CARRY_MIB = 64.0  # what one device call carries, the working tree included
MARGIN_MIB = 0.5


def tree_mib() -> float:
    """The working tree a device call copies: tracked and untracked, unignored files."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=ROOT, check=True,
                            capture_output=True).stdout.split(b"\0")
    return sum((ROOT / os.fsdecode(f)).stat().st_size for f in listed
               if f and (ROOT / os.fsdecode(f)).is_file()) / 2**20


def missing(image: set[str] = IMAGE, python: str = "3.12") -> dict[str, str]:
    """{distribution: installed version} that autotune needs and the image lacks: its
    requirements, and theirs, walked only through distributions the image does not have
    (the image's own satisfy their own), markers read for the image's Python."""
    found: dict[str, str] = {}
    target = TARGET | {"python_version": python, "python_full_version": f"{python}.0"}

    def walk(name: str, extras: frozenset[str]) -> None:
        key = canonicalize_name(name)
        if key in image or key in found or key in NOT_CARRIED:
            return
        dist = md.distribution(name)
        found[key] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate(target | {"extra": e})
                                         for e in {"", *extras}):
                walk(req.name, frozenset(req.extras))

    for line in md.requires("autotune") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(target | {"extra": ""}):
            walk(req.name, frozenset(req.extras))
    return found


def fetch(name: str, version: str, out: Path, python: str = "3.12") -> Path:
    """One distribution's wheel for the image (or another CPython `python`), into `out`."""
    before = set(out.iterdir())
    if name in NO_WHEEL:
        cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
               "-w", str(out), f"{name}=={version}"]
        env = os.environ | {"DS_BUILD_OPS": "0"}
    else:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps",
               "--only-binary=:all:", "--python-version", python, "--implementation", "cp",
               *[f"--platform={p}" for p in PLATFORMS], "-d", str(out), f"{name}=={version}"]
        env = None
    subprocess.run(cmd, check=True, env=env)
    new = set(out.iterdir()) - before
    if len(new) != 1:
        raise RuntimeError(f"{name}=={version}: expected one wheel, got {sorted(new)}")
    return new.pop()


def slim(wheel: Path, drop: tuple[str, ...]) -> Path:
    """The wheel less the files whose path contains any of `drop`, its RECORD rewritten
    to match (pip takes the RECORD as the list of what it installed)."""
    tmp = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        kept = [n for n in src.namelist() if n != record and not any(d in n for d in drop)]
        rows = []
        for name in kept:
            data = src.read(name)
            dst.writestr(src.getinfo(name), data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            rows.append(f"{name},sha256={digest.decode()},{len(data)}")
        dst.writestr(record, "\n".join([*rows, f"{record},,"]) + "\n")
    tmp.replace(wheel)
    return wheel


def image_overlay(target: Path, pins: dict[str, str] = IMAGE_VERSIONS) -> list[str]:
    """Install into `target` the image's versions of autotune's stack and what they need
    that this environment lacks (pip resolves them against it), so that this environment
    with PYTHONPATH=target runs as the image would, the way gpu_proof.sh lays the carried
    wheels over the image: a rehearsal on them fails here, not in a device call."""
    wanted = [f"{name}=={version}" for name, version in pins.items()]
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--report",
                        str(report), *wanted], check=True)
        resolved = [f"{d['metadata']['name']}=={d['metadata']['version']}"
                    for d in json.loads(report.read_text())["install"]]
    if resolved:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--upgrade",
                        "--target", str(target), *resolved], check=True)
    return resolved


def overlay_mismatches(target: Path, pins: dict[str, str] = IMAGE_VERSIONS) -> list[str]:
    """Where this environment under `target` does not import the image's versions."""
    probe = ("import importlib.metadata as md, json, sys; "
             "print(json.dumps({n: md.version(n) for n in json.loads(sys.argv[1])}))")
    path = [str(target), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(path)}
    seen = json.loads(subprocess.run([sys.executable, "-c", probe, json.dumps(list(pins))],
                                     env=env, check=True, capture_output=True,
                                     text=True).stdout)
    return [f"{n} {seen[n]} (image: {v})" for n, v in pins.items() if seen[n] != v]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / ".whl"))
    ap.add_argument("--image-overlay", metavar="DIR", default=None,
                    help="instead: install the image's versions of transformers and its "
                         "kin into DIR, to rehearse with PYTHONPATH=DIR")
    ap.add_argument("--python", default="3.12", help="the target CPython (a rehearsal "
                    "in a bare environment of this machine's Python: 3.11)")
    ap.add_argument("--budget-mib", type=float, default=None,
                    help="default: 64 MiB less the working tree and a margin")
    args = ap.parse_args()
    if args.image_overlay:
        target = Path(args.image_overlay)
        installed = image_overlay(target)
        wrong = overlay_mismatches(target)
        print(f"{target}: {', '.join(installed) or 'nothing to add'}; as on the image: "
              f"{', '.join(f'{n} {v}' for n, v in IMAGE_VERSIONS.items())}"
              + (f"; NOT: {', '.join(wrong)}" if wrong else ""))
        return 1 if wrong else 0
    if args.budget_mib is None:
        args.budget_mib = CARRY_MIB - tree_mib() - MARGIN_MIB
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):  # a fresh set: two versions of one stop the install
        old.unlink()
    need = missing(python=args.python) | GPU_ONLY
    order = sorted(n for n in need if n not in LAST) + [n for n in LAST if n in need]
    total = 0.0
    with tempfile.TemporaryDirectory() as scratch:
        for name in order:
            wheel = fetch(name, need[name], Path(scratch), args.python)
            if name in SLIMMED:
                slim(wheel, SLIMMED[name])
            mib = wheel.stat().st_size / 2**20
            if total + mib > args.budget_mib:
                print(f"{name} ({mib:.1f} MiB) does not fit: {total:.1f} MiB already of "
                      f"{args.budget_mib:.1f} MiB (64 MiB less the working tree, "
                      f"{tree_mib():.1f} MiB, and {MARGIN_MIB} MiB); slim a wheel or the "
                      "tree: the proof needs every one", file=sys.stderr)
                return 1
            shutil.move(str(wheel), out / wheel.name)
            total += mib
            print(f"  {name} {need[name]}: {mib:.1f} MiB")
    print(f"{len(need)} wheels, {total:.1f} MiB in {out} (budget {args.budget_mib:.1f} MiB, "
          f"{args.budget_mib - total:.1f} MiB to spare)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
