"""The CUDA paths' findings, checked where their logic runs on a CPU: what a trial really
ran with (TF32, Liger, compile, its wrapper) recorded and held to its label, the rules for
TF32 under compile and Liger under ZeRO-3, MFU's counts under LoRA and a 4-bit base, no
host read per micro-batch, no CPU figure for a GPU config, and a warm launcher that keeps
bitsandbytes from making a CUDA context and tries a fork before it serves."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from autotune import knobs
from autotune.config import TrialConfig
from autotune.device import DeviceSpec, named_device, peak_flops_of
from autotune.records import RanWith
from autotune.trials import forkserver
from autotune.trials.runtime import (
    contradiction,
    liger_applied,
    settle_tf32,
    tf32_state,
    unwrapped,
)


@pytest.fixture
def restored_tf32():
    """The float32 matmul precision as a fresh process has it for the test (an in-process
    trial earlier in the run, tests/test_long_context.py's, leaves its own: an fp32 run
    settles the matmuls to ieee), and as it was after (tests run in one process)."""
    import json
    import subprocess
    import sys

    names = ("cuda.matmul", "cudnn.conv", "cudnn.rnn", "mkldnn.matmul", "mkldnn.conv",
             "mkldnn.rnn")

    def backend(name):
        obj = torch.backends
        for part in name.split("."):
            obj = getattr(obj, part)
        return obj

    saved = {n: backend(n).fp32_precision for n in names}
    probe = ("import functools, json, sys, torch\n"
             "print(json.dumps({n: functools.reduce(getattr, n.split('.'), torch.backends)"
             ".fp32_precision for n in sys.argv[1:]}))")
    fresh = json.loads(subprocess.run([sys.executable, "-c", probe, *names],
                                      capture_output=True, text=True, check=True).stdout)
    torch.backends.fp32_precision = "none"
    for n, v in fresh.items():
        backend(n).fp32_precision = v
    yield
    torch.backends.fp32_precision = "none"
    for n, v in saved.items():
        backend(n).fp32_precision = v
    torch.set_float32_matmul_precision("highest")


def test_tf32_that_transformers_set_is_readable_once_settled(restored_tf32):
    """transformers sets TF32 through torch's new API; Inductor's max-autotune then reads
    it through the legacy getter, which raises on the mix. Settled, both read it."""
    from transformers.utils.import_utils import enable_tf32

    enable_tf32.__wrapped__(True)  # what TrainingArguments does for bf16 with compile
    with pytest.raises(RuntimeError, match="legacy and new"):
        torch.get_float32_matmul_precision()
    settle_tf32()
    assert torch.get_float32_matmul_precision() == "high"
    assert tf32_state() is True


def test_a_label_the_run_contradicts_gets_no_figure():
    ran = RanWith(tf32=True, compiled=True, liger=False)
    assert "tf32's figure" in contradiction("fp32", False, True, ran, cuda=True)
    assert contradiction("fp32", False, True, ran, cuda=False) is None  # no TF32 on a CPU
    assert contradiction("bf16", False, True, ran, cuda=True) is None
    assert "did not take effect" in contradiction("tf32", False, False,
                                                  RanWith(tf32=False), cuda=True)
    assert "Liger" in contradiction("bf16", True, False, ran, cuda=True)
    assert "torch_compile" in contradiction("bf16", False, True,
                                            dataclasses.replace(ran, compiled=False),
                                            cuda=True)


def test_fp32_under_compile_and_liger_under_zero3_are_ruled_out():
    a100, v100 = named_device("A100-80GB"), named_device("V100-32GB")
    fp32_compiled = TrialConfig.of(8, 1, precision="fp32", torch_compile=True)
    assert "runs as tf32" in knobs.device_rule(fp32_compiled, a100)[1]
    assert knobs.device_rule(fp32_compiled, v100) is None  # no TF32 before Ampere
    assert knobs.device_rule(TrialConfig.of(8, 1, precision="tf32", torch_compile=True),
                             a100) is None
    liger3 = TrialConfig.of(8, 1, precision="bf16", use_liger_kernel=True, zero_stage=3)
    assert "Liger-Kernel #767" in knobs.device_rule(liger3, a100, installs=False)[1]


def test_liger_applies_to_causal_lms_only():
    from autotune.spec import load_spec

    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}
    assert knobs.LIGER.applies(load_spec({"model": {"config": llama}}), True) is None
    said = knobs.LIGER.applies(load_spec({"model": {"config": llama,
                                                    "task": "sequence-classification"}}), True)
    assert "sequence-classification" in said


def test_a_compiled_wrapper_is_seen_through():
    """accelerate hands back torch.compile's OptimizedModule around FSDP (FSDP itself needs
    GPUs: a module of its class name stands in), which the sharding check must see."""
    from autotune.trials.worker import _sharding_fallback

    class FullyShardedDataParallel(torch.nn.Module):
        def forward(self, x):
            return x

    compiled = torch.compile(FullyShardedDataParallel())
    assert type(compiled).__name__ == "OptimizedModule"
    assert type(unwrapped(compiled)).__name__ == "FullyShardedDataParallel"
    fsdp = TrialConfig.of(8, 1, fsdp="full_shard")
    assert _sharding_fallback(fsdp, type(unwrapped(compiled)).__name__) is None
    assert "did not take effect" in _sharding_fallback(fsdp, type(compiled).__name__)


def test_liger_is_recognised_by_where_its_forward_comes_from():
    """liger-kernel needs Triton on a GPU: a forward defined in a module of its name
    stands in for one it patched in."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LayerNorm(2))
    assert not liger_applied(model)

    def forward(self, x):
        return x

    forward.__module__ = "liger_kernel.transformers.rms_norm"
    model[1].forward = forward.__get__(model[1])
    assert liger_applied(model)


def test_mfu_counts_a_4bit_base_whole_and_frozen_weights_without_their_gradients():
    from transformers import set_seed

    from autotune.trials.model_builder import build_model
    from autotune.trials.worker import _flops_per_token, _parameters, flop_parameters

    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 256}
    set_seed(0)
    plain, _ = build_model({"config": llama}, {}, "cpu")
    packed, _ = build_model({"config": llama},
                            {"quantization_config": knobs.quantization_config("nf4", "bf16")},
                            "cpu")
    assert _parameters(packed) == _parameters(plain)  # not half of each packed weight
    assert (flop_parameters(packed)["flop_parameters"]
            == flop_parameters(plain)["flop_parameters"])  # counted whole, frozen
    shape = {"num_layers": 2, "hidden_size": 64, "seq_len": 32}
    attention = 12 * 2 * 64 * 32
    assert _flops_per_token(1000, 1000, shape) == 6 * 1000 + attention
    assert _flops_per_token(1000, 10, shape) == 4 * 1000 + 2 * 10 + attention
    assert peak_flops_of("NVIDIA A100-SXM4-40GB MIG 3g.20gb") == {}
    assert peak_flops_of("NVIDIA A100-SXM4-40GB")["bf16"] == 312e12


def test_micro_batches_are_counted_without_a_host_read_per_step():
    """A host read of a sum on the GPU waits for the GPU: counting does no read (an
    `aten._local_scalar_dense`, what int() and .item() dispatch to) until the run is over."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from autotune.trials.worker import MicroBatches

    class HostReads(TorchDispatchMode):
        reads = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                HostReads.reads += 1
            return func(*args, **(kwargs or {}))

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    trainer = Trainer(model=model, args=TrainingArguments("unused", use_cpu=True,
                                                          report_to="none"))
    trainer.current_gradient_accumulation_steps = 1  # as train() sets it before a step
    step, at_step = trainer.training_step, []

    def entered(*args, **kwargs):  # the Trainer's own step (its model reads masks itself)
        at_step.append(HostReads.reads)
        return step(*args, **kwargs)

    trainer.training_step = entered
    counted = MicroBatches(trainer, packed=False)
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, 6:] = 0
    batch = {"input_ids": torch.randint(0, 64, (3, 8)), "attention_mask": mask,
             "labels": torch.randint(0, 64, (3, 8))}
    with HostReads():
        trainer.training_step(model, batch)
    assert at_step == [0]  # counting read nothing back before the step ran
    assert counted.sizes() == [3] and counted.tokens() == [22]


def test_a_gpu_config_never_trains_on_the_cpu(tiny_spec, tmp_path):
    from autotune.trials.worker import run
    from tests.conftest import trial_request

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    request = trial_request(tiny_spec, TrialConfig(4, 4))
    request.on_cpu = False  # a GPU config, on a process that sees no GPU
    out = run(request, str(tmp_path / "result.json"))
    assert out.status == "lost" and "sees none" in out.error


def test_a_fork_that_cannot_reach_the_device_refuses_the_launcher():
    assert forkserver.fork_check(lambda: None) is None

    def broken() -> None:
        raise RuntimeError("CUDA error: initialization error")

    assert "initialization error" in forkserver.fork_check(broken)
    assert "no answer" in forkserver.fork_check(lambda: __import__("time").sleep(30),
                                                timeout_s=0.5)
    assert forkserver._fork_unsafe() is None  # here: no GPU to reach, and none touched


def test_preloaded_libraries_learn_the_capability_from_nvml(monkeypatch):
    """bitsandbytes asks the GPU's capability as it is imported; NVML answers it while the
    launcher preloads, so no CUDA context is made. (No GPU here: NVML's answer for one
    stands in, as the hardware is not here.)"""
    asked: list[int] = []  # the GPU each question reached NVML for

    def nvml(index: int) -> tuple[int, int]:
        asked.append(index)
        return (9, 0)

    monkeypatch.setattr(forkserver, "nvml_capability", nvml)
    before = torch.cuda.get_device_capability
    with forkserver._capability_from_nvml():
        assert torch.cuda.get_device_capability(torch.cuda.device(2)) == (9, 0)
        assert torch.cuda.get_device_capability(None) == (9, 0)
        assert torch.cuda.get_device_capability(torch.device("cuda", 3)) == (9, 0)
        assert torch.cuda.get_device_capability(1) == (9, 0)
    assert asked == [2, 0, 3, 1]  # each form of the argument names its GPU
    assert torch.cuda.get_device_capability is before
    assert not torch.cuda.is_initialized()


def test_py_cpuinfo_is_asked_once_a_boot_and_only_by_a_trial_that_asks(tmp_path):
    """DeepSpeed asks py-cpuinfo three times each time a trial loads a CPU op (1.1 s each
    here, a subprocess each). Nothing is asked until something asks; the first answer is
    written down for this boot, and every later question, in that process or a new one
    (another trial, another search), is answered from it, a fresh copy each time, without
    a subprocess."""
    import json
    import subprocess
    import sys

    folder = str(tmp_path)
    code = (
        "import json, subprocess, sys, cpuinfo\n"
        "from autotune.trials.cpu_info import remember_cpu_info\n"
        "remember_cpu_info(sys.argv[1])\n"
        "if sys.argv[2] == 'again':\n"
        "    def asked(*a, **k): raise AssertionError('py-cpuinfo asked again')\n"
        "    subprocess.Popen = asked\n"
        "first = cpuinfo.get_cpu_info(); first['changed'] = True\n"
        "def asked(*a, **k): raise AssertionError('py-cpuinfo asked again')\n"
        "subprocess.Popen = asked\n"
        "again = cpuinfo.get_cpu_info()\n"
        "print(json.dumps([sorted(again), again['flags'], 'changed' in again]))\n")

    def run(mode: str) -> list:
        out = subprocess.run([sys.executable, "-c", code, folder, mode], capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    installed = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom autotune.trials.cpu_info import "
         "remember_cpu_info\nremember_cpu_info(sys.argv[1])", folder],
        capture_output=True, text=True, timeout=120)
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert not list(tmp_path.iterdir())  # installing the answerer asks nothing
    first = run("first")
    kept = list(tmp_path.glob("autotune-cpuinfo-*.json"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["flags"] == first[1]
    assert first[2] is False  # a copy each time: the caller's edit is not the next answer
    assert run("again") == first  # a new process: read from the file, no subprocess


@pytest.mark.slow
def test_compiled_zero1_trials_run_compiled_cold_then_warm_under_one_limit(
        tiny_spec, tmp_path, monkeypatch):
    """accelerate compiles a DeepSpeed engine in place (`engine.compile()` calls the
    module's own `compile()`): no OptimizedModule wrapper appears, and such a trial was
    thrown away as "not compiled" after paying its compile. Two in a row on a fresh
    Inductor cache: the first compiles cold, the second reuses it, and both were held to
    the same limit, their compilation not counted."""
    from autotune.trials.launch import run_trial
    from tests.conftest import trial_request

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    config = TrialConfig.of(4, 4, zero_stage=1, torch_compile=True)
    cold, warm = (run_trial(trial_request(tiny_spec, config, timeout_s=300)) for _ in "ab")
    for out in (cold, warm):
        assert out.status == "ok", out.error
        facts = out.ran_with
        assert facts.wrapped_as == "DeepSpeedEngine" and facts.compiled, facts
        assert facts.compiled_graphs > 0 and out.compile.recompiled_steps == 0
        assert out.launch.compile_not_counted_s == pytest.approx(out.compile.seconds,
                                                                 abs=0.01)
    assert cold.compile.cache == "cold", cold.compile
    assert warm.compile.cache == "warm", warm.compile
    assert cold.compile.seconds > warm.compile.seconds
    limits = [(o.launch.time_limit_s, o.launch.compile_allowance_s) for o in (cold, warm)]
    assert limits[0] == limits[1] == (300, 300)
    # The warm-up paid the compile, not the timed steps (charged once to the long run).
    assert cold.compile.charged_seconds > 10 * cold.median_step


def test_a_compiled_trials_limit_does_not_count_its_compilation(tmp_path):
    """The launcher's wait: an eager trial is past its limit at the limit; a compiled
    one, whose rank's clock says it has been compiling, only that much later (up to its
    allowance), whether the compile finished or is still running."""
    import json
    import time

    from autotune.trials import compile_clock
    from autotune.trials.launch import _wait_within_limit
    from autotune.trials.protocol import TrialRequest

    assert compile_clock.deadline(100.0, 60.0, 60.0, 45.0) == 205.0
    assert compile_clock.deadline(100.0, 60.0, 60.0, 500.0) == 220.0  # the allowance
    (tmp_path / "result.json.compile").write_text(json.dumps({"seconds": 0.2, "since": None}))
    (tmp_path / "result.json.rank1.compile").write_text(
        json.dumps({"seconds": 0.1, "since": time.time() - 0.2}))
    assert compile_clock.spent(list(tmp_path.glob("*.compile"))) == pytest.approx(0.3, abs=0.05)

    def never_ends(seconds: float) -> None:
        time.sleep(min(seconds, 0.02))

    def waited(torch_compile: bool) -> float:
        request = TrialRequest({}, {"torch_compile": torch_compile}, {}, timeout_s=0.3)
        begun = time.monotonic()
        assert _wait_within_limit(never_ends, request, tmp_path) is None
        return time.monotonic() - begun

    assert 0.29 < waited(False) < 0.45
    (tmp_path / "result.json.rank1.compile").write_text(json.dumps({"seconds": 0.1,
                                                                    "since": None}))
    assert 0.49 < waited(True) < 0.7  # 0.3 s of its own, 0.2 s of compiling


@pytest.fixture
def broken_flash_attn(tmp_path, monkeypatch):
    """A flash-attn wheel built against another torch (its extension's undefined symbol),
    on this process's path and its children's: a fake of the hardware-specific wheel. The
    knob table's memo of what imports is emptied before and after."""
    package = tmp_path / "site" / "flash_attn"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so: undefined "
        "symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(package.parent))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(package.parent), *filter(None, [os.environ.get("PYTHONPATH")])]))
    knobs._installed.cache_clear()
    knobs._import_failure.cache_clear()
    yield
    knobs._installed.cache_clear()
    knobs._import_failure.cache_clear()


def test_a_flash_attn_that_fails_to_import_is_left_out_with_its_error(broken_flash_attn):
    """find_spec finds the broken wheel; only importing it tells. On a GPU the space
    prunes flash_attention_2 with the import's own error and the recipe, which tries it
    first, takes SDPA: no trial builds a model that cannot be built, and the search goes
    on. The import is tried in another interpreter: the driver has not paid it."""
    import sys

    from autotune.space import build_space
    from autotune.spec import load_spec
    from autotune.tuning.recipe import available_values, recipe_family

    h100 = named_device("H100-80GB")
    llama = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 1, "num_attention_heads": 2, "vocab_size": 64}
    spec = load_spec({"model": {"config": llama}, "data": {"seq_len": 32},
                      "target_batch_size": 8})
    assert knobs._installed("flash_attn")
    planned = build_space(spec, h100)
    why = planned.pruned["attn_implementation=flash_attention_2"]
    assert "fails to import" in why and "undefined symbol: _ZN3c104cuda9SetDeviceEi" in why
    assert "flash_attention_2" not in {c.attn_implementation for c in planned.candidates}
    assert "sdpa" in {c.attn_implementation for c in planned.candidates}
    assert recipe_family(h100, available_values(spec)).attn_implementation == "sdpa"
    assert "flash_attn" not in sys.modules


def test_bitsandbytes_without_its_cuda_library_is_never_timed_on_a_gpu():
    """bitsandbytes falls back to its CPU library (or a stand-in) where it finds no CUDA
    one: on a GPU its 8-bit and 4-bit ops would run its fallback kernels and be timed as
    the GPU's. Read here for real (its CPU library, right on a CPU); what a GPU's process
    would read is given as data, the hardware not being here."""
    from autotune.trials.runtime import bitsandbytes_state, bitsandbytes_unfit

    here = bitsandbytes_state()
    assert here["backend"] == "CPU" and not here["compiled_with_cuda"]
    assert here["path"].endswith("libbitsandbytes_cpu.so")
    assert bitsandbytes_unfit(here, cuda=False) is None
    why = bitsandbytes_unfit(here, cuda=True)
    assert "libbitsandbytes_cpu.so" in why and "fallback kernels" in why
    cuda_lib = here | {"backend": "CUDA", "library": "CudaBNBNativeLibrary",
                       "compiled_with_cuda": True, "path": "/x/libbitsandbytes_cuda130.so"}
    assert bitsandbytes_unfit(cuda_lib, cuda=True) is None
    no_binary = {"backend": "CUDA", "library": "ErrorHandlerMockBNBNativeLibrary",
                 "compiled_with_cuda": False, "path": None,
                 "error": "No compatible CUDA binary found at /x/libbitsandbytes_cuda131.so"}
    why = bitsandbytes_unfit(no_binary, cuda=True)
    assert "no native library" in why and "libbitsandbytes_cuda131.so" in why
    assert bitsandbytes_unfit(None, cuda=True) is None  # not installed: the rules say so


def test_the_allocators_cap_leaves_the_runtimes_share_of_the_budget():
    """A GPU trial's budget holds its CUDA context and NCCL's communicator, which the
    caching allocator never sees: capped at the whole budget, a trial over it ran to its
    end before it was an OOM. The cap is the budget less the memory model's runtime term."""
    from autotune.plan.memory import CUDA_RUNTIME_BYTES, NCCL_COMM_BYTES, GiB
    from autotune.trials.worker import allocator_cap

    total, budget = 80 * GiB, 24 * GiB
    plain = allocator_cap(budget, total, TrialConfig.of(4, 4), 1)
    assert plain * total == pytest.approx(budget - CUDA_RUNTIME_BYTES)
    for config, world in ((TrialConfig.of(4, 4, zero_stage=2), 1), (TrialConfig.of(4, 4), 2)):
        capped = allocator_cap(budget, total, config, world)  # a process group: NCCL's too
        assert capped * total == pytest.approx(budget - CUDA_RUNTIME_BYTES - NCCL_COMM_BYTES)
    assert allocator_cap(200 * GiB, total, TrialConfig.of(4, 4), 1) == 1.0
    assert allocator_cap(GiB, total, TrialConfig.of(4, 4), 1) == 0.0  # not even the runtime


def test_mfu_is_palms_appendix_b_on_gpt2_124m_a_llama_and_an_moe():
    """MFU by PaLM's appendix B as nanoGPT's estimate_mfu and torchtitan count it:
    6N + 12·L·H·Q·T per token, N without the input embeddings (a token embedding tied to
    the LM head counts: nanoGPT's GPT-2 124M has 123.65M), attention counted whole, an
    MoE's routed experts at num_experts_per_tok of num_local_experts. The expected
    figures are the formula's, by hand from each config; the models are built on the meta
    device (the shapes, no memory)."""
    from transformers import (
        GPT2Config,
        GPT2LMHeadModel,
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
    )

    from autotune.device import KNOWN_DEVICES
    from autotune.records import Measurement, Outcome
    from autotune.trials.worker import _flops_per_token, flop_parameters, model_flops_utilisation

    def flops(model, layers, heads, hidden, seq, head_dim=None):
        counted = flop_parameters(model)
        shape = {"num_layers": layers, "num_attention_heads": heads, "hidden_size": hidden,
                 "seq_len": seq, "hf_config": {"head_dim": head_dim} if head_dim else {}}
        return counted, _flops_per_token(counted["flop_parameters"],
                                         counted["flop_trainable_parameters"], shape)

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(GPT2Config())  # 124M: 12 x 768, 12 heads, vocab 50257, tied
    L, h, V, T = 12, 768, 50257, 1024
    n = L * (12 * h * h + 13 * h) + 2 * h + V * h  # blocks, ln_f, the tied head; no wpe
    assert n == 123_653_376  # nanoGPT: "number of parameters: 123.65M"
    counted, per_token = flops(gpt2, L, 12, h, T)
    assert counted["flop_parameters"] == n
    assert per_token == 6 * n + 12 * L * 12 * 64 * T

    with torch.device("meta"):  # Llama-3-8B: untied head, GQA
        llama = LlamaForCausalLM(LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    L, h, f, kv, V, T = 32, 4096, 14336, 8 * 128, 128256, 4096
    n = L * (2 * h * h + 2 * h * kv + 3 * h * f + 2 * h) + h + V * h  # no embed_tokens
    assert n == 7_504_924_672
    counted, per_token = flops(llama, L, 32, h, T, head_dim=128)
    assert counted["flop_parameters"] == n
    assert per_token == 6 * n + 12 * L * 32 * 128 * T
    for p in llama.parameters():  # LoRA's frozen base: no weight gradients
        p.requires_grad_(False)
    assert flops(llama, L, 32, h, T)[1] == 4 * n + 12 * L * 32 * 128 * T
    h100 = DeviceSpec("H100", "cuda", 80 * 2**30, (9, 0), 1, KNOWN_DEVICES["H100-80GB"][2])
    run = Outcome("ok", tokens_per_second=2e4, measured=Measurement(**counted))
    shape = {"num_layers": L, "num_attention_heads": 32, "hidden_size": h, "seq_len": T}
    assert model_flops_utilisation(run, shape, h100, "bf16", 1) == pytest.approx(
        (6 * n + 12 * L * 32 * 128 * T) * 2e4 / 989e12)

    E, k, L, h, f, kv, V = 8, 2, 2, 64, 128, 32, 256
    moe = MixtralForCausalLM(MixtralConfig(
        hidden_size=h, intermediate_size=f, num_hidden_layers=L, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=V, num_local_experts=E, num_experts_per_tok=k))
    active = L * (2 * h * h + 2 * h * kv + h * E + k * 3 * h * f + 2 * h) + h + V * h
    assert flop_parameters(moe)["flop_parameters"] == active  # 2 of 8 experts a token
    held = sum(p.numel() for p in moe.parameters())  # all 8 experts, the input embedding
    assert held == active + L * (E - k) * 3 * h * f + V * h


def test_nothing_is_read_from_the_device_per_step_inside_the_timed_window(
        tiny_spec, tmp_path, monkeypatch):
    """Trainer's logging reads the loss and the grad norm on the host at every logged
    step: with logging_steps 1, a GPU sync per step inside the timed window. A real trial,
    run in this process: no host read of a tensor (`aten._local_scalar_dense`, what
    .item(), float() and bool() dispatch to) is asked for by the training loop, accelerate
    or the trial's own code from the end of the warm-up to the last step's end (the
    model's own, masks among them, are the model's and a long run's too); the losses and
    grad norms are still there, read after the run. (torch's AdamW reads its CPU step
    counters, no device sync; the model's mask check is the model's.)"""
    import traceback

    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.trials import worker
    from tests.conftest import trial_request

    loop_reads: list[str] = []
    WRAPPERS = ("torch/_tensor.py", "torch/overrides.py", "torch/_compile.py",  # noqa: N806
                "torch/_dynamo/", "torch/utils/_python_dispatch.py")

    class Reads(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                # who asked: the innermost frame but this mode's and torch's wrappers
                asker = next(f for f in reversed(traceback.extract_stack())
                             if f.filename != __file__ and not any(
                                 w in f.filename for w in WRAPPERS))
                if any(part in asker.filename for part in (
                        "transformers/trainer", "/accelerate/", "/autotune/")):
                    loop_reads.append(f"{asker.filename}:{asker.lineno} {asker.line}")
            return func(*args, **(kwargs or {}))

    tiny_spec["measure"] = {"warmup_steps": 1, "steps": 3}
    made = worker._step_timer

    def watched(sync, warmup, memory=None):
        timer = made(sync, warmup, memory)
        reads, end = Reads(), timer.on_step_end

        def on_step_end(args, state, control, **kw):
            if state.global_step == state.max_steps:
                reads.__exit__(None, None, None)  # the last step's reads are in its window
            end(args, state, control, **kw)
            if state.global_step == warmup:
                reads.__enter__()

        timer.on_step_end = on_step_end
        return timer

    monkeypatch.setattr(worker, "_step_timer", watched)
    out = worker.run(trial_request(tiny_spec, TrialConfig(4, 4)), str(tmp_path / "r.json"))
    assert out.status == "ok", out.error
    assert loop_reads == []
    assert len(out.measured.losses) == 4 and all(0 < x < 10 for x in out.measured.losses)


def test_the_fork_check_touches_only_the_devices_a_trial_is_given(monkeypatch):
    """The warm launcher's fork check made a context on every GPU it could see: on a busy
    node another job's GPU could refuse it (every trial then cold) or lose memory to it.
    It touches the trial's devices only, cuda:0 up to its ranks on the node, of those
    CUDA_VISIBLE_DEVICES leaves (the CUDA calls stand in for a GPU here)."""
    probe = forkserver.PROBE_DEVICES
    assert forkserver.probe_devices(8, {probe: "2"}) == [0, 1]
    assert forkserver.probe_devices(1, {probe: "4"}) == [0]  # Ray narrowed it to one
    assert forkserver.probe_devices(8, {}) == [0]  # not said: one
    assert forkserver.probe_devices(0, {probe: "2"}) == []  # a CPU host: nothing
    monkeypatch.setenv(probe, "2")
    touched: list[int] = []
    forkserver._cuda_usable(touch=touched.append, visible=lambda: 8)
    assert touched == [0, 1]

    def refusing(i: int) -> None:  # another job's GPU, in exclusive mode
        if i >= 2:
            raise RuntimeError(f"CUDA error: all CUDA-capable devices are busy (cuda:{i})")

    assert forkserver.fork_check(lambda: forkserver._cuda_usable(refusing, lambda: 8)) is None
    monkeypatch.setenv(probe, "3")
    assert "busy" in forkserver.fork_check(
        lambda: forkserver._cuda_usable(refusing, lambda: 8))
