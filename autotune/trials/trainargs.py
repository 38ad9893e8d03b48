"""The one place a TrialConfig becomes TrainingArguments kwargs and a DeepSpeed config.

The trial and the exporter both call these functions: what is measured is what is
exported. Knobs that only set TrainingArguments say so in their table row; this module
adds the settings every run shares and the DeepSpeed config that ZeRO needs. What a
trainer's config class adds (SFTConfig's, DPOConfig's fields) is the trainer's
(autotune/tasks/), composed here.
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
    """The kwargs the spec's trainer takes for `config`: TrainingArguments', and the own
    fields of its trainer's config class (SFTConfig, DPOConfig) or of its task's
    arguments class (Seq2SeqTrainingArguments)."""
    from autotune.tasks.registry import task_of, trainer_of

    kwargs = training_arguments_kwargs(config, seed=spec.search.seed,
                                       world_size=spec.world_size, on_cpu=on_cpu,
                                       output_dir=output_dir)
    return kwargs | (trainer_of(spec).fields(spec, config)
                     or task_of(spec).arguments_fields(spec) or {})


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


def split_attention(config: TrialConfig, model_attention: str | None = None) -> str:
    """The attention kernel a sequence split runs, named to accelerate: the config's, or
    with `auto` the spec's model.attn_implementation, else SDPA (transformers' default
    where the model supports it, which the knob's rules and `applies` see to)."""
    if config.attn_implementation != "auto":
        return config.attn_implementation
    return model_attention or "sdpa"


def parallelism_fields(config: TrialConfig, *, world_size: int, seq_len: int,
                       model_attention: str | None = None) -> dict[str, Any] | None:
    """accelerate's ParallelismConfig fields for `config` (its sp_handler's flattened
    beside them), or None without a sequence split: Ulysses' (DeepSpeed, every batch
    `seq_len` long) or context parallelism's (FSDP2, its shards over the rest of the
    ranks). The trial builds the object from them (trials/long_context.py), the
    accelerate config carries them (`accelerate_config`)."""
    if config.sequence_parallel > 1:
        return {"sp_size": config.sequence_parallel, "sp_backend": "deepspeed",
                "sp_seq_length": seq_len, "sp_seq_length_is_variable": False,
                "sp_attn_implementation": split_attention(config, model_attention)}
    if config.context_parallel > 1:
        return {"cp_size": config.context_parallel, "cp_backend": "torch",
                "dp_shard_size": max(1, world_size // config.context_parallel)}
    return None


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
                      deepspeed_file: str = "ds_config.json", nodes: int = 1,
                      seq_len: int | None = None,
                      model_attention: str | None = None) -> dict[str, Any]:
    """An `accelerate launch --config_file` config for `config`: DeepSpeed (from the
    exported ds_config.json, which carries precision and batch itself) or FSDP inside it,
    else plain data parallelism; over `nodes` machines, each launched with its own
    `--machine_rank` (and rank 0's node's address). A sequence split (`seq_len` long)
    is its `parallelism_config` block, keyed as accelerate's launcher reads it
    (`parallelism_config_sp_size`...: it sets the PARALLELISM_CONFIG_* variables from
    which the script's Accelerator builds its ParallelismConfig)."""
    out: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE", "machine_rank": 0, "num_machines": nodes,
        "num_processes": world_size, "main_training_function": "main",
        "rdzv_backend": "static", "same_network": True, "use_cpu": on_cpu,
    }
    if nodes > 1:
        out |= {"main_process_ip": MAIN_NODE_PLACEHOLDER, "main_process_port": MAIN_PORT}
    fields = parallelism_fields(config, world_size=world_size, seq_len=seq_len or 0,
                                model_attention=model_attention) if seq_len else None
    if fields:
        out["parallelism_config"] = {f"parallelism_config_{k}": v for k, v in fields.items()}
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
        if config.context_parallel > 1:  # accelerate's launcher: parallelism on FSDP2 only
            out["fsdp_config"]["fsdp_version"] = 2
    elif world_size > 1:
        out["distributed_type"] = "MULTI_CPU" if on_cpu else "MULTI_GPU"
    else:
        out["distributed_type"] = "NO"
    return out
