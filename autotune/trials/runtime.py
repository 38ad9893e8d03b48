"""What a trial really ran with, read from the process rather than assumed from its config:
TF32 on or off, whether Liger's kernels patched the model, whether the trained module was
compiled and how, the wrapper the Trainer put around it. The libraries decide some of it
behind the config's back (transformers and accelerate turn TF32 on for compiled runs), so
a trial records it and refuses a figure whose label it contradicts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.records import RanWith


def tf32_state() -> bool | None:
    """Whether float32 matmuls on CUDA run as TF32, read through the API that set it
    (torch >= 2.9's `fp32_precision`, else the legacy flag); None where torch has no
    CUDA build to say."""
    import torch

    matmul = torch.backends.cuda.matmul
    try:
        return str(matmul.fp32_precision) == "tf32"
    except (AttributeError, RuntimeError):
        pass
    try:
        return bool(matmul.allow_tf32)
    except (AttributeError, RuntimeError):
        return None


def settle_tf32() -> None:
    """Say the TF32 state once more through torch's legacy API. transformers sets it
    through torch >= 2.9's new API, after which the legacy getter Inductor's max-autotune
    calls (`torch.get_float32_matmul_precision`) raises "mix of the legacy and new APIs";
    saying the same state the legacy way makes both readable and changes nothing."""
    import torch

    state = tf32_state()
    if state is not None:
        torch.set_float32_matmul_precision("high" if state else "highest")


def liger_applied(model) -> bool:
    """Whether Liger's kernels replaced any of the model's modules or forwards."""
    for module in model.modules():
        forward = getattr(type(module), "forward", None)
        bound = module.__dict__.get("forward")  # an instance patched in place
        for f in (forward, getattr(bound, "__func__", bound)):
            if str(getattr(f, "__module__", "") or "").startswith("liger_kernel"):
                return True
        if type(module).__module__.startswith("liger_kernel"):
            return True
    return False


def unwrapped(module) -> Any:
    """The module under torch.compile's wrapper (accelerate hands back the compiled
    `OptimizedModule`, whose `_orig_mod` is what it wrapped: FSDP, DDP, the model)."""
    while type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        module = module._orig_mod
    return module


def compiled_in_place(module) -> bool:
    """Whether `module` or one of its submodules was compiled in place: accelerate
    compiles a DeepSpeed engine with `engine.compile()`, which calls its module's own
    `nn.Module.compile()` (and regional compilation each block's), so no `OptimizedModule`
    wrapper appears; the compiled call is kept in the module's `_compiled_call_impl`
    instead, and the engine says `is_compiled`."""
    if getattr(module, "_is_compiled", False) is True:  # DeepSpeedEngine.compile() ran
        return True
    return any(getattr(m, "_compiled_call_impl", None) is not None for m in module.modules())


def ran_with(trainer, tf32: bool | None, graphs: int | None = None) -> RanWith:
    """The facts of a trial's run, for its outcome (`Outcome.ran_with`); `graphs`: the
    graphs torch.compile compiled in the run, the evidence that compiled code ran."""
    wrapped = trainer.model_wrapped
    compiled = any(type(m).__name__ == "OptimizedModule" or compiled_in_place(m)
                   for m in (wrapped, trainer.model))
    model = unwrapped(trainer.model)
    return RanWith(
        tf32=tf32, compiled=compiled,
        compile_mode=(getattr(trainer.args, "torch_compile_mode", None) or "default")
        if compiled else None,
        compiled_graphs=graphs, liger=liger_applied(model),
        attn_implementation=getattr(getattr(model, "config", None), "_attn_implementation",
                                    None),
        wrapped_as=type(unwrapped(wrapped)).__name__)


def contradiction(precision: str, use_liger: bool, torch_compile: bool, facts: RanWith,
                  cuda: bool) -> str | None:
    """Why the run's facts contradict its config's label, or None: fp32 that ran TF32
    matmuls, tf32 that did not, Liger or compile asked for and not applied (compile
    applied as a wrapper or in place, and at least one graph compiled)."""
    if cuda and facts.tf32 is not None:
        if precision == "fp32" and facts.tf32:
            return ("precision fp32 ran its matmuls in TF32 (transformers and accelerate turn "
                    "TF32 on for compiled runs without mixed precision): this is tf32's "
                    "figure, not fp32's")
        if precision == "tf32" and not facts.tf32:
            return "precision tf32 ran its matmuls in full fp32: TF32 did not take effect"
    if use_liger and not facts.liger:
        return "use_liger_kernel did not take effect: no module of the model is Liger's"
    if torch_compile and not facts.compiled:
        return "torch_compile did not take effect: the trained module was not compiled"
    if torch_compile and facts.compiled_graphs == 0:
        return ("torch_compile did not take effect: the module was compiled but torch.compile "
                "compiled no graph of it, so every step ran eagerly")
    return None


def bitsandbytes_state() -> dict[str, Any] | None:
    """Which native library the installed bitsandbytes loaded, read from its own module
    (`bitsandbytes.cextension`: `BNB_BACKEND`, the `lib` it made, whether that was built
    with CUDA, the file it loaded or the error it fell back on); None where it is not
    installed. On a CUDA device it loads its CUDA library; where it cannot (no binary for
    this CUDA, a missing runtime) it loads the CPU one or a stand-in and runs its
    fallback kernels instead."""
    try:
        import bitsandbytes.cextension as cext
    except Exception:  # noqa: BLE001 - not installed, or broken: the install rules say so
        return None
    lib = cext.lib
    own = vars(lib)  # not getattr: its __getattr__ answers every name with a stub
    dll = own.get("_lib")
    return {"backend": str(getattr(cext, "BNB_BACKEND", "")), "library": type(lib).__name__,
            "compiled_with_cuda": bool(getattr(type(lib), "compiled_with_cuda", False)),
            "path": getattr(dll, "_name", None) if dll is not None else None,
            "error": str(own["error_msg"])[:300] if own.get("error_msg") else None}


def bitsandbytes_unfit(state: dict[str, Any] | None, cuda: bool) -> str | None:
    """Why a trial using bitsandbytes (a 4-bit or 8-bit base, its optimizers) must not be
    timed on this device, from `bitsandbytes_state()`; None where it may. On a CPU its CPU
    library is the right one. On a CUDA device a library without CUDA means its fallback
    kernels, whose seconds would be taken for the GPU's."""
    if not cuda or state is None or state.get("compiled_with_cuda"):
        return None
    loaded = Path(state["path"]).name if state.get("path") else "no native library"
    said = f"; its load error: {state['error']}" if state.get("error") else ""
    return (f"bitsandbytes loaded {loaded} ({state.get('library')}, backend "
            f"{state.get('backend') or 'unknown'}) on a CUDA device: its 8-bit and 4-bit ops "
            "would run its fallback kernels and be timed as the GPU's (install a "
            f"bitsandbytes built for this CUDA){said}")
