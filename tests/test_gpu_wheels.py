"""The wheels carried to the GPU machine: what is missing there, and slimming a wheel."""

from __future__ import annotations

import base64
import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_wheels  # noqa: E402


def test_what_the_gpu_image_lacks_is_walked_from_autotunes_requirements():
    need = gpu_wheels.missing()
    for name in ("deepspeed", "ray", "optuna", "pydantic", "sqlalchemy", "plotly"):
        assert name in need, name  # direct requirements, and optuna's storage
    for name in ("torch", "transformers", "accelerate", "peft", "numpy", "nvidia-ml-py"):
        assert name not in need, name  # on the image: neither carried nor walked into
    # A requirement the image lacks brings its own: pydantic -> pydantic-core.
    assert "pydantic-core" in need
    assert gpu_wheels.missing(gpu_wheels.IMAGE | {"pydantic"}).get("pydantic-core") is None


def _wheel(path: Path, files: dict[str, bytes], name: str = "demo",
           requires: str = "") -> Path:
    info = f"{name}-1.0.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires.split())
    files = files | {f"{info}/METADATA": meta.encode(),
                     f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\n"
                                      b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(path, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", "".join(f"{n},,\n" for n in [*files, f"{info}/RECORD"]))
    return path


def test_a_slimmed_wheel_installs_without_the_dropped_files(tmp_path):
    wheel = _wheel(tmp_path / "demo-1.0-py3-none-any.whl",
                   {"demo/__init__.py": b"VALUE = 1\n", "demo/jars/big.jar": b"x" * 4096,
                    "demo/web/app.js.map": b"y" * 1024})
    gpu_wheels.slim(wheel, ("demo/jars/", ".js.map"))
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        record = z.read("demo-1.0.dist-info/RECORD").decode().splitlines()
        payload = z.read("demo/__init__.py")
    assert "demo/jars/big.jar" not in names and "demo/web/app.js.map" not in names
    digest = base64.urlsafe_b64encode(hashlib.sha256(payload).digest()).rstrip(b"=").decode()
    assert f"demo/__init__.py,sha256={digest},{len(payload)}" in record
    assert not any("big.jar" in row for row in record)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    "--target", str(target), str(wheel)], check=True)
    assert (target / "demo" / "__init__.py").is_file()
    assert not (target / "demo" / "jars").exists()


def test_the_image_overlay_makes_this_environment_import_the_images_versions(tmp_path,
                                                                            monkeypatch):
    """Pins this environment lacks are resolved by pip against it and installed into the
    overlay with what they need that it lacks, and nothing it has; under
    PYTHONPATH=overlay their versions are what imports; a pin the overlay does not give is
    named. (Local wheels stand in for the registry.)"""
    import importlib.metadata as md

    links = tmp_path / "links"
    links.mkdir()
    _wheel(links / "demo-1.0-py3-none-any.whl", {"demo/__init__.py": b"VALUE = 1\n"})
    _wheel(links / "demo_plugin-1.0-py3-none-any.whl", {"demo_plugin/__init__.py": b""},
           name="demo_plugin", requires="demo")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    overlay = tmp_path / "overlay"
    held = {"demo_plugin": "1.0", "pyyaml": md.version("pyyaml")}  # pyyaml: here already
    assert sorted(gpu_wheels.image_overlay(overlay, held)) == ["demo==1.0", "demo_plugin==1.0"]
    assert (overlay / "demo" / "__init__.py").is_file()
    assert not list(overlay.glob("*yaml*"))
    assert gpu_wheels.overlay_mismatches(overlay, held) == []
    assert gpu_wheels.overlay_mismatches(overlay, {"demo": "2.0"}) == ["demo 1.0 (image: 2.0)"]
