"""The toolbox knobs, each run for real where the CPU can run it (compile, eager vs sdpa,
FSDP on 2 gloo ranks, packing on a JSONL file, dataloader workers, LoRA, the optional
optimizers) and ruled out with its reason where it cannot (flash-attn, Liger)."""

from __future__ import annotations

import copy
import inspect
import json

import pytest
import torch
import yaml

from autotune import knobs
from autotune.config import TrialConfig
from autotune.device import DeviceSpec, local_device
from autotune.optimizers import optimizer
from autotune.plan.calibration import MemoryModel
from autotune.plan.shape import model_shape
from autotune.records import TOKENS_PER_SECOND
from autotune.space import build_space
from autotune.spec import load_spec
from autotune.tasks import objective_of
from autotune.trials.launch import run_trial
from autotune.trials.trainargs import deepspeed_config
from tests.conftest import TINY_SPEC, trial_request
from tests.test_data import TEXTS, make_tokenizer

H100 = DeviceSpec("H100-80GB", "cuda", 80 * 2**30, (9, 0))


def _spec(tmp_path, **changes) -> dict:
    spec = copy.deepcopy(TINY_SPEC) | {"output": str(tmp_path / "out")}
    for key, value in changes.items():
        spec[key] = spec.get(key, {}) | value if isinstance(value, dict) else value
    return spec


def _run(spec, **knob_values):
    return run_trial(trial_request(spec, TrialConfig.of(4, 4, **knob_values), timeout_s=300))


# --- rules: where a knob cannot run, it is never run, and the report says why ---------

def test_flash_attention_and_liger_are_ruled_out_with_their_reason():
    cpu = local_device()
    flash = TrialConfig.of(4, 4, attn_implementation="flash_attention_2", precision="bf16")
    assert "flash" in knobs.device_rule(flash, cpu)[1]
    fp32 = TrialConfig.of(4, 4, attn_implementation="flash_attention_2")
    reasons = [hit[1] for r in knobs.ATTENTION.rules if (hit := r.check(fp32, H100))]
    assert any("fp16 or bf16" in r for r in reasons)
    assert not any("compute capability" in r for r in reasons)  # an H100 has flash kernels
    liger = TrialConfig.of(4, 4, use_liger_kernel=True)
    assert "liger" in knobs.device_rule(liger, cpu)[1].lower()


def test_liger_and_packing_apply_only_where_the_model_and_data_allow(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"per_device_train_batch_size": [4],
                                     "use_liger_kernel": [False, True],
                                     "padding_free": [False, True]}))
    spec = load_spec(_spec(tmp_path, search={"space": str(space)}))
    result = build_space(spec, H100)
    assert "model types" in result.pruned["use_liger_kernel=True"]  # gpt2 is not covered
    assert "no padding" in result.pruned["padding_free=True"]  # synthetic data
    assert {c.use_liger_kernel for c in result.candidates} == {False}
    llama = load_spec(_spec(tmp_path, search={"space": str(space)}, model={"config": {
        "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32,
        "intermediate_size": 64, "num_attention_heads": 2, "vocab_size": 512}}))
    # Llama is covered: what stops Liger now is the install, not the model.
    assert "model types" not in build_space(llama, H100).pruned.get("use_liger_kernel=True", "")


def test_offload_sends_each_cpu_optimizer_only_the_arguments_it_takes():
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion

    classes = {"AdamW": DeepSpeedCPUAdam, "Lion": DeepSpeedCPULion,
               "Adagrad": DeepSpeedCPUAdagrad}
    for name in ("adamw_torch", "lion_32bit", "adagrad"):
        ds = deepspeed_config(TrialConfig.of(4, 4, optim=name, zero_stage=2,
                                             offload="optimizer"))
        taken = inspect.signature(classes[optimizer(name).offload_type].__init__).parameters
        assert set(ds["optimizer"]["params"]) <= set(taken), name


# --- the memory model follows the knobs -------------------------------------------------

def test_memory_model_follows_attention_kernel_and_lora(tmp_path):
    full = MemoryModel(model_shape(load_spec(_spec(tmp_path))), H100)
    sdpa = TrialConfig.of(8, 2, attn_implementation="sdpa")
    eager = TrialConfig.of(8, 2, attn_implementation="eager")
    assert full.predict(eager).components["activations"] > full.predict(
        sdpa).components["activations"]
    lora_shape = model_shape(load_spec(_spec(tmp_path, model={"lora": {"r": 4}})))
    assert 0 < lora_shape.trainable_parameters < lora_shape.num_parameters / 10
    lora = MemoryModel(lora_shape, H100).predict(sdpa).components
    assert lora["optimizer"] < full.predict(sdpa).components["optimizer"] / 10
    assert lora["gradients"] < full.predict(sdpa).components["gradients"] / 10


LLAMA = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 256,
         "intermediate_size": 688, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 32000}


def test_liger_holds_a_chunk_and_the_heads_gradient_not_the_logits(tmp_path):
    """Liger's fused linear cross-entropy, by hand: a chunk of logits about the size of
    the tokens' hidden states plus the input's gradient (4 bytes each where the input is
    fp32), and the head's fp32 gradient it makes in the forward, whatever the batch;
    without it, the loss's three fp32 vocabulary-wide tensors per token."""
    spec = load_spec(_spec(tmp_path, model={"config": LLAMA}, data={"seq_len": 512}))
    model = MemoryModel(model_shape(spec), H100)
    s, h, v = 512, 256, 32000
    for b in (1, 8):
        plain = model.physics(TrialConfig.of(b, 1, precision="bf16")).components["logits"]
        liger = model.physics(TrialConfig.of(b, 1, precision="bf16", use_liger_kernel=True))
        assert plain == pytest.approx(b * s * v * 12, rel=1e-6)
        assert liger.components["logits"] == pytest.approx(b * s * h * 8 + 4 * v * h, rel=1e-6)
    # What Liger keeps in a system that holds more (a simulator keeping an eighth of the
    # logits) is one term of its own: calibration learns it from Liger's trials alone.
    for b in (2, 4, 8):
        c = TrialConfig.of(b, 1, precision="bf16", use_liger_kernel=True)
        model.observe(c, int(model.physics(c).total_bytes + b * s * v * 12 / 8 * 1.05))
    other = TrialConfig.of(16, 1, precision="bf16", use_liger_kernel=True, optim="adamw_bnb_8bit")
    plain_other = TrialConfig.of(16, 1, precision="bf16", optim="adamw_bnb_8bit")
    fresh = MemoryModel(model_shape(spec), H100)
    assert model.predict_total(other) > fresh.predict_total(other) + 16 * s * v * 12 / 8 * 0.7
    assert model.predict_total(plain_other) < fresh.predict_total(plain_other) * 1.1


def test_compile_keeps_a_share_of_the_activations(tmp_path):
    from autotune.plan.memory import COMPILED_ACTIVATIONS

    model = MemoryModel(model_shape(load_spec(_spec(tmp_path))), H100)
    eager = model.physics(TrialConfig.of(8, 2, precision="bf16")).components["activations"]
    compiled = model.physics(TrialConfig.of(8, 2, precision="bf16", torch_compile=True))
    assert compiled.components["activations"] == pytest.approx(COMPILED_ACTIVATIONS * eager,
                                                               rel=1e-6)


@pytest.mark.slow
def test_compile_saves_fewer_activations_for_the_backward_on_this_cpu():
    """The share COMPILED_ACTIVATIONS stands for, measured on a real compiled model here
    (Inductor's partitioner, which the GPU shares): benchmarks/compile_activations.py."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import compile_activations

    body, lm = compile_activations.measure(
        "gpt2", {"n_layer": 1, "n_embd": 128, "n_head": 2, "n_positions": 128}, 4, 64)
    assert 0.4 < body < 0.9 and lm < 0.95


# --- real trials ------------------------------------------------------------------------



@pytest.mark.slow
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_attention_kernel_reaches_the_model(tmp_path, attn):
    out = _run(_spec(tmp_path), attn_implementation=attn)
    assert out.status == "ok", out.error
    assert out.ran_with.attn_implementation == attn


@pytest.mark.slow
@pytest.mark.parametrize("optim", ["adafactor", "lion_32bit", "sgd", "paged_adamw_8bit"])
def test_optional_optimizers_train(tmp_path, optim):
    out = _run(_spec(tmp_path), optim=optim)
    assert out.status == "ok", out.error


@pytest.mark.slow
def test_lora_trial_trains_only_the_adapters(tmp_path):
    out = _run(_spec(tmp_path, model={"lora": {"r": 4, "target_modules": ["c_attn"]}}))
    assert out.status == "ok", out.error
    assert out.measured.trainable_parameters == 2 * 4 * (32 + 96)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["full_shard", "shard_grad_op"])
def test_fsdp_on_two_gloo_ranks_is_never_measured_as_something_else(tmp_path, mode):
    """Found when this test first checked what the model was wrapped in: on CPU ranks
    accelerate ignores the FSDP plugin and Trainer trains with DDP, so the trial 'ran' and
    measured DDP under an FSDP label. A search rules FSDP out on CPU (test_space.py); a
    trial forced with it ends `error` naming the fallback, never `ok` with DDP's figures.
    On a GPU the same trial must be wrapped in FSDP."""
    spec = _spec(tmp_path, hardware={"gpus_per_trial": 2})
    out = run_trial(trial_request(spec, TrialConfig.of(2, 4, fsdp=mode), timeout_s=300))
    assert sorted(out.measured.peak_memory_by_rank) == [0, 1]  # both ranks trained
    if torch.cuda.is_available():
        assert out.status == "ok", out.error
        assert "FSDP" in out.ran_with.wrapped_as or "FullySharded" in out.ran_with.wrapped_as
    else:
        assert out.status == "error" and out.ran_with.wrapped_as == "DistributedDataParallel"
        assert f"fsdp={mode} did not take effect" in out.error


@pytest.mark.slow
def test_packing_on_jsonl_counts_real_tokens_with_dataloader_workers(tmp_path):
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n"
                                                 for t in TEXTS))
    make_tokenizer(tmp_path / "tok", TEXTS)
    spec = _spec(tmp_path, data={"seq_len": 16, "source": str(tmp_path / "data.jsonl"),
                                 "tokenizer": str(tmp_path / "tok")})
    spec["model"]["config"] |= {"vocab_size": 64, "n_positions": 32}
    padded = _run(spec, dataloader_num_workers=2)
    packed = _run(spec, padding_free=True, dataloader_num_workers=2)
    objective = objective_of(load_spec(spec))  # the driver's: real tokens/s on real rows
    assert objective == TOKENS_PER_SECOND
    for out in (padded, packed):
        assert out.status == "ok", out.error
        assert out.score_for(objective) == out.tokens_per_second
        # The texts are 5-9 words: most of each 16-token row is padding, not counted.
        assert out.tokens_per_second < 0.7 * out.samples_per_second * 16
    assert packed.measured.micro_batches == [4] * 12  # 4 samples in each packed row
