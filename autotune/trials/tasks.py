"""What a trial builds beyond a causal or masked LM under Trainer (inside the trial
process): an encoder-decoder under Seq2SeqTrainer, an image classifier, and DPO's
preference pairs under TRL's DPOTrainer.

The worker asks this module, in its order, for the trainer's arguments (before the model:
ZeRO-3 builds under zero.Init), for DPO's reference model (in the model phase), for the
trainer and its rows, for how to count a micro-batch's samples and tokens, and, once the
steps are timed, for what the kind adds to the outcome:

- seq2seq-lm: rows of `data.seq_len` source tokens and `target_len` target tokens (the
  decoder's labels); a sample's tokens are both.
- image-classification: images sized from the model's config (synthetic), or an image
  folder or dataset through the model's image processor; a sample is an image and its
  tokens are its patches.
- trainer: dpo: a sample is a preference pair, two rows (prompt and chosen, prompt and
  rejected) through the policy and the reference's forward; under LoRA the reference is
  the base with the adapters off (TRL's, given the adapters as `peft_config`), without it
  a second copy built as the policy was, or none where the reference's log-probs are
  precomputed once (the `precompute_ref_log_probs` knob), whose seconds are charged to
  the timed steps at their share.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.trials.data import (
    IGNORE,
    TokenDataset,
    data_format,
    length_stats,
    load_tokenizer,
    preference_rows,
    read_rows,
)

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.records import Outcome
    from autotune.spec import Spec

# Distinct synthetic images a trial cycles through: their values change neither the step's
# time nor its memory, and a pool keeps the host's share small (a ViT-base image is
# 600 KB) without generating pixels inside the timed steps.
IMAGE_POOL = 32


def kind(spec: Spec) -> str:
    """What this module builds for the spec: "dpo", "seq2seq", "image", or "" (the worker's
    own Trainer or SFTTrainer)."""
    if spec.trainer == "dpo":
        return "dpo"
    return {"seq2seq-lm": "seq2seq", "image-classification": "image"}.get(spec.model.task, "")


def arguments(spec: Spec, kwargs: dict[str, Any]):
    """The spec's trainer's arguments from the one builder's kwargs: TrainingArguments,
    Seq2SeqTrainingArguments, TRL's SFTConfig or DPOConfig."""
    if spec.trainer == "sft":
        from trl import SFTConfig

        return SFTConfig(**kwargs)
    if spec.trainer == "dpo":
        from trl import DPOConfig

        return DPOConfig(**kwargs)
    if spec.model.task == "seq2seq-lm":
        from transformers import Seq2SeqTrainingArguments

        return Seq2SeqTrainingArguments(**kwargs)
    from transformers import TrainingArguments

    return TrainingArguments(**kwargs)


def reference_model(spec: Spec, cfg: TrialConfig, device: Any, seed: int):
    """DPO's reference without LoRA: a second copy of the policy, built the same way from
    the same seed (so with the same weights), frozen. None where no second model is kept:
    under LoRA, with precomputed log-probs (the policy before its first step computes
    them once), under any other trainer."""
    if (spec.trainer != "dpo" or spec.model.lora is not None
            or cfg.precompute_ref_log_probs):
        return None
    from transformers import set_seed

    from autotune.trials.model_builder import build_model
    from autotune.trials.trainargs import model_kwargs

    set_seed(seed)
    reference, _ = build_model(spec.model.model_dump(), model_kwargs(cfg), device)
    reference.requires_grad_(False)
    return reference.eval()


def make_trainer(spec: Spec, model, args, samples: int, timer, seed: int,
                 reference=None) -> tuple[Any, dict[str, float] | None]:
    """The trainer of this kind on `samples` samples (pairs under DPO), with the step
    timer; and the rows' token lengths where they are real."""
    which = kind(spec)
    if which == "dpo":
        return _dpo_trainer(spec, model, args, samples, timer, reference)
    if which == "seq2seq":
        from transformers import Seq2SeqTrainer

        rows = seq2seq_dataset(spec, model, samples, seed)
        return Seq2SeqTrainer(model=model, args=args, train_dataset=rows,
                              callbacks=[timer]), rows.lengths
    from transformers import Trainer

    rows = image_dataset(spec, model, samples, seed)
    return Trainer(model=model, args=args, train_dataset=rows, callbacks=[timer]), None


# --- an encoder-decoder's rows -----------------------------------------------------------

def seq2seq_dataset(spec: Spec, model, n_samples: int, seed: int = 0) -> TokenDataset:
    """`n_samples` rows of source (`data.seq_len`, padded) and target (`target_len`: the
    labels, padded with IGNORE) tokens: random ids, or prompt-completion rows."""
    import torch

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


# --- images ------------------------------------------------------------------------------

class ImageRows:
    """Rows of pixel values and a label, drawn from a pool of `len(pool)` (synthetic: their
    values change neither speed nor memory), or one per real image."""

    def __init__(self, pool: list[dict], n: int) -> None:
        self.pool, self.n = pool, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return self.pool[i % len(self.pool)]


def image_dataset(spec: Spec, model, n_samples: int, seed: int = 0) -> ImageRows:
    """`n_samples` images of the model's size with a label each: random pixels, or the
    source's images through the model's image processor."""
    import torch

    from autotune.plan.shape import image_pixels

    cfg = model.config
    classes = int(getattr(cfg, "num_labels", 2) or 2)
    data = spec.data.model_dump()
    if data["source"] != "synthetic":
        return ImageRows(_real_images(data, spec.model.name_or_path, n_samples, classes),
                         n_samples)
    channels = int(getattr(cfg, "num_channels", 3) or 3)
    side = image_pixels(cfg) // channels
    size = getattr(cfg, "image_size", None)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
    if h * w != side:
        raise SetupError("model.config", "an image model's config needs image_size (and "
                         "num_channels) to size its synthetic images")
    g = torch.Generator().manual_seed(seed)
    pool = [{"pixel_values": torch.randn(channels, h, w, generator=g),
             "labels": torch.randint(0, classes, (), generator=g)}
            for _ in range(min(n_samples, IMAGE_POOL))]
    return ImageRows(pool, n_samples)


def _real_images(data: dict[str, Any], model_path: str | None, n: int,
                 classes: int) -> list[dict]:
    """Each image through the image processor (data.processor, or the model folder's),
    with its label; a label the model's head has no class for is named."""
    import torch
    from transformers import AutoImageProcessor

    rows = read_rows(data["source"], n)
    data_format(data | {"format": "image"}, list(rows.column_names))
    where = data.get("processor") or model_path
    try:
        processor = AutoImageProcessor.from_pretrained(where)
    except Exception as exc:  # noqa: BLE001 - a folder without one raises anything
        field = "data.processor" if data.get("processor") else "model.name_or_path"
        raise SetupError(field, f"{where!r} has no image processor: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200]}") from exc
    out = []
    for i, row in enumerate(rows):
        label = row.get("label")
        if not isinstance(label, int) or not 0 <= label < classes:
            raise SetupError("data.source", f"row {i}: label {label!r} is no class of the "
                             f"model's {classes} (set num_labels in its config)")
        pixels = processor(images=[row["image"].convert("RGB")],
                           return_tensors="pt")["pixel_values"][0]
        out.append({"pixel_values": pixels, "labels": torch.tensor(label)})
    return (out * (n // len(out) + 1))[:n]


# --- DPO ---------------------------------------------------------------------------------

def _dpo_class():
    from trl import DPOTrainer

    class TimedDPOTrainer(DPOTrainer):
        """DPOTrainer that keeps the seconds of each batch of its precomputation of the
        reference's log-probs (a forward of the reference over every pair, before the
        first step, a micro-batch at a time): a cost per pair, as the reference's forward
        in every step is. The device is synchronised after each, as TRL's own copy of the
        result to the host does."""

        precompute_batches: list[float]

        def compute_ref_log_probs(self, model, inputs):
            import torch

            began = time.perf_counter()
            out = super().compute_ref_log_probs(model, inputs)
            if torch.cuda.is_available() and out[0].is_cuda:
                torch.cuda.synchronize()
            self.__dict__.setdefault("precompute_batches", []).append(
                time.perf_counter() - began)
            return out

    return TimedDPOTrainer


def _dpo_trainer(spec: Spec, model, args, pairs: int, timer, reference):
    """TRL's DPOTrainer on the source's preference rows (it renders, tokenizes and
    collates them) with the DPOConfig the driver built; under LoRA the adapters are TRL's
    to add (`peft_config`), so the reference is the base with them off."""
    data = spec.data.model_dump()
    tok = load_tokenizer(data)
    peft = None
    if spec.model.lora is not None:
        from peft import LoraConfig

        from autotune.trials.lora import lora_config_kwargs

        peft = LoraConfig(**lora_config_kwargs(spec.model.lora.model_dump(), spec.model.task))
    rows = preference_rows(data, pairs)
    try:
        trainer = _dpo_class()(model=model, ref_model=reference, args=args,
                               train_dataset=rows, processing_class=tok, peft_config=peft,
                               callbacks=[timer])
    except (ValueError, KeyError) as exc:  # TRL's word on the rows or the template
        raise SetupError("data", f"DPOTrainer refused the data: "
                         f"{' '.join(str(exc).split())[:400]}") from exc
    return trainer, _pair_lengths(trainer.train_dataset, data["seq_len"])


def _pair_lengths(rows, seq_len: int) -> dict[str, float]:
    """Both rows of every pair as the collator truncates them: prompt and reply, the
    loss on the reply."""
    encoded = []
    for prompt, chosen, rejected in zip(rows["prompt_ids"], rows["chosen_ids"],
                                        rows["rejected_ids"], strict=True):
        for reply in (chosen, rejected):
            ids = (prompt + reply)[:seq_len]
            encoded.append((ids, ([IGNORE] * len(prompt) + reply)[:seq_len]))
    return length_stats(encoded, seq_len)


# --- counting and finishing --------------------------------------------------------------

def counter(spec: Spec, shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
    """(samples, tokens) of a micro-batch's inputs for this kind, or None for the
    worker's own count: a DPO batch is chosen rows then rejected rows (a sample is the
    pair, its tokens both rows'); a seq2seq sample's tokens are its source's and its
    target's; an image's are its patches."""
    which = kind(spec)
    if which == "dpo":
        return lambda x: (x["input_ids"].shape[0] // 2, x["attention_mask"].sum())
    if which == "seq2seq":
        return lambda x: (x["input_ids"].shape[0], x["attention_mask"].sum()
                          + (x["labels"] != IGNORE).sum())
    if which == "image":
        patches = int((shape or {}).get("seq_len") or 1)
        return lambda x: (x["pixel_values"].shape[0], x["pixel_values"].shape[0] * patches)
    return None


def finish(spec: Spec, outcome: Outcome, trainer) -> None:
    """What the kind adds to a measured outcome: DPO's precomputed reference log-probs
    charged to the timed steps at their share of the pairs (a long run pays them for
    every pair); an image model's objective is images/s (its tokens are patches, as many
    in every image)."""
    if kind(spec) == "image":
        outcome.extra.pop("objective", None)
    batches = getattr(trainer, "precompute_batches", None)
    if not batches or not outcome.timed_seconds:
        return
    # One precomputed batch per micro-batch (the same batch size): the timed steps' share
    # is the typical batch's seconds (its first pays the warm-up) times their micro-batches.
    typical = statistics.median(batches)
    share = typical * spec.measure.steps * trainer.args.gradient_accumulation_steps
    slower = outcome.timed_seconds / (outcome.timed_seconds + share)
    outcome.extra |= {"precompute_ref_seconds": sum(batches),
                      "precompute_charged_seconds": share}
    outcome.timed_seconds += share
    for name in ("samples_per_second", "tokens_per_second"):
        value = getattr(outcome, name)
        if value:
            setattr(outcome, name, value * slower)
