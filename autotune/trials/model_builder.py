"""Build the model and the training data a trial runs on (inside the trial process)."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from autotune.errors import SetupError
from autotune.plan.shape import AUTO_CLASSES, load_hf_config, max_positions
from autotune.trials.oom import is_oom_exception


def _model_field(model: dict[str, Any]) -> str:
    return next(f"model.{k}" for k in ("factory", "name_or_path", "config") if model.get(k))


def build_model(model: dict[str, Any], attn_implementation: str = "auto"):
    """The spec's model, with the attention kernel the config's knob names ("auto": the
    spec's own or the model's default). A failure that is not a lack of memory is a
    SetupError naming the spec's field: no config of the search could avoid it."""
    if attn_implementation != "auto":
        model = model | {"attn_implementation": attn_implementation}
    try:
        return _build_model(model)
    except SetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised, classified
        if is_oom_exception(exc):
            raise
        raise SetupError(_model_field(model), f"{type(exc).__name__}: {exc}") from exc


def _build_model(model: dict[str, Any]):
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
    kwargs = {}
    if model.get("attn_implementation"):
        kwargs["attn_implementation"] = model["attn_implementation"]
    if model.get("config"):
        return auto.from_config(hf_config, **kwargs)
    return auto.from_pretrained(str(Path(model["name_or_path"]).expanduser()),
                                config=hf_config, **kwargs)


class TokenDataset:
    """A list of ready tensors: the trial measures the model, not a data pipeline."""

    def __init__(self, rows: list[dict]):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def build_dataset(spec: dict[str, Any], model, n_samples: int, seed: int = 0) -> TokenDataset:
    import torch

    data, task = spec["data"], spec["model"].get("task", "causal-lm")
    seq_len = data["seq_len"]
    limit = max_positions(getattr(model, "config", None))
    if limit is not None and seq_len > limit:
        raise SetupError("data.seq_len", f"{seq_len} exceeds the model's {limit} positions")
    g = torch.Generator().manual_seed(seed)
    if data.get("source", "synthetic") == "synthetic":
        vocab = int(getattr(model.config, "vocab_size", 30000))
        low = 100 if vocab > 1000 else 0  # as in the seeds: skip special-token ids
        ids = torch.randint(low, vocab, (n_samples, seq_len), generator=g)
        masks = torch.ones_like(ids)
    else:
        ids, masks = _tokenized(data, n_samples)
    rows = []
    for i in range(n_samples):
        row = {"input_ids": ids[i], "attention_mask": masks[i]}
        if task == "sequence-classification":
            row["labels"] = torch.randint(0, 2, (), generator=g)
        elif task == "masked-lm":
            labels = ids[i].clone()
            labels[torch.rand(seq_len, generator=g) > 0.15] = -100
            row["labels"] = labels
        else:
            labels = ids[i].clone()
            labels[masks[i] == 0] = -100
            row["labels"] = labels
        rows.append(row)
    return TokenDataset(rows)


def _read_texts(source: str, field: str) -> list[str]:
    path = Path(source)
    if path.suffix in (".jsonl", ".json"):
        lines = path.read_text().splitlines()
        return [json.loads(line)[field] for line in lines if line.strip()]
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    return list(ds[field])


def _tokenized(data: dict[str, Any], n_samples: int):
    import transformers

    try:
        texts = _read_texts(data["source"], data.get("text_field", "text"))
    except KeyError as exc:
        raise SetupError("data.text_field", f"{exc} is not a field of {data['source']}") from exc
    except Exception as exc:  # noqa: BLE001 - whatever the reader raised, named
        raise SetupError("data.source", f"{type(exc).__name__}: {exc}") from exc
    if not texts:
        raise SetupError("data.source", f"{data['source']!r} holds no texts")
    try:
        tok = transformers.AutoTokenizer.from_pretrained(data["tokenizer"])
    except Exception as exc:  # noqa: BLE001 - a broken folder raises anything
        raise SetupError("data.tokenizer", f"{data['tokenizer']!r} could not be loaded: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    texts = (texts * (n_samples // len(texts) + 1))[:n_samples]
    enc = tok(texts, max_length=data["seq_len"], truncation=True, padding="max_length",
              return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]
