"""The files a user takes to the long run: TrainingArguments JSON and DeepSpeed JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autotune.config import TrialConfig
from autotune.trainargs import deepspeed_config, training_arguments_kwargs

TRAINING_ARGS_FILE = "training_args.json"
DEEPSPEED_FILE = "ds_config.json"


def export_config(config: TrialConfig, output: Path, *, on_cpu: bool,
                  world_size: int = 1) -> dict[str, str | None]:
    """Write the winner's files into `output`; returns {kind: file name or None}."""
    output.mkdir(parents=True, exist_ok=True)
    ds = deepspeed_config(config, world_size=world_size)
    ds_path = output / DEEPSPEED_FILE
    if ds is not None:
        ds_path.write_text(json.dumps(ds, indent=2) + "\n")
    elif ds_path.exists():  # a stale file from an earlier winner would mislead
        ds_path.unlink()
    kwargs = training_arguments_kwargs(config, on_cpu=on_cpu,
                                       deepspeed=DEEPSPEED_FILE if ds is not None else None)
    (output / TRAINING_ARGS_FILE).write_text(json.dumps(kwargs, indent=2) + "\n")
    return {"training_args": TRAINING_ARGS_FILE,
            "deepspeed": DEEPSPEED_FILE if ds is not None else None}


def load_training_args(path: str | Path, output_dir: str, **overrides: Any):
    """TrainingArguments from an exported file, with the placeholder output_dir replaced.

    A relative `deepspeed` path is resolved against the exported file's folder.
    """
    from transformers import TrainingArguments

    path = Path(path)
    kwargs = json.loads(path.read_text()) | {"output_dir": output_dir} | overrides
    ds = kwargs.get("deepspeed")
    if isinstance(ds, str) and not Path(ds).is_absolute():
        kwargs["deepspeed"] = str(path.parent / ds)
    return TrainingArguments(**kwargs)
