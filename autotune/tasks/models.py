"""A spec's model section as transformers knows it: its config, the class its task
builds it with, how many positions it has. Read by the spec's checks and the knob rules
(below the physics), the memory model and the trials alike."""

from __future__ import annotations

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
