"""`autotune init`: a commented spec for a model, written from its config alone.

MODEL is a local model folder (its config.json), a model type with a size hint
("llama-8b", "qwen2-1.5b", "gpt2"; PRESETS), or a hub id where the hub is reachable. The
config is read, never the weights; the device is the one here unless named. The spec
says what it found: the parameter count, the knobs the device allows and why the others
are out, and which configs the memory model expects to fit.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import SpecError
from autotune.tasks import task, task_for_model_type

# Shapes people fine-tune, by model type and size: enough of each config to count it.
_LLAMA = {"model_type": "llama", "tie_word_embeddings": False}
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        "1b": _LLAMA | {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                        "num_attention_heads": 32, "num_key_value_heads": 8,
                        "vocab_size": 128256, "max_position_embeddings": 131072,
                        "tie_word_embeddings": True},
        "3b": _LLAMA | {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
                        "num_attention_heads": 24, "num_key_value_heads": 8,
                        "vocab_size": 128256, "max_position_embeddings": 131072,
                        "tie_word_embeddings": True},
        "8b": _LLAMA | {"hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32,
                        "num_key_value_heads": 8, "vocab_size": 128256,
                        "max_position_embeddings": 131072},
        "70b": _LLAMA | {"hidden_size": 8192, "intermediate_size": 28672,
                         "num_hidden_layers": 80, "num_attention_heads": 64,
                         "num_key_value_heads": 8, "vocab_size": 128256,
                         "max_position_embeddings": 131072},
    },
    "qwen2": {
        "0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
                 "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                 "vocab_size": 151936, "max_position_embeddings": 32768,
                 "tie_word_embeddings": True},
        "1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
                 "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
                 "vocab_size": 151936, "max_position_embeddings": 32768,
                 "tie_word_embeddings": True},
        "7b": {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
               "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
               "vocab_size": 152064, "max_position_embeddings": 32768,
               "tie_word_embeddings": False},
    },
    "mistral": {
        "7b": {"model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
               "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
               "vocab_size": 32768, "max_position_embeddings": 32768},
    },
    "gemma": {
        "2b": {"model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384,
               "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
               "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192},
        "7b": {"model_type": "gemma", "hidden_size": 3072, "intermediate_size": 24576,
               "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
               "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192},
    },
    "gpt2": {
        "124m": {"model_type": "gpt2"},
        "355m": {"model_type": "gpt2", "n_layer": 24, "n_embd": 1024, "n_head": 16},
        "774m": {"model_type": "gpt2", "n_layer": 36, "n_embd": 1280, "n_head": 20},
        "1.5b": {"model_type": "gpt2", "n_layer": 48, "n_embd": 1600, "n_head": 25},
    },
    "bert": {
        "base": {"model_type": "bert"},
        "large": {"model_type": "bert", "num_hidden_layers": 24, "hidden_size": 1024,
                  "num_attention_heads": 16, "intermediate_size": 4096},
    },
    # Encoder-decoders (seq2seq-lm): T5 v1.0's and BART's published shapes.
    "t5": {
        "small": {"model_type": "t5", "d_model": 512, "d_ff": 2048, "d_kv": 64,
                  "num_layers": 6, "num_heads": 8, "vocab_size": 32128,
                  "decoder_start_token_id": 0},
        "base": {"model_type": "t5", "d_model": 768, "d_ff": 3072, "d_kv": 64,
                 "num_layers": 12, "num_heads": 12, "vocab_size": 32128,
                 "decoder_start_token_id": 0},
        "large": {"model_type": "t5", "d_model": 1024, "d_ff": 4096, "d_kv": 64,
                  "num_layers": 24, "num_heads": 16, "vocab_size": 32128,
                  "decoder_start_token_id": 0},
    },
    "bart": {
        "base": {"model_type": "bart", "d_model": 768, "encoder_layers": 6,
                 "decoder_layers": 6, "encoder_attention_heads": 12,
                 "decoder_attention_heads": 12, "encoder_ffn_dim": 3072,
                 "decoder_ffn_dim": 3072, "vocab_size": 50265,
                 "max_position_embeddings": 1024},
        "large": {"model_type": "bart", "d_model": 1024, "encoder_layers": 12,
                  "decoder_layers": 12, "encoder_attention_heads": 16,
                  "decoder_attention_heads": 16, "encoder_ffn_dim": 4096,
                  "decoder_ffn_dim": 4096, "vocab_size": 50265,
                  "max_position_embeddings": 1024},
    },
    # Image classifiers: ViT at 224 pixels in patches of 16 (197 tokens with the class
    # token), ImageNet's 1000 classes.
    "vit": {
        "base": {"model_type": "vit", "hidden_size": 768, "num_hidden_layers": 12,
                 "num_attention_heads": 12, "intermediate_size": 3072, "image_size": 224,
                 "patch_size": 16, "num_labels": 1000},
        "large": {"model_type": "vit", "hidden_size": 1024, "num_hidden_layers": 24,
                  "num_attention_heads": 16, "intermediate_size": 4096, "image_size": 224,
                  "patch_size": 16, "num_labels": 1000},
    },
}
# An encoder-decoder's source and target tokens where --seq-len does not say: a
# summary's article and its summary, as T5 was trained (512 positions).
SEQ2SEQ_LENGTHS = (512, 128)
# A GRPO spec's placeholders (hub-id-shaped, so the spec loads and plans before they are
# replaced) and lengths: a prompt cap and completions as TRL's GRPO guides run them.
GRPO_PROMPTS = "your-org/your-prompts"
GRPO_TOKENIZER = "your-org/your-tokenizer"
GRPO_PROMPT_LEN, GRPO_COMPLETION = 512, 256


def preset_names() -> list[str]:
    return [f"{kind}-{size}" for kind, sizes in PRESETS.items() for size in sizes]


def model_section(model: str, spec_dir: Path | None = None) -> tuple[dict[str, Any], str]:
    """The spec's model section for MODEL, and how it was read. A folder given relative
    stays relative, to the spec's folder (`spec_dir`) where its paths are read from: a
    spec that moves with its model folder still finds it."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        where = str(path) if path.is_absolute() or spec_dir is None else os.path.relpath(
            path.resolve(), spec_dir.resolve())
        return {"name_or_path": where}, f"the model folder {path}"
    m = re.fullmatch(r"([a-z0-9]+?)(?:[-:_](\S+))?", model.lower())
    if m and m.group(1) in PRESETS:
        kind, sizes = m.group(1), PRESETS[m.group(1)]
        size = m.group(2) or next(iter(sizes))
        if size not in sizes:
            raise SpecError(f"MODEL: {model!r}: {kind} comes in {', '.join(sizes)} here "
                            f"(e.g. {kind}-{next(iter(sizes))})")
        return {"config": dict(sizes[size]), "task": task_for_model_type(kind).name}, (
            f"the {kind}-{size} shape (random weights: point model.name_or_path at your "
            "checkpoint)")
    try:
        import transformers

        transformers.AutoConfig.from_pretrained(model)
    except Exception as exc:  # noqa: BLE001 - the hub unreachable, or no such id
        raise SpecError(f"MODEL: {model!r} is no local model folder (with a config.json), no "
                        f"shape autotune knows ({', '.join(preset_names()[:6])}, ...), and "
                        f"the hub gave {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                        ) from None
    return {"name_or_path": model}, f"the hub's {model}"


@dataclass
class InitPlan:
    spec: dict[str, Any]
    source: str  # how MODEL was read
    parameters: int
    device_name: str
    allowed: dict[str, list]  # knob -> values the device allows (of the default space's)
    left_out: dict[str, str]  # "knob=value" -> why
    fits: int
    configs: int


DEFAULT_SEQ_LEN = 1024


def plan(model: str, *, seq_len: int | None = None, target_batch: int = 32,
         device: str | None = None, lora: bool = False, qlora: bool = False,
         grpo: bool = False, output: str = "runs/autotune",
         spec_dir: Path | None = None) -> InitPlan:
    """The spec for MODEL and what it found, reading the model's config only. `qlora`:
    LoRA adapters, whose default space searches a 4-bit base beside the full one. `grpo`:
    trained by TRL's GRPOTrainer on the user's prompts (placeholders to replace: the
    prompts, and a tokenizer where MODEL is a shape). `spec_dir`: where the spec goes."""
    from autotune.device import local_device, named_device
    from autotune.plan.estimate import estimate
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec

    section, source = model_section(model, spec_dir)
    kind = task(section.get("task"))
    if seq_len is None:  # 1024, or fewer where the model has fewer positions
        seq_len = _default_seq_len(section)
        if kind.has_target:
            seq_len = min(seq_len, SEQ2SEQ_LENGTHS[0])
    if lora or qlora:
        section["lora"] = {"r": 16, "alpha": 32}
    data: dict[str, Any] = {"seq_len": seq_len}
    if kind.has_target:
        data["target_len"] = min(SEQ2SEQ_LENGTHS[1], seq_len)
    if kind.reads_images:  # its sequence is its patches, from its config
        data = {}
    extra: dict[str, Any] = {}
    if grpo:  # a prompt cap, completions and the algorithm TRL defaults to, halved
        data = {"source": GRPO_PROMPTS, "tokenizer": section.get("name_or_path", GRPO_TOKENIZER),
                "seq_len": min(seq_len, GRPO_PROMPT_LEN)}
        extra = {"trainer": "grpo", "grpo": {"num_generations": 4,
                                             "max_completion_length": GRPO_COMPLETION,
                                             "beta": 0.0, "reward": "length"}}
    spec: dict[str, Any] = {"model": section, "data": data, **extra,
                            "target_batch_size": target_batch,
                            "hardware": {"gpus_per_trial": 1},
                            "search": {"space": "default", "n_trials": 40, "timeout": "30m"},
                            "measure": {"warmup_steps": 2, "steps": 5},
                            "run": {"steps": 10000}, "output": output}
    dev = named_device(device) if device else local_device()
    if device:
        spec["hardware"]["device"] = dev.name
    loaded = load_spec(spec)
    shape = model_shape(loaded)
    result = estimate(loaded, device=dev.name if dev.is_cuda else None)
    allowed: dict[str, set] = {}
    for row in result.rows:
        for name, value in row.config.family.items:
            allowed.setdefault(name, set()).add(value)
    return InitPlan(spec, source, shape.num_parameters if shape else 0, dev.name,
                    {k: sorted(v, key=repr) for k, v in allowed.items() if len(v) > 1},
                    dict(result.pruned_by_rules), sum(r.fits for r in result.rows),
                    len(result.rows))


def _default_seq_len(section: dict[str, Any]) -> int:
    from autotune.tasks.models import load_hf_config, max_positions

    try:
        limit = max_positions(load_hf_config(section))
    except Exception:  # noqa: BLE001 - the spec's own check names what is wrong
        limit = None
    return min(DEFAULT_SEQ_LEN, limit) if limit else DEFAULT_SEQ_LEN


def render(p: InitPlan) -> str:
    """The spec as YAML, each section with a comment saying what it is for."""
    def block(key: str, comment: str) -> str:
        body = yaml.safe_dump({key: p.spec[key]}, sort_keys=False, width=88)
        return "\n".join(f"# {line}" for line in comment.splitlines()) + "\n" + body

    allowed = "\n".join(f"  {k}: {', '.join(map(str, v))}" for k, v in p.allowed.items())
    left = "\n".join(f"  {k}: {why}" for k, why in p.left_out.items())
    head = (f"autotune spec for {p.source}: {p.parameters / 1e6:,.1f}M parameters.\n"
            f"Written by `autotune init`; every key is in docs/spec.md.\n"
            f"On {p.device_name} the default space searches:\n{allowed or '  (one config)'}\n"
            + (f"and leaves out:\n{left}\n" if left else "")
            + f"The memory model expects {p.fits} of its {p.configs} configs to fit "
            f"(`autotune estimate` lists them).\n"
            "Run it: autotune search THIS_FILE")
    parts = ["\n".join(f"# {line}" for line in head.splitlines()), "",
             block("model", "What to tune. name_or_path: a folder or hub id; config: an inline "
                   "shape, random weights." + ("\nlora: train adapters; the default space "
                                               "then searches a 4-bit base (QLoRA) too."
                                               if "lora" in p.spec["model"] else "")),
             block("data", GRPO_DATA_COMMENT if "grpo" in p.spec
                   else task(p.spec["model"].get("task")).data_comment),
             *([block("trainer", "TRL's GRPOTrainer: each step generates completions of "
                      "its prompts, scores them and trains on them."),
                block("grpo", "The algorithm: yours, never searched. num_generations "
                      "completions of each prompt, each up to max_completion_length\ntokens "
                      "(the trials force them to it: the worst case); beta > 0 keeps a "
                      "reference model; reward: length\n(for timing) or "
                      "package.module:function.")] if "grpo" in p.spec else []),
             block("target_batch_size", "The effective batch per optimizer step: every "
                   "config trains exactly this" + (" (completions: a multiple of "
                   "grpo.num_generations)." if "grpo" in p.spec else ".")),
             block("hardware", "Ranks per trial (data parallel); memory_budget caps a "
                   "trial's memory."),
             block("search", "The space (autotune/search_spaces/default.yaml), trials and "
                   "wall time."),
             block("measure", "Steps per trial: warm-up (not timed), then timed."),
             block("run", "Your long run: its wall time is projected in the report."),
             block("output", "Where the winner's files and the report go.")]
    return "\n".join(parts)


GRPO_DATA_COMMENT = ("REPLACE the placeholders: source, your prompts (a .jsonl with a prompt "
                     "column, text or chat messages,\nor a hub dataset id); tokenizer, your "
                     "model's (its folder or hub id). seq_len caps a prompt's tokens.")


def write(path: Path, text: str) -> None:
    """Write a new spec; never over an existing file."""
    if path.exists():
        raise SpecError(f"--output: {str(path)!r} exists; autotune init writes a new file "
                        "(remove it, or name another with --output)")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
