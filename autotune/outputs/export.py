"""The files a user takes to the long run: TrainingArguments JSON and DeepSpeed JSON, and
writing a search's outputs (exports, summary.json, the report) in one step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune.files import write_atomically
from autotune.trials.trainargs import (
    accelerate_config,
    deepspeed_config,
    dpo_fields_for,
    model_kwargs,
    seq2seq_fields_for,
    sft_fields_for,
    training_arguments_kwargs,
)

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.spec import Spec
    from autotune.summary import Summary

TRAINING_ARGS_FILE = "training_args.json"
DEEPSPEED_FILE = "ds_config.json"
ACCELERATE_FILE = "accelerate_config.yaml"
LORA_FILE = "lora_config.json"
MODEL_KWARGS_FILE = "model_kwargs.json"
QUANTIZATION_FILE = "quantization_config.json"
SFT_FILE = "sft_config.json"
DPO_FILE = "dpo_config.json"


def export_config(config: TrialConfig, output: Path, *, on_cpu: bool, seed: int,
                  world_size: int = 1, lora: dict[str, Any] | None = None,
                  task: str = "causal-lm", sft: dict[str, Any] | None = None,
                  nodes: int = 1, dpo: dict[str, Any] | None = None,
                  seq2seq: dict[str, Any] | None = None) -> dict[str, str | None]:
    """Write the winner's files into `output`; returns {kind: file name or None}.

    training_args.json carries the DeepSpeed config inline, so
    `TrainingArguments(**json.load(open(path)))` works from any working directory;
    ds_config.json holds the same dict for the `deepspeed` launcher and accelerate;
    accelerate_config.yaml is for `accelerate launch --config_file` (it names
    ds_config.json by its absolute path: accelerate reads it from the launching folder, so
    a relative one worked only from `output`); lora_config.json,
    under LoRA, is `peft.LoraConfig(**kwargs)`; model_kwargs.json, where the winner
    changes how the model is loaded (its attention kernel, a quantized base), is
    `from_pretrained`'s; quantization_config.json, for a quantized base, is
    `BitsAndBytesConfig(**kwargs)` (the same dict model_kwargs.json holds); under
    `trainer: sft`, sft_config.json is `SFTConfig(**kwargs)`: training_args.json's kwargs
    and SFTConfig's own fields (`sft`); under `trainer: dpo`, dpo_config.json is
    `DPOConfig(**kwargs)` likewise (`dpo`). For a seq2seq-lm model training_args.json
    holds Seq2SeqTrainingArguments' own fields too (`seq2seq`)."""
    from autotune.trials.lora import lora_config_kwargs

    output.mkdir(parents=True, exist_ok=True)
    write_atomically(output / ACCELERATE_FILE, yaml.safe_dump(
        accelerate_config(config, world_size=world_size, on_cpu=on_cpu,
                          deepspeed_file=str((output / DEEPSPEED_FILE).resolve()),
                          nodes=nodes),
        sort_keys=False))
    model_path, loading = output / MODEL_KWARGS_FILE, model_kwargs(config)
    quant_path, quantized = output / QUANTIZATION_FILE, loading.get("quantization_config")
    for path, content in ((model_path, loading), (quant_path, quantized)):
        if content:
            write_atomically(path, json.dumps(content, indent=2) + "\n")
        elif path.exists():  # a stale file from an earlier winner would mislead
            path.unlink()
    lora_path = output / LORA_FILE
    if lora is not None:
        write_atomically(lora_path, json.dumps(lora_config_kwargs(lora, task), indent=2) + "\n")
    elif lora_path.exists():
        lora_path.unlink()
    kwargs = training_arguments_kwargs(config, seed=seed, world_size=world_size, on_cpu=on_cpu)
    write_atomically(output / TRAINING_ARGS_FILE,
                     json.dumps(kwargs | (seq2seq or {}), indent=2) + "\n")
    for path, fields in ((output / SFT_FILE, sft), (output / DPO_FILE, dpo)):
        if fields is not None:  # the same kwargs and the TRL config's own fields
            write_atomically(path, json.dumps(kwargs | fields, indent=2) + "\n")
        elif path.exists():  # a stale file from an earlier winner would mislead
            path.unlink()
    ds = deepspeed_config(config, world_size=world_size)
    ds_path = output / DEEPSPEED_FILE
    if ds is not None:
        write_atomically(ds_path, json.dumps(ds, indent=2) + "\n")
    elif ds_path.exists():  # a stale file from an earlier winner would mislead
        ds_path.unlink()
    return {"training_args": TRAINING_ARGS_FILE,
            "deepspeed": DEEPSPEED_FILE if ds is not None else None,
            "accelerate": ACCELERATE_FILE, "lora": LORA_FILE if lora is not None else None,
            "model": MODEL_KWARGS_FILE if loading else None,
            "quantization": QUANTIZATION_FILE if quantized else None,
            "sft": SFT_FILE if sft is not None else None,
            "dpo": DPO_FILE if dpo is not None else None}


def spec_exports(spec: Spec, config: TrialConfig) -> dict[str, Any]:
    """`export_config`'s spec-given arguments for `config`: the task, LoRA, and the
    trainer's own fields (SFTConfig's, DPOConfig's, Seq2SeqTrainingArguments')."""
    return {"task": spec.model.task, "seed": spec.search.seed, "world_size": spec.world_size,
            "lora": spec.model.lora.model_dump() if spec.model.lora else None,
            "sft": sft_fields_for(spec, config), "dpo": dpo_fields_for(spec, config),
            "seq2seq": seq2seq_fields_for(spec)}


def trainer_file(spec: Spec) -> str:
    """The exported file the spec's trainer's arguments load from."""
    return {"sft": SFT_FILE, "dpo": DPO_FILE}.get(spec.trainer, TRAINING_ARGS_FILE)


def load_training_args(path: str | Path, output_dir: str, **overrides: Any):
    """TrainingArguments from an exported file, with the placeholder output_dir replaced."""
    from transformers import TrainingArguments

    return TrainingArguments(**(json.loads(Path(path).read_text())
                                | {"output_dir": output_dir} | overrides))


def write_outputs(summary: Summary, output: Path, spec: Spec, *, on_cpu: bool) -> None:
    """Exports, summary.json and the report; nothing here runs a trial."""
    from autotune.outputs.report import write_report

    if summary.best is not None:
        summary.exports = export_config(
            summary.best.config, output, on_cpu=on_cpu,
            nodes=summary.device.nodes if summary.device else 1,
            **spec_exports(spec, summary.best.config))
    summary.write(output)
    write_report(output)
