"""What autotune knows about each TrainingArguments optimizer, in one place.

The knob table's rules, the memory model and the DeepSpeed builder all ask here: how many
bytes of state per parameter, whether it needs bitsandbytes, whether DeepSpeed has a CPU
implementation for offload, whether it is a GPU-only kernel, which arguments that CPU
implementation takes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache


@dataclass(frozen=True)
class Optimizer:
    # Bytes per element of each state tensor a parameter gets (Adam's two fp32 moments:
    # (4, 4)); quantised for bitsandbytes' 8-bit optimizers.
    states: tuple[float, ...]
    bitsandbytes: bool = False  # implemented by bitsandbytes (8-bit, paged, its Lion)
    gpu_only: bool = False  # a fused CUDA kernel: measures nothing new on CPU
    # DeepSpeed's CPU implementation under optimizer offload, and the config params it
    # takes (seed 000: offload needs an optimizer with both a CPU and a GPU version).
    offload_type: str | None = None
    offload_params: tuple[str, ...] = ("lr", "betas", "eps", "weight_decay")
    # Changes the training algorithm (not just its implementation): never searched unless
    # the user lists it.
    changes_algorithm: bool = False
    # Bytes per element of the one tensor per parameter its step allocates and frees
    # (torch's foreach AdamW: the square root of the second moment); fused kernels and
    # bitsandbytes update in place. The allocator replay needs it (plan/allocator.py).
    step_temporary_bytes: float = 0.0
    # An 8-bit optimizer's states where it keeps them in 32 bits: parameters under its
    # min_8bit_size (4096 elements), and every nn.Embedding, which Trainer registers with
    # bitsandbytes' GlobalOptimManager at 32 bits.
    states_32bit: tuple[float, ...] | None = None

    @property
    def state_bytes(self) -> float:
        """Per parameter."""
        return float(sum(self.states))

    def states_of(self, numel: int, embedding: bool) -> tuple[float, ...]:
        """The state tensors one parameter gets."""
        if self.states_32bit is not None and (embedding or numel < MIN_8BIT_SIZE):
            return self.states_32bit
        return self.states


MIN_8BIT_SIZE = 4096  # bitsandbytes' default min_8bit_size
ADAM = Optimizer((4, 4), offload_type="AdamW", step_temporary_bytes=4)
ADAM_8BIT = Optimizer((1, 1), bitsandbytes=True, states_32bit=(4, 4))
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw_torch": ADAM,
    "adamw_torch_fused": Optimizer((4, 4), gpu_only=True),
    "adamw_torch_xla": Optimizer((4, 4)),
    "adamw_torch_npu_fused": Optimizer((4, 4)),
    "adamw_apex_fused": Optimizer((4, 4), gpu_only=True),
    "adamw_anyprecision": Optimizer((4, 4)),
    "adamw_bnb_8bit": ADAM_8BIT,
    "adamw_8bit": ADAM_8BIT,
    "paged_adamw_8bit": ADAM_8BIT,
    "paged_adamw_32bit": Optimizer((4, 4), bitsandbytes=True),
    # AdEMAMix's two first moments in one tensor, and a second moment.
    "ademamix_8bit": Optimizer((2, 1), bitsandbytes=True, changes_algorithm=True,
                               states_32bit=(8, 4)),
    # Lion keeps one momentum; DeepSpeed's CPU Lion takes no eps.
    "lion_32bit": Optimizer((4,), bitsandbytes=True, offload_type="Lion",
                            offload_params=("lr", "betas", "weight_decay"),
                            changes_algorithm=True),
    "lion_8bit": Optimizer((1,), bitsandbytes=True, changes_algorithm=True,
                           states_32bit=(4,)),
    "paged_lion_8bit": Optimizer((1,), bitsandbytes=True, changes_algorithm=True,
                                 states_32bit=(4,)),
    "paged_lion_32bit": Optimizer((4,), bitsandbytes=True, changes_algorithm=True),
    "rmsprop": Optimizer((4,), changes_algorithm=True),
    "rmsprop_bnb_8bit": Optimizer((1,), bitsandbytes=True, changes_algorithm=True,
                                  states_32bit=(4,)),
    # DeepSpeed's CPU Adagrad takes no betas.
    "adagrad": Optimizer((4,), offload_type="Adagrad",
                         offload_params=("lr", "eps", "weight_decay"), changes_algorithm=True),
    # Trainer's `sgd` is torch SGD without momentum: no state (with momentum it is 4).
    "sgd": Optimizer((), changes_algorithm=True),
    # Adafactor's factored second moments: counted from the shape by the memory model.
    "adafactor": Optimizer((), changes_algorithm=True),
}
UNKNOWN = Optimizer((4, 4))  # an optimizer we have no entry for: assume Adam-like, no offload


def optimizer(name: str) -> Optimizer:
    return OPTIMIZERS.get(name, UNKNOWN)


def offload_capable() -> list[str]:
    return [name for name, o in OPTIMIZERS.items() if o.offload_type]


@cache
def trainer_optimizers() -> list[str]:
    """Every `optim` value the installed transformers accepts: its `OptimizerNames`, read
    from the source of transformers/training_args.py where the module is not imported yet
    (transformers_source: importing it costs seconds a plan needs for nothing else)."""
    import sys

    from autotune import transformers_source

    loaded = sys.modules.get(transformers_source.TRAINING_ARGS)
    names = None if loaded is not None else transformers_source.optimizer_names()
    if names is None:
        from transformers.training_args import OptimizerNames

        names = [o.value for o in OptimizerNames]
    return names
