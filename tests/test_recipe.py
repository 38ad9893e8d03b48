"""The guide's recipe: what a careful user writes by hand, per device and model, derived
from the knob table; probed like the baseline; confirmed beside the winner."""

from __future__ import annotations

from pathlib import Path

import pytest

from autotune.config import Family, TrialConfig
from autotune.device import DeviceSpec, named_device
from autotune.records import CONFIRM_REASON, Outcome, Record
from autotune.spec import load_spec
from autotune.tuning import confirm
from autotune.tuning.recipe import available_values, recipe_family, recipe_rungs

LANDSCAPES = Path(__file__).resolve().parents[2] / "shared" / "landscapes"
GPT2 = {"model": {"config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2}},
        "target_batch_size": 16}
LLAMA = {"model": {"config": {"model_type": "llama", "num_hidden_layers": 2,
                              "hidden_size": 64, "intermediate_size": 128,
                              "num_attention_heads": 4, "num_key_value_heads": 2}},
         "target_batch_size": 16}
CPU_BF16 = DeviceSpec("cpu", "cpu", 16 * 2**30, native_bf16=True)
CPU_PLAIN = DeviceSpec("cpu", "cpu", 16 * 2**30)


def recipe(spec: dict, device: DeviceSpec, *, installs: bool = True, **data) -> Family:
    loaded = load_spec(spec | ({"data": data} if data else {}))
    return recipe_family(device, available_values(loaded), installs=installs,
                         real_data=loaded.data.source != "synthetic")


def test_recipe_on_cuda_with_bf16():
    """Ampere or newer: bf16, fused AdamW, compile, SDPA without flash-attn installed (a
    landscape's replay counts its columns as installed: flash-attention 2 then), Liger
    for the model types it covers only, and not beside compile (compiled, its fused loss
    costs more memory than either alone: the user takes one)."""
    h100 = named_device("H100-80GB")
    fam = recipe(LLAMA, h100, installs=False)
    assert (fam.precision, fam.optim, fam.torch_compile) == ("bf16", "adamw_torch_fused", True)
    assert fam.attn_implementation == "flash_attention_2" and not fam.use_liger_kernel
    assert not fam.gradient_checkpointing and fam.zero_stage == 0
    uncompiled = recipe_family(h100, available_values(load_spec(LLAMA)), installs=False,
                               fixed={"torch_compile": False})
    assert uncompiled.use_liger_kernel
    here = recipe(LLAMA, h100)  # this machine has neither flash-attn nor liger-kernel
    assert here.attn_implementation == "sdpa" and not here.use_liger_kernel
    gpt2 = recipe_family(h100, available_values(load_spec(GPT2)), installs=False,
                         fixed={"torch_compile": False})
    assert not gpt2.use_liger_kernel  # Liger does not cover GPT-2


def test_recipe_on_cuda_without_bf16():
    """A V100 or T4: fp16 mixed precision (no bf16, no tf32), no flash-attention 2."""
    for name in ("V100-16GB", "T4-16GB"):
        fam = recipe(LLAMA, named_device(name), installs=False)
        assert fam.precision == "fp16", name
        assert fam.attn_implementation == "sdpa" and fam.optim == "adamw_torch_fused"


def test_recipe_on_cpu_with_and_without_native_bf16():
    """bf16 only where the CPU computes it natively; no fused GPU kernels, no compile
    (Inductor's C++ build costs a minute a process on a few cores), no Liger."""
    fast = recipe(GPT2, CPU_BF16)
    assert (fast.precision, fast.optim, fast.torch_compile) == ("bf16", "adamw_torch", False)
    assert fast.attn_implementation == "sdpa" and not fast.use_liger_kernel
    assert recipe(GPT2, CPU_PLAIN).precision == "fp32"


def test_recipe_loads_real_data_with_workers(tmp_path):
    rows = tmp_path / "data.jsonl"
    rows.write_text('{"text": "a b c"}\n')
    real = recipe(GPT2 | {"data": {"source": str(rows), "tokenizer": "gpt2"}}, CPU_PLAIN)
    assert real.dataloader_num_workers == 4 and real.dataloader_pin_memory
    assert recipe(GPT2, CPU_PLAIN).dataloader_num_workers == 0


def test_memory_fallbacks_follow_the_guide_in_order():
    """Checkpointing, then 8-bit states, then ZeRO (stage 2 and stage 3 alone over several
    ranks: on one they partition nothing), its CPU offload last (with DeepSpeed's CPU
    Adam). Under ZeRO-3 the recipe does not compile (dynamo recompiles at its gathers)."""
    avail = available_values(load_spec(LLAMA))
    one = recipe_rungs(named_device("A100-80GB"), avail, installs=False)
    assert [(f.gradient_checkpointing, f.optim, f.zero_stage, f.offload) for f in one] == [
        (False, "adamw_torch_fused", 0, "none"), (True, "adamw_torch_fused", 0, "none"),
        (True, "adamw_bnb_8bit", 0, "none"),
        (True, "adamw_torch", 3, "optimizer"), (True, "adamw_torch", 3, "optimizer+param")]
    assert [f.torch_compile for f in one] == [True, True, True, False, False]
    eight = recipe_rungs(named_device("A100-80GB", 8), avail, world_size=8, installs=False)
    assert [f.zero_stage for f in eight] == [0, 0, 0, 2, 3, 3, 3]


def _rec(n: int, family: Family, batch: int, reason: str, sps: float,
         per_rank: int = 16) -> Record:
    return Record(TrialConfig(batch, per_rank // batch, family),
                  Outcome("ok", samples_per_second=sps), reason, n)


def test_a_recipe_that_confirms_fastest_is_the_winner_and_said_so():
    """The tuner's best single measurement did not hold up: the recipe confirmed fastest,
    so it is the winner, at exactly 1x the recipe, and the report says so."""
    from autotune.outputs.report import headline
    from autotune.summary import Summary

    base = Family.baseline()
    guide = Family.of(precision="bf16", attn_implementation="sdpa")
    searched = [Record(TrialConfig(16, 1, base), Outcome("ok", samples_per_second=10.0),
                       "baseline", 0),
                _rec(1, guide, 8, "recipe", 20.0),
                _rec(2, Family.of(precision="bf16", optim="adamw_bnb_8bit"), 8, "model", 21.0)]
    picked = confirm.contenders(searched, 16)
    assert [(role, r.number) for role, r in picked] == [("best", 2), ("recipe", 1),
                                                        ("baseline", 0)]
    runs = {2: [19.0, 19.2, 18.9], 1: [20.1, 20.3, 20.0], 0: [10.0, 10.1, 9.9]}
    history = list(searched) + [
        Record(searched[n].config, Outcome("ok", samples_per_second=runs[n][k]),
               CONFIRM_REASON, 10 + 3 * k + i)
        for k in range(3) for i, n in enumerate((2, 1, 0))]
    c = confirm.summarise(history, 3, 8, 16)
    assert c.winner == searched[1].config and c.recipe_won
    assert c.vs_recipe == {"speedup": 1.0, "low": 1.0, "high": 1.0}
    assert c.speedup == pytest.approx(20.1 / 10.0) and c.speedup_low > 1.9
    summary = Summary(model={}, device=None, memory_limit_bytes=2**30, target_batch_size=16,
                      world_size=1, seq_len=8, trials=history, confirmation=c)
    assert summary.best.config == searched[1].config and summary.recipe.number == 1
    fact = next(f for f in headline(summary) if f.label == "Speedup")
    assert fact.value.startswith("2.01× (") and "Trainer defaults · 1.00× the guide" in (
        fact.value)
    assert "the recipe confirmed fastest: the tuner found nothing faster" in fact.detail
    assert summary.to_dict()["confirmation"]["vs_recipe"]["speedup"] == 1.0


def test_a_tuned_winner_states_both_ratios_with_intervals():
    base, guide = Family.baseline(), Family.of(precision="bf16")
    tuned = Family.of(precision="bf16", optim="adamw_bnb_8bit")
    searched = [Record(TrialConfig(16, 1, base), Outcome("ok", samples_per_second=10.0),
                       "baseline", 0), _rec(1, guide, 8, "recipe", 20.0),
                _rec(2, tuned, 16, "model", 24.0)]
    runs = {2: [24.0, 24.2, 23.9], 1: [20.1, 20.3, 20.0], 0: [10.0, 10.1, 9.9]}
    history = list(searched) + [
        Record(searched[n].config, Outcome("ok", samples_per_second=runs[n][k]),
               CONFIRM_REASON, 10 + 3 * k + i)
        for k in range(3) for i, n in enumerate((2, 1, 0))]
    c = confirm.summarise(history, 3, 8, 16)
    assert c.winner == tuned.config(16, 16)
    vs = c.vs_recipe
    assert vs["speedup"] == pytest.approx(24.0 / 20.1) and vs["low"] <= vs["speedup"] <= vs[
        "high"] and vs["low"] > 1.1


@pytest.mark.skipif(not LANDSCAPES.is_dir(), reason="needs ../shared/landscapes")
def _replayed(name: str, trials: int):
    from autotune.bench.bench import choices, context
    from autotune.bench.landscape import load_landscape
    from autotune.bench.replay import ReplayExecutor
    from autotune.tuning.loop import Limits, drive
    from autotune.tuning.strategies.registry import make_strategy
    from autotune.tuning.study import StudyLog

    land = load_landscape(LANDSCAPES / name)
    ctx = context(land, 0)
    log = StudyLog.in_memory(choices(ctx.candidates), ctx.memory_limit_bytes, None)
    return land, ctx, drive(make_strategy("autotune", ctx, log, guarded=False),
                            ReplayExecutor(land), log, Limits(max_trials=trials))


def test_trainer_defaults_whose_states_cannot_fit_cost_no_trial():
    """llama-7b on 8 A100s: fp32 AdamW states alone (16 bytes a parameter, arithmetic)
    exceed a device. The baseline's probe records its smallest batch as pruned, saying so,
    instead of an OOM trial to prove it (issue 51: every such trial was a certain OOM);
    the recipe then runs on its first rung that fits."""
    from autotune.summary import Summary

    land, ctx, history = _replayed("sim-llama-7b-8xa100-80gb", 4)
    base = [r for r in history if r.reason == "baseline"]
    assert [(r.config.per_device_train_batch_size, r.outcome.status) for r in base] == [
        (1, "pruned")]
    assert "weights, gradients and optimizer states alone need" in base[0].outcome.error
    recipe_runs = [r for r in history if r.reason == "recipe"]
    assert recipe_runs and recipe_runs[-1].outcome.ok
    assert recipe_runs[0].config.zero_stage > 0  # the first rung that fits 7B on a device
    summary = Summary(model={}, device=None, memory_limit_bytes=ctx.memory_limit_bytes,
                      target_batch_size=land.target_batch_size, world_size=land.world_size,
                      trials=history)
    assert summary.defaults_do_not_fit and summary.baseline is None
    from autotune.outputs.report import headline

    fact = next(f for f in headline(summary) if f.label == "Speedup")
    assert "Trainer's defaults do not fit this device (its weights, gradients" in fact.detail
    assert "the guide's recipe" in fact.value


def test_trainer_defaults_predicted_not_to_fit_cost_one_trial():
    """opt-1.3b on an A10G: the defaults' states fit (21 GB of 24), their activations are
    predicted not to. A prediction is no proof: the smallest batch runs once, rather than
    a walk down the chain OOM by OOM."""
    _, _, history = _replayed("sim-opt-1.3b-a10g-24gb", 3)
    base = [r for r in history if r.reason == "baseline"]
    assert [(r.config.per_device_train_batch_size, r.outcome.status) for r in base] == [
        (1, "oom")]
