"""The long-context levers inside a trial (issue 54): DeepSpeed's Ulysses sequence
parallelism and accelerate's context parallelism through a ParallelismConfig, DeepSpeed's
tiled MLP and tiled logits loss (ALST), the checkpointing variants and TRL's activation
offloading. Each is applied here, and each reports afterwards whether it really took
effect (`facts`), so that a run whose lever did not is refused (`contradiction`) rather
than measured as the config it is not.

The worker asks a `Levers` of its config, in order: `arguments` (the ParallelismConfig
for the TrainingArguments, before the model), `join` (DeepSpeed's comm layer over the
ranks, before the model), `model` (once it is built), `collator` (for the trainer),
`trainer` (once it is made), and after the run `record` (into its RanWith) and
`contradiction`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING, Any

from autotune.tasks.models import gated_mlp

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.spec import Spec

IGNORE = -100
# TiledFusedLogitsLoss computes the logits of one shard at a time: shards of at most this
# many bytes of fp32 logits, and at least two, so that the tiled path is what runs.
LOGITS_SHARD_BYTES = 2**30
# A ratio of the outer gradient to the scale the tiled loss assumed (1 where right) beyond
# this is a wrong head gradient, and the run is refused.
SCALE_TOLERANCE = 1e-4


# --- parallelism ---------------------------------------------------------------------------

def parallelism(fields: dict[str, Any] | None) -> Any:
    """accelerate's ParallelismConfig from the one builder's fields
    (trials/trainargs.py `parallelism_fields`), or None."""
    if not fields:
        return None
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    fields = dict(fields)
    sp = {k: fields.pop(k) for k in ("sp_seq_length", "sp_seq_length_is_variable",
                                      "sp_attn_implementation") if k in fields}
    if sp:
        fields["sp_handler"] = DeepSpeedSequenceParallelConfig(**sp)
    return ParallelismConfig(**fields)


def join(args: Any, on_cpu: bool) -> None:
    """DeepSpeed's comm layer over the trial's ranks, before the model and the Trainer:
    Ulysses makes its sequence-parallel groups there (on CPU over gloo)."""
    import deepspeed

    args.device  # noqa: B018 - TrainingArguments sets up the devices and process group
    deepspeed.init_distributed(dist_backend="gloo" if on_cpu else None)


def collator(cfg: TrialConfig, base: Callable | None) -> Callable | None:
    """A collator that adds position ids to every batch, where the sequence is split
    across ranks: Ulysses' data loader adapter refuses a batch without them (each shard
    keeps its tokens' global positions). Rows are padded at the end, so 0..len-1 is
    right for every row. None where no lever needs it."""
    if cfg.sequence_parallel == 1 and cfg.context_parallel == 1:
        return None
    import torch
    from transformers import default_data_collator

    inner = base or default_data_collator

    def collate(features):
        batch = inner(features)
        if "position_ids" not in batch:
            rows, length = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
        return batch

    return collate


# --- tiled MLP ----------------------------------------------------------------------------

def _tiled_mlp_forward(module: Any) -> Callable:
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    params = [p for m in (module.down_proj, module.gate_proj, module.up_proj)
              for p in m.parameters()]

    def forward(x):
        # DeepSpeed's own choice: shards of about `hidden` tokens each. Every rank's
        # sequence is as long, so each takes the same number (ZeRO-3 gathers per shard).
        shards = max(1, math.ceil(x.shape[-2] / x.shape[-1]))
        return TiledMLP.apply(mlp, module, x, shards, params)

    forward.autotune_tiled = True
    return forward


def tile_mlps(model: Any) -> int:
    """Every gated MLP of the model computed by DeepSpeed's TiledMLP (its forward run
    shard by shard along the sequence, and again in the backward); how many."""
    n = 0
    for module in model.modules():
        if gated_mlp(type(module)):
            module.forward = _tiled_mlp_forward(module)
            n += 1
    return n


def tiled_mlps(model: Any) -> int:
    return sum(1 for m in model.modules()
               if getattr(m.__dict__.get("forward"), "autotune_tiled", False))


# --- tiled loss -----------------------------------------------------------------------------

class TiledLoss:
    """The causal LM's loss by DeepSpeed's TiledFusedLogitsLoss: the LM head and the
    cross-entropy shard by shard, no full logits kept.

    TiledFusedLogitsLoss runs the head's backward inside its forward, with an incoming
    gradient of 1: the head's weight gradient is made before the Trainer scales the loss
    (by the accumulation steps, the ranks' token average, sequence parallelism's
    weighting). Normalised outside it, the head's gradient would be off by that factor
    (by the token count, were the sum normalised afterwards). So each shard's loss is
    made inside it already normalised as the model's own loss is (over the batch's
    tokens, or `num_items_in_batch`) and multiplied by the scale the Trainer will apply
    (`scale`), the result divided by that scale outside it: the value is the model's
    loss, the head's gradient what the Trainer's backward would have made. The scale
    actually applied is read in the backward and kept (on the device, read after the
    run): a run where it differed is refused (`mismatch`)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.scale: float | None = None  # set by the Trainer's patched compute_loss
        self.sp_size = 1  # Ulysses' sequence-parallel ranks (their group made in train())
        self.calls = 0
        self.ratios: list[Any] = []  # the outer gradient over the assumed scale, per call
        self._original = model.forward
        model.forward = self.forward

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                logits_to_keep=0, **kwargs):
        import torch

        shift = kwargs.pop("shift_labels", None)
        if (labels is None and shift is None) or not torch.is_grad_enabled() or (
                not self.model.training) or self.scale is None:
            if shift is not None:
                kwargs["shift_labels"] = shift
            return self._original(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, labels=labels,
                                  use_cache=use_cache, logits_to_keep=logits_to_keep,
                                  **kwargs)
        from transformers.modeling_outputs import CausalLMOutputWithPast

        items = kwargs.pop("num_items_in_batch", None)
        decoder = getattr(self.model, self.model.base_model_prefix)
        given = {"input_ids": input_ids, "attention_mask": attention_mask,
                 "position_ids": position_ids, "past_key_values": past_key_values,
                 "inputs_embeds": inputs_embeds}
        out = decoder(**{k: v for k, v in given.items() if v is not None}, use_cache=False,
                      **kwargs)
        if shift is None:
            shift = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        loss = self.loss(out.last_hidden_state, shift.to(out.last_hidden_state.device),
                         items)
        return CausalLMOutputWithPast(loss=loss, logits=None,
                                      hidden_states=out.hidden_states,
                                      attentions=out.attentions)

    def loss(self, hidden, shift, items):
        import torch
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

        head = self.model.get_output_embeddings()
        vocab = head.out_features  # kept whole where ZeRO-3 partitions the weight
        good = (shift != IGNORE).sum()
        scale = self.scale
        if self.sp_size > 1:  # the SP loss weighs this rank's mean by its share of tokens
            from deepspeed.utils import groups

            total = good.clone()
            torch.distributed.all_reduce(total, group=groups._get_sequence_parallel_group())
            scale = scale * self.sp_size * good / total.clamp(min=1)
            denominator = good.clamp(min=1)
        else:
            denominator = items if items is not None else good.clamp(min=1)
        factor = scale / denominator

        def shard_loss(module, x, y):
            logits = module(x).float()
            return torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=IGNORE,
                reduction="sum") * factor

        tokens = hidden.shape[0] * hidden.shape[1]
        shards = min(tokens, max(2, math.ceil(tokens * vocab * 4 / LOGITS_SHARD_BYTES)))
        scaled = TiledFusedLogitsLoss.apply(shard_loss, head, hidden, shift, None, shards,
                                            list(head.parameters()), "sum")
        self.calls += 1
        return _unscale().apply(scaled, scale, self.ratios)

    def mismatch(self) -> str | None:
        """Why the head's gradients were wrong, or None: the outer gradient differed from
        the scale the loss assumed in some micro-batch."""
        import torch

        if not self.ratios:
            return None
        ratios = torch.stack([r.detach().float().reshape(()) for r in self.ratios]).cpu()
        worst = float((ratios - 1).abs().max())
        if worst > SCALE_TOLERANCE:
            return (f"tiled_loss: the Trainer scaled the loss by {float(ratios[0]):.6g} x what "
                    "the tiled loss assumed, so the LM head's gradient (made inside the "
                    "forward) was off by that factor")
        return None


@cache
def _unscale() -> Any:
    """out / scale as an autograd function that keeps its backward's incoming gradient
    over the scale: 1 where the Trainer scaled the loss as assumed (made once, torch
    imported only in a trial)."""
    import torch

    class Unscale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, scaled, scale, ratios):
            ctx.scale, ctx.ratios = scale, ratios
            return scaled / scale

        @staticmethod
        def backward(ctx, grad):
            ctx.ratios.append((grad / ctx.scale).detach())
            return grad / ctx.scale, None, None

    return Unscale


def outer_scale(trainer: Any, num_items_in_batch: Any) -> float:
    """The factor Trainer's training step and accelerate's backward apply to the loss
    compute_loss returns, before its backward (transformers 5 and accelerate 1.x): the
    ranks' token average, the accumulation steps, accelerate's own accumulation."""
    from accelerate.utils import DistributedType

    args, accelerator = trainer.args, trainer.accelerator
    accepts = trainer.model_accepts_loss_kwargs
    pc = getattr(accelerator, "parallelism_config", None)
    sp = pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled
    scale = 1.0
    if (not sp and getattr(args, "average_tokens_across_devices", False)
            and (accepts or trainer.compute_loss_func) and num_items_in_batch is not None):
        scale *= accelerator.num_processes // trainer.get_tp_size()
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (not sp and accepts and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None)
    if not scaled:
        scale /= trainer.current_gradient_accumulation_steps
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        scale /= accelerator.gradient_accumulation_steps
    return scale


def tile_loss(model: Any, trainer: Any) -> TiledLoss:
    """The model's loss tiled, and the Trainer's compute_loss telling it, per micro-batch,
    the scale its loss will be backpropagated with."""
    tiled = TiledLoss(model)
    compute = trainer.compute_loss
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        tiled.sp_size = pc.sp_size

    def compute_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
        tiled.scale = outer_scale(trainer, num_items_in_batch)
        return compute(model, inputs, return_outputs=return_outputs,
                       num_items_in_batch=num_items_in_batch)

    trainer.compute_loss = compute_loss
    return tiled


# --- checkpointing and activation offloading ---------------------------------------------

def selective_checkpointing(model: Any) -> None:
    """TRL's selective activation checkpointing: the attention op's output saved, the
    rest of each layer recomputed (on the model transformers built, under any wrapper)."""
    from trl.models import enable_selective_activation_checkpointing

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    enable_selective_activation_checkpointing(base)


def checkpointing_state(model: Any) -> str | None:
    """How the decoder layers were checkpointed in the run, read from them:
    "<variant> <checkpointed>/<layers>" (variant: reentrant, non-reentrant, selective),
    or None where no layer is checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    on = [m for m in layers if m.gradient_checkpointing]
    if not on:
        return None
    keywords = getattr(getattr(on[0], "_gradient_checkpointing_func", None), "keywords", {})
    variant = ("selective" if keywords.get("context_fn") is not None
               else "reentrant" if keywords.get("use_reentrant", True) else "non-reentrant")
    return f"{variant} {len(on)}/{len(layers)}"


def expected_checkpointing(cfg: TrialConfig, layers: int) -> str | None:
    """What `checkpointing_state` reads where the config's checkpointing took effect."""
    if not cfg.gradient_checkpointing:
        return None
    variant = cfg.checkpointing_variant
    if variant == "every-2":
        return f"non-reentrant {(layers + 1) // 2}/{layers}"
    return f"{variant} {layers}/{layers}"


def offload_activations(trainer: Any) -> None:
    """TRL's activation offloading around each training step, as SFTTrainer does: saved
    activations moved to pinned host memory in the forward, back in the backward."""
    from trl.models import get_act_offloading_ctx_manager

    context = get_act_offloading_ctx_manager(model=trainer.model)
    step = trainer.training_step

    def training_step(*args, **kwargs):
        with context:
            return step(*args, **kwargs)

    training_step.autotune_offloading = True
    trainer.training_step = training_step


# --- the trial's calls ----------------------------------------------------------------------

class Levers:
    """A trial's long-context levers, from its config: what the worker asks of them, in
    order, and what they report of themselves after the run."""

    def __init__(self, cfg: TrialConfig, spec: Spec, on_cpu: bool) -> None:
        from autotune.trials.trainargs import parallelism_fields

        self.cfg, self.on_cpu = cfg, on_cpu
        self.fields = parallelism_fields(cfg, world_size=spec.world_size,
                                         seq_len=spec.data.seq_len,
                                         model_attention=spec.model.attn_implementation)
        self.tiled: TiledLoss | None = None

    def arguments(self) -> dict[str, Any]:
        """What the TrainingArguments take beside the exported kwargs: the
        ParallelismConfig (an object, which no JSON holds)."""
        return {"parallelism_config": parallelism(self.fields)} if self.fields else {}

    @property
    def joins_deepspeed(self) -> bool:
        """DeepSpeed's comm layer must be up before the model and the Trainer: Ulysses
        makes its groups there."""
        return self.cfg.sequence_parallel > 1

    def join(self, args: Any) -> None:
        join(args, self.on_cpu)

    def model(self, model: Any) -> None:
        prepare_model(self.cfg, model)

    def collator(self, base: Callable | None) -> Callable | None:
        return collator(self.cfg, base) or base

    def trainer(self, model: Any, trainer: Any) -> None:
        self.tiled = prepare_trainer(self.cfg, model, trainer)

    def record(self, ran: Any, trainer: Any, model: Any) -> None:
        """Each lever's facts into the run's RanWith, where the config asks for the lever
        or the run shows one."""
        read = facts(trainer, model, self.tiled)
        asked = {"sequence_parallel": self.cfg.sequence_parallel > 1,
                 "context_parallel": self.cfg.context_parallel > 1,
                 "tiled_mlps": self.cfg.tiled_mlp, "tiled_loss_calls": self.cfg.tiled_loss,
                 "checkpointing": self.cfg.gradient_checkpointing,
                 "activation_offloading": self.cfg.activation_offloading}
        for name, value in read.items():
            if asked[name] or value not in (None, 0, 1, False):
                setattr(ran, name, value)

    def contradiction(self, model: Any, ran: Any) -> str | None:
        read = {"sequence_parallel": ran.sequence_parallel or 1,
                "context_parallel": ran.context_parallel or 1,
                "tiled_mlps": ran.tiled_mlps or 0, "tiled_loss_calls": ran.tiled_loss_calls or 0,
                "checkpointing": ran.checkpointing,
                "activation_offloading": bool(ran.activation_offloading)}
        return contradiction(self.cfg, model, read, self.tiled)


def prepare_model(cfg: TrialConfig, model: Any) -> None:
    """The levers on the built model: tiled MLPs, selective checkpointing."""
    if cfg.tiled_mlp:
        tile_mlps(model)
    if cfg.gradient_checkpointing and cfg.checkpointing_variant == "selective":
        selective_checkpointing(model)


def prepare_trainer(cfg: TrialConfig, model: Any, trainer: Any) -> TiledLoss | None:
    """The levers on the made Trainer: the tiled loss, activation offloading. Called
    before the step readings wrap its training step, so theirs stays outermost."""
    if cfg.activation_offloading:
        offload_activations(trainer)
    return tile_loss(model, trainer) if cfg.tiled_loss else None


def facts(trainer: Any, model: Any, tiled: TiledLoss | None) -> dict[str, Any]:
    """What the run did of each lever, read from the process after it: the sequence-
    and context-parallel sizes accelerate ran with (and that Ulysses' attention was in
    place), the MLPs tiled, the loss calls tiled, the layers checkpointed and how,
    whether activation offloading wrapped the step."""
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    sp = 1
    if pc is not None and pc.sp_backend == "deepspeed" and pc.sp_enabled:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        attn = getattr(getattr(model, "config", None), "_attn_implementation", None)
        wrapper = ALL_ATTENTION_FUNCTIONS.get(attn) if attn else None
        sp = pc.sp_size if getattr(wrapper, "__name__", "") == "uattn_wrapper" else 1
    cp = pc.cp_size if pc is not None and pc.cp_enabled else 1
    return {"sequence_parallel": sp, "context_parallel": cp,
            "tiled_mlps": tiled_mlps(model),
            "tiled_loss_calls": tiled.calls if tiled is not None else 0,
            "checkpointing": checkpointing_state(model),
            "activation_offloading": bool(getattr(trainer.training_step,
                                                  "autotune_offloading", False))}


def _layers(model: Any) -> int:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(1 for m in model.modules() if isinstance(m, GradientCheckpointingLayer))


def contradiction(cfg: TrialConfig, model: Any, ran: dict[str, Any],
                  tiled: TiledLoss | None) -> str | None:
    """Why the run's facts contradict the config's long-context levers, or None."""
    if ran["sequence_parallel"] != cfg.sequence_parallel:
        return (f"sequence_parallel={cfg.sequence_parallel} did not take effect: the run's "
                f"sequence-parallel size was {ran['sequence_parallel']}")
    if ran["context_parallel"] != cfg.context_parallel:
        return (f"context_parallel={cfg.context_parallel} did not take effect: the run's "
                f"context-parallel size was {ran['context_parallel']}")
    if cfg.tiled_mlp and not ran["tiled_mlps"]:
        return "tiled_mlp did not take effect: the model has no gated MLP to tile"
    if cfg.tiled_loss and not ran["tiled_loss_calls"]:
        return "tiled_loss did not take effect: no training step computed the tiled loss"
    if cfg.tiled_loss and tiled is not None and (wrong := tiled.mismatch()):
        return wrong
    layers = _layers(model)
    expected = expected_checkpointing(cfg, layers)
    if cfg.checkpointing_variant != "non-reentrant" and expected is not None and (
            not layers or ran["checkpointing"] != expected):
        return (f"checkpointing_variant={cfg.checkpointing_variant} did not take effect: the "
                f"layers ran {ran['checkpointing'] or 'unchecked'}, not {expected}")
    if cfg.activation_offloading and not ran["activation_offloading"]:
        return "activation_offloading did not take effect: the training step was not wrapped"
    return None
