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
from tests.conftest import accelerate_launch

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
    assert files == {"training_args": "training_args.json", "deepspeed": None,
                     "accelerate": "accelerate_config.yaml", "lora": None, "model": None,
                     "quantization": None, "sft": None, "dpo": None, "grpo": None}
    assert not (tmp_path / "ds_config.json").exists()
    args = load_training_args(tmp_path / "training_args.json", str(tmp_path / "run"))
    assert args.per_device_train_batch_size == 4 and args.bf16


@pytest.mark.slow
def test_exported_training_args_train_two_steps(tmp_path):
    export_config(TrialConfig.of(4, 2, precision="bf16", gradient_checkpointing=True),
                  tmp_path / "x", on_cpu=True, seed=0)
    out = _train(tmp_path / "x", tmp_path)
    assert out | {"trainable": 0} == {"global_step": 2, "deepspeed": None, "batch": 4,
                                      "accum": 2, "bf16": True, "trainable": 0, "world": 1}


@pytest.mark.slow
def test_exported_deepspeed_config_parses_and_trains_two_steps(tmp_path):
    cfg = TrialConfig.of(4, 2, zero_stage=3, offload="optimizer+param")
    files = export_config(cfg, tmp_path / "x", on_cpu=True, seed=0)
    assert files["deepspeed"] == "ds_config.json"
    out = _train(tmp_path / "x", tmp_path)
    assert out["global_step"] == 2
    assert out["deepspeed"] == [8, 4, 2, 3]


def _accelerate_config(cfg: TrialConfig, tmp_path: Path, world: int = 1):
    from accelerate.commands.config.config_args import load_config_from_file

    export_config(cfg, tmp_path, on_cpu=True, seed=0, world_size=world)
    return load_config_from_file(str(tmp_path / "accelerate_config.yaml"))


def test_accelerate_config_carries_the_sharding_backend(tmp_path):
    """accelerate's own loader reads each export: DeepSpeed from ds_config.json, FSDP
    with its sharding strategy, plain data parallelism."""
    ds = _accelerate_config(TrialConfig.of(4, 2, zero_stage=3), tmp_path / "ds", world=2)
    assert ds.distributed_type == "DEEPSPEED" and ds.num_processes == 2
    assert ds.deepspeed_config["deepspeed_config_file"] == str(
        (tmp_path / "ds" / "ds_config.json").resolve())
    fsdp = _accelerate_config(TrialConfig.of(4, 2, fsdp="full_shard+offload",
                                             precision="bf16"), tmp_path / "fsdp", world=2)
    assert fsdp.distributed_type == "FSDP" and fsdp.mixed_precision == "bf16"
    assert fsdp.fsdp_config["fsdp_sharding_strategy"] == "FULL_SHARD"
    assert fsdp.fsdp_config["fsdp_offload_params"] is True
    plain = _accelerate_config(TrialConfig.of(4, 2), tmp_path / "plain")
    assert plain.distributed_type == "NO" and plain.mixed_precision == "no"


@pytest.mark.slow
def test_accelerate_launch_trains_two_steps_from_the_exports(tmp_path):
    """`accelerate launch --config_file x/accelerate_config.yaml`, from another folder, with
    ZeRO-1: the config names ds_config.json by its absolute path (a relative one failed
    outside x/ with a JSON error). On CPU accelerate runs one process (its multi-CPU path
    needs MPI); several ranks are what the GPU export is for, and the loader test above
    reads those."""
    export_config(TrialConfig.of(2, 4, zero_stage=1), tmp_path / "x", on_cpu=True, seed=0)
    proc = accelerate_launch(["--config_file", str(tmp_path / "x" / "accelerate_config.yaml"),
                              "--main_process_port", "29563", str(SCRIPT),
                              str(tmp_path / "x"), str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["global_step"] == 2 and out["world"] == 1


@pytest.mark.slow
def test_exported_lora_config_trains_two_steps(tmp_path):
    lora = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["c_attn"]}
    files = export_config(TrialConfig.of(4, 2), tmp_path / "x", on_cpu=True, seed=0,
                          lora=lora)
    assert files["lora"] == "lora_config.json"
    out = _train(tmp_path / "x", tmp_path)
    # c_attn of 2 layers: r x (32 in + 96 out) each.
    assert out["global_step"] == 2 and out["trainable"] == 2 * 4 * (32 + 96)


def test_model_loading_knobs_are_exported_beside_the_training_arguments(tmp_path):
    from transformers import AutoModelForCausalLM, GPT2Config

    files = export_config(TrialConfig.of(4, 2, attn_implementation="eager",
                                         torch_compile=True), tmp_path, on_cpu=True, seed=0)
    assert files["model"] == "model_kwargs.json"
    kwargs = json.loads((tmp_path / "model_kwargs.json").read_text())
    assert kwargs == {"attn_implementation": "eager"}
    assert json.loads((tmp_path / "training_args.json").read_text())["torch_compile"] is True
    model = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=32, n_head=2),
                                             **kwargs)
    assert model.config._attn_implementation == "eager"


def test_the_export_carries_the_seed_the_trials_ran_with(tmp_path):
    """The long run starts from the seed the measurements used (once 42 against 0)."""
    from autotune.outputs.export import write_outputs
    from autotune.records import Outcome, Record
    from autotune.spec import load_spec
    from autotune.summary import Summary
    from autotune.trials.protocol import make_request
    from tests.conftest import TINY_SPEC

    spec = load_spec(TINY_SPEC | {"output": str(tmp_path), "search": {"seed": 7}})
    config = TrialConfig.of(4, 4)
    request = make_request(spec, config, on_cpu=True, shape=None, memory_budget_bytes=None,
                           timeout_s=60, cpu_threads=1)
    summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=16,
                      trials=[Record(config, Outcome("ok", samples_per_second=1.0), "model", 0)])
    write_outputs(summary, tmp_path, spec, on_cpu=True)
    exported = json.loads((tmp_path / "training_args.json").read_text())
    assert request.seed == request.training_args["seed"] == exported["seed"] == 7


def test_deepspeed_ops_are_built_into_the_environment_at_setup():
    """scripts/setup.sh builds them (python -m autotune.trials.ops): no trial compiles CPU
    Adam or the shared-memory collectives inside its own time limit."""
    from autotune.trials.ops import build

    assert build() == []
    built = {p.name for p in Path(extensions_dir()).iterdir()}
    assert {"cpu_adam", "deepspeed_shm_comm"} <= built
