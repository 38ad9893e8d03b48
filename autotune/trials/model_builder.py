"""Build the model a trial trains (inside the trial process); its data: trials/data.py."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from autotune.errors import SetupError
from autotune.plan.shape import AUTO_CLASSES, load_hf_config
from autotune.trials.oom import is_oom_exception


def _model_field(model: dict[str, Any]) -> str:
    return next(f"model.{k}" for k in ("factory", "name_or_path", "config") if model.get(k))


def build_model(model: dict[str, Any], loading: dict[str, Any] | None = None,
                 scratch: Path | None = None):
    """The spec's model, loaded with the config's model kwargs (trainargs.model_kwargs:
    the attention kernel its knob names, else the spec's own or the model's default; a
    quantized base's BitsAndBytesConfig). A failure that is not a lack of memory is a
    SetupError naming the spec's field: no config of the search could avoid it."""
    loading = dict(loading or {})
    if "attn_implementation" in loading:
        model = model | {"attn_implementation": loading.pop("attn_implementation")}
    try:
        return _build_model(model, loading.get("quantization_config"), scratch)
    except SetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised, classified
        if is_oom_exception(exc):
            raise
        if loading.get("quantization_config") and _is_quantizer_error(exc):
            raise  # the quantized base's (bitsandbytes'), not the spec's: the config fails
        raise SetupError(_model_field(model), f"{type(exc).__name__}: {exc}") from exc


def _is_quantizer_error(exc: Exception) -> bool:
    import traceback

    return any("bitsandbytes" in f.filename or "quantizer" in f.filename
               for f in traceback.extract_tb(exc.__traceback__))


def _build_model(model: dict[str, Any], quantization: dict[str, Any] | None = None,
                 scratch: Path | None = None):
    import transformers

    hf_config = load_hf_config(model)
    if hf_config is not None and model.get("task") == "sequence-classification":
        hf_config.num_labels = getattr(hf_config, "num_labels", 2) or 2
        if getattr(hf_config, "pad_token_id", None) is None:  # GPT-style: batches need one
            hf_config.pad_token_id = getattr(hf_config, "eos_token_id", None) or 0
    if model.get("factory"):
        module_name, func_name = model["factory"].split(":")
        try:
            factory = getattr(importlib.import_module(module_name), func_name)
        except (ImportError, AttributeError) as exc:
            raise SetupError("model.factory", f"{model['factory']!r}: {exc}") from exc
        built = factory(hf_config)
        if model.get("attn_implementation") and hasattr(built, "set_attn_implementation"):
            built.set_attn_implementation(model["attn_implementation"])
        return built
    auto = getattr(transformers, AUTO_CLASSES[model.get("task", "causal-lm")])
    kwargs: dict[str, Any] = {}
    if model.get("attn_implementation"):
        kwargs["attn_implementation"] = model["attn_implementation"]
    if model.get("config") and quantization is None:
        return auto.from_config(hf_config, **kwargs)
    if model.get("config"):
        # bitsandbytes quantizes as from_pretrained loads: the inline config's random
        # weights (the trial's seed) go through a folder first, as a checkpoint would.
        folder = Path(scratch or Path.cwd()) / "base-weights"
        auto.from_config(hf_config, **kwargs).save_pretrained(str(folder))
        source = str(folder)
    else:
        source = str(Path(model["name_or_path"]).expanduser())
    if quantization is not None:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(**quantization)
    return auto.from_pretrained(source, config=hf_config, **kwargs)


def prepare_quantized(model):
    """PEFT's preparation of a quantized base for training its adapters: the layers left
    in 16 bits go to fp32 for stable updates. Checkpointing stays the knob's (Trainer
    turns it on from the TrainingArguments), not PEFT's default of always."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
