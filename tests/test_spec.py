"""Bad input fails before anything runs, with a message that names the field."""

from __future__ import annotations

import pytest
import yaml
from typer.testing import CliRunner

from autotune.cli import app
from autotune.errors import SpecError
from autotune.spec import load_spec, parse_bytes, parse_duration

GOOD = {"model": {"config": {"model_type": "gpt2", "n_layer": 1}}, "target_batch_size": 8}


def _cli(tmp_path, spec: dict, *args: str):
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    return CliRunner().invoke(app, ["search", str(path), *args])


@pytest.mark.parametrize(("spec", "words"), [
    (GOOD | {"bogus_key": 1}, ["bogus_key", "unknown key"]),
    (GOOD | {"target_batch_size": 6, "hardware": {"gpus_per_trial": 4}},
     ["target_batch_size", "6", "gpus_per_trial"]),
    ({"model": {"name_or_path": "./no/such/model"}}, ["model.name_or_path", "./no/such/model"]),
    (GOOD | {"model": {"config": {"model_type": "gpt2"}, "task": "translation"}},
     ["model.task", "translation", "causal-lm"]),
    (GOOD | {"hardware": {"memory_budget": "lots"}}, ["hardware.memory_budget", "lots"]),
    (GOOD | {"search": {"timeout": "soon"}}, ["search.timeout", "soon"]),
    ({"model": {}}, ["model", "name_or_path, config or factory"]),
    # Found by a review: a model the spec cannot make was transformers' traceback (exit 1),
    # after Ray had started; a boolean, a zero budget or '30mm' were read as something.
    (GOOD | {"model": {"config": {"model_type": "gpt5"}}}, ["model.config", "gpt5"]),
    (GOOD | {"model": {"config": {"model_type": "gpt2", "n_layer": "two"}}},
     ["model.config", "n_layer", "two"]),
    (GOOD | {"model": {"config": {"model_type": "gpt2", "n_layer": 1}, "task": "masked-lm"}},
     ["model.task", "MaskedLM"]),
    (GOOD | {"model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_positions": 32}},
             "data": {"seq_len": 64}}, ["data.seq_len", "64", "32 positions"]),
    (GOOD | {"model": {"config": {"model_type": "gpt2", "n_layer": 1},
                       "lora": {"target_modules": ["nosuch"]}}}, ["model.lora", "nosuch"]),
    (GOOD | {"model": {"config": {"model_type": "gpt2", "n_layer": 1},
                       "attn_implementation": "flash"}}, ["model.attn_implementation", "flash"]),
    (GOOD | {"target_batch_size": True}, ["target_batch_size", "is a boolean"]),
    (GOOD | {"hardware": {"memory_budget": "0GiB"}}, ["hardware.memory_budget", "0GiB"]),
    (GOOD | {"search": {"timeout": "30mm"}}, ["search.timeout", "30mm"]),
    (GOOD | {"search": {"trial_timeout": "1h30"}}, ["search.trial_timeout", "1h30"]),
    (GOOD | {"search": {"timeout": 0}}, ["search.timeout", "no time"]),
    # Found by a newcomer run: a bad storage URL was a SQLAlchemy traceback (exit 1), and a
    # zero target's message left out the value.
    (GOOD | {"search": {"storage": "notaurl"}}, ["search.storage", "notaurl", "sqlite:///"]),
    (GOOD | {"search": {"storage": "nosuchdb://x"}}, ["search.storage", "nosuchdb"]),
    (GOOD | {"target_batch_size": 0}, ["target_batch_size: 0: ", "greater than 0"]),
    # A typo is named with the value it was probably meant to be, before the list.
    (GOOD | {"search": {"n_trails": 3}}, ["search.n_trails", "did you mean 'n_trials'?",
                                          "allowed: space, n_trials"]),
    (GOOD | {"search": {"sampler": "tep"}}, ["search.sampler: 'tep' is not allowed (did you "
                                             "mean 'tpe'?); allowed: autotune, tpe, gp"]),
    (GOOD | {"model": {"config": {"model_type": "gtp2"}}},
     ["model.config.model_type: 'gtp2' is not allowed (did you mean 'gpt2'?)",
      "transformers.CONFIG_MAPPING"]),
])
def test_bad_spec_fails_naming_the_field(tmp_path, spec, words):
    result = _cli(tmp_path, spec)
    assert result.exit_code == 2
    for word in words:
        assert word in result.output, result.output
    assert "Traceback" not in result.output


def test_unknown_optimizer_in_space_names_allowed_values(tmp_path):
    """transformers' 40-odd optimizers are named by where they are listed and the nearest
    few, a typo's likely meaning first; a space key's typo likewise."""
    space = tmp_path / "space.yaml"
    space.write_text("optim: [adamw_torch, adamw_torh]\n")
    result = _cli(tmp_path, GOOD | {"search": {"space": str(space)}})
    assert result.exit_code == 2
    assert ("optim: 'adamw_torh' is not allowed (did you mean 'adamw_torch'?); allowed: the "
            in result.output)
    assert "of transformers' OptimizerNames, such as adamw_torch" in result.output
    space.write_text("optm: [adamw_torch]\n")
    result = _cli(tmp_path, GOOD | {"search": {"space": str(space)}})
    assert result.exit_code == 2
    assert "key 'optm' is not allowed (did you mean 'optim'?); allowed: " in result.output
    assert "per_device_train_batch_size" in result.output  # a short list is listed whole


def test_a_value_outside_a_list_is_named_with_its_likely_meaning():
    from autotune.errors import not_allowed

    assert not_allowed("bf61", ["fp32", "bf16", "fp16"]) == (
        "'bf61' is not allowed (did you mean 'bf16'?); allowed: fp32, bf16, fp16")
    assert not_allowed("zzz", ["fp32", "bf16"]) == "'zzz' is not allowed; allowed: fp32, bf16"
    assert not_allowed(5, [1, 2, 4, 8]) == "5 is not allowed; allowed: 1, 2, 4, 8"  # no guess
    many = [f"name{i}" for i in range(30)]
    assert not_allowed("name7x", many, "the registry") == (
        "'name7x' is not allowed (did you mean 'name7'?); allowed: the 30 of the registry, "
        "such as name7, name27, name17, name9, name8")
    assert not_allowed("x", many).endswith("name28, name29")  # no source: listed whole


@pytest.mark.parametrize(("text", "words"), [
    ("optim: [adamw_torch\n", ["space.yaml", "not valid YAML"]),
    ("- optim\n", ["space.yaml", "mapping", "list"]),
    ("precision: []\n", ["space.yaml", "precision", "empty"]),
    ("gradient_checkpointing: [maybe]\n", ["search space space.yaml", "maybe", "True"]),
    ("zero_stage: [true]\n", ["search space space.yaml", "zero_stage", "True"]),
    ("precision: [fp8]\n", ["search space space.yaml", "fp8", "bf16"]),
])
def test_a_bad_space_file_fails_in_one_line(tmp_path, text, words):
    space = tmp_path / "space.yaml"
    space.write_text(text)
    result = _cli(tmp_path, GOOD | {"search": {"space": str(space)}})
    assert result.exit_code == 2, result.output
    for word in words:
        assert word in result.output, result.output
    assert "Traceback" not in result.output


def test_an_output_that_is_a_file_fails_before_anything_runs(tmp_path):
    (tmp_path / "taken").write_text("")
    result = _cli(tmp_path, GOOD | {"output": str(tmp_path / "taken")})
    assert result.exit_code == 2 and "output" in result.output and "is a file" in result.output


def test_unknown_space_name_lists_known_ones(tmp_path):
    result = _cli(tmp_path, GOOD | {"search": {"space": "fastest"}})
    assert result.exit_code == 2 and "search.space" in result.output
    assert "default" in result.output


def test_missing_spec_file(tmp_path):
    result = CliRunner().invoke(app, ["search", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "not found" in result.output


def test_overrides_and_units():
    spec = load_spec(GOOD, **{"search.n_trials": 3, "hardware.memory_budget": "512MiB"})
    assert spec.search.n_trials == 3
    assert spec.hardware.budget_bytes() == 512 * 2**20
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_bytes("1.5GB") == 1_500_000_000
    assert parse_duration("1h30m") == 5400 and parse_duration("90s") == 90
    with pytest.raises(SpecError, match="unknown key"):
        load_spec(GOOD | {"search": {"n_trail": 3}})
    # A bare `search:` in the file takes an override; a scalar there is named.
    assert load_spec(GOOD | {"search": None}, **{"search.n_trials": 3}).search.n_trials == 3
    with pytest.raises(SpecError, match="search: expected a mapping"):
        load_spec(GOOD | {"search": 5}, **{"search.n_trials": 3})
    for text, seconds in (("2m30s", 150), ("120", 120), ("1.5h", 5400), (" 30m ", 1800),
                          ("1h 30m", 5400), (".5h", 1800), (45, 45)):
        assert parse_duration(text) == seconds


def test_fingerprint_ignores_budget_but_not_target():
    a = load_spec(GOOD)
    assert a.fingerprint() == load_spec(GOOD, **{"search.n_trials": 99}).fingerprint()
    assert a.fingerprint() != load_spec(GOOD | {"target_batch_size": 16}).fingerprint()
