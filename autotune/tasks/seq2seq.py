"""An encoder-decoder's target tokens (`model.task: seq2seq-lm`): T5 and BART under
Seq2SeqTrainer. A row is `data.seq_len` source tokens and `data.target_len` target tokens
(the decoder's labels); a sample's tokens are both. Its decoder is a second stack of
layers, at the target's length, attending the source too."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.tasks.base import Task

if TYPE_CHECKING:
    from autotune.spec import Spec


class Seq2SeqLM(Task):
    name = "seq2seq-lm"
    auto_class = "AutoModelForSeq2SeqLM"
    lora_task_type = "SEQ_2_SEQ_LM"
    lm_logits = True
    replayable = False  # two stacks: the allocator replay follows one
    arguments_class = "Seq2SeqTrainingArguments"
    has_target = True
    units = ("samples", "tokens", "a sample's tokens are its source's and its target's")
    model_types = ("t5", "bart")
    second_stack_keys = ("num_decoder_layers", "decoder_layers")
    data_comment = ("synthetic tokens as written: seq_len source and target_len target "
                    "tokens a row; for your rows set\nsource (prompt and completion: the "
                    "source and the target text) and tokenizer.")

    def prepare_config(self, hf_config: Any) -> Any:
        """The decoder's start token, which T5's checkpoints set to the pad token (0) and
        transformers 5's T5Config leaves unset."""
        if getattr(hf_config, "decoder_start_token_id", None) is None:
            hf_config.decoder_start_token_id = getattr(hf_config, "pad_token_id", None) or 0
        return hf_config

    def lengths(self, spec: Spec) -> dict[str, int]:
        return {"seq_len": spec.data.seq_len, "target_len": spec.target_len}

    def shape_fields(self, spec_target_len: int | None) -> dict[str, Any]:
        return {"target_len": spec_target_len} if spec_target_len else {}

    def notes(self, spec: Spec) -> list[str]:
        if spec.data.target_len is not None:
            return []
        return [f"data.target_len is not set: seq2seq targets of {spec.target_len} tokens "
                "(the default; set data.target_len to your targets' length)"]

    def trace_inputs(self, hf_config: Any, seq_len: int, batch: int, target_len: int,
                     rows: int) -> dict[str, Any]:
        import torch

        vocab = int(getattr(hf_config, "vocab_size", 2) or 2)
        return {"input_ids": torch.randint(0, vocab, (batch, seq_len)),
                "labels": torch.randint(0, vocab, (batch, target_len))}

    def rows(self, spec: Spec, model: Any, n_samples: int,
             seed: int) -> tuple[Any, dict[str, float] | None]:
        rows = seq2seq_dataset(spec, model, n_samples, seed)
        return rows, rows.lengths

    def trainer_class(self) -> Any:
        from transformers import Seq2SeqTrainer

        return Seq2SeqTrainer

    def arguments_fields(self, spec: Spec) -> dict[str, Any] | None:
        """No generation in evaluation by default, and where it is asked for, targets as
        long as the trials trained on."""
        return {"predict_with_generate": False, "generation_max_length": spec.target_len}

    def counter(self, shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
        from autotune.tasks.data import IGNORE

        return lambda x: (x["input_ids"].shape[0], x["attention_mask"].sum()
                          + (x["labels"] != IGNORE).sum())


SEQ2SEQ_LM = Seq2SeqLM()


def seq2seq_dataset(spec: Spec, model, n_samples: int, seed: int = 0):
    """`n_samples` rows of source (`data.seq_len`, padded) and target (`target_len`: the
    labels, padded with IGNORE) tokens: random ids, or prompt-completion rows."""
    import torch

    from autotune.tasks.data import IGNORE, TokenDataset, length_stats, load_tokenizer

    data, seq, target = spec.data.model_dump(), spec.data.seq_len, spec.target_len
    if data["source"] == "synthetic":
        g = torch.Generator().manual_seed(seed)
        vocab = int(getattr(model.config, "vocab_size", 30000))
        low = 100 if vocab > 1000 else 0  # as in the seeds: skip special-token ids
        ids = torch.randint(low, vocab, (n_samples, seq), generator=g)
        labels = torch.randint(low, vocab, (n_samples, target), generator=g)
        return TokenDataset([{"input_ids": ids[i], "attention_mask": torch.ones_like(ids[i]),
                              "labels": labels[i]} for i in range(n_samples)])
    pairs = encode_seq2seq(data, seq, target, n_samples)
    pad = int(load_tokenizer(data).pad_token_id or 0)
    rows = []
    for source, label in pairs:
        ids = torch.full((seq,), pad, dtype=torch.long)
        row = {"input_ids": ids, "attention_mask": torch.zeros(seq, dtype=torch.long),
               "labels": torch.full((target,), IGNORE, dtype=torch.long)}
        ids[:len(source)] = torch.tensor(source)
        row["attention_mask"][:len(source)] = 1
        row["labels"][:len(label)] = torch.tensor(label)
        rows.append(row)
    # The rows' real tokens, source and target together: what the padding costs and the
    # loss sees (the target's share).
    both = [(s + t, [IGNORE] * len(s) + t) for s, t in pairs]
    return TokenDataset(rows, lengths=length_stats(both, seq + target))


def encode_seq2seq(data: dict[str, Any], seq: int, target: int,
                   n_samples: int) -> list[tuple[list[int], list[int]]]:
    """(source ids, target ids) per prompt-completion row, truncated to the two lengths;
    the target ends with the tokenizer's EOS, as T5's and BART's do."""
    from autotune.tasks.data import data_format, load_tokenizer, read_rows

    rows = read_rows(data["source"], n_samples)
    fmt = data_format(data, list(rows.column_names))
    if fmt != "prompt-completion":
        raise SetupError("data.format", f"a seq2seq-lm model trains on prompt-completion "
                         f"rows (the source and the target); {data['source']!r} has {fmt} "
                         "rows")
    tok = load_tokenizer(data)
    out = []
    for i, row in enumerate(rows):
        prompt, completion = row.get("prompt"), row.get("completion")
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise SetupError("data.source", f"row {i} has no {name!r} string (a "
                                 "seq2seq row is a source and a target text)")
        source = tok(prompt)["input_ids"][:seq]
        label = tok(text_target=completion)["input_ids"]
        if tok.eos_token_id is not None and (not label or label[-1] != tok.eos_token_id):
            label = [*label, tok.eos_token_id]
        out.append((source, label[:target]))
    return (out * (n_samples // len(out) + 1))[:n_samples]
