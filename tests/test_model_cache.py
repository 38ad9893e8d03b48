"""A model's facts are remembered by what they were read from (tasks/model_cache.py): a
search's driver that read a model once does not import torch, transformers or the
modeling module for it again, and a changed model is read afresh."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import yaml

from autotune.tasks.model_cache import ENV
from tests.conftest import TINY_SPEC

# What a search's driver asks of its model before the first trial: the shape, the knob
# rules over the whole table (the recipe's question), the device, the study's versions.
DRIVER = """
import json, sys
from autotune.device import local_device
from autotune.plan.shape import model_shape
from autotune.spec import load_spec
from autotune.tuning.recipe import available_values
from autotune.versions import library_versions

spec = load_spec(sys.argv[1])
shape = model_shape(spec)
values = {k: sorted(map(str, v)) for k, v in available_values(spec).items()}
versions = library_versions()
imported = sorted(m for m in ("torch", "transformers") if m in sys.modules)
device = local_device()  # a GPU build of torch is imported to ask: not counted above
print(json.dumps({"shape": shape.to_dict(), "values": values, "versions": versions,
                  "bf16": device.native_bf16, "imported": imported}))
"""


def _drive(spec_path, cache, **env_more: str) -> dict:
    env = os.environ | {ENV: str(cache)} | env_more
    out = subprocess.run([sys.executable, "-c", DRIVER, str(spec_path)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_model_read_once_is_answered_without_importing_it_and_a_changed_one_is_read(
        tmp_path):
    spec = copy.deepcopy(TINY_SPEC)
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    cache = tmp_path / "cache"

    first = _drive(path, cache)
    assert first["imported"] == ["torch", "transformers"]  # read: counted on the meta device
    assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["class", "shape"]
    again = _drive(path, cache)
    assert again["imported"] == []
    assert {k: v for k, v in again.items() if k != "imported"} == {
        k: v for k, v in first.items() if k != "imported"}
    assert again["shape"]["num_parameters"] > 0 and "sdpa" in again["values"][
        "attn_implementation"]

    spec["model"]["config"]["n_layer"] = 3  # another model: read, not remembered
    path.write_text(yaml.safe_dump(spec))
    deeper = _drive(path, cache)
    assert deeper["imported"] == ["torch", "transformers"]
    assert deeper["shape"]["num_layers"] == 3
    assert deeper["shape"]["num_parameters"] > first["shape"]["num_parameters"]


def test_a_saved_folder_is_remembered_by_its_config_file_and_off_keeps_nothing(tmp_path):
    from transformers import GPT2Config

    folder = tmp_path / "gpt2"
    GPT2Config(**{k: v for k, v in TINY_SPEC["model"]["config"].items()
                  if k != "model_type"}).save_pretrained(folder)
    spec = copy.deepcopy(TINY_SPEC)
    spec["model"] = {"name_or_path": str(folder)}
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    cache = tmp_path / "cache"

    first = _drive(path, cache)
    assert len(list(cache.glob("shape-*.json"))) == 1
    saved = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(saved | {"n_embd": 64}))  # retrained wider
    wider = _drive(path, cache)
    assert wider["imported"] == ["torch", "transformers"]
    assert wider["shape"]["hidden_size"] == 64
    assert wider["shape"]["num_parameters"] > first["shape"]["num_parameters"]

    xdg = tmp_path / "xdg"  # where the cache would be without the variable
    assert _drive(path, "off", XDG_CACHE_HOME=str(xdg))["imported"] == ["torch", "transformers"]
    assert not xdg.exists()


def test_only_whole_answers_are_kept_and_a_bad_cache_is_worked_around(tmp_path, monkeypatch):
    """A partial read (NotKept) answers its call and is read again next time; a cache file
    that is not JSON or has no value, or a folder that cannot be written, only costs the
    work."""
    from autotune.tasks import model_cache

    calls = []

    def work():
        calls.append(1)
        return {"n": len(calls)}

    def partial():
        calls.append(1)
        raise model_cache.NotKept({"partial": True})

    cache = tmp_path / "cache"
    monkeypatch.setenv(ENV, str(cache))
    assert model_cache.remembered("t", {"k": 1}, partial) == {"partial": True}
    assert not cache.exists() or not list(cache.iterdir())
    assert model_cache.remembered("t", {"k": 1}, work) == {"n": 2}  # read again, then kept
    assert model_cache.remembered("t", {"k": 1}, work) == {"n": 2} and len(calls) == 2
    for kept in cache.iterdir():
        kept.write_text(json.dumps({"key": json.loads(kept.read_text())["key"]}))  # no value
    monkeypatch.setattr(model_cache, "_READ", {})  # as a new process: read from the file
    assert model_cache.remembered("t", {"k": 1}, work) == {"n": 3}
    for kept in cache.iterdir():
        kept.write_text("{not json")
    monkeypatch.setattr(model_cache, "_READ", {})
    assert model_cache.remembered("t", {"k": 1}, work) == {"n": 4}
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv(ENV, str(blocked))  # a "folder" that is a file: nothing kept
    assert model_cache.remembered("t", {"k": 1}, work) == {"n": 5}
    assert model_cache.remembered("t", {1: 1, "a": 2}, work) == {"n": 6}  # keys JSON cannot sort


def test_a_model_class_that_fails_to_import_is_not_remembered(tmp_path, monkeypatch):
    """The knob rules' facts of a model whose modeling module fails to import (a missing
    optional package) answer without the class, and are read again once it imports."""
    from autotune.tasks import models

    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    model = copy.deepcopy(TINY_SPEC["model"])
    model["config"]["n_layer"] = 5  # a model no other test keeps

    class Broken:
        class _model_mapping:  # noqa: N801 - stands in for transformers' lazy mapping
            def __getitem__(self, key):
                raise ImportError("the modeling module needs a package that is missing")
        _model_mapping = _model_mapping()

    real = models.auto_class
    monkeypatch.setattr(models, "auto_class", lambda m: Broken)
    assert models.model_facts(model)["class"] is None
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    monkeypatch.setattr(models, "auto_class", real)
    assert models.model_facts(model)["class"] == "GPT2LMHeadModel"
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_a_length_past_the_models_positions_is_the_specs_error_each_time(tmp_path, monkeypatch):
    """A sequence longer than the model's positions fails naming the field, before the
    model is counted, and is never kept as an answer."""
    import pytest

    from autotune.errors import SpecError
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec

    monkeypatch.setenv(ENV, str(tmp_path / "cache"))
    spec = copy.deepcopy(TINY_SPEC) | {"data": {"seq_len": 128}}  # n_positions is 64
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    loaded = load_spec(path)
    for _ in range(2):
        with pytest.raises(SpecError, match=r"data.seq_len: 128 exceeds the model's 64"):
            model_shape(loaded)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
