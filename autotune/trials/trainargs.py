"""The one place a TrialConfig becomes TrainingArguments kwargs and a DeepSpeed config.

The trial and the exporter both call these functions: what is measured is what is
exported. Knobs that only set TrainingArguments say so in their table row; this module
adds the settings every run shares and the DeepSpeed config that ZeRO needs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune import knobs
from autotune.config import TrialConfig
from autotune.optimizers import optimizer

if TYPE_CHECKING:
    from autotune.spec import Spec

OUTPUT_DIR_PLACEHOLDER = "OUTPUT_DIR"
# TrainingArguments defaults that the DeepSpeed config must repeat (HF's integration
# refuses a ds_config whose explicit values disagree with the TrainingArguments).
LEARNING_RATE = 5e-5
ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0
MAX_GRAD_NORM = 1.0


def training_arguments_kwargs(
    config: TrialConfig,
    *,
    seed: int,
    world_size: int = 1,
    on_cpu: bool = False,
    output_dir: str = OUTPUT_DIR_PLACEHOLDER,
) -> dict[str, Any]:
    """kwargs for `TrainingArguments(**kwargs)` that train with `config`. The DeepSpeed
    config, when ZeRO is on, is inline, so the kwargs load from any working directory."""
    kwargs: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": config.per_device_train_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps,
        "learning_rate": LEARNING_RATE,
        "adam_beta1": ADAM_BETAS[0],
        "adam_beta2": ADAM_BETAS[1],
        "adam_epsilon": ADAM_EPS,
        "weight_decay": WEIGHT_DECAY,
        "max_grad_norm": MAX_GRAD_NORM,
        "seed": seed,
        "report_to": "none",
    }
    for k in knobs.table():
        if k.training_args is not None:
            kwargs |= k.training_args(getattr(config, k.name))
    if on_cpu:
        kwargs["use_cpu"] = True  # Trainer needs it for bf16 autocast on CPU
    ds = deepspeed_config(config, world_size=world_size)
    if ds is not None:
        kwargs["deepspeed"] = ds
    return kwargs


def trainer_kwargs(spec: Spec, config: TrialConfig, *, on_cpu: bool,
                   output_dir: str = OUTPUT_DIR_PLACEHOLDER) -> dict[str, Any]:
    """The kwargs the spec's trainer takes for `config`: TrainingArguments', or those and
    the own fields of its subclass: Seq2SeqTrainingArguments' for a seq2seq-lm model,
    SFTConfig's under `trainer: sft`, DPOConfig's under `trainer: dpo`."""
    kwargs = training_arguments_kwargs(config, seed=spec.search.seed,
                                       world_size=spec.world_size, on_cpu=on_cpu,
                                       output_dir=output_dir)
    return kwargs | (sft_fields_for(spec, config) or dpo_fields_for(spec, config)
                     or seq2seq_fields_for(spec) or {})


def seq2seq_fields_for(spec: Spec) -> dict[str, Any] | None:
    """What Seq2SeqTrainingArguments adds for a seq2seq-lm model (None for any other): no
    generation in evaluation by default, and where it is asked for, targets as long as
    the trials trained on."""
    if spec.model.task != "seq2seq-lm":
        return None
    return {"predict_with_generate": False, "generation_max_length": spec.target_len}


def dpo_fields_for(spec: Spec, config: TrialConfig) -> dict[str, Any] | None:
    """What a DPOConfig adds under `trainer: dpo` (None under the others): each of a pair's
    rows cut at data.seq_len, the reference's log-probs precomputed where the knob says,
    no padding-free batching (TRL has it off since its DPO rewrite)."""
    if spec.trainer != "dpo":
        return None
    return {"max_length": int(spec.data.seq_len), "truncation_mode": "keep_start",
            "padding_free": False,
            "precompute_ref_log_probs": bool(config.precompute_ref_log_probs)}


def sft_fields_for(spec: Spec, config: TrialConfig) -> dict[str, Any] | None:
    """`sft_fields` for the spec's data under `trainer: sft`; None under Trainer."""
    if spec.trainer != "sft":
        return None
    from autotune.trials.data import resolved_format

    data = spec.data.model_dump()
    return sft_fields(config, data, resolved_format(data))


def launch_commands(world_size: int, nodes: int, accelerate_file: str) -> list[str]:
    """For a run over several machines: per node, the `accelerate launch` and the
    `torchrun` command lines (rank 0's node's address the user's to fill in)."""
    out = []
    for k in range(nodes):
        out += [f"# node {k}",
                f"accelerate launch --config_file {accelerate_file} --machine_rank {k} "
                f"--main_process_ip {MAIN_NODE_PLACEHOLDER} train.py ...",
                f"torchrun --nnodes {nodes} --nproc_per_node {world_size // nodes} "
                f"--node_rank {k} --master_addr {MAIN_NODE_PLACEHOLDER} --master_port "
                f"{MAIN_PORT} train.py ..."]
    return out


def sft_fields(config: TrialConfig, data: dict[str, Any], fmt: str) -> dict[str, Any]:
    """What an SFTConfig adds to the TrainingArguments kwargs (TRL's SFTTrainer tokenizes
    and collates itself): the sequence length, padding-free batching from its knob, no
    packing of rows into each other, and the loss on completions (prompt-completion rows)
    or on the assistant's turns (messages) where the spec asks. `fmt`: the data's format
    (data.resolved_format)."""
    only = bool(data.get("completion_only_loss"))
    return {"max_length": int(data["seq_len"]), "packing": False,
            "padding_free": bool(config.padding_free),
            "completion_only_loss": only and fmt == "prompt-completion",
            "assistant_only_loss": only and fmt == "messages",
            "dataset_text_field": data.get("text_field", "text")}


def model_kwargs(config: TrialConfig) -> dict[str, Any]:
    """The config's model-loading kwargs, `from_pretrained(..., **kwargs)`: the knobs that
    change how the model is built (the attention kernel, a quantized base)."""
    out: dict[str, Any] = {}
    for k in knobs.table():
        if k.loading is not None:
            out |= k.loading(getattr(config, k.name), config)
    return out


def deepspeed_config(config: TrialConfig, *, world_size: int = 1) -> dict[str, Any] | None:
    """The DeepSpeed JSON for `config`, or None when it uses no ZeRO.

    Every value is explicit (no "auto") so DeepSpeed's own parser accepts the file
    outside Trainer, and each one equals its TrainingArguments counterpart above.
    """
    if not config.zero_stage:
        return None
    micro, accum = config.per_device_train_batch_size, config.gradient_accumulation_steps
    zero: dict[str, Any] = {"stage": config.zero_stage}
    if config.zero_stage >= 2:
        zero |= {"overlap_comm": True, "contiguous_gradients": True}
    if config.offload in ("optimizer", "optimizer+param"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if config.offload == "optimizer+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    ds: dict[str, Any] = {
        "train_batch_size": micro * accum * world_size,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": MAX_GRAD_NORM,
        "bf16": {"enabled": config.precision == "bf16"},
        "fp16": {"enabled": config.precision == "fp16"},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if config.offload != "none":
        # Offload needs DeepSpeed's CPU optimizer, so the optimizer is named here rather
        # than created by Trainer from `optim`, with only the arguments it takes.
        opt = optimizer(config.optim)
        every = {"lr": LEARNING_RATE, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
                 "weight_decay": WEIGHT_DECAY}
        ds["optimizer"] = {"type": opt.offload_type,
                           "params": {k: every[k] for k in opt.offload_params}}
    return ds


# Where a multi-node config names rank 0's node: the user's to fill in (or to pass as
# `accelerate launch --main_process_ip`).
MAIN_NODE_PLACEHOLDER = "RANK0_NODE_ADDRESS"
MAIN_PORT = 29500


def accelerate_config(config: TrialConfig, *, world_size: int = 1, on_cpu: bool = False,
                      deepspeed_file: str = "ds_config.json",
                      nodes: int = 1) -> dict[str, Any]:
    """An `accelerate launch --config_file` config for `config`: DeepSpeed (from the
    exported ds_config.json, which carries precision and batch itself) or FSDP inside it,
    else plain data parallelism; over `nodes` machines, each launched with its own
    `--machine_rank` (and rank 0's node's address)."""
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": nodes,
        "num_processes": world_size, "main_training_function": "main",
        "rdzv_backend": "static", "same_network": True, "use_cpu": on_cpu,
    }
    if nodes > 1:
        out |= {"main_process_ip": MAIN_NODE_PLACEHOLDER, "main_process_port": MAIN_PORT}
    if config.zero_stage:
        out |= {"distributed_type": "DEEPSPEED", "deepspeed_config": {
            "deepspeed_config_file": deepspeed_file,
            "zero3_init_flag": config.zero_stage == 3}}
        return out
    out["mixed_precision"] = config.precision if config.precision in ("fp16", "bf16") else "no"
    if config.fsdp != "none":
        strategy, _, offload = config.fsdp.partition("+")
        out |= {"distributed_type": "FSDP", "fsdp_config": {
            "fsdp_sharding_strategy": strategy.upper(),
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_offload_params": bool(offload), "fsdp_use_orig_params": True,
            "fsdp_state_dict_type": "SHARDED_STATE_DICT"}}
    elif world_size > 1:
        out["distributed_type"] = "MULTI_CPU" if on_cpu else "MULTI_GPU"
    else:
        out["distributed_type"] = "NO"
    return out
