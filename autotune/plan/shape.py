"""The few architecture figures that memory and FLOP estimates need, and where they come
from: a config counted on the meta device, a built model, or a landscape's meta.json.

Kept apart from the model itself so a 70B model (or a landscape that never had one)
can be reasoned about without instantiating any weights.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import AutotuneError, SpecError, not_allowed

if TYPE_CHECKING:
    from autotune.spec import Spec

# The transformers auto class that builds each task's model.
AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "image-classification": "AutoModelForImageClassification",
}


@dataclass(frozen=True)
class ModelShape:
    num_parameters: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_len: int
    causal_lm: bool = True
    intermediate_size: int | None = None  # None: 4 x hidden, as in GPT-2/BERT
    name: str = "model"
    # "eager" materialises the seq x seq attention matrix; "sdpa"/"flash_attention_2" do
    # not; "auto": not known, the memory model decides from the device.
    attn_implementation: str = "auto"
    task: str = ""  # a key of AUTO_CLASSES; "" = from causal_lm
    # Parameters with gradients and optimizer states: LoRA's adapters; None: all of them.
    trainable_parameters: int | None = None
    # The transformers config (a dict with its model_type) and LoRA section the model is
    # built from, so its activations can be traced (plan/trace.py); None: not known (a
    # factory, a landscape), and the formulas stand alone.
    hf_config: dict[str, Any] | None = None
    lora: dict[str, Any] | None = None
    # Trainable parameters of nn.Embedding modules: Trainer keeps their states in 32 bits
    # under bitsandbytes' 8-bit optimizers. None: not known.
    embedding_parameters: int | None = None
    # Weights bitsandbytes quantizes in a quantized base: every linear layer's but the
    # output head's (transformers keeps that in the compute dtype). None: not known.
    quantizable_parameters: int | None = None
    largest_linear: int | None = None  # the largest such weight, dequantized one at a time
    # An encoder-decoder's (seq2seq-lm) decoder: its layers and target tokens per row (the
    # encoder's are num_layers and seq_len). 0: no decoder.
    decoder_layers: int = 0
    target_len: int = 0
    # An image model's input values per image (channels x height x width); its seq_len is
    # its patches (and class token). 0: not an image model.
    pixels: int = 0
    # What trains it: "trainer", "sft", or "dpo" (a sample is a preference pair: two rows
    # through the policy, and the reference's forward). "" = not known (a landscape).
    trainer: str = ""

    @property
    def has_lm_logits(self) -> bool:
        """A vocabulary-sized output per token (causal or masked LM, an encoder-decoder's
        target), not a class head."""
        return self.task in ("causal-lm", "masked-lm", "seq2seq-lm") if self.task else (
            self.causal_lm)

    @property
    def preference_pairs(self) -> bool:
        """Trained by DPO: every sample is a chosen and a rejected row."""
        return self.trainer == "dpo"

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size

    def to_dict(self) -> dict[str, Any]:
        """The shape as it travels: from a trial that learned it, in its Outcome, and into
        summary.json's `model`."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelShape:
        """The shape `to_dict` wrote; a key it does not know (a newer autotune's) is
        ignored."""
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})

    @classmethod
    def from_landscape_meta(cls, meta: dict[str, Any]) -> ModelShape:
        m = meta["model"]
        return cls(
            num_parameters=int(m["num_parameters"]),
            num_layers=int(m["num_layers"]),
            hidden_size=int(m["hidden_size"]),
            num_attention_heads=int(m["num_attention_heads"]),
            vocab_size=int(m["vocab_size"]),
            seq_len=int(m["seq_len"]),
            causal_lm=bool(m.get("causal_lm", True)),
            intermediate_size=m.get("intermediate_size"),
            name=str(m.get("name", "model")),
            attn_implementation=str(m.get("attn_implementation", "auto")),
            task=str(m.get("task", "")),
            trainable_parameters=m.get("trainable_parameters"),
        )


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim")
_DECODER_LAYER_KEYS = ("num_decoder_layers", "decoder_layers")


def _first(cfg: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = getattr(cfg, k, None)
        if v is not None:
            return v
    return None


def load_hf_config(model: dict[str, Any]):
    """The transformers config for the spec's model section, or None for a bare factory."""
    import transformers

    if model.get("config"):
        cfg = dict(model["config"])
        kind = cfg.pop("model_type")
        if kind not in transformers.CONFIG_MAPPING:
            raise SpecError("model.config.model_type: " + not_allowed(
                kind, sorted(transformers.CONFIG_MAPPING.keys()), "transformers.CONFIG_MAPPING"))
        return transformers.AutoConfig.for_model(kind, **cfg)
    if model.get("name_or_path"):
        return transformers.AutoConfig.from_pretrained(str(Path(model["name_or_path"])
                                                           .expanduser()))
    return None


def model_class(model: dict[str, Any]) -> type | None:
    """The transformers class a spec's model section is built with (importing its
    module); None where not known (a factory, a config transformers cannot map)."""
    try:
        cfg = load_hf_config(model)
        if cfg is None:
            return None
        import transformers

        auto = getattr(transformers, AUTO_CLASSES[model.get("task") or "causal-lm"])
        return auto._model_mapping[type(cfg)]
    except Exception:  # noqa: BLE001 - the spec's own checks report a broken model
        return None


def task_config(hf_config: Any, task: str) -> Any:
    """`hf_config` with what training its task's head needs and an inline config can
    leave out: an encoder-decoder's decoder start token (T5's checkpoints set it to the
    pad token, 0; transformers 5's T5Config has none of its own)."""
    if task == "seq2seq-lm" and getattr(hf_config, "decoder_start_token_id", None) is None:
        hf_config.decoder_start_token_id = getattr(hf_config, "pad_token_id", None) or 0
    return hf_config


def image_tokens(model: Any) -> int | None:
    """The sequence an image model's encoder runs on: its position embeddings' length
    (patches and class token), or (image/patch)^2 + 1; None for no image model."""
    cfg = getattr(model, "config", None)
    for name, p in model.named_parameters():
        if name.endswith("position_embeddings") and p.dim() == 3:
            return int(p.shape[1])
    size, patch = getattr(cfg, "image_size", None), getattr(cfg, "patch_size", None)
    if isinstance(size, int) and isinstance(patch, int) and patch:
        return (size // patch) ** 2 + 1
    return None


def image_pixels(cfg: Any) -> int:
    """Input values per image (channels x height x width), from the config."""
    size = getattr(cfg, "image_size", None)
    h, w = (size, size) if isinstance(size, int) else tuple(size or (0, 0))[:2]
    return int(getattr(cfg, "num_channels", 3) or 3) * int(h) * int(w)


def count_parameters(hf_config: Any, task: str = "causal-lm",
                     lora: dict[str, Any] | None = None) -> tuple[int, str, int | None, int,
                                                                  tuple[int, int], int | None]:
    """Parameters of the model the config describes, built on the meta device (no weights
    allocated, so a 70B model counts in seconds), the attention implementation
    transformers resolves for it, under LoRA the adapters' (trainable) count, the
    trainable parameters of its embeddings, what a quantized base quantizes, and an
    image model's sequence (`image_tokens`)."""
    import torch
    import transformers

    auto = getattr(transformers, AUTO_CLASSES[task])
    with torch.device("meta"):
        model = auto.from_config(hf_config)
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        quantizable = quantizable_parameters(model)
        trainable = None
        if lora is not None:
            import warnings

            from autotune.trials.lora import with_lora

            with warnings.catch_warnings():  # PEFT asks transformers 5 a renamed question
                warnings.simplefilter("ignore", FutureWarning)
                model = with_lora(model, lora, task)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = sum(p.numel() for p in model.parameters())
    return n, str(attn), trainable, embedding_parameters(model), quantizable, (
        image_tokens(model) if task == "image-classification" else None)


def quantizable_parameters(model: Any) -> tuple[int, int]:
    """(weights of the linear layers bitsandbytes replaces in a quantized base, the
    largest one): every nn.Linear and GPT-2's Conv1D but the output head, which
    transformers leaves in the compute dtype."""
    import torch
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    sizes = [m.weight.numel() for m in model.modules()
             if isinstance(m, torch.nn.Linear | Conv1D) and m is not head]
    return sum(sizes), max(sizes, default=0)


def embedding_parameters(model: Any) -> int:
    """Trainable parameters of a model's nn.Embedding modules, each tensor once (tied
    heads share theirs)."""
    import torch

    seen = {id(p): p.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)
            for p in m.parameters() if p.requires_grad}
    return sum(seen.values())


def _from_config(cfg: Any, num_parameters: int, seq_len: int, task: str, name: str,
                 attn_implementation: str, trainable: int | None = None,
                 lora: dict[str, Any] | None = None,
                 embeddings: int | None = None,
                 quantizable: tuple[int, int] | None = None, **kinds: Any) -> ModelShape:
    """The shape; `kinds`: an encoder-decoder's, an image model's or a trainer's fields
    (decoder_layers, target_len, pixels, trainer)."""
    if task == "seq2seq-lm":
        kinds.setdefault("decoder_layers", int(_first(cfg, _DECODER_LAYER_KEYS)
                                               or _first(cfg, _LAYER_KEYS) or 1))
    if task == "image-classification":
        kinds.setdefault("pixels", image_pixels(cfg))
    return ModelShape(**kinds,
        num_parameters=int(num_parameters),
        num_layers=int(_first(cfg, _LAYER_KEYS) or 1),
        hidden_size=int(_first(cfg, _HIDDEN_KEYS) or 1),
        num_attention_heads=int(_first(cfg, _HEAD_KEYS) or 1),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
        seq_len=int(seq_len), causal_lm=task == "causal-lm", task=task,
        intermediate_size=_first(cfg, _FFN_KEYS), name=name,
        attn_implementation=attn_implementation, trainable_parameters=trainable,
        hf_config=_config_dict(cfg), lora=lora, embedding_parameters=embeddings,
        quantizable_parameters=quantizable[0] if quantizable else None,
        largest_linear=quantizable[1] if quantizable else None)


def _config_dict(cfg: Any) -> dict[str, Any] | None:
    """The config as `load_hf_config` takes it back: what differs from the defaults."""
    to_dict = getattr(cfg, "to_diff_dict", None)
    if to_dict is None or not getattr(cfg, "model_type", None):
        return None
    raw = {k: v for k, v in to_dict().items()
           if not k.startswith("_") and k not in ("transformers_version", "architectures")}
    return raw | {"model_type": cfg.model_type}


def shape_from_model(model: Any, seq_len: int, task: str = "causal-lm",
                     **kinds: Any) -> ModelShape | None:
    """The shape of a built model (a factory's, whose config the spec does not give), so a
    search can predict memory from its first trial on."""
    cfg = getattr(model, "config", None)
    if cfg is None or _first(cfg, _LAYER_KEYS) is None or _first(cfg, _HIDDEN_KEYS) is None:
        return None
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if task == "image-classification":
        seq_len = image_tokens(model) or seq_len
    return _from_config(cfg, sum(p.numel() for p in params), seq_len, task,
                        str(getattr(cfg, "model_type", "model")),
                        str(getattr(cfg, "_attn_implementation", None) or "auto"),
                        trainable if trainable < sum(p.numel() for p in params) else None,
                        embeddings=embedding_parameters(model), **kinds)


def shape_from_hf_config(hf_config: Any, seq_len: int, task: str = "causal-lm",
                         attn_implementation: str | None = None,
                         lora: dict[str, Any] | None = None, **kinds: Any) -> ModelShape:
    """The shape of the model `hf_config` describes; `kinds` as `_from_config` takes them
    (an image model's seq_len is its patches, counted here)."""
    if attn_implementation:
        hf_config._attn_implementation = attn_implementation
    n_params, resolved, trainable, embeddings, quantizable, patches = count_parameters(
        hf_config, task, lora)
    name = str(getattr(hf_config, "name_or_path", "") or hf_config.model_type)
    return _from_config(hf_config, n_params, patches or seq_len, task, name,
                        attn_implementation or resolved, trainable, lora, embeddings,
                        quantizable, **kinds)


def max_positions(hf_config: Any) -> int | None:
    """The longest sequence the model's config allows, where it says."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


@contextmanager
def spec_field(field: str) -> Iterator[None]:
    """A model the spec's section cannot make (an unknown model type, a value of the wrong
    type, a task the architecture has no head for, an unreachable hub) fails in one line
    naming the field, as every other bad input does, not with transformers' traceback."""
    try:
        yield
    except AutotuneError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the library raises, said once
        frames = traceback.extract_tb(exc.__traceback__)
        if frames and f"{os.sep}autotune{os.sep}" in frames[-1].filename:
            raise  # raised by autotune's own code: a bug to see whole, not the spec's fault
        text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
        said = text if len(text) <= 300 else text[:299] + "…"
        raise SpecError(f"{field}: {type(exc).__name__}: {said}") from exc


def model_shape(spec: Spec) -> ModelShape | None:
    """The architecture figures of the spec's model; None for a bare factory model (its
    first trial reports them)."""
    model = spec.model
    with spec_field("model.config" if model.config else "model.name_or_path"):
        hf_config = load_hf_config(model.model_dump())
    if hf_config is None:
        return None
    limit = max_positions(hf_config)
    lengths = {"seq_len": spec.data.seq_len} if model.task != "image-classification" else {}
    if model.task == "seq2seq-lm":
        lengths["target_len"] = spec.target_len
    for key, n in lengths.items():
        if limit is not None and n > limit:
            raise SpecError(f"data.{key}: {n} exceeds the model's {limit} positions")
    lora = model.lora.model_dump() if model.lora else None
    fields = ["model.task"] + (["model.attn_implementation"] if model.attn_implementation
                               else []) + (["model.lora"] if lora else [])
    kinds = {"trainer": spec.trainer} | (
        {"target_len": spec.target_len} if model.task == "seq2seq-lm" else {})
    with spec_field(" / ".join(fields)):
        return shape_from_hf_config(task_config(hf_config, model.task), spec.data.seq_len,
                                    model.task, model.attn_implementation, lora, **kinds)
