"""The training data a trial runs on, as people have it (inside the trial process).

A source is synthetic tokens (the seeds' benchmark), a JSONL/JSON/Parquet file, a saved
dataset folder, or a hub dataset id where the hub is reachable. Its format is found from
its columns, or said outright (`data.format`): plain `text`; chat `messages` rendered by
the tokenizer's chat template; `prompt` and `completion` (strings, or lists of messages
for a chat model). With `data.completion_only_loss` the loss is on the completion (the
assistant's turns) only. Every row is tokenized once, truncated to `data.seq_len` and
padded to it; padding-free packing (a knob) then drops the padding again.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.tasks.models import max_positions

if TYPE_CHECKING:
    from autotune.tasks.base import Task

FORMATS = ("text", "messages", "prompt-completion", "preference", "image")
# Columns that say a format (a preference row's prompt may be left in its chosen and
# rejected conversations, which TRL then splits).
FORMAT_COLUMNS = {"messages": ("messages",), "prompt-completion": ("prompt", "completion"),
                  "preference": ("chosen", "rejected"), "image": ("image", "label")}
# The order the columns are looked for when data.format is auto: a preference row may
# also have a prompt, a conversation's rows a completion.
DETECTED = ("preference", "messages", "prompt-completion", "image", "text")
IGNORE = -100  # labels the loss skips


class TokenDataset:
    """A list of ready tensors: the trial measures the model, not a data pipeline."""

    def __init__(self, rows: list[dict], lengths: dict[str, float] | None = None):
        self.rows, self.lengths = rows, lengths

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return self.rows[i]


def build_dataset(spec: dict[str, Any], model, n_samples: int, task: Task | None = None,
                  seed: int = 0) -> TokenDataset:
    """`n_samples` rows of the spec's data for `model` (the source's rows repeated where it
    has fewer), labelled as its task labels a row (`Task.row_labels`)."""
    import torch

    from autotune.tasks.registry import task as named

    task = task or named(spec["model"].get("task"))
    data = spec["data"]
    seq_len = data["seq_len"]
    limit = max_positions(getattr(model, "config", None))
    if limit is not None and seq_len > limit:
        raise SetupError("data.seq_len", f"{seq_len} exceeds the model's {limit} positions")
    g = torch.Generator().manual_seed(seed)
    if data.get("source", "synthetic") == "synthetic":
        vocab = int(getattr(model.config, "vocab_size", 30000))
        low = 100 if vocab > 1000 else 0  # as in the seeds: skip special-token ids
        ids = torch.randint(low, vocab, (n_samples, seq_len), generator=g)
        return TokenDataset(_rows(ids, torch.ones_like(ids), None, task, g))
    encoded = encode(data, n_samples)
    ids, masks, labels = _padded(encoded, seq_len, n_samples)
    return TokenDataset(_rows(ids, masks, labels, task, g), lengths=length_stats(
        encoded, seq_len))


def _rows(ids, masks, labels, task: Task, g) -> list[dict]:
    return [{"input_ids": ids[i], "attention_mask": masks[i],
             "labels": task.row_labels(ids[i], masks[i],
                                       None if labels is None else labels[i], g)}
            for i in range(len(ids))]


# --- reading --------------------------------------------------------------------------

def read_rows(source: str, n: int | None = None):
    """The source's training rows as a datasets.Dataset (its train split), the first `n`."""
    import datasets

    path = Path(source)
    try:
        if path.is_dir() and not _saved_dataset(path):  # a folder of images, one per class
            ds = datasets.load_dataset("imagefolder", data_dir=str(path))
        elif path.is_dir():
            ds = datasets.load_from_disk(str(path))
        elif path.suffix in (".jsonl", ".json"):
            ds = datasets.load_dataset("json", data_files=str(path))
        elif path.suffix == ".parquet":
            ds = datasets.load_dataset("parquet", data_files=str(path))
        else:  # a hub dataset id
            ds = datasets.load_dataset(source)
    except Exception as exc:  # noqa: BLE001 - whatever the reader raised, named
        text = " ".join(str(exc).split())[:300]
        raise SetupError("data.source", f"{source!r} could not be read: "
                         f"{type(exc).__name__}: {text}") from exc
    if isinstance(ds, datasets.DatasetDict):
        ds = ds["train"] if "train" in ds else next(iter(ds.values()))
    if len(ds) == 0:
        raise SetupError("data.source", f"{source!r} holds no rows")
    return ds.select(range(min(n, len(ds)))) if n else ds


def _saved_dataset(path: Path) -> bool:
    """Whether a folder holds a dataset written by `save_to_disk` (else: image files)."""
    return any((path / name).is_file() for name in
               ("dataset_info.json", "state.json", "dataset_dict.json"))


def data_format(data: dict[str, Any], columns: list[str]) -> str:
    """The format `data.format` says, or the one the columns show; one line naming the
    columns found where none fits."""
    said = data.get("format", "auto")
    text_field = data.get("text_field", "text")
    needs = {"text": (text_field,), **FORMAT_COLUMNS}
    if said != "auto":
        missing = [c for c in needs[said] if c not in columns]
        if missing:
            raise SetupError("data.format", f"{said} needs the column(s) "
                             f"{', '.join(missing)}; {data['source']!r} has "
                             f"{', '.join(columns) or 'none'}")
        return said
    for name in DETECTED:
        if all(c in columns for c in needs[name]):
            return name
    raise SetupError("data.format", f"{data['source']!r} has the columns "
                     f"{', '.join(columns) or 'none'}: none fits a format (text needs "
                     f"{text_field!r}, messages needs 'messages', prompt-completion needs "
                     "'prompt' and 'completion', preference needs 'chosen' and 'rejected', "
                     "image needs 'image' and 'label'; or set data.text_field)")


def resolved_format(data: dict[str, Any]) -> str:
    """The data's format as the trials will read it (synthetic tokens are text), found
    from the source's first row where `data.format` is auto: the driver's SFTConfig
    needs it before any trial runs."""
    if data.get("source", "synthetic") == "synthetic":
        return "text"
    if data.get("format", "auto") != "auto":
        return data["format"]
    return data_format(data, list(read_rows(data["source"], 1).column_names))


def sft_dataset(data: dict[str, Any], n_samples: int):
    """The rows as SFTTrainer takes them: the source's own columns (TRL renders and
    tokenizes them), or synthetic tokens already tokenized; `n_samples` of them."""
    import datasets

    if data.get("source", "synthetic") == "synthetic":
        raise SetupError("data.source", "trainer: sft tokenizes text: give a data source")
    rows = read_rows(data["source"], n_samples)
    data_format(data, list(rows.column_names))  # one line naming the columns if none fits
    repeats = [rows] * (n_samples // len(rows) + 1)
    return datasets.concatenate_datasets(repeats).select(range(n_samples))


# --- tokenizing -----------------------------------------------------------------------

def load_tokenizer(data: dict[str, Any]):
    import transformers

    try:
        tok = transformers.AutoTokenizer.from_pretrained(data["tokenizer"])
    except Exception as exc:  # noqa: BLE001 - a broken folder raises anything
        raise SetupError("data.tokenizer", f"{data['tokenizer']!r} could not be loaded: "
                         f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}") from exc
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token or tok.unk_token
    return tok


def encode(data: dict[str, Any], n_samples: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, labels) per row, truncated to seq_len: labels IGNORE outside the
    completion where the loss is on completions only."""
    rows = read_rows(data["source"], n_samples)
    fmt = data_format(data, list(rows.column_names))
    tok = load_tokenizer(data)
    only = bool(data.get("completion_only_loss"))
    if fmt != "text" and _conversational(rows, fmt) and not getattr(tok, "chat_template", None):
        raise SetupError("data.tokenizer", f"{data['tokenizer']!r} has no chat template, "
                         f"which {fmt} rows of messages are rendered with")
    out = []
    for i, row in enumerate(rows):
        ids, labels = _encode_row(tok, row, fmt, data, only, i)
        out.append((ids[:data["seq_len"]], labels[:data["seq_len"]]))
    return (out * (n_samples // len(out) + 1))[:n_samples]


def _conversational(rows, fmt: str) -> bool:
    first = rows[0]["messages" if fmt == "messages" else "prompt"]
    return isinstance(first, list)


def _field(row: dict, name: str, i: int):
    value = row.get(name)
    if value is None:
        raise SetupError("data.source", f"row {i} has no {name!r} (every row needs one)")
    return value


def preference_rows(data: dict[str, Any], n_samples: int):
    """`n_samples` preference pairs as DPOTrainer takes them (it renders and tokenizes
    them), in memory (a cached file would let one trial reuse another's precomputed
    reference log-probs): the source's rows, repeated where it has fewer; a row without
    its chosen or rejected reply is named."""
    import datasets

    rows = read_rows(data["source"], n_samples)
    fmt = data_format(data, list(rows.column_names))
    if fmt != "preference":
        raise SetupError("data.format", f"trainer: dpo trains on preference pairs (columns "
                         f"chosen and rejected, with a prompt); {data['source']!r} has "
                         f"{', '.join(rows.column_names)} ({fmt} rows)")
    keep = [c for c in ("prompt", "chosen", "rejected") if c in rows.column_names]
    pairs = []
    for i, row in enumerate(rows):
        for name in keep:
            _field(row, name, i)
        pairs.append({c: row[c] for c in keep})
    return datasets.Dataset.from_list((pairs * (n_samples // len(pairs) + 1))[:n_samples])


def _encode_row(tok, row: dict, fmt: str, data: dict, only: bool,
                i: int) -> tuple[list[int], list[int]]:
    if fmt == "text":
        ids = tok(_field(row, data.get("text_field", "text"), i), truncation=False)["input_ids"]
        return ids, list(ids)
    if fmt == "messages":
        return _chat(tok, _field(row, "messages", i), None, only, i)
    prompt, completion = _field(row, "prompt", i), _field(row, "completion", i)
    if isinstance(prompt, list):  # conversational prompt-completion
        return _chat(tok, prompt, completion, only, i)
    head = tok(prompt)["input_ids"]
    tail = tok(completion, add_special_tokens=False)["input_ids"]
    tail += [tok.eos_token_id] if tok.eos_token_id is not None else []
    return head + tail, ([IGNORE] * len(head) if only else head) + tail


def _chat(tok, messages: list[dict], completion: list[dict] | None, only: bool,
          i: int) -> tuple[list[int], list[int]]:
    """A conversation through the chat template; with `only`, labels on the assistant's
    turns (each found as what its turn adds to the rendered prefix before it, which works
    with any template that renders conversations prefix by prefix)."""
    turns = list(messages) + list(completion or [])

    def render(msgs: list[dict], prompt: bool) -> list[int]:
        return list(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=prompt,
                                            return_dict=True)["input_ids"])

    ids = render(turns, False)
    if not only:
        return ids, list(ids)
    labels = [IGNORE] * len(ids)
    first = len(messages) if completion is not None else 0
    for k in range(first, len(turns)):
        if turns[k].get("role") != "assistant":
            continue
        before, after = render(turns[:k], True), render(turns[:k + 1], False)
        if after[:len(before)] != before or ids[:len(after)] != after:
            raise SetupError("data.completion_only_loss", f"row {i}: the tokenizer's chat "
                             "template does not render the conversation prefix by prefix, "
                             "so the assistant's tokens cannot be told apart")
        labels[len(before):len(after)] = ids[len(before):len(after)]
    return ids, labels


def _padded(encoded: list[tuple[list[int], list[int]]], seq_len: int, n: int):
    import torch

    ids = torch.zeros((n, seq_len), dtype=torch.long)
    masks = torch.zeros((n, seq_len), dtype=torch.long)
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    for r, (row_ids, row_labels) in enumerate(encoded):
        ids[r, :len(row_ids)] = torch.tensor(row_ids, dtype=torch.long)
        masks[r, :len(row_ids)] = 1
        labels[r, :len(row_labels)] = torch.tensor(row_labels, dtype=torch.long)
    return ids, masks, labels


def length_stats(encoded: list[tuple[list[int], list[int]]], seq_len: int) -> dict[str, float]:
    """The rows' real tokens after truncation: the distribution padding and packing are
    judged on, and the share of tokens the loss sees."""
    lengths = sorted(len(ids) for ids, _ in encoded)
    counted = sum(sum(1 for x in labels if x != IGNORE) for _, labels in encoded)

    def q(p: float) -> float:
        return float(lengths[min(len(lengths) - 1, int(p * len(lengths)))])

    return {"min": float(lengths[0]), "p50": q(0.5), "p90": q(0.9), "max": float(lengths[-1]),
            "mean": statistics.fmean(lengths), "seq_len": float(seq_len),
            "padding": 1 - statistics.fmean(lengths) / seq_len,
            "truncated": sum(n >= seq_len for n in lengths) / len(lengths),
            "loss_tokens": counted / max(1, sum(lengths))}
