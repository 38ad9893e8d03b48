"""The knob table: every lever autotune searches, declared once.

A row says which values the knob takes, what Trainer's defaults give (the baseline), how
it is shown, which TrainingArguments it sets, which devices and installs allow it, and
what is known of its speed before anything is measured. TrialConfig, the search space and
its rules, labels, report columns, the plot grid, Optuna distributions, the baseline and
the throughput model's priors all derive from this table. A knob with a physical effect
beyond TrainingArguments (memory, the DeepSpeed config, the model or the data) is read
by name where that effect is computed, and nowhere else.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import subprocess
import sys
import threading
import types
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

from autotune.errors import SpecError
from autotune.optimizers import offload_capable, optimizer, trainer_optimizers

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.device import DeviceSpec
    from autotune.spec import Spec


@dataclass(frozen=True)
class Rule:
    """A combination that cannot run where `excludes(config, device)` holds. `label` and
    `reason` are formatted with the config's knobs, `device` and `cc`. An `install` rule
    is about this machine's packages, not the device: a replay of a landscape measured
    elsewhere skips it."""

    label: str
    reason: str
    excludes: Callable[[TrialConfig, DeviceSpec], bool]
    install: bool = False
    # The reason as it stands on this machine, where it says more than `reason` (which
    # the knob references print): a package's own import error.
    explain: Callable[[], str] | None = None
    # Where it holds only for some numbers of a trial's ranks (DDP's on several): the
    # ranks it holds at. Without them (a recipe, a replay) it holds as for any.
    ranks: Callable[[int], bool] | None = None

    def check(self, config: TrialConfig, device: DeviceSpec,
              world_size: int | None = None) -> tuple[str, str] | None:
        if not self.excludes(config, device):
            return None
        if self.ranks is not None and world_size is not None and not self.ranks(world_size):
            return None
        fields = config.to_dict() | {"device": device.name,
                                     "cc": device.compute_capability or "CPU"}
        reason = self.explain() if self.explain else self.reason.format(**fields)
        return self.label.format(**fields), reason


def _no_prior(value: Any, device: DeviceSpec, world_size: int) -> float:
    return 0.0


@dataclass(frozen=True)
class Speed:
    """A knob's effect on log throughput as known before measuring: the prior mean per
    value, its width, and the width of a per-batch interaction (for knobs whose kernels
    saturate at other batch sizes), None for none. Values of one `kin` (fp16 and bf16 on
    the same tensor cores) share an effect as wide as `kin_sd`, and differ from each
    other by `sd` only."""

    prior: Callable[[Any, DeviceSpec, int], float] = _no_prior
    sd: float = 0.3
    batch_sd: float | None = None
    kin: Callable[[Any], str] | None = None
    kin_sd: float | None = None
    # A per-batch interaction only where ranks talk: a collective run every micro-batch
    # costs once per micro-batch, so its share of a step falls as the micro-batch grows.
    ranks_batch_sd: float | None = None


@cache
def _installed(module: str) -> bool:
    """Whether `module` can be imported. Memoised: a process's packages do not change, and
    the device rules ask for every config of a space (about 35,000 times for a 70B plan,
    1.5 s of path searching)."""
    return importlib.util.find_spec(module) is not None


IMPORT_CHECK_TIMEOUT_S = 120.0


@cache
def _import_failure(module: str) -> str | None:
    """Why `module` cannot be used here ("is not installed", or installed and failing to
    import: a compiled wheel built against another torch fails with "undefined symbol"),
    or None where it imports. Imported in a fresh interpreter, once per process, and only
    where it is installed: the driver neither pays the import (torch's, a CUDA library's)
    nor dies of a broken extension."""
    if not _installed(module):
        return "is not installed"
    try:
        done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                              text=True, timeout=IMPORT_CHECK_TIMEOUT_S,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return f"is installed but did not finish importing in {IMPORT_CHECK_TIMEOUT_S:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line.strip() for line in done.stderr.splitlines() if line.strip()]
    said = lines[-1] if lines else f"exit status {done.returncode}"
    return f"is installed but fails to import ({said[:300]})"


@dataclass(frozen=True)
class Knob:
    name: str  # TrialConfig attribute, space-file key, landscape column, Optuna param
    values: tuple | Callable[[], Sequence]  # allowed in a space file
    baseline: Any  # Trainer's default: the baseline family has it
    label: str  # for people: plot titles, errors
    column: str  # report table header
    kind: type = str
    tag: Callable[[Any], str] | None = None  # in a config's label; default name=value
    training_args: Callable[[Any], dict[str, Any]] | None = None
    rules: tuple[Rule, ...] = ()
    group: str = ""  # knobs whose effects are modelled jointly (ZeRO stage with offload)
    speed: Speed = field(default_factory=Speed)
    # Whether a value that keeps failing (nan, error, crash) may be blamed and written off;
    # False for knobs that change no numerics and no code path that can break.
    blamed: bool = True
    # A lever that must not change the maths (a sequence split, tiled compute, how
    # checkpointing recomputes): the driver checks a trial's first step against its twin
    # with every such knob at its baseline (tuning/numerics.py `parity`).
    parity: bool = False
    # Changes how the model is built (attention kernel, adapters): a model that fails to
    # build under a non-baseline value may be this knob's fault, not the spec's.
    affects_model: bool = False
    # Values the memory physics gives the same bytes take the same bytes (fp16 and bf16,
    # two fused attention kernels, two AdamW implementations): a family never measured
    # is predicted from its measured twin (plan/calibration.py `_stand_in`). Not for a
    # knob whose engine holds what the physics lacks (ZeRO on one CPU rank: 4-14% over
    # its twin without DeepSpeed in benchmarks/memory_accuracy.txt).
    memory_twins: bool = False
    # The physics has this knob's bytes, so it orders its values' memory (ZeRO stage,
    # offload, FSDP, the optimizer's states): an OOM bounds a config that holds its other
    # values and one of these the physics puts above it (plan/calibration.py `_above`).
    # A group is ordered only where every knob in it is. Not for a lever whose bytes the
    # physics may lack (compile, Liger, checkpointing's variants).
    memory_ordered: bool = False
    # Its values other than the baseline's run the model under an engine (DeepSpeed,
    # FSDP) that holds bytes the physics lacks (4-14% on one CPU rank): an OOM under it
    # bounds no config outside it (`_above`).
    memory_engine: bool = False
    # Why a value other than the baseline's cannot apply to this spec's model or data
    # (None: it can): a Liger kernel for a model type it does not cover, packing synthetic
    # rows that have no padding, an attention kernel the model's class does not support.
    applies: Callable[[Spec, Any], str | None] | None = None
    # Where a long list of allowed values is defined, named in errors instead of the list
    listed_in: str = ""
    # What the guide's careful user picks by hand (the seeds' recipe), best first: the
    # recipe takes the first value that the device rules and the model allow. None: the
    # baseline's value. Called with the device and whether the data is real (not synthetic).
    recipe: Callable[[DeviceSpec, bool], Sequence] | None = None
    # The model-loading kwargs a value sets (`from_pretrained(..., **kwargs)`), given the
    # whole config: the attention kernel, a quantized base's BitsAndBytesConfig.
    loading: Callable[[Any, TrialConfig], dict[str, Any]] | None = None
    # A listed value that cannot apply to the spec is an input error, not a pruned value
    # (a quantized base without LoRA is a mistake, not a lever that does not fit).
    strict: bool = False
    # Where `applies` lets a value other than the baseline's run, for people (the knob
    # references): "causal LMs", "trainer: dpo without LoRA". "" : every spec.
    scope: str = ""
    # What a value sets where neither training_args nor loading says (a TRL config's own
    # field, read by name by the one builder); "": the trial itself.
    sets: str = ""

    def allowed(self) -> list:
        return list(self.values() if callable(self.values) else self.values)

    def parse(self, raw: Any) -> Any:
        """A value from YAML, CSV text or JSON, as the knob's type."""
        if self.kind is bool:
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text not in ("true", "false", "1", "0"):
                raise SpecError(f"{self.name}: {raw!r} is not true or false")
            return text in ("true", "1")
        if isinstance(raw, bool):  # YAML's `true` is no stage 1
            raise SpecError(f"{self.name}: {raw!r} is not a {self.kind.__name__}")
        try:
            return self.kind(raw)
        except (TypeError, ValueError):
            raise SpecError(f"{self.name}: {raw!r} is not a {self.kind.__name__}") from None

    def tag_of(self, value: Any) -> str:
        if self.tag is not None:
            return self.tag(value)
        return "" if value == self.baseline else f"{self.name}={value}"

    @property
    def group_name(self) -> str:
        return self.group or self.name

    def preferred(self, device: DeviceSpec, real_data: bool) -> list:
        """The recipe's values for this knob on `device`, best first."""
        return list(self.recipe(device, real_data)) if self.recipe else [self.baseline]


# --- precision -----------------------------------------------------------------------

def _precision_args(p: str) -> dict[str, Any]:
    return {"bf16": p == "bf16", "fp16": p == "fp16"} | ({"tf32": True} if p == "tf32" else {})


def _precision_prior(p: str, device: DeviceSpec, world_size: int) -> float:
    if not device.is_cuda:
        return 0.0  # CPU: bf16 autocast can be slower or faster than fp32; no prior
    cc = device.compute_capability or (0, 0)
    if p in ("fp16", "bf16") and cc >= (7, 0):
        # Where both exist, bf16 skips fp16's loss scaling (unscale and overflow checks).
        return math.log(2.0) - (0.02 if p == "fp16" and device.supports_bf16() else 0.0)
    if p == "tf32" and cc >= (8, 0):
        return math.log(1.3)
    return 0.0


PRECISION = Knob(
    "precision", ("fp32", "tf32", "fp16", "bf16"), "fp32", "precision", "precision",
    tag=str, training_args=_precision_args,
    rules=(
        Rule("precision=fp16", "fp16 mixed precision needs a CUDA GPU (Trainer has no fp16 "
             "AMP on CPU)", lambda c, d: c.precision == "fp16" and not d.supports_fp16()),
        Rule("precision=tf32", "tf32 needs an Ampere or newer GPU (compute capability 8.0+; "
             "here {cc})", lambda c, d: c.precision == "tf32" and not d.supports_tf32()),
        Rule("precision=bf16", "bf16 needs compute capability 8.0+ (here {cc})",
             lambda c, d: c.precision == "bf16" and not d.supports_bf16()),
    ),
    # The guide: bf16 where the device has it (Ampere+, or a CPU with native bf16), else
    # fp16 on a GPU; fp32 with tf32 matmuls is what is left on Ampere+ without 16-bit.
    recipe=lambda d, real: (["bf16", "fp16", "tf32", "fp32"] if d.is_cuda
                            else ["bf16", "fp32"] if d.native_bf16 else ["fp32"]),
    memory_twins=True,
    speed=Speed(_precision_prior, sd=0.2, batch_sd=0.25, kin_sd=0.7,
                kin=lambda p: "16-bit" if p in ("fp16", "bf16") else "32-bit"))


# --- optimizer -------------------------------------------------------------------------

def _optim_prior(name: str, device: DeviceSpec, world_size: int) -> float:
    # A fused kernel does the step in one launch per parameter group.
    return 0.01 if optimizer(name).gpu_only and device.is_cuda else 0.0


OPTIM = Knob(
    "optim", trainer_optimizers, "adamw_torch", "optimizer", "optim", tag=str,
    training_args=lambda o: {"optim": o}, listed_in="transformers' OptimizerNames",
    rules=(
        Rule("optim={optim}", "{optim} is a GPU kernel; on CPU it measures nothing its plain "
             "version does not", lambda c, d: optimizer(c.optim).gpu_only and not d.is_cuda),
        Rule("optim={optim}", "{optim} needs bitsandbytes, which is not installed",
             lambda c, d: optimizer(c.optim).bitsandbytes and not _installed("bitsandbytes"),
             install=True),
    ),
    recipe=lambda d, real: ["adamw_torch_fused", "adamw_torch"],  # fused on CUDA (rules)
    memory_twins=True, memory_ordered=True, speed=Speed(_optim_prior, sd=0.15))


# --- gradient checkpointing ------------------------------------------------------------

# transformers' lazy module is not thread-safe: threads importing from it at once (the
# memory benchmark's pool, building its trials' requests) get ImportError.
_TRANSFORMERS_IMPORT = threading.Lock()


@cache
def _checkpointing_arg() -> str:
    """transformers 5 renamed gradient_checkpointing; use the installed version's name so
    the exported kwargs load without deprecation warnings where they will be used. Read
    from transformers' source where it is not imported yet: importing TrainingArguments
    cost a search's driver 1.3-3.7 s here, for this one name."""
    from dataclasses import fields

    from autotune import transformers_source

    names = (None if transformers_source.TRAINING_ARGS in sys.modules
             else transformers_source.training_arguments_fields())
    if names is None:
        with _TRANSFORMERS_IMPORT:
            from transformers import TrainingArguments

        names = {f.name for f in fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else (
        "gradient_checkpointing")


def _checkpointing_args(on: bool) -> dict[str, Any]:
    name = _checkpointing_arg()
    # Non-reentrant checkpointing works with frozen inputs and ZeRO-3; the reentrant
    # default warns and is slated for removal in torch.
    return {name: on} | ({f"{name}_kwargs": {"use_reentrant": False}} if on else {})


GRADIENT_CHECKPOINTING = Knob(
    "gradient_checkpointing", (False, True), False, "gradient checkpointing", "ckpt", kind=bool,
    tag=lambda on: "ckpt" if on else "", training_args=_checkpointing_args, blamed=False,
    # One more forward pass per step: about 4/3 of the compute.
    speed=Speed(lambda on, d, w: math.log(0.75) if on else 0.0, sd=0.2, batch_sd=0.1))


# --- ZeRO stage and offload (one group: offload exists only under ZeRO) -------------------

# Sharding's communication beyond data parallelism's gradient all-reduce, in log throughput,
# on one node and where the ranks span nodes (a network link an order of magnitude slower
# than NVLink): ZeRO-2 / shard_grad_op reduce-scatter every micro-batch; ZeRO-3 /
# full_shard also gather the parameters forward and backward, every micro-batch.
_SHARDING_COST = {"partition": (0.0, 0.0), "grad": (0.0, -0.1), "full": (-0.15, -0.5)}


def _sharding_prior(kind: str, device: DeviceSpec, world_size: int) -> float:
    if world_size == 1:  # no peers: only the bookkeeping
        return {"partition": -0.02, "grad": -0.04, "full": -0.15}[kind]
    one_node, across = _SHARDING_COST[kind]
    return across if device.nodes > 1 else one_node


def _zero_prior(stage: int, device: DeviceSpec, world_size: int) -> float:
    if stage == 0:
        return 0.0
    return _sharding_prior({1: "partition", 2: "grad", 3: "full"}[stage], device, world_size)


ZERO_STAGE = Knob(
    "zero_stage", (0, 1, 2, 3), 0, "ZeRO stage", "ZeRO", kind=int,
    tag=lambda z: f"z{z}" if z else "", group="sharding",
    rules=(Rule("zero_stage>0", "ZeRO needs deepspeed, which is not installed",
                lambda c, d: c.zero_stage > 0 and not _installed("deepspeed"), install=True),),
    memory_ordered=True, memory_engine=True,
    speed=Speed(_zero_prior, sd=0.4, ranks_batch_sd=0.1))

OFFLOAD = Knob(
    "offload", ("none", "optimizer", "optimizer+param"), "none", "offload", "offload",
    tag=lambda o: "" if o == "none" else f"off:{o}", group="sharding", memory_ordered=True,
    rules=(
        Rule("offload={offload} without ZeRO", "offload is a DeepSpeed ZeRO feature "
             "(zero_stage 1-3)", lambda c, d: c.offload != "none" and c.zero_stage == 0),
        Rule("offload=optimizer+param with zero_stage<3", "parameter offload needs ZeRO "
             "stage 3", lambda c, d: c.offload == "optimizer+param" and c.zero_stage != 3),
        Rule("offload with optim={optim}", "optimizer offload runs DeepSpeed's CPU optimizer, "
             "which exists only for " + ", ".join(offload_capable()),
             lambda c, d: c.offload != "none" and optimizer(c.optim).offload_type is None),
        # The optimizer's offload stays on a CPU: it runs DeepSpeed's CPU Adam, a lever of
        # its own there (the 0.5B QLoRA example's winner on 2 cores, 2026-11-27).
        Rule("offload=optimizer+param on CPU", "on a CPU the parameters are in host memory "
             "already: offloading them moves nothing and adds ZeRO-3's gathers",
             lambda c, d: c.offload == "optimizer+param" and not d.is_cuda),
    ),
    speed=Speed(lambda o, d, w: {"none": 0.0, "optimizer": -0.4,
                                 "optimizer+param": -1.0}[o], sd=0.4))


# --- FSDP (the other sharding backend; in the sharding group with ZeRO) ------------------

FSDP_MODES = ("none", "shard_grad_op", "full_shard", "full_shard+offload")


def _fsdp_args(mode: str) -> dict[str, Any]:
    if mode == "none":
        return {}
    strategy, _, offload = mode.partition("+")
    # Wrap each transformer block (the model's _no_split_modules), as accelerate does for
    # TRANSFORMER_BASED_WRAP; offload moves parameters and gradients to the host.
    return {"fsdp": f"{strategy} auto_wrap" + (" offload" if offload else ""),
            "fsdp_config": {"auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "use_orig_params": True}}


FSDP = Knob(
    "fsdp", FSDP_MODES, "none", "FSDP", "FSDP", tag=lambda f: "" if f == "none" else f"fsdp:{f}",
    training_args=_fsdp_args, group="sharding", memory_ordered=True, memory_engine=True,
    rules=(
        Rule("fsdp with zero_stage>0", "FSDP and DeepSpeed ZeRO are two sharding backends; "
             "a run uses one", lambda c, d: c.fsdp != "none" and c.zero_stage > 0),
        # accelerate turns FSDP on only for GPU-type distributed runs: on CPU ranks (gloo)
        # Trainer ignores the plugin and trains with DDP (seen in a 2-rank CPU trial).
        Rule("fsdp={fsdp} on CPU", "Trainer runs FSDP only on GPUs (accelerate ignores it "
             "on CPU ranks and trains with DDP)", lambda c, d: c.fsdp != "none"
             and not d.is_cuda),
        Rule("fsdp={fsdp} with 8-bit optim", "bitsandbytes' optimizers do not take FSDP's "
             "flattened sharded parameters", lambda c, d: c.fsdp != "none"
             and optimizer(c.optim).bitsandbytes),
    ),
    speed=Speed(lambda f, d, w: 0.0 if f == "none" else -1.0 if f == "full_shard+offload"
                else _sharding_prior("grad" if f == "shard_grad_op" else "full", d, w),
                sd=0.4, ranks_batch_sd=0.1))


# --- torch.compile -------------------------------------------------------------------------

TORCH_COMPILE = Knob(
    "torch_compile", (False, True), False, "torch.compile", "compile", kind=bool,
    tag=lambda on: "compile" if on else "", training_args=lambda on: {"torch_compile": on},
    group="compile",
    rules=(Rule("torch_compile=True", "torch.compile's CPU kernels need a C++ compiler "
                "(none on PATH)", lambda c, d: c.torch_compile and not d.is_cuda
                and not _have_cxx(), install=True),
           # transformers' TrainingArguments and accelerate's state both switch TF32 on for
           # a compiled run without mixed precision: it would be tf32's program twice.
           Rule("torch_compile=True with precision=fp32", "transformers and accelerate turn "
                "TF32 matmuls on for a compiled run without mixed precision on a GPU with "
                "TF32 ({cc}): fp32 with torch.compile runs as tf32 with torch.compile",
                lambda c, d: c.torch_compile and c.precision == "fp32"
                and d.supports_tf32()),
           # On an H100 (2026-11-27) the recipe's ZeRO-3 rung, compiled, hit dynamo's
           # recompile limit in DeepSpeed's post-forward hooks and ran past its 180 s trial.
           Rule("torch_compile=True with zero_stage=3", "torch.compile recompiles at each of "
                "ZeRO-3's parameter gathers (DeepSpeed's module hooks change what its guards "
                "check); Trainer's compile under ZeRO-3 ran past a 180 s trial on an H100",
                lambda c, d: c.torch_compile and c.zero_stage == 3)),
    # Published: about +16% tokens/s on H100 (torchtitan); on CPU no prior either way.
    speed=Speed(lambda on, d, w: math.log(1.12) if on and d.is_cuda else 0.0, sd=0.2,
                batch_sd=0.1),
    # The guide compiles on GPUs. On a CPU Inductor's C++ build costs a minute or more per
    # process on a few cores, which no careful user pays for a short run.
    recipe=lambda d, real: [True, False] if d.is_cuda else [False])

COMPILE_MODE = Knob(
    "torch_compile_mode", ("default", "reduce-overhead", "max-autotune"), "default",
    "compile mode", "mode", tag=lambda m: "" if m == "default" else f"mode:{m}",
    training_args=lambda m: {} if m == "default" else {"torch_compile_mode": m},
    group="compile",
    rules=(Rule("torch_compile_mode={torch_compile_mode} without torch_compile",
                "a compile mode needs torch_compile", lambda c, d:
                c.torch_compile_mode != "default" and not c.torch_compile),),
    speed=Speed(sd=0.1))


def _have_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


# --- attention kernel ---------------------------------------------------------------------

def _attention_prior(attn: str, device: DeviceSpec, world_size: int) -> float:
    if not device.is_cuda:
        return 0.0
    return {"eager": math.log(0.8), "flash_attention_2": 0.02}.get(attn, 0.0)


def _attention_applies(spec: Spec, attn: Any) -> str | None:
    from autotune.tasks.models import KERNEL_SUPPORT

    if attn not in KERNEL_SUPPORT:
        return None
    facts = _class_facts(spec)
    if facts is None or facts["kernels"].get(attn):
        return None
    return f"{facts['class']} does not support attn_implementation={attn}"


def _model_facts(spec: Spec) -> dict[str, Any]:
    """What the knob rules ask of the spec's model (tasks/models.py's model_facts)."""
    from autotune.tasks.models import model_facts

    with _TRANSFORMERS_IMPORT:
        return model_facts(spec.model.model_dump())


def _class_facts(spec: Spec) -> dict[str, Any] | None:
    """`_model_facts` where the transformers class is known; None otherwise (a factory, a
    config transformers cannot map)."""
    facts = _model_facts(spec)
    return facts if facts["class"] else None


ATTENTION = Knob(
    # "auto": what the model gets without asking (the spec's model.attn_implementation,
    # else transformers' choice, SDPA where the model supports it).
    "attn_implementation", ("auto", "eager", "sdpa", "flash_attention_2"), "auto",
    "attention kernel", "attn", tag=lambda a: "" if a == "auto" else f"attn:{a}",
    affects_model=True,
    loading=lambda a, c: {} if a == "auto" else {"attn_implementation": a},
    rules=(
        # Imported, not only found: a wheel built against another torch is common, and the
        # recipe tries flash_attention_2 first (its build's ImportError ended the search).
        Rule("attn_implementation=flash_attention_2", "flash_attention_2 needs flash-attn, "
             "which is not installed or fails to import", lambda c, d: c.attn_implementation
             == "flash_attention_2" and _import_failure("flash_attn") is not None,
             install=True, explain=lambda: "flash_attention_2 needs flash-attn, which "
             f"{_import_failure('flash_attn')}"),
        Rule("attn_implementation=flash_attention_2", "flash_attention_2 is a CUDA kernel",
             lambda c, d: c.attn_implementation == "flash_attention_2" and not d.is_cuda),
        Rule("attn_implementation=flash_attention_2", "flash_attention_2 needs an Ampere or "
             "newer GPU (compute capability 8.0+; here {cc})", lambda c, d:
             c.attn_implementation == "flash_attention_2" and not d.supports_bf16()),
        Rule("attn_implementation=flash_attention_2 with {precision}", "flash_attention_2 "
             "runs in fp16 or bf16 only", lambda c, d: c.attn_implementation ==
             "flash_attention_2" and c.precision not in ("fp16", "bf16")),
    ),
    applies=_attention_applies, scope="models whose class supports the kernel",
    # The guide: flash-attention 2 where installed and the dtype allows, else SDPA.
    recipe=lambda d, real: ["flash_attention_2", "sdpa", "auto"],
    memory_twins=True,
    speed=Speed(_attention_prior, sd=0.1, batch_sd=0.1, kin_sd=0.2,
                kin=lambda a: "materialised" if a == "eager" else "fused"))


# --- a quantized base (QLoRA) ------------------------------------------------------------

def _quantization_applies(spec: Spec, q: Any) -> str | None:
    if spec.model.lora is None:
        return (f"quantization {q} needs model.lora: a quantized base is frozen, only LoRA "
                "adapters train on it (add `lora: {}` to the model section, or leave "
                "quantization out of the space)")
    if spec.model.factory and not (spec.model.config or spec.model.name_or_path):
        return (f"quantization {q} loads the base through from_pretrained: model.factory "
                "builds the model itself")
    return None


_COMPUTE_DTYPE = {"bf16": "bfloat16", "fp16": "float16"}


def quantization_config(q: str, precision: str) -> dict[str, Any]:
    """`BitsAndBytesConfig(**kwargs)` for a quantized base: NF4 with double quantization
    (QLoRA's), computing in the precision knob's dtype; or LLM.int8."""
    if q == "nf4":
        return {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": _COMPUTE_DTYPE.get(precision, "float32")}
    return {"load_in_8bit": True}


QUANTIZATION = Knob(
    "quantization", ("none", "int8", "nf4"), "none", "quantized base", "quant",
    tag=lambda q: "" if q == "none" else q, affects_model=True, strict=True,
    applies=_quantization_applies, scope="model.lora, a model from a config or folder",
    loading=lambda q, c: {} if q == "none" else {
        "quantization_config": quantization_config(q, c.precision)},
    rules=(
        Rule("quantization={quantization}", "a quantized base needs bitsandbytes, which is "
             "not installed", lambda c, d: c.quantization != "none"
             and not _installed("bitsandbytes"), install=True),
        # ZeRO-1/2 partition only the adapters' states and gradients: the frozen quantized
        # base stays whole on each rank (trained here on CPU at the installed versions).
        Rule("quantization={quantization} with zero_stage=3", "ZeRO-3 would partition the "
             "packed quantized weights, which needs bnb_4bit_quant_storage and loading "
             "under zero.Init; a quantized base combines with ZeRO-1/2 here",
             lambda c, d: c.quantization != "none" and c.zero_stage == 3),
        Rule("quantization={quantization} with fsdp={fsdp}", "FSDP would shard the packed "
             "quantized weights (FSDP-QLoRA needs bnb_4bit_quant_storage in the compute "
             "dtype); a quantized base combines with ZeRO-1/2 here",
             lambda c, d: c.quantization != "none" and c.fsdp != "none"),
    ),
    # Dequantizing each weight before its matmul: NF4 about 15% slower than 16-bit
    # LoRA, LLM.int8's mixed-precision matmuls more.
    speed=Speed(lambda q, d, w: {"none": 0.0, "nf4": math.log(0.85),
                                 "int8": math.log(0.6)}[q], sd=0.3))


# --- fused kernels ------------------------------------------------------------------------

# Model types Liger's AutoLigerKernelForCausalLM patches (liger-kernel 0.5-0.6).
LIGER_MODEL_TYPES = ("llama", "mllama", "mistral", "mixtral", "gemma", "gemma2", "gemma3",
                     "qwen2", "qwen2_vl", "qwen2_5_vl", "qwen3", "phi3", "granite", "olmo2",
                     "glm4", "paligemma")


def _liger_applies(spec: Spec, on: Any = True) -> str | None:
    from autotune.tasks.registry import task_of, trainer_of

    task = task_of(spec)
    if not task.causal:  # Trainer patches the causal-LM forward in
        return (f"Liger's kernels are applied to causal LMs (their fused loss replaces the "
                f"LM head's forward); this model's task is {task.name}")
    refused = trainer_of(spec).refuses.get("use_liger_kernel")
    if refused:
        return refused

    model_type = _model_facts(spec)["model_type"]
    if model_type not in LIGER_MODEL_TYPES:
        return (f"Liger kernels cover model types {', '.join(LIGER_MODEL_TYPES)}; this model "
                f"is {model_type or 'of unknown type'}")
    return None


LIGER = Knob(
    "use_liger_kernel", (False, True), False, "Liger kernels", "liger", kind=bool,
    tag=lambda on: "liger" if on else "", training_args=lambda on: {"use_liger_kernel": on},
    applies=_liger_applies, scope="causal LMs of the types Liger covers, not under trainer: dpo",
    rules=(
        Rule("use_liger_kernel=True", "Liger kernels need liger-kernel, which is not "
             "installed", lambda c, d: c.use_liger_kernel and not _installed("liger_kernel"),
             install=True),
        Rule("use_liger_kernel=True", "Liger's Triton kernels need a CUDA GPU",
             lambda c, d: c.use_liger_kernel and not d.is_cuda),
        # Liger's fused loss reads lm_head.weight outside lm_head's forward, where ZeRO-3
        # has not gathered it: a size mismatch at the first step (Liger-Kernel #767; TRL
        # #3368 and #5891, which gathered it for GRPO only).
        Rule("use_liger_kernel=True with zero_stage=3", "Liger's fused cross-entropy reads "
             "the LM head's weight outside its forward, where ZeRO-3 keeps it partitioned "
             "(Liger-Kernel #767)", lambda c, d: c.use_liger_kernel and c.zero_stage == 3),
    ),
    # Published: about +20% throughput on Llama-3-8B.
    speed=Speed(lambda on, d, w: math.log(1.15) if on and d.is_cuda else 0.0, sd=0.2),
    recipe=lambda d, real: [True, False])


# --- data ---------------------------------------------------------------------------------

def _packing_applies(spec: Spec, on: Any = True) -> str | None:
    from autotune.tasks.registry import task_of, trainer_of

    if not task_of(spec).causal:
        return "padding-free packing (DataCollatorWithFlattening) is for causal LMs"
    if spec.data.source == "synthetic":
        return "synthetic rows are all seq_len tokens: there is no padding to remove"
    return trainer_of(spec).refuses.get("padding_free")


PACKING = Knob(
    # Padding-free packing: a micro-batch's rows concatenated into one, with position ids
    # restarting per row, so no compute is spent on padding.
    "padding_free", (False, True), False, "padding-free packing", "packing", kind=bool,
    tag=lambda on: "packed" if on else "", applies=_packing_applies,
    scope="causal LMs on real rows under trainer: trainer", sets="the data collator",
    speed=Speed(sd=0.3))


# --- DPO's reference model ------------------------------------------------------------------

def _precompute_applies(spec: Spec, on: Any = True) -> str | None:
    from autotune.tasks.registry import trainer_of

    if not trainer_of(spec).keeps_reference:
        return ("the reference model's log-probs are DPO's: only trainer: dpo has a "
                "reference to precompute")
    if spec.model.lora is not None:
        return ("under LoRA DPO's reference is the base with the adapters off: no second "
                "model to save, and its forward runs in the step either way")
    return None


PRECOMPUTE_REF = Knob(
    # DPO without LoRA keeps a second copy of the model as its reference and runs its
    # forward on every pair in every step; precomputed, one forward over every pair runs
    # before training and the copy is never made (its weights' memory saved; its
    # forward's seconds charged to the timed steps at their share of the pairs).
    "precompute_ref_log_probs", (False, True), False, "reference log-probs precomputed",
    "ref pre", kind=bool, tag=lambda on: "refpre" if on else "",
    applies=_precompute_applies, scope="trainer: dpo without model.lora",
    sets="DPOConfig (dpo_config.json)", speed=Speed(sd=0.1))

DATALOADER_WORKERS = Knob(
    "dataloader_num_workers", (0, 1, 2, 4, 8), 0, "dataloader workers", "loaders", kind=int,
    tag=lambda n: f"dl{n}" if n else "", training_args=lambda n: {"dataloader_num_workers": n},
    blamed=False, speed=Speed(sd=0.05),
    # The guide's DataLoader(num_workers=4) on real data; synthetic rows need no loading.
    recipe=lambda d, real: [4, 2, 1, 0] if real else [0])

PIN_MEMORY = Knob(
    "dataloader_pin_memory", (True, False), True, "pinned host memory", "pin", kind=bool,
    tag=lambda on: "" if on else "unpinned",
    training_args=lambda on: {"dataloader_pin_memory": on}, blamed=False,
    speed=Speed(sd=0.05))


# --- generation (a trainer that generates: trainer: grpo) ------------------------------

def _generation_applies(spec: Spec, on: Any = True) -> str | None:
    from autotune.tasks.registry import trainer_of

    if not trainer_of(spec).generates:
        return ("how completions are generated is a generating trainer's (trainer: grpo); "
                f"this spec's trainer is {spec.trainer}")
    return None


GENERATION_CACHE = Knob(
    # model.generate's KV cache: grown as tokens come (dynamic), or allocated whole for
    # the longest completion up front (static: no reallocations, and compilable).
    "generation_cache", ("dynamic", "static"), "dynamic", "generation KV cache", "kv cache",
    tag=lambda v: "" if v == "dynamic" else f"{v}-kv", applies=_generation_applies,
    scope="trainer: grpo", sets="GRPOConfig's cache_implementation (grpo_config.json)",
    blamed=False, speed=Speed(sd=0.15))

CONTINUOUS_BATCHING = Knob(
    # transformers' paged attention and continuous batching for the completions.
    "continuous_batching", (False, True), False, "continuous batching", "paged", kind=bool,
    tag=lambda on: "paged" if on else "", applies=_generation_applies, scope="trainer: grpo",
    sets="GRPOConfig's use_transformers_continuous_batching (grpo_config.json)",
    speed=Speed(sd=0.2), recipe=lambda d, real: [False])

VLLM_MODES = ("none", "colocate-0.3", "colocate-0.5", "colocate-0.3-sleep")

VLLM = Knob(
    # vLLM inside the trial's process (colocate), given this share of the GPU's memory
    # (vllm_gpu_memory_utilization), its weights and cache put to sleep while training
    # where "-sleep". Server mode runs on GPUs of its own: docs/grpo.md.
    "vllm", VLLM_MODES, "none", "vLLM generation", "vllm",
    tag=lambda v: "" if v == "none" else f"vllm:{v}", applies=_generation_applies,
    scope="trainer: grpo", sets="GRPOConfig's use_vllm, vllm_mode, "
    "vllm_gpu_memory_utilization, vllm_enable_sleep_mode (grpo_config.json)",
    rules=(
        Rule("vllm={vllm}", "vLLM is not installed", lambda c, d: c.vllm != "none"
             and not _installed("vllm"), install=True),
        Rule("vllm={vllm}", "vLLM generates on a CUDA GPU", lambda c, d: c.vllm != "none"
             and not d.is_cuda),
        Rule("vllm={vllm} with continuous_batching=True", "continuous batching is "
             "transformers' generation path; vLLM is another",
             lambda c, d: c.vllm != "none" and c.continuous_batching),
    ),
    speed=Speed(lambda v, d, w: math.log(3.0) if v != "none" and d.is_cuda else 0.0,
                sd=0.5),
    # TRL's advice for GRPO: generate with vLLM, colocated by default at its default share
    # (huggingface.co/docs/trl/speeding_up_training, vllm_integration); where it cannot
    # run, model.generate as TRL defaults to.
    recipe=lambda d, real: ["colocate-0.3", "none"])


# --- long context (issue 54): the sequence split across ranks, tiled compute, -----------
# --- how activations are kept ----------------------------------------------------------

def _long_context_trainer(spec: Spec, what: str) -> str | None:
    """Why a lever the trial applies to transformers' Trainer's own step (its loss, its
    training step, its accelerator's ParallelismConfig) cannot apply under the spec's
    trainer; TRL's were not tried (GRPOConfig refuses sequence parallelism outright)."""
    from autotune.tasks.registry import task_of, trainer_of

    if not task_of(spec).causal:
        return f"{what} is for causal LMs; this model's task is {spec.model.task}"
    if not trainer_of(spec).long_context_levers:
        return (f"{what} is applied to transformers' Trainer's step (trainer: trainer); "
                f"under trainer: {spec.trainer} it was not tried")
    return None


def _text_config(spec: Spec) -> Any:
    """The model's text config as far as the rules read it (tasks/models.py's TEXT_FACTS),
    or None where it has none or it cannot be read."""
    text = _model_facts(spec)["text"]
    return types.SimpleNamespace(**text) if text is not None else None


def _split_applies(spec: Spec, size: Any, what: str, chunks: int = 1) -> str | None:
    """Why splitting each sequence `size` ways cannot apply to the spec: it must divide
    the trial's ranks, the sequence (in `chunks` x size pieces) and the attention heads
    and key-value heads (Ulysses gives each rank whole heads)."""
    if size == 1:
        return None
    why = _long_context_trainer(spec, what)
    if why:
        return why
    if spec.world_size % size:
        return (f"{what}={size} must divide the trial's ranks (hardware.gpus_per_trial "
                f"{spec.world_size})")
    if spec.data.seq_len % (size * chunks):
        return f"{what}={size} needs data.seq_len {spec.data.seq_len} divisible by {size * chunks}"
    text = _text_config(spec)
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None) or heads
    if not heads:
        return f"{what} needs the model's attention heads, which its config does not say"
    if heads % size or kv % size:
        return (f"{what}={size} must divide the model's attention heads ({heads}) and "
                f"key-value heads ({kv})")
    if spec.model.attn_implementation == "eager":
        return f"{what} does not run eager attention (model.attn_implementation: eager)"
    return None


def _sequence_parallel_applies(spec: Spec, size: Any) -> str | None:
    why = _split_applies(spec, size, "sequence_parallel")
    facts = None if why or size == 1 else _class_facts(spec)
    if facts is not None and not any(facts["kernels"].values()):
        return f"Ulysses runs SDPA or flash attention, which {facts['class']} supports neither of"
    return why


def _sp_prior(size: int, device: DeviceSpec, world_size: int) -> float:
    # Two all-to-alls per layer forward and backward; a memory lever, not a speed one.
    if size == 1:
        return 0.0
    return math.log(0.6) if device.nodes > 1 else math.log(0.9)


SEQUENCE_PARALLEL = Knob(
    # DeepSpeed's Ulysses (ALST) through accelerate: each sequence split across `size`
    # ranks, attention gathered per head by all-to-all. Those ranks share one batch: the
    # data-parallel ranks are world / size, and the accumulation keeps the target with them
    # (config.py).
    "sequence_parallel", (1, 2, 4, 8), 1, "sequence parallelism (Ulysses)", "SP", kind=int,
    parity=True, tag=lambda n: f"sp{n}" if n > 1 else "", applies=_sequence_parallel_applies,
    scope="causal LMs under trainer: trainer; it divides hardware.gpus_per_trial, "
    "data.seq_len and the attention and key-value heads",
    sets="accelerate's ParallelismConfig(sp_backend='deepspeed', sp_size, sp_handler="
    "DeepSpeedSequenceParallelConfig(sp_seq_length, sp_seq_length_is_variable=False, "
    "sp_attn_implementation)): accelerate_config.yaml's parallelism_config block under "
    "`accelerate launch`, or TrainingArguments(parallelism_config=...) in your script, "
    "which also puts position_ids in every batch (and calls "
    "deepspeed.init_distributed(dist_backend='gloo') first on CPU)",
    rules=(
        # Measured here (benchmarks/sp_gradient_scale.py): the loss matches one rank's,
        # the gradient is sp_size times too large below ZeRO-3.
        Rule("sequence_parallel={sequence_parallel} with zero_stage={zero_stage}",
             "Ulysses' gradients come out sp_size times too large below ZeRO-3 (2 CPU ranks, "
             "a 2-layer Llama at seq 256, accelerate 1.15, DeepSpeed 0.19.8: grad norm 3.148 "
             "vs 1.574 on one rank at ZeRO-1, one SGD step at lr 0.1 moved down_proj by "
             "0.0482 vs 0.0241; exactly right at ZeRO-3)",
             lambda c, d: c.sequence_parallel > 1 and c.zero_stage != 3),
        Rule("sequence_parallel={sequence_parallel} with attn_implementation=eager",
             "Ulysses drops the attention mask and runs SDPA or flash attention; eager "
             "attention needs the full 4D mask",
             lambda c, d: c.sequence_parallel > 1 and c.attn_implementation == "eager"),
        Rule("sequence_parallel={sequence_parallel} with padding_free=True", "Ulysses "
             "shards padded rows of one length; packing's flattened rows are not tried",
             lambda c, d: c.sequence_parallel > 1 and c.padding_free),
    ),
    speed=Speed(_sp_prior, sd=0.3))


def _context_parallel_applies(spec: Spec, size: Any) -> str | None:
    # torch's load-balanced split cuts each sequence into 2 x size chunks.
    return _split_applies(spec, size, "context_parallel", chunks=2)


CONTEXT_PARALLEL = Knob(
    # accelerate's context parallelism (torch's ring attention under FSDP2): the sequence
    # split across `size` ranks of FSDP's mesh, which share one batch.
    "context_parallel", (1, 2, 4), 1, "context parallelism (FSDP2)", "CP", kind=int, parity=True,
    tag=lambda n: f"cp{n}" if n > 1 else "", applies=_context_parallel_applies,
    scope="causal LMs under trainer: trainer; it divides hardware.gpus_per_trial and the "
    "heads, 2 x it data.seq_len",
    sets="accelerate's ParallelismConfig(cp_size, cp_backend='torch', dp_shard_size) with "
    "FSDP2: accelerate_config.yaml's parallelism_config block, or "
    "TrainingArguments(parallelism_config=...) in your script",
    rules=(
        Rule("context_parallel={context_parallel}", "context parallelism runs on CUDA GPUs "
             "(torch's ring attention over NCCL)",
             lambda c, d: c.context_parallel > 1 and not d.is_cuda),
        Rule("context_parallel={context_parallel} with fsdp={fsdp}", "accelerate prepares "
             "context parallelism inside FSDP2's mesh only (fsdp: shard_grad_op or full_shard)",
             lambda c, d: c.context_parallel > 1 and c.fsdp == "none"),
        Rule("context_parallel={context_parallel} with attn_implementation="
             "{attn_implementation}", "Trainer runs context parallelism with SDPA only",
             lambda c, d: c.context_parallel > 1
             and c.attn_implementation not in ("auto", "sdpa")),
        Rule("context_parallel={context_parallel} with sequence_parallel="
             "{sequence_parallel}", "one split of the sequence at a time: Ulysses is "
             "DeepSpeed's, context parallelism FSDP2's",
             lambda c, d: c.context_parallel > 1 and c.sequence_parallel > 1),
        Rule("context_parallel={context_parallel} with padding_free=True", "the ring splits "
             "padded rows of one length; packing's flattened rows are not tried",
             lambda c, d: c.context_parallel > 1 and c.padding_free),
    ),
    speed=Speed(_sp_prior, sd=0.3))


def _model_lacks(spec: Spec, knob: str, has: str, why: str) -> str | None:
    """Why `knob` cannot apply to the spec's model: a trainer that takes no long-context
    lever, or a model class without the fact `has` of model_facts (`why`, formatted with
    its {name}); None."""
    said = _long_context_trainer(spec, knob)
    if said:
        return said
    facts = _class_facts(spec)
    if facts is None or not facts[has]:
        return why.format(name=facts["class"] if facts is not None else "this model")
    return None


def _tiled_mlp_applies(spec: Spec, on: Any = True) -> str | None:
    return _model_lacks(spec, "tiled_mlp", "gated_mlp",
                        "tiled_mlp recomputes a gated MLP (down_proj(act(gate_proj(x)) * "
                        "up_proj(x)): Llama's, Qwen2's, Mistral's); {name} has none")

TILED_MLP = Knob(
    # DeepSpeed's TiledMLP (ALST): each MLP's forward run shard by shard along the
    # sequence, its intermediate never whole, and run again in the backward.
    "tiled_mlp", (False, True), False, "tiled MLP", "tmlp", kind=bool, parity=True,
    tag=lambda on: "tmlp" if on else "", applies=_tiled_mlp_applies,
    scope="causal LMs with a gated MLP under trainer: trainer",
    sets="the trial: each gated MLP's forward through "
    "deepspeed.runtime.sequence_parallel.ulysses_sp.TiledMLP (your script patches the "
    "model's MLP forward so, as its docstring shows)",
    rules=(
        Rule("tiled_mlp=True", "TiledMLP is DeepSpeed's, which is not installed",
             lambda c, d: c.tiled_mlp and not _installed("deepspeed"), install=True),
        # Seen on 2 CPU ranks: "Expected to mark a variable ready only once".
        Rule("tiled_mlp=True without ZeRO on several ranks", "TiledMLP accumulates each "
             "weight's gradient once per shard, which ZeRO is told of (ds_grad_is_ready) "
             "and DDP refuses (\"Expected to mark a variable ready only once\", 2 CPU ranks)",
             lambda c, d: c.tiled_mlp and c.zero_stage == 0 and c.fsdp == "none",
             ranks=lambda w: w > 1),
        Rule("tiled_mlp=True with fsdp={fsdp}", "TiledMLP tells DeepSpeed's ZeRO when a "
             "weight's gradient is whole; FSDP's reduction is not told (DeepSpeed: \"DDP, "
             "FSDP will need something similar\")",
             lambda c, d: c.tiled_mlp and c.fsdp != "none"),
    ),
    # The MLP's forward once more in the backward: about 1/9 of a step's compute more.
    speed=Speed(lambda on, d, w: math.log(0.92) if on else 0.0, sd=0.1))


def _tiled_loss_applies(spec: Spec, on: Any = True) -> str | None:
    why = _model_lacks(spec, "tiled_loss", "plain_head",
                       "tiled_loss recomputes logits straight from lm_head; {name}'s forward "
                       "changes them (a softcap, a logit scale) or is not known")
    if why:
        return why
    text = _text_config(spec)
    if getattr(text, "tie_word_embeddings", False):
        # ZeRO-2/3 on 2 CPU ranks: "The parameter model.embed_tokens.weight has already
        # been reduced"; DDP and one rank trained right.
        return ("tiled_loss makes the LM head's gradient inside the forward: with the head "
                "tied to the embeddings ZeRO-2/3 reduce that weight twice in a step (2 CPU "
                "ranks: \"has already been reduced\")")
    return None


TILED_LOSS = Knob(
    # DeepSpeed's TiledFusedLogitsLoss (ALST): the LM head and its cross-entropy shard by
    # shard, the backward of each shard inside the forward, no full logits ever kept.
    "tiled_loss", (False, True), False, "tiled logits loss", "tloss", kind=bool, parity=True,
    tag=lambda on: "tloss" if on else "", applies=_tiled_loss_applies,
    scope="causal LMs whose logits are lm_head's, head untied, under trainer: trainer",
    sets="the trial: the model's loss through deepspeed.runtime.sequence_parallel."
    "ulysses_sp.TiledFusedLogitsLoss, each shard normalised inside it by the Trainer's "
    "scale (your script computes the loss so: trials/long_context.py TiledLoss)",
    rules=(
        Rule("tiled_loss=True", "TiledFusedLogitsLoss is DeepSpeed's, which is not "
             "installed", lambda c, d: c.tiled_loss and not _installed("deepspeed"),
             install=True),
        Rule("tiled_loss=True with use_liger_kernel=True", "Liger's fused linear "
             "cross-entropy replaces the same head and loss",
             lambda c, d: c.tiled_loss and c.use_liger_kernel),
        Rule("tiled_loss=True with precision=fp16", "the head's gradient is made inside the "
             "forward, before fp16's loss scaler multiplies the loss",
             lambda c, d: c.tiled_loss and c.precision == "fp16"),
    ),
    speed=Speed(lambda on, d, w: math.log(0.98) if on else 0.0, sd=0.1))


CHECKPOINTING_VARIANTS = ("non-reentrant", "reentrant", "every-2", "selective")


def _checkpointing_variant_args(variant: str) -> dict[str, Any]:
    name = f"{_checkpointing_arg()}_kwargs"
    if variant == "reentrant":
        return {name: {"use_reentrant": True}}
    if variant == "every-2":  # transformers checkpoints layers 0, 2, 4...
        return {name: {"use_reentrant": False, "every_n_layers": 2}}
    return {}  # non-reentrant: gradient_checkpointing's own; selective: the trial's


def _checkpointing_variant_applies(spec: Spec, variant: Any) -> str | None:
    from autotune.tasks.registry import trainer_of

    if variant in ("every-2", "selective") and not trainer_of(spec).long_context_levers:
        return (f"checkpointing_variant={variant} is applied to transformers' Trainer's "
                f"model (trainer: trainer); under trainer: {spec.trainer} it was not tried")
    return None


@cache
def _every_n_layers() -> bool:
    """Whether the installed transformers' activation checkpointing takes
    `every_n_layers` (read from training_args.py's source, not imported)."""
    from autotune import transformers_source

    return transformers_source.mentions("every_n_layers")


CHECKPOINTING_VARIANT = Knob(
    # How gradient checkpointing recomputes: torch's non-reentrant checkpoint of every
    # decoder layer (gradient_checkpointing's), the reentrant one, every other layer only,
    # or TRL's selective checkpointing (the attention op's output saved, the rest
    # recomputed).
    "checkpointing_variant", CHECKPOINTING_VARIANTS, "non-reentrant", "checkpointing variant",
    "ckpt how", parity=True,
    tag=lambda v: "" if v == "non-reentrant" else f"ckpt:{v}",
    group="gradient_checkpointing", training_args=_checkpointing_variant_args,
    applies=_checkpointing_variant_applies,
    scope="gradient_checkpointing=True; every-2 and selective under trainer: trainer",
    sets="TrainingArguments' activation_checkpointing_kwargs (use_reentrant, "
    "every_n_layers); selective: trl.models.enable_selective_activation_checkpointing(model) "
    "in your script before the Trainer",
    rules=(
        Rule("checkpointing_variant={checkpointing_variant} without gradient_checkpointing",
             "a checkpointing variant is how gradient_checkpointing=True recomputes",
             lambda c, d: c.checkpointing_variant != "non-reentrant"
             and not c.gradient_checkpointing),
        Rule("checkpointing_variant=every-2", "every-2 needs transformers whose activation "
             "checkpointing takes every_n_layers (5.x)", lambda c, d:
             c.checkpointing_variant == "every-2" and not _every_n_layers(), install=True),
    ),
    # Against checkpointing every layer: half the recompute, or the attention's kept.
    speed=Speed(lambda v, d, w: {"every-2": math.log(1.12), "selective": math.log(1.05)}
                .get(v, 0.0), sd=0.1))


ACTIVATION_OFFLOADING = Knob(
    # TRL's activation offloading around each training step (as SFTTrainer's
    # activation_offloading): saved activations to pinned host memory on a side stream in
    # the forward, back in the backward.
    "activation_offloading", (False, True), False, "activation offloading", "act off",
    kind=bool, parity=True, tag=lambda on: "actoff" if on else "",
    applies=lambda spec, on: _long_context_trainer(spec, "activation_offloading"),
    scope="causal LMs under trainer: trainer",
    sets="the trial: each training step inside trl.models.get_act_offloading_ctx_manager("
    "model) (your script wraps Trainer.training_step so, as SFTTrainer does)",
    rules=(Rule("activation_offloading=True", "activation offloading moves a GPU's saved "
                "activations to host memory over CUDA streams; on a CPU they are there",
                lambda c, d: c.activation_offloading and not d.is_cuda),),
    speed=Speed(lambda on, d, w: math.log(0.9) if on else 0.0, sd=0.2))


# --- the table -------------------------------------------------------------------------

_TABLE: list[Knob] = [PRECISION, OPTIM, GRADIENT_CHECKPOINTING, ZERO_STAGE, OFFLOAD, FSDP,
                      TORCH_COMPILE, COMPILE_MODE, ATTENTION, QUANTIZATION, LIGER, PACKING,
                      DATALOADER_WORKERS, PIN_MEMORY, PRECOMPUTE_REF, GENERATION_CACHE,
                      CONTINUOUS_BATCHING, VLLM, CHECKPOINTING_VARIANT, SEQUENCE_PARALLEL,
                      CONTEXT_PARALLEL, TILED_MLP, TILED_LOSS, ACTIVATION_OFFLOADING]


def table() -> tuple[Knob, ...]:
    return tuple(_TABLE)


def names() -> list[str]:
    return [k.name for k in _TABLE]


def knob(name: str) -> Knob:
    for k in _TABLE:
        if k.name == name:
            return k
    raise SpecError(f"unknown knob {name!r}; known: {', '.join(names())}")


def groups() -> dict[str, list[Knob]]:
    """Knobs by effect group, in table order."""
    out: dict[str, list[Knob]] = {}
    for k in _TABLE:
        out.setdefault(k.group_name, []).append(k)
    return out


@contextlib.contextmanager
def added(*new: Knob) -> Iterator[None]:
    """The table with `new` rows for the duration (a plugin's or a test's knob)."""
    taken = set(names())
    for k in new:
        if k.name in taken:
            raise SpecError(f"knob {k.name!r} is already in the table")
    _TABLE.extend(new)
    try:
        yield
    finally:
        for k in new:
            _TABLE.remove(k)


def parity_levers(config: TrialConfig) -> dict[str, Any]:
    """The config's levers that must not change the maths (`Knob.parity`), each off its
    baseline: what its twin turns off (tuning/numerics.py)."""
    return {k.name: getattr(config, k.name) for k in table()
            if k.parity and getattr(config, k.name) != k.baseline}


def device_rule(config: TrialConfig, device: DeviceSpec, *, installs: bool = True,
                world_size: int | None = None) -> tuple[str, str] | None:
    """(label, reason) of the first rule that rules `config` out on `device`, or None;
    `installs=False` leaves out the rules about this machine's packages (a replay);
    `world_size`: the trial's ranks, where a rule depends on them (unknown: it holds)."""
    for k in _TABLE:
        for rule in k.rules:
            if rule.install and not installs:
                continue
            hit = rule.check(config, device, world_size)
            if hit is not None:
                return hit
    return None
