"""The files a user takes to the long run: TrainingArguments JSON and DeepSpeed JSON, and
writing a search's outputs (exports, summary.json, the report) in one step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune.files import write_atomically
from autotune.tasks import DEFAULT_TASK, TRAINERS, task_of, trainer_of
from autotune.trials.trainargs import (
    accelerate_config,
    deepspeed_config,
    model_kwargs,
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
# Each trainer's own config file, where it has one (sft_config.json, dpo_config.json).
TRAINER_FILES = {t.name: t.export_file for t in TRAINERS.values() if t.export_file}


def export_config(config: TrialConfig, output: Path, *, on_cpu: bool, seed: int,
                  world_size: int = 1, lora: dict[str, Any] | None = None,
                  task: str = DEFAULT_TASK, nodes: int = 1,
                  trainer_fields: tuple[str, dict[str, Any]] | None = None,
                  arguments_fields: dict[str, Any] | None = None, seq_len: int | None = None,
                  model_attention: str | None = None) -> dict[str, str | None]:
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
    `BitsAndBytesConfig(**kwargs)` (the same dict model_kwargs.json holds); under a
    trainer with a config of its own (`trainer_fields`: its name and the config's own
    fields), its file is that config's kwargs: training_args.json's and its own
    (sft_config.json is `SFTConfig(**kwargs)`, dpo_config.json `DPOConfig(**kwargs)`).
    Where the task's arguments class adds fields (`arguments_fields`: a seq2seq-lm
    model's Seq2SeqTrainingArguments), training_args.json holds them too. A sequence
    split (sequence or context parallelism, of sequences `seq_len` long) is the
    accelerate config's `parallelism_config` block: a ParallelismConfig is no JSON, so
    training_args.json cannot hold it (docs/knobs.md says what a script adds)."""
    from autotune.tasks.lora import lora_config_kwargs

    output.mkdir(parents=True, exist_ok=True)
    write_atomically(output / ACCELERATE_FILE, yaml.safe_dump(
        accelerate_config(config, world_size=world_size, on_cpu=on_cpu,
                          deepspeed_file=str((output / DEEPSPEED_FILE).resolve()),
                          nodes=nodes, seq_len=seq_len, model_attention=model_attention),
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
                     json.dumps(kwargs | (arguments_fields or {}), indent=2) + "\n")
    own = dict([trainer_fields]) if trainer_fields else {}
    for name, file in TRAINER_FILES.items():
        path = output / file
        if name in own:  # the same kwargs and the trainer's config's own fields
            write_atomically(path, json.dumps(kwargs | own[name], indent=2) + "\n")
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
            "quantization": QUANTIZATION_FILE if quantized else None} | {
            name: (file if name in own else None) for name, file in TRAINER_FILES.items()}


def spec_exports(spec: Spec, config: TrialConfig) -> dict[str, Any]:
    """`export_config`'s spec-given arguments for `config`: the task, LoRA, the trainer's
    own config fields (SFTConfig's, DPOConfig's), the task's arguments class's
    (Seq2SeqTrainingArguments'), the sequence length and attention a sequence split
    names."""
    kind, by = task_of(spec), trainer_of(spec)
    own = by.fields(spec, config)
    return {"task": kind.name, "seed": spec.search.seed, "world_size": spec.world_size,
            "lora": spec.model.lora.model_dump() if spec.model.lora else None,
            "trainer_fields": (by.name, own) if own is not None else None,
            "arguments_fields": kind.arguments_fields(spec), "seq_len": spec.data.seq_len,
            "model_attention": spec.model.attn_implementation}


def trainer_file(spec: Spec) -> str:
    """The exported file the spec's trainer's arguments load from."""
    return trainer_of(spec).export_file or TRAINING_ARGS_FILE


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
