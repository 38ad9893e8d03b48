"""What autotune knows about each TrainingArguments optimizer, in one place.

The knob table's rules, the memory model and the DeepSpeed builder all ask here: how many
bytes of state per parameter, whether it needs bitsandbytes, whether DeepSpeed has a CPU
implementation for offload, whether it is a GPU-only kernel, which arguments that CPU
implementation takes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Optimizer:
    state_bytes: float  # per parameter, fp32 states unless quantised
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

    @property
    def eight_bit(self) -> bool:
        return self.bitsandbytes and self.state_bytes < 4 * len(self.state_tensors)

    def embedding_state_tensors(self) -> tuple[float, ...]:
        """An nn.Embedding's states: Trainer has bitsandbytes keep them in 32 bits under
        its 8-bit optimizers (`register_module_override(..., {"optim_bits": 32})`)."""
        return (4.0,) * len(self.state_tensors) if self.eight_bit else self.state_tensors

    @property
    def state_tensors(self) -> tuple[float, ...]:
        """Bytes per element of each state tensor a parameter gets: Adam's two moments
        (fp32, or 8-bit), one for single-moment optimizers."""
        two = self.state_bytes in (2, 8)
        return (self.state_bytes / 2,) * 2 if two else ((self.state_bytes,)
                                                        if self.state_bytes else ())


ADAM = Optimizer(8, offload_type="AdamW", step_temporary_bytes=4)
OPTIMIZERS: dict[str, Optimizer] = {
    "adamw_torch": ADAM,
    "adamw_torch_fused": Optimizer(8, gpu_only=True),
    "adamw_torch_xla": Optimizer(8),
    "adamw_torch_npu_fused": Optimizer(8),
    "adamw_apex_fused": Optimizer(8, gpu_only=True),
    "adamw_anyprecision": Optimizer(8),
    "adamw_bnb_8bit": Optimizer(2, bitsandbytes=True),
    "adamw_8bit": Optimizer(2, bitsandbytes=True),
    "paged_adamw_8bit": Optimizer(2, bitsandbytes=True),
    "paged_adamw_32bit": Optimizer(8, bitsandbytes=True),
    "ademamix_8bit": Optimizer(3, bitsandbytes=True, changes_algorithm=True),
    # Lion keeps one momentum; DeepSpeed's CPU Lion takes no eps.
    "lion_32bit": Optimizer(4, bitsandbytes=True, offload_type="Lion",
                            offload_params=("lr", "betas", "weight_decay"),
                            changes_algorithm=True),
    "lion_8bit": Optimizer(1, bitsandbytes=True, changes_algorithm=True),
    "paged_lion_8bit": Optimizer(1, bitsandbytes=True, changes_algorithm=True),
    "paged_lion_32bit": Optimizer(4, bitsandbytes=True, changes_algorithm=True),
    "rmsprop": Optimizer(4, changes_algorithm=True),
    "rmsprop_bnb_8bit": Optimizer(1, bitsandbytes=True, changes_algorithm=True),
    # DeepSpeed's CPU Adagrad takes no betas.
    "adagrad": Optimizer(4, offload_type="Adagrad", offload_params=("lr", "eps", "weight_decay"),
                         changes_algorithm=True),
    # Trainer's `sgd` is torch SGD without momentum: no state (with momentum it is 4).
    "sgd": Optimizer(0, changes_algorithm=True),
    # Adafactor's factored second moments: counted from the shape by the memory model.
    "adafactor": Optimizer(0, changes_algorithm=True),
}
UNKNOWN = Optimizer(8)  # an optimizer we have no entry for: assume Adam-like, no offload


def optimizer(name: str) -> Optimizer:
    return OPTIMIZERS.get(name, UNKNOWN)


def offload_capable() -> list[str]:
    return [name for name, o in OPTIMIZERS.items() if o.offload_type]


def trainer_optimizers() -> list[str]:
    """Every `optim` value the installed transformers accepts."""
    from transformers.training_args import OptimizerNames

    return [o.value for o in OptimizerNames]
