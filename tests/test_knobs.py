"""The knob table is the one declaration of a knob: a row added here reaches the space,
the trials, the exports, summary.json and the report with no other change."""

from __future__ import annotations

import json

import pytest
import yaml

from autotune import knobs
from autotune.config import Family, TrialConfig
from autotune.device import DeviceSpec
from autotune.errors import SpecError
from autotune.knobs import Knob, Rule
from autotune.space import build_space
from autotune.spec import load_spec
from tests.conftest import ROOT

CPU = DeviceSpec("cpu", "cpu", 16 * 2**30)
# A knob that only sets TrainingArguments: its row is everything it needs.
PERSIST = Knob("dataloader_persistent_workers", (False, True), False, "persistent workers",
               "persist", kind=bool,
               training_args=lambda on: {"dataloader_persistent_workers": on},
               rules=(Rule("dataloader_persistent_workers without workers", "persistent "
                           "workers need dataloader_num_workers > 0", lambda c, d:
                           c.dataloader_persistent_workers and not c.dataloader_num_workers),))


def test_family_is_a_named_value_with_baseline_defaults():
    fam = Family.of(precision="bf16")
    assert fam.precision == "bf16" and fam.optim == "adamw_torch" and fam.zero_stage == 0
    assert fam.replace(precision="fp32") == Family.baseline()
    assert fam.config(4, 32, 2) == TrialConfig(4, 4, fam)  # accumulation derived
    assert TrialConfig.from_dict(fam.config(4, 32).to_dict()) == fam.config(4, 32)
    with pytest.raises(SpecError, match="does not divide"):
        fam.config(3, 32)
    with pytest.raises(SpecError, match="unknown knob"):
        Family.of(precison="bf16")


def test_knob_values_are_attributes_that_no_method_or_field_shadows():
    """Family and TrialConfig keep each knob's value as an instance attribute (read
    millions of times in a replayed search): a knob named like one of their fields or
    methods would read as the knob's value and break them."""
    import pickle

    for name in knobs.names():
        assert not hasattr(Family, name) and not hasattr(TrialConfig, name), name
        assert name not in {f for cls in (Family, TrialConfig)
                            for f in cls.__dataclass_fields__}, name
    c = TrialConfig.of(4, 2, precision="bf16", zero_stage=2)
    again = pickle.loads(pickle.dumps(c))
    assert again == c and hash(again) == hash(c)
    assert (again.precision, again.zero_stage, again.family.optim) == ("bf16", 2, "adamw_torch")
    with pytest.raises(AttributeError):
        c.no_such_knob  # noqa: B018


def test_a_new_row_enters_the_space_and_its_rules():
    with knobs.added(PERSIST):
        assert Family.baseline().dataloader_persistent_workers is False
        spec = load_spec({"model": {"config": {"model_type": "gpt2"}}, "target_batch_size": 8})
        space = build_space(spec, CPU)
        assert "dataloader_persistent_workers" in space.space.choices()
        # baseline only
        assert {c.dataloader_persistent_workers for c in space.candidates} == {False}
    assert "dataloader_persistent_workers" not in knobs.names()  # the table is itself again


@pytest.mark.slow
def test_a_new_row_reaches_trials_exports_summary_and_report(tmp_path, tiny_spec):
    space = {"per_device_train_batch_size": [16], "dataloader_persistent_workers": [True, False],
             "dataloader_num_workers": [1]}
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    # Trainer's defaults and the recipe run first: two more trials.
    tiny_spec["search"] |= {"space": str(tmp_path / "space.yaml"), "n_trials": 4}
    from autotune.tuning.run import run_search

    with knobs.added(PERSIST):
        result = run_search(tiny_spec)
        ran = [t for t in result.trials if t.outcome.ran]
        assert ran and all(t.outcome.ok for t in ran), [t.outcome.error for t in ran]
        assert {t.config.dataloader_persistent_workers for t in ran} == {True, False}
        out = result.output
        summary = json.loads((out / "summary.json").read_text())
        assert all("dataloader_persistent_workers" in t["config"] for t in summary["trials"])
        exported = json.loads((out / "training_args.json").read_text())
        best = result.best.config
        assert exported["dataloader_persistent_workers"] == best.dataloader_persistent_workers
        report = (out / "report.md").read_text()
        assert "| persist |" in report.splitlines()[
            next(i for i, line in enumerate(report.splitlines()) if line.startswith("| # |"))]
        assert "persistent workers" in (out / "report.html").read_text()  # the effects grid's panel


def test_trainer_args_are_built_from_several_threads_at_once():
    """transformers' lazy imports are not thread-safe: threads that built their trials'
    TrainingArguments at once (the memory benchmark's pool) got ImportError. In fresh
    processes, where transformers is not imported yet."""
    import subprocess
    import sys

    code = ("import threading\n"
            "from autotune.config import TrialConfig\n"
            "from autotune.trials.trainargs import training_arguments_kwargs\n"
            "errors = []\n"
            "def build():\n"
            "    try:\n"
            "        training_arguments_kwargs(TrialConfig.of(4, 1, gradient_checkpointing=True),"
            " seed=0, on_cpu=True, output_dir='/tmp/x')\n"
            "    except Exception as exc:\n"
            "        errors.append(repr(exc))\n"
            "threads = [threading.Thread(target=build) for _ in range(4)]\n"
            "[t.start() for t in threads]\n"
            "[t.join() for t in threads]\n"
            "print(errors)\n")
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-1500:]
        assert done.stdout.strip().splitlines()[-1] == "[]"


def test_a_label_names_its_config_back():
    """Recorded logs keep only a config's label (the memory files): it reads back to the
    same config, knobs it leaves out at their baseline; a tag that names no knob value
    is an error that says which."""
    for config in (TrialConfig.of(8, 4, precision="bf16", zero_stage=2, offload="optimizer"),
                   TrialConfig.of(16, 2, precision="bf16", gradient_checkpointing=True),
                   TrialConfig.of(4, 8, optim="adamw_bnb_8bit", attn_implementation="eager"),
                   TrialConfig.of(1, 32)):
        assert TrialConfig.from_label(config.label()) == config, config.label()
    for bad in ("b8x4 bf16 z9", "8x4 bf16"):
        with pytest.raises(SpecError, match=bad.split()[-1]):
            TrialConfig.from_label(bad)


def test_the_optimizer_knob_reads_transformers_list_without_importing_it():
    """A plan checks `optim` against transformers' OptimizerNames read from its source
    (importing training_args costs seconds); the list is the imported enum's. Likewise
    the fields of TrainingArguments that name gradient checkpointing's argument."""
    import subprocess
    import sys
    from dataclasses import fields

    from transformers import TrainingArguments
    from transformers.training_args import OptimizerNames

    from autotune import transformers_source

    assert transformers_source.optimizer_names() == [o.value for o in OptimizerNames]
    assert knobs.OPTIM.allowed() == [o.value for o in OptimizerNames]
    assert transformers_source.training_arguments_fields() == {
        f.name for f in fields(TrainingArguments)}
    # A fresh process builds a trial's kwargs without importing training_args.
    code = ("import sys; from autotune.config import TrialConfig; "
            "from autotune.trials.trainargs import training_arguments_kwargs; "
            "k = training_arguments_kwargs(TrialConfig.of(4, 2, gradient_checkpointing=True),"
            " seed=0); print(sorted(k)); "
            "assert 'transformers.training_args' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert knobs._checkpointing_arg() in done.stdout
