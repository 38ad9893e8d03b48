"""The exported files are what a user takes to the long run: they must load and train."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from autotune.config import TrialConfig
from autotune.outputs.export import export_config, load_training_args
from autotune.trials.launch import extensions_dir
from autotune.trials.trainargs import deepspeed_config, training_arguments_kwargs

SCRIPT = Path(__file__).with_name("train_from_exports.py")


def _train(export_dir: Path, tmp_path: Path) -> dict:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", TORCH_EXTENSIONS_DIR=extensions_dir())
    elsewhere = tmp_path / "elsewhere"  # not the export folder: paths must not matter
    elsewhere.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(SCRIPT), str(export_dir), str(tmp_path / "run")],
                          capture_output=True, text=True, env=env, timeout=300, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_deepspeed_values_match_training_arguments():
    cfg = TrialConfig.of(8, 4, precision="bf16", gradient_checkpointing=True, zero_stage=2,
                         offload="optimizer")
    ds = deepspeed_config(cfg, world_size=2)
    kw = training_arguments_kwargs(cfg, seed=0, world_size=2)
    assert kw["deepspeed"] == ds  # inline: the kwargs load from any folder
    assert ds["train_micro_batch_size_per_gpu"] == kw["per_device_train_batch_size"] == 8
    assert ds["gradient_accumulation_steps"] == kw["gradient_accumulation_steps"] == 4
    assert ds["train_batch_size"] == 8 * 4 * 2
    assert ds["bf16"]["enabled"] is kw["bf16"] is True
    assert ds["optimizer"]["params"]["lr"] == kw["learning_rate"]
    assert ds["gradient_clipping"] == kw["max_grad_norm"]
    assert ds["zero_optimization"]["offload_optimizer"]["device"] == "cpu"


def test_no_deepspeed_file_without_zero(tmp_path):
    files = export_config(TrialConfig.of(4, 4, precision="bf16"), tmp_path, on_cpu=True, seed=0)
    assert files == {"training_args": "training_args.json", "deepspeed": None}
    assert not (tmp_path / "ds_config.json").exists()
    args = load_training_args(tmp_path / "training_args.json", str(tmp_path / "run"))
    assert args.per_device_train_batch_size == 4 and args.bf16


@pytest.mark.slow
def test_exported_training_args_train_two_steps(tmp_path):
    export_config(TrialConfig.of(4, 2, precision="bf16", gradient_checkpointing=True),
                  tmp_path / "x", on_cpu=True, seed=0)
    out = _train(tmp_path / "x", tmp_path)
    assert out == {"global_step": 2, "deepspeed": None, "batch": 4, "accum": 2, "bf16": True}


@pytest.mark.slow
def test_exported_deepspeed_config_parses_and_trains_two_steps(tmp_path):
    cfg = TrialConfig.of(4, 2, zero_stage=3, offload="optimizer+param")
    files = export_config(cfg, tmp_path / "x", on_cpu=True, seed=0)
    assert files["deepspeed"] == "ds_config.json"
    out = _train(tmp_path / "x", tmp_path)
    assert out["global_step"] == 2
    assert out["deepspeed"] == [8, 4, 2, 3]
