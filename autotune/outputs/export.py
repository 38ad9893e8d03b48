"""The files a user takes to the long run: TrainingArguments JSON and DeepSpeed JSON, and
writing a search's outputs (exports, summary.json, the report) in one step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.trials.trainargs import deepspeed_config, training_arguments_kwargs

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.spec import Spec
    from autotune.summary import Summary

TRAINING_ARGS_FILE = "training_args.json"
DEEPSPEED_FILE = "ds_config.json"


def export_config(config: TrialConfig, output: Path, *, on_cpu: bool, seed: int,
                  world_size: int = 1) -> dict[str, str | None]:
    """Write the winner's files into `output`; returns {kind: file name or None}.

    training_args.json carries the DeepSpeed config inline, so
    `TrainingArguments(**json.load(open(path)))` works from any working directory;
    ds_config.json holds the same dict for the `deepspeed` launcher and accelerate."""
    output.mkdir(parents=True, exist_ok=True)
    kwargs = training_arguments_kwargs(config, seed=seed, world_size=world_size, on_cpu=on_cpu)
    (output / TRAINING_ARGS_FILE).write_text(json.dumps(kwargs, indent=2) + "\n")
    ds = deepspeed_config(config, world_size=world_size)
    ds_path = output / DEEPSPEED_FILE
    if ds is not None:
        ds_path.write_text(json.dumps(ds, indent=2) + "\n")
    elif ds_path.exists():  # a stale file from an earlier winner would mislead
        ds_path.unlink()
    return {"training_args": TRAINING_ARGS_FILE,
            "deepspeed": DEEPSPEED_FILE if ds is not None else None}


def load_training_args(path: str | Path, output_dir: str, **overrides: Any):
    """TrainingArguments from an exported file, with the placeholder output_dir replaced."""
    from transformers import TrainingArguments

    return TrainingArguments(**(json.loads(Path(path).read_text())
                                | {"output_dir": output_dir} | overrides))


def write_outputs(summary: Summary, output: Path, spec: Spec, *, on_cpu: bool) -> None:
    """Exports, summary.json and the report; nothing here runs a trial."""
    from autotune.outputs.report import write_report

    if summary.best is not None:
        summary.exports = export_config(summary.best.config, output, on_cpu=on_cpu,
                                        seed=spec.search.seed, world_size=spec.world_size)
    summary.write(output)
    write_report(output)
