"""A spec's model section as transformers knows it: its config, the class its task
builds it with, how many positions it has. Read by the spec's checks and the knob rules
(below the physics), the memory model and the trials alike."""

from __future__ import annotations

import contextlib
import inspect
import sys
from functools import cache
from pathlib import Path
from typing import Any

from autotune.errors import SpecError, not_allowed


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


def auto_class(model: dict[str, Any]) -> Any:
    """transformers' Auto class the model section's task builds with."""
    import transformers

    from autotune.tasks.registry import task

    return getattr(transformers, task(model.get("task")).auto_class)


def model_class(model: dict[str, Any]) -> type | None:
    """The transformers class a spec's model section is built with (importing its
    module); None where not known (a factory, a config transformers cannot map)."""
    try:
        cfg = load_hf_config(model)
        if cfg is None:
            return None
        return auto_class(model)._model_mapping[type(cfg)]
    except Exception:  # noqa: BLE001 - the spec's own checks report a broken model
        return None


# The class attribute transformers sets where a model supports each kernel (4.x named
# flash attention's `_supports_flash_attn_2`).
KERNEL_SUPPORT = {"sdpa": ("_supports_sdpa",),
                  "flash_attention_2": ("_supports_flash_attn", "_supports_flash_attn_2")}


# What the long-context rules read of the (text) config: the heads a sequence split
# divides, and whether the LM head is tied to the embeddings.
TEXT_FACTS = ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def model_facts(model: dict[str, Any]) -> dict[str, Any]:
    """What the knob rules ask of a model section: its `model_type`, its text config's
    TEXT_FACTS (`text`; None where there is no config), and of the class it
    is built with its name (`class`), the attention kernels it supports, whether its module
    has a gated MLP (TiledMLP's) and its forward takes the logits straight from lm_head
    (the tiled loss's); `model_type` and `class` are None where not known (a factory, a
    config transformers cannot map or read). Remembered on disk (model_cache.py): the
    answer imports transformers and the modeling module."""
    from autotune.tasks import model_cache

    def read() -> dict[str, Any]:
        failed = False
        cfg = cls = None
        try:
            cfg = load_hf_config(model)
            if cfg is not None:
                with contextlib.suppress(KeyError):  # a config the task's class cannot map
                    cls = auto_class(model)._model_mapping[type(cfg)]
        except Exception:  # noqa: BLE001 - the spec's own checks report a broken model
            failed = True  # answered for now, not kept: a fixed environment reads again
        text = cfg.get_text_config() if cfg is not None else None
        facts: dict[str, Any] = {"model_type": getattr(cfg, "model_type", None),
                                 "class": cls.__name__ if cls is not None else None,
                                 "text": {k: getattr(text, k, None) for k in TEXT_FACTS}
                                 if text is not None else None}
        if cls is not None:
            facts |= {"kernels": {k: any(bool(getattr(cls, f, False)) for f in flags)
                                  for k, flags in KERNEL_SUPPORT.items()},
                      "gated_mlp": bool(gated_mlp_classes(cls)), "plain_head": plain_head(cls)}
        if failed:
            raise model_cache.NotKept(facts)
        return facts

    key = model_cache.content_key(model)
    return read() if key is None else model_cache.remembered("class", key, read)


def max_positions(hf_config: Any) -> int | None:
    """The longest sequence the model's config allows, where it says."""
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    return None


# --- what the long-context levers apply to (the knob table and the trial read it) ---

# The forward a gated MLP (Llama's, Qwen2's, Mistral's...) has in transformers: TiledMLP
# recomputes exactly it, shard by shard.
GATED_FORWARD = "self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))"



@cache
def gated_mlp(cls: type) -> bool:
    """Whether `cls`'s forward is transformers' gated MLP and nothing more (its source
    read once per class)."""
    forward = cls.__dict__.get("forward")
    if forward is None:
        return False
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    body = [line.strip() for line in source.splitlines()[1:] if line.strip()
            and not line.strip().startswith(("#", '"""'))]
    return body == [f"return {GATED_FORWARD}"] or body == [
        f"down_proj = {GATED_FORWARD}", "return down_proj"]


def gated_mlp_classes(model_class: type) -> list[type]:
    """The gated MLP classes of the module a model class is defined in."""
    import torch

    module = sys.modules.get(model_class.__module__)
    return [obj for obj in vars(module).values() if isinstance(obj, type)
            and issubclass(obj, torch.nn.Module) and gated_mlp(obj)] if module else []


def plain_head(model_class: type) -> bool:
    """Whether the model's forward takes its logits straight from `lm_head` (no softcap,
    no logit scale): what the tiled loss recomputes per shard."""
    try:
        source = inspect.getsource(model_class.forward)
    except (OSError, TypeError):
        return False
    assigned = [line.strip() for line in source.splitlines()
                if line.strip().startswith("logits =")]
    return len(assigned) == 1 and assigned[0].startswith("logits = self.lm_head(")
