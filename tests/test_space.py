"""Search spaces: accumulation is derived, device rules prune before anything runs."""

from __future__ import annotations

from autotune.device import DeviceSpec, named_device
from autotune.space import build_space, load_space
from autotune.spec import load_spec

CPU = DeviceSpec("cpu", "cpu", 16 * 2**30)
SPEC = load_spec({"model": {"config": {"model_type": "gpt2"}}, "target_batch_size": 64,
                  "hardware": {"gpus_per_trial": 2}})


def test_effective_batch_never_changes():
    result = build_space(SPEC, named_device("A100-80GB"))
    assert result.candidates
    for c in result.candidates:
        assert c.per_device_train_batch_size * c.gradient_accumulation_steps * 2 == 64
    assert load_space("default", 64, 2).batch_sizes == [1, 2, 4, 8, 16, 32]


def test_cpu_space_is_fp32_and_bf16_without_fused_adamw():
    result = build_space(SPEC, CPU)
    assert {c.precision for c in result.candidates} == {"fp32", "bf16"}
    assert "adamw_torch_fused" not in {c.optim for c in result.candidates}
    assert "precision=fp16" in result.pruned and "precision=tf32" in result.pruned


def test_v100_has_no_bf16_or_tf32_but_fp16():
    result = build_space(SPEC, named_device("V100-16GB"))
    precisions = {c.precision for c in result.candidates}
    assert precisions == {"fp32", "fp16"}
    assert "8.0" in result.pruned["precision=bf16"]


def test_offload_rules():
    result = build_space(SPEC, named_device("H100-80GB"))
    for c in result.candidates:
        if c.offload != "none":
            assert c.zero_stage >= 1 and c.optim == "adamw_torch"
        if c.offload == "optimizer+param":
            assert c.zero_stage == 3
    assert "offload with optim=adamw_bnb_8bit" in result.pruned
    assert any(c.offload == "optimizer+param" for c in result.candidates)


def test_zero3_on_one_rank_only_with_its_parameter_offload():
    """On one rank ZeRO-3 partitions nothing: alone or with its optimizer offload it holds
    what ZeRO-2 holds and pays its gathers, so only its parameter offload is searched;
    over two ranks all of it is."""
    one = SPEC.model_copy(update={"hardware": SPEC.hardware.model_copy(
        update={"gpus_per_trial": 1})})
    single = build_space(one, named_device("H100-80GB"))
    assert {c.offload for c in single.candidates if c.zero_stage == 3} == {"optimizer+param"}
    assert "ZeRO-3 partitions nothing" in single.pruned[
        "zero_stage=3 without offload=optimizer+param on one rank"]
    assert any(c.zero_stage == 2 and c.offload == "optimizer" for c in single.candidates)
    two = build_space(SPEC, named_device("H100-80GB"))
    assert {c.offload for c in two.candidates if c.zero_stage == 3} == {
        "none", "optimizer", "optimizer+param"}
    # On a CPU the parameters have nowhere to go: one CPU rank searches no ZeRO-3 at all,
    # but keeps the optimizer's offload (DeepSpeed's CPU Adam).
    cpu = build_space(one, CPU)
    assert not any(c.zero_stage == 3 for c in cpu.candidates)
    assert "host memory already" in cpu.pruned["offload=optimizer+param on CPU"]
    assert any(c.offload == "optimizer" for c in cpu.candidates)


def test_fsdp_rules_keep_one_sharding_backend_and_no_8bit_states(tmp_path):
    space = tmp_path / "fsdp.yaml"
    space.write_text("precision: [bf16]\noptim: [adamw_torch, adamw_bnb_8bit]\n"
                     "zero_stage: [0, 2]\nfsdp: [none, full_shard, shard_grad_op]\n")
    spec = load_spec(SPEC.model_dump() | {"search": {"space": str(space)}})
    result = build_space(spec, named_device("H100-80GB"))
    sharded = [c for c in result.candidates if c.fsdp != "none"]
    assert {c.fsdp for c in sharded} == {"full_shard", "shard_grad_op"}
    assert all(c.zero_stage == 0 and c.optim == "adamw_torch" for c in sharded)
    assert any(c.zero_stage == 2 for c in result.candidates)  # ZeRO alone stays
    assert "fsdp with zero_stage>0" in result.pruned
    assert any(key.endswith("with 8-bit optim") for key in result.pruned)


def test_fsdp_is_ruled_out_on_cpu_where_trainer_would_run_ddp(tmp_path):
    space = tmp_path / "fsdp.yaml"
    space.write_text("fsdp: [none, full_shard]\n")
    spec = load_spec(SPEC.model_dump() | {"search": {"space": str(space)}})
    result = build_space(spec, CPU)
    assert {c.fsdp for c in result.candidates} == {"none"}
    assert "DDP" in result.pruned["fsdp=full_shard on CPU"]


def test_a_prime_target_is_noted_with_a_nearby_one_that_splits():
    """31 samples split only as 1 x 31 and 31 x 1: the search says so, and names the
    nearest target with the most micro-batches to try."""
    from autotune.space import few_splits

    note = few_splits(31)
    assert note is not None and "31 samples per rank, a prime" in note
    assert "only micro-batches are 1 and 31" in note
    assert "30 would allow 8 (1, 2, 3, 5, 6, 10, 15, 30)" in note
    assert few_splits(32) is None and few_splits(12) is None
    assert few_splits(3) is None  # too small a target for other splits to matter


def test_the_default_space_searches_the_gpus_own_levers_on_cuda_only():
    """On a GPU the attention kernel, torch.compile and Liger join the search (each pruned
    with its reason where it cannot run: flash-attn not installed, Liger for a model it
    does not cover); on a CPU the default stays as quick as it was."""
    gpu = build_space(SPEC, named_device("H100-80GB"))
    values = gpu.space.values
    assert values["torch_compile"] == [False, True]
    assert {c.attn_implementation for c in gpu.candidates} == {"sdpa"}
    assert "flash-attn" in gpu.pruned["attn_implementation=flash_attention_2"]
    assert "Liger kernels cover model types" in gpu.pruned["use_liger_kernel=True"]
    cpu = build_space(SPEC, CPU)
    assert {c.torch_compile for c in cpu.candidates} == {False}
    assert {c.attn_implementation for c in cpu.candidates} == {"auto"}


def test_a_device_section_names_knobs_only_and_is_checked(tmp_path):
    import pytest

    from autotune.errors import SpecError

    bad = tmp_path / "bad.yaml"
    bad.write_text("precision: [fp32]\ncuda:\n  torch_compyle: [true]\n")
    with pytest.raises(SpecError, match=r"bad.yaml \(cuda:\): key .*torch_compile"):
        load_space(str(bad), 64)
    bad.write_text("precision: [fp32]\ncuda:\n  attn_implementation: [sdpa, fast]\n")
    with pytest.raises(SpecError, match="fast"):
        load_space(str(bad), 64)
