"""Installed, not cloned: the wheel `pip wheel .` builds carries what a run needs, as a
cluster node or a team's image has it (no checkout beside the package, no editable
install), and `autotune estimate` and a search run from it in a folder of their own."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml

from tests.conftest import TINY_SPEC

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
# What a build of the checkout never reads: the checkout's own environment, the history,
# outputs and caches (an in-tree build/ could carry files the package no longer has).
NOT_SOURCE = (".git", ".venv", ".whl", "build", "dist", "runs", "reports", "*.egg-info",
              "__pycache__", ".pytest_cache", ".ruff_cache")


def _build_wheel(out: Path) -> Path:
    """`pip wheel . --no-deps` of a copy of the checkout, so the build leaves nothing in it.
    Without build isolation where setuptools is at hand (offline, and seconds faster)."""
    src = out / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_SOURCE))
    isolation = [] if importlib.util.find_spec("setuptools") is None else [
        "--no-build-isolation"]
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           *isolation, "-w", str(out / "dist"), str(src)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (wheel,) = (out / "dist").glob("autotune-*.whl")
    return wheel


def _venv_with(wheel: Path, where: Path) -> Path:
    """A fresh venv holding the wheel, installed non-editable; the heavy dependencies
    come from this interpreter's site-packages, appended as a plain path (its .pth files,
    the editable install's finder among them, are not run)."""
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig."
                                "get_paths()['purelib'])"], capture_output=True, text=True,
                               check=True).stdout.strip())
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "checkout-deps.pth").write_text("".join(f"{p}\n" for p in sorted(deps)))
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "-q", "--no-deps", "--no-index", str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return venv


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(the venv, a folder outside the checkout, the environment to run there in)."""
    tmp = tmp_path_factory.mktemp("install")
    venv = _venv_with(_build_wheel(tmp), tmp)
    elsewhere = tmp / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return venv, elsewhere, env


def _run(installed, *args: str, timeout: float = 120) -> str:
    venv, elsewhere, env = installed
    proc = subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_wheel_carries_the_spaces_and_runs_from_the_installed_package(installed):
    venv, elsewhere, _ = installed
    # The package imported is the venv's copy, never the checkout.
    where = _run(installed, "python", "-c", "import autotune, autotune.space as s; "
                 "print(autotune.__file__); print(s.SPACES_DIR)").split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    assert {"default.yaml", "no-deepspeed.yaml"} <= {p.name for p in Path(where[1]).iterdir()}
    # The bundled example, copied out of the checkout (the search below runs the console
    # script).
    shutil.copy(ROOT / "examples" / "tiny-gpt2.yaml", elsewhere / "tiny-gpt2.yaml")
    fitting = _run(installed, "python", "-c", "import autotune; r = autotune.estimate("
                   "'tiny-gpt2.yaml'); print(sum(r.fits for r in r.rows))")
    assert int(fitting) > 0, fitting


def test_a_tiny_search_runs_from_the_installed_package(installed):
    _, elsewhere, _ = installed
    spec = TINY_SPEC | {"output": "out", "search": TINY_SPEC["search"] | {
        "space": "default", "n_trials": 2, "confirm_repeats": 0}}
    (elsewhere / "model.yaml").write_text(yaml.safe_dump(spec))
    _run(installed, "autotune", "search", "model.yaml", timeout=600)
    summary = json.loads((elsewhere / "out" / "summary.json").read_text())
    ran = [t["outcome"] for t in summary["trials"] if t["outcome"]["status"] != "pruned"]
    assert ran and all(o["status"] == "ok" for o in ran), [o.get("error") for o in ran]
    assert (elsewhere / "out" / "training_args.json").is_file()
