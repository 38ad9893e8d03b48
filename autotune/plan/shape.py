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
from typing import TYPE_CHECKING, Any

from autotune.errors import AutotuneError, SpecError
from autotune.tasks import DEFAULT_TASK, model_cache, task_of, trainer, trainer_of
from autotune.tasks import task as named_task
from autotune.tasks.images import image_pixels, image_tokens
from autotune.tasks.models import auto_class, load_hf_config, max_positions

if TYPE_CHECKING:
    from autotune.spec import Spec
    from autotune.tasks.base import Task, TrainerKind



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
    task: str = ""  # a registered task's name (autotune/tasks/); "" = from causal_lm
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
    # What trains it: a registered trainer's name (under DPO a sample is a preference
    # pair: two rows through the policy, and the reference's forward). "" = not known (a
    # landscape).
    trainer: str = ""
    # A generating trainer's (GRPO's): tokens generated after each prompt (its seq_len),
    # and whether the algorithm keeps a reference model beside the policy.
    generated_len: int = 0
    reference: bool = False
    # Its MLP is transformers' gated one (Llama's, Qwen2's, Mistral's: SwiGLU), which
    # keeps four intermediate-wide tensors a token for the backward, not GPT-2's two.
    gated_mlp: bool = False

    @property
    def has_lm_logits(self) -> bool:
        """A vocabulary-sized output per token (causal or masked LM, an encoder-decoder's
        target), not a class head."""
        return self.kind.lm_logits if self.task else self.causal_lm

    @property
    def kind(self) -> Task:
        """Its task (the default for a shape that does not say: a landscape's)."""
        return named_task(self.task or None)

    @property
    def trained_by(self) -> TrainerKind:
        """Its trainer (Trainer's where the shape does not say: a landscape's)."""
        return trainer(self.trainer or None)

    @property
    def preference_pairs(self) -> bool:
        """Trained on preference pairs (DPO): every sample is a chosen and a rejected row."""
        return self.trained_by.preference_pairs

    @property
    def generates(self) -> bool:
        """Trained on its own completions (GRPO): a step generates, then trains."""
        return self.generated_len > 0

    @property
    def train_len(self) -> int:
        """Tokens a row has in the training forward: a prompt and its completion."""
        return self.seq_len + self.generated_len

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
            gated_mlp=bool(m.get("gated_mlp", False)),
        )


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_HEAD_KEYS = ("num_attention_heads", "n_head")
_FFN_KEYS = ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "encoder_ffn_dim")


def _first(cfg: Any, keys: tuple[str, ...]) -> Any:
    for k in keys:
        v = getattr(cfg, k, None)
        if v is not None:
            return v
    return None


def count_parameters(hf_config: Any, task: str = DEFAULT_TASK,
                     lora: dict[str, Any] | None = None
                     ) -> tuple[int, str, int | None, int, tuple[int, int], int | None, bool]:
    """Parameters of the model the config describes, built on the meta device (no weights
    allocated, so a 70B model counts in seconds), the attention implementation
    transformers resolves for it, under LoRA the adapters' (trainable) count, the
    trainable parameters of its embeddings, what a quantized base quantizes, an
    image model's sequence (`image_tokens`), and whether its MLP is gated."""
    import torch

    kind = named_task(task)
    auto = auto_class({"task": task})
    with torch.device("meta"):
        model = auto.from_config(hf_config)
        attn = getattr(model.config, "_attn_implementation", None) or "eager"
        quantizable = quantizable_parameters(model)
        gated = has_gated_mlp(model)
        trainable = None
        if lora is not None:
            import warnings

            from autotune.tasks.lora import with_lora

            with warnings.catch_warnings():  # PEFT asks transformers 5 a renamed question
                warnings.simplefilter("ignore", FutureWarning)
                model = with_lora(model, lora, kind)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n = sum(p.numel() for p in model.parameters())
    return n, str(attn), trainable, embedding_parameters(model), quantizable, (
        image_tokens(model) if kind.reads_images else None), gated


def has_gated_mlp(model: Any) -> bool:
    """Whether the model's MLPs are transformers' gated ones (tasks/models.py)."""
    from autotune.tasks.models import gated_mlp

    return any(gated_mlp(type(m)) for m in model.modules())


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
    kind = named_task(task)
    if kind.second_stack_keys:
        kinds.setdefault("decoder_layers", int(_first(cfg, kind.second_stack_keys)
                                               or _first(cfg, _LAYER_KEYS) or 1))
    if kind.reads_images:
        kinds.setdefault("pixels", image_pixels(cfg))
    return ModelShape(**kinds,
        num_parameters=int(num_parameters),
        num_layers=int(_first(cfg, _LAYER_KEYS) or 1),
        hidden_size=int(_first(cfg, _HIDDEN_KEYS) or 1),
        num_attention_heads=int(_first(cfg, _HEAD_KEYS) or 1),
        vocab_size=int(getattr(cfg, "vocab_size", 0) or 0),
        seq_len=int(seq_len), causal_lm=kind.causal, task=kind.name,
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


def shape_from_model(model: Any, seq_len: int, task: str = DEFAULT_TASK,
                     **kinds: Any) -> ModelShape | None:
    """The shape of a built model (a factory's, whose config the spec does not give), so a
    search can predict memory from its first trial on."""
    cfg = getattr(model, "config", None)
    if cfg is None or _first(cfg, _LAYER_KEYS) is None or _first(cfg, _HIDDEN_KEYS) is None:
        return None
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    if named_task(task).reads_images:
        seq_len = image_tokens(model) or seq_len
    return _from_config(cfg, sum(p.numel() for p in params), seq_len, task,
                        str(getattr(cfg, "model_type", "model")),
                        str(getattr(cfg, "_attn_implementation", None) or "auto"),
                        trainable if trainable < sum(p.numel() for p in params) else None,
                        embeddings=embedding_parameters(model), gated_mlp=has_gated_mlp(model),
                        **kinds)


def shape_from_hf_config(hf_config: Any, seq_len: int, task: str = DEFAULT_TASK,
                         attn_implementation: str | None = None,
                         lora: dict[str, Any] | None = None, **kinds: Any) -> ModelShape:
    """The shape of the model `hf_config` describes; `kinds` as `_from_config` takes them
    (an image model's seq_len is its patches, counted here)."""
    if attn_implementation:
        hf_config._attn_implementation = attn_implementation
    n_params, resolved, trainable, embeddings, quantizable, patches, gated = count_parameters(
        hf_config, task, lora)
    name = str(getattr(hf_config, "name_or_path", "") or hf_config.model_type)
    return _from_config(hf_config, n_params, patches or seq_len, task, name,
                        attn_implementation or resolved, trainable, lora, embeddings,
                        quantizable, gated_mlp=gated, **kinds)


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
    first trial reports them). Remembered on disk by what they were read from
    (tasks/model_cache.py): a model searched again is not imported again."""
    if spec.data.seq_len == "longest":
        raise SpecError("data.seq_len: longest is found by autotune search and estimate "
                        "(plan/longest.py) before the model is read; here a length is "
                        "needed: a number of tokens")
    kind = task_of(spec)
    kinds = ({"trainer": spec.trainer} | kind.shape_fields(spec.target_len)
             | trainer_of(spec).shape_fields(spec))
    key = model_cache.content_key(spec.model.model_dump())
    if key is None:
        read = _read_shape(spec, kind, kinds)
    else:
        key |= {"seq_len": spec.data.seq_len, "task": kind.name, "kinds": kinds}
        read = model_cache.remembered("shape", key, lambda: _read_shape(spec, kind, kinds))
    if read is None:
        return None
    _within_positions(spec, kind, read["max_positions"])  # a kept shape is checked too
    return ModelShape.from_dict(read["shape"])


def _within_positions(spec: Spec, kind: Task, limit: int | None) -> None:
    for key, n in kind.lengths(spec).items():
        if limit is not None and n > limit:
            raise SpecError(f"data.{key}: {n} exceeds the model's {limit} positions")


def _read_shape(spec: Spec, kind: Task, kinds: dict[str, Any]) -> dict[str, Any] | None:
    """{"shape": the ModelShape as it travels, "max_positions": the model's limit}, read
    from transformers (its config, the model counted on the meta device); None for a bare
    factory."""
    model = spec.model
    with spec_field("model.config" if model.config else "model.name_or_path"):
        hf_config = load_hf_config(model.model_dump())
    if hf_config is None:
        return None
    limit = max_positions(hf_config)
    _within_positions(spec, kind, limit)  # before counting: the spec's error, at once
    lora = model.lora.model_dump() if model.lora else None
    fields = ["model.task"] + (["model.attn_implementation"] if model.attn_implementation
                               else []) + (["model.lora"] if lora else [])
    with spec_field(" / ".join(fields)):
        shape = shape_from_hf_config(kind.prepare_config(hf_config), spec.data.seq_len,
                                     kind.name, model.attn_implementation, lora, **kinds)
    return {"shape": shape.to_dict(), "max_positions": limit}
