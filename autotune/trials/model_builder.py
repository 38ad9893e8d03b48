"""Build the model a trial trains (inside the trial process), on the trial's device, with
no work that measuring speed does not need (design.md, "Trials at real size").

A trial measures speed and memory, so its model needs the right shape, dtype, placement
and sharding, not the checkpoint's values: by default (`model.weights: random`) it is
built from its config as transformers builds missing weights in `from_pretrained`: a
skeleton on the meta device, each tensor allocated on the trial's device and set by the
model's own init, module by module (never uninitialised memory: garbage can hold inf or
NaN and turn every step into a skipped one). A quantized base's weights are quantized by
bitsandbytes on the device one block at a time, as soon as the block is initialised, so
no full-precision copy of the model exists anywhere and nothing is written to disk. Under
ZeRO-3 transformers builds inside `zero.Init`, which partitions each module as it is
made. `model.weights: checkpoint` loads the checkpoint straight onto the device (safetensors
are memory-mapped: the node's page cache serves every trial after the first). An MoE
model built with random weights keeps its checkpoint's routers, which decide its step
time; without a checkpoint its routing is a random router's, about balanced.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import re
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.errors import SetupError
from autotune.tasks import task
from autotune.tasks.models import auto_class, load_hf_config
from autotune.trials.oom import is_oom_exception

RANDOM, CHECKPOINT = "random", "checkpoint"
# A router's parameters: the small gate that picks experts per token (Mixtral, Qwen-MoE,
# DeepSeek, OLMoE: `mlp.gate`, GPT-OSS: `mlp.router`, Qwen's shared-expert gate), and a
# router's load-balancing bias where the model has one.
ROUTER_PARAMETER = re.compile(
    r"(^|\.)(gate|router|shared_expert_gate)\.(weight|bias|e_score_correction_bias)$")
# Config fields that say a model routes tokens to experts.
EXPERT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def _model_field(model: dict[str, Any]) -> str:
    return next(f"model.{k}" for k in ("factory", "name_or_path", "config") if model.get(k))


def build_model(model: dict[str, Any], loading: dict[str, Any] | None = None,
                device: Any = "cpu", io_aside: Sequence[threading.Thread] = (),
                ) -> tuple[Any, dict[str, Any]]:
    """The spec's model on `device`, loaded with the config's model kwargs
    (trainargs.model_kwargs: the attention kernel its knob names, else the spec's own or
    the model's default; a quantized base's BitsAndBytesConfig), and how it was built
    (for the outcome: which weights, where, partitioned or not, the disk it read and
    wrote, less what the threads `io_aside` did meanwhile: a trial's RSS watcher). A
    failure that is not a lack of memory is a SetupError naming the spec's field: no
    config of the search could avoid it."""
    loading = dict(loading or {})
    if "attn_implementation" in loading:
        model = model | {"attn_implementation": loading.pop("attn_implementation")}
    before = _disk_io(io_aside)
    try:
        built, how = _build_model(model, loading.get("quantization_config"), device)
    except SetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised, classified
        if is_oom_exception(exc):
            raise
        if loading.get("quantization_config") and _is_quantizer_error(exc):
            raise  # the quantized base's (bitsandbytes'), not the spec's: the config fails
        raise SetupError(_model_field(model), f"{type(exc).__name__}: {exc}") from exc
    after = _disk_io(io_aside)
    how |= {"device": str(device)} | {f"disk_{k}_bytes": after[k] - before[k]
                                       for k in ("read", "write") if k in before}
    return built, how


def _is_quantizer_error(exc: Exception) -> bool:
    import traceback

    return any("bitsandbytes" in f.filename or "quantizer" in f.filename
               for f in traceback.extract_tb(exc.__traceback__))


def _disk_io(aside: Sequence[threading.Thread] = ()) -> dict[str, int]:
    """This process's bytes read from and written to storage so far (Linux's /proc; the
    page cache's hits are no reads), less those of the threads `aside` (a trial's RSS
    watcher rewrites its figure file while the model builds: 4-48 KiB counted as the
    build's before; a thread that has ended counts again); {} where not known."""

    def io(path: str) -> dict[str, int]:
        fields = dict(line.split(": ") for line in Path(path).read_text().splitlines())
        return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}

    def theirs() -> list[dict[str, int]]:
        out = []
        for thread in aside:
            with contextlib.suppress(OSError, KeyError, ValueError, TypeError):
                out.append(io(f"/proc/self/task/{thread.native_id}/io"))
        return out

    try:
        for _ in range(10):  # theirs read unchanged on both sides of the total: consistent
            first = theirs()
            total = io("/proc/self/io")
            last = theirs()
            if first == last:
                break
    except (OSError, KeyError, ValueError):
        return {}
    return {k: v - sum(t[k] for t in last) for k, v in total.items()}


def _build_model(model: dict[str, Any], quantization: dict[str, Any] | None,
                 device: Any) -> tuple[Any, dict[str, Any]]:
    import torch

    hf_config = load_hf_config(model)
    if hf_config is not None:  # what its task's head needs and a config may leave out
        task(model.get("task")).prepare_config(hf_config)
    if model.get("factory"):
        return _from_factory(model, hf_config, device), {"weights": "factory"}
    auto = auto_class(model)
    # fp32 master weights, as Trainer's mixed precision keeps them (and the memory model
    # counts them), whatever dtype a checkpoint's config names.
    kwargs: dict[str, Any] = {"dtype": torch.float32}
    if model.get("attn_implementation"):
        kwargs["attn_implementation"] = model["attn_implementation"]
    weights = model.get("weights") or RANDOM
    if weights == CHECKPOINT:
        return _from_checkpoint(auto, model, hf_config, quantization, device, kwargs)
    built, how = _from_config(auto, hf_config, quantization, device, kwargs)
    if _experts(hf_config):
        how["routing"] = _routers(built, model.get("name_or_path"))
    return built, how


def _from_factory(model: dict[str, Any], hf_config, device):
    import torch

    module_name, func_name = model["factory"].split(":")
    try:
        factory = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise SetupError("model.factory", f"{model['factory']!r}: {exc}") from exc
    with torch.device(device):  # what it allocates without naming a device lands there
        built = factory(hf_config)
    if model.get("attn_implementation") and hasattr(built, "set_attn_implementation"):
        built.set_attn_implementation(model["attn_implementation"])
    return built


def _from_checkpoint(auto, model: dict[str, Any], hf_config, quantization, device,
                     kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    source = str(Path(model["name_or_path"]).expanduser())
    if quantization is not None:
        kwargs["quantization_config"] = transformers.BitsAndBytesConfig(**quantization)
    zero3 = is_deepspeed_zero3_enabled()
    if not zero3:  # ZeRO-3 loads into the partitions zero.Init made instead
        kwargs["device_map"] = {"": str(device)}
    built = auto.from_pretrained(source, config=hf_config, **kwargs)
    return built, {"weights": CHECKPOINT, "partitioned": zero3,
                   "quantized": "on load" if quantization else None}


def _from_config(auto, hf_config, quantization, device,
                 kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Random weights of the config's exact shape, made on `device` by the model's init."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if is_deepspeed_zero3_enabled() and quantization is None:
        # transformers builds inside zero.Init: each module partitioned as it is made,
        # then initialised a module at a time, gathered. Made in the dtype zero.Init casts
        # its partitions to (DeepSpeed's bf16 or fp16 keeps 16-bit parameters and the fp32
        # master copy in its optimizer), not made in fp32 and cast a tensor at a time.
        from transformers import initialization

        kwargs = kwargs | {"dtype": _zero3_dtype() or kwargs["dtype"]}
        with _parallel_normal(initialization):
            built = auto.from_config(hf_config, **kwargs)
        return built, {"weights": RANDOM, "partitioned": True}
    skeleton = _skeleton(auto, hf_config, kwargs)
    if skeleton is None:  # a transformers without meta-device init: built whole, there
        return _whole_on_device(auto, hf_config, quantization, device, kwargs)
    model, quantizer = skeleton
    if quantization is not None:
        quantizer = _quantizer(model, quantization, device)
    _materialise(model, device, quantize=quantizer is not None)
    model.tie_weights()
    if quantizer is not None:
        model.hf_quantizer = quantizer
        quantizer.postprocess_model(model)
    return model, {"weights": RANDOM, "partitioned": False,
                   "quantized": "on the device, a block at a time" if quantization else None}


def _zero3_dtype():
    """The dtype DeepSpeed's config (the one transformers holds) keeps parameters in."""
    import torch
    from transformers.integrations.deepspeed import deepspeed_config

    config = deepspeed_config() or {}
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if (config.get(key) or {}).get("enabled") is True:
            return dtype
    return None


def _skeleton(auto, hf_config, kwargs: dict[str, Any]):
    """(the model on the meta device, untied, no tensor allocated; None) or None where the
    installed transformers cannot initialise one (no `initialize_weights`)."""
    import torch
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "initialize_weights"):
        return None
    from transformers import initialization

    untied = getattr(initialization, "no_tie_weights", contextlib.nullcontext)
    with torch.device("meta"), untied():
        model = auto.from_config(hf_config, **kwargs)
    return model, None


def _whole_on_device(auto, hf_config, quantization, device, kwargs):
    import torch

    if quantization is not None:
        raise SetupError("model.weights", "this transformers cannot build a quantized base "
                         "from a config without a checkpoint (it has no meta-device init); "
                         "upgrade transformers to 5 or later")
    with torch.device(device):
        return auto.from_config(hf_config, **kwargs), {"weights": RANDOM, "partitioned": False}


def _quantizer(model, quantization: dict[str, Any], device):
    """transformers' bitsandbytes quantizer, its linear layers swapped in on the meta
    device as from_pretrained swaps them."""
    import transformers
    from transformers.quantizers import AutoHfQuantizer

    quantizer = AutoHfQuantizer.from_config(transformers.BitsAndBytesConfig(**quantization),
                                            pre_quantized=False)
    device_map = {"": str(device)}
    quantizer.validate_environment(device_map=device_map, weights_only=True)
    quantizer.preprocess_model(model=model, dtype=model.dtype, device_map=device_map,
                               checkpoint_files=None, use_kernels=False)
    return quantizer


def _materialise(model, device, *, quantize: bool) -> None:
    """Allocate the skeleton's tensors on `device` and run the model's own init on them in
    the order `PreTrainedModel.initialize_weights` does (children first, each sub-model
    with its own `_init_weights`), so a quantized build draws the same values as a plain
    one. A quantized layer's weight exists in full precision only until its block (a
    `_no_split_modules` class: a decoder layer) is initialised; a parent's init may still
    rescale a child's weight before that (GPT-2's residual projections)."""
    import torch
    from transformers import PreTrainedModel, initialization

    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    blocks = set(getattr(model, "_no_split_modules", None) or [])
    allocated: dict[int, Any] = {}  # meta tensor id -> its allocation (shared tensors)
    pending: list[tuple[Any, str, Any]] = []  # (module, name, meta weight) to quantize

    def allocate(prefix: str, module) -> None:
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if f"{prefix}{name}" in tied:  # the tie replaces it: neither made nor initialised
                p._is_hf_initialized = True
                continue
            if _packed(p):  # full precision only until its block is initialised
                weight = torch.empty(p.shape, dtype=model.dtype, device=device)
                module._parameters[name] = torch.nn.Parameter(weight, requires_grad=False)
                pending.append((module, name, p))
                continue
            if id(p) not in allocated:
                allocated[id(p)] = torch.nn.Parameter(torch.empty_like(p, device=device),
                                                      requires_grad=p.requires_grad)
            module._parameters[name] = allocated[id(p)]
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty_like(b, device=device)

    def quantize_pending() -> None:
        while pending:
            module, name, meta = pending.pop()
            module._parameters[name] = _quantized(module._parameters[name], meta, device)

    def walk(prefix: str, module, init) -> None:
        for name, child in module.named_children():
            walk(f"{prefix}{name}.", child,
                 child._initialize_weights if isinstance(child, PreTrainedModel) else init)
        allocate(prefix, module)
        init(module)
        if quantize and type(module).__name__ in blocks:
            quantize_pending()

    for m in model.modules():  # from_config marked them as initialised on the meta device
        m._is_hf_initialized = False
    guard = getattr(initialization, "guard_torch_init_functions", contextlib.nullcontext)
    with torch.no_grad(), guard(), _parallel_normal(initialization):
        walk("", model, model._initialize_weights)
    quantize_pending()


# A host tensor of at least this many elements is drawn in chunks, side by side.
PARALLEL_NORMAL_MIN = 1 << 20


@contextlib.contextmanager
def _parallel_normal(initialization):
    """The init's normal draws on a host filled by several generators at once. torch's
    CPU normal_ draws from one generator, so it barely uses a second core: at 0.5B it was
    two thirds of a build (2.4 s of 3.8 on two cores; half that this way). Each chunk's
    generator is seeded from the default one, so the trial's seed still decides every
    value, and the distribution is the init's own."""
    import torch

    functions = getattr(initialization, "TORCH_INIT_FUNCTIONS", None)
    threads = torch.get_num_threads()
    if not isinstance(functions, dict) or "normal_" not in functions or threads < 2:
        yield
        return
    from concurrent.futures import ThreadPoolExecutor

    original = functions["normal_"]
    chunks = 2 * threads  # a chunk each and one more to even the threads' finish

    def normal_(tensor, mean: float = 0.0, std: float = 1.0, generator=None):
        if (generator is not None or tensor.device.type != "cpu"
                or tensor.numel() < PARALLEL_NORMAL_MIN or not tensor.is_contiguous()):
            return original(tensor, mean=mean, std=std, generator=generator)
        seeds = torch.randint(2**62, (chunks,)).tolist()
        parts = tensor.detach().view(-1).chunk(chunks)

        def fill(i: int) -> None:
            with torch.no_grad():  # grad mode is per thread
                parts[i].normal_(mean, std, generator=torch.Generator().manual_seed(seeds[i]))

        list(pool.map(fill, range(len(parts))))
        return tensor

    with ThreadPoolExecutor(threads, thread_name_prefix="autotune-init") as pool:
        functions["normal_"] = normal_
        try:
            yield
        finally:
            functions["normal_"] = original


def _packed(p) -> bool:
    """Whether `p` is a weight bitsandbytes holds quantized (Params4bit, Int8Params)."""
    return type(p).__name__ in ("Params4bit", "Int8Params")


def _quantized(weight, meta, device):
    """`weight` quantized on `device` as transformers' bitsandbytes ops quantize a loaded
    weight (the quantization settings are the skeleton's parameter's)."""
    settings = {k: v for k, v in meta.__dict__.items() if k not in ("SCB", "CB")}
    if weight.device.type == "cpu" and type(meta).__name__ == "Params4bit" and (
            settings.get("quant_type") == "nf4"):
        return nf4_on_cpu(weight.data, settings)
    data = weight.data
    if type(meta).__name__ == "Int8Params":  # it quantizes as it moves off the host
        data = data.to("cpu")
    return type(meta)(data, requires_grad=False, **settings).to(device)


def nf4_on_cpu(weight, settings: dict[str, Any]):
    """An NF4 Params4bit of `weight` as `Params4bit._quantize` makes it (packed codes, the
    block absmax, double-quantized where `compress_statistics`), its codes from
    bitsandbytes' blockwise C kernel on the NF4 table: on a CPU the 4-bit op is plain
    torch whose bucketize costs five times as much (5 s for a 0.5B model's layers on two
    cores, against 1 s). The two differ only at the bins' edges (about one code in 10^4,
    each within 1e-5 of an edge, one level apart), which neither speed nor memory sees."""
    import torch
    from bitsandbytes import functional as F
    from bitsandbytes.nn import Params4bit

    blocksize = settings.get("blocksize") or 64
    storage = settings.get("quant_storage") or torch.uint8
    code = F.get_4bit_type("nf4", device=weight.device)
    # The kernel takes a table of 256; values past 1 are never the nearest to |x| <= 1.
    table = torch.cat([code, torch.arange(2, 258 - code.numel(), dtype=code.dtype,
                                          device=code.device)])
    codes, absmax = torch.ops.bitsandbytes.quantize_blockwise.default(
        weight.contiguous(), table, blocksize)
    codes = codes.reshape(-1)
    if codes.numel() % 2:  # the last byte's second code: zero's, as bitsandbytes pads
        codes = torch.nn.functional.pad(codes, (0, 1), value=int(code.abs().argmin()))
    pairs = codes.view(-1, 2)  # a byte holds two codes, the first in its high half
    packed = ((pairs[:, 0] << 4) | pairs[:, 1]).unsqueeze(1)
    if storage != torch.uint8:
        packed = packed.squeeze().view(storage).unsqueeze(1)
    common = {"shape": weight.shape, "dtype": weight.dtype, "blocksize": blocksize,
              "code": code, "quant_type": "nf4"}
    if settings.get("compress_statistics"):
        offset = absmax.mean()
        nested, state2 = F.quantize_blockwise(absmax - offset, blocksize=256)
        state = F.QuantState(absmax=nested, offset=offset, state2=state2, **common)
    else:
        state = F.QuantState(absmax=absmax, **common)
    module = settings.get("module")
    if module is not None:
        module.quant_state = state
    return Params4bit(packed, requires_grad=False, quant_state=state, blocksize=blocksize,
                      compress_statistics=settings.get("compress_statistics", True),
                      quant_type="nf4", quant_storage=storage, module=module,
                      bnb_quantized=True)


def _experts(hf_config) -> bool:
    return any(getattr(hf_config, f, None) for f in EXPERT_FIELDS)


def _routers(model, checkpoint: str | None) -> str:
    """Copy the checkpoint's routers into an MoE model built with random weights (only
    those tensors are read); what its routing is, said in the report."""
    state = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]
             if ROUTER_PARAMETER.search(n) and not _packed(t)}
    files = _safetensors(checkpoint) if checkpoint else []
    if not state or not files:
        return "random router: about balanced (no checkpoint's router to keep)"
    import torch
    from safetensors import safe_open

    wanted = {_router_key(n, tuple(getattr(t, "ds_shape", t.shape))): n
              for n, t in state.items()}
    found = 0
    gathered = [t for t in state.values() if hasattr(t, "ds_id")]  # ZeRO-3's partitions
    with _gathered(gathered), torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - a safetensors file, no dict
                    if not ROUTER_PARAMETER.search(key):
                        continue
                    name = wanted.get(_router_key(key, tuple(f.get_slice(key).get_shape())))
                    if name is not None:
                        state[name].copy_(f.get_tensor(key).to(state[name].dtype))
                        found += 1
    if found < len(state):
        return (f"random router: the checkpoint holds {found} of the model's "
                f"{len(state)} router tensors")
    return f"the checkpoint's routers ({found} tensors), random experts"


def _router_key(name: str, shape: tuple) -> tuple:
    """What identifies a router tensor across the names a checkpoint and transformers
    give it (Mixtral's `block_sparse_moe.gate` is `mlp.gate` in transformers 5): its
    layer numbers, its own two last names, its shape."""
    return (tuple(re.findall(r"\.(\d+)\.", name)), tuple(name.split(".")[-2:]), shape)


def _gathered(params: list):
    """ZeRO-3's partitioned `params` whole for the block (written back after), or nothing
    to do."""
    if not params:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _safetensors(folder: str) -> list[Path]:
    root = Path(folder).expanduser()
    index = root / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / s for s in shards]
    return sorted(root.glob("*.safetensors"))


def prepare_quantized(model):
    """PEFT's preparation of a quantized base for training its adapters: the layers left
    in 16 bits go to fp32 for stable updates. Checkpointing stays the knob's (Trainer
    turns it on from the TrainingArguments), not PEFT's default of always."""
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
