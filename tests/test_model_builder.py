"""A trial's model at real size: built on its device by the model's own init, a 4-bit base
quantized there a block at a time, nothing written to disk; a checkpoint's weights when
asked; an MoE model's routers kept; a ZeRO-3 rank holding its partitions only."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, set_seed

from autotune.config import TrialConfig
from autotune.knobs import quantization_config
from autotune.trials.launch import run_trial
from autotune.trials.model_builder import build_model, nf4_on_cpu
from tests.conftest import trial_request

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 256, "max_position_embeddings": 128, "tie_word_embeddings": True}
NF4 = {"quantization_config": quantization_config("nf4", "bf16")}


def _build(model: dict, loading: dict | None = None, seed: int = 0):
    set_seed(seed)
    return build_model(model, loading, "cpu")


def test_random_weights_are_the_models_own_init_on_the_device():
    model, how = _build({"config": LLAMA})
    assert how["weights"] == "random" and how["device"] == "cpu"
    reference = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA))
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert {k: (v.shape, v.dtype) for k, v in ours.items()} == {
        k: (v.shape, v.dtype) for k, v in theirs.items()}
    for name, p in ours.items():
        assert p.device.type == "cpu" and torch.isfinite(p).all(), name
    layer = model.model.layers[0]
    assert torch.equal(layer.input_layernorm.weight, torch.ones(64))  # norms: ones
    assert layer.mlp.up_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied as configured
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
    ids = torch.randint(0, 256, (2, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_a_large_host_tensors_draw_is_the_inits_normal_decided_by_the_seed():
    """Tensors past PARALLEL_NORMAL_MIN are drawn in chunks by several generators at once:
    still the init's N(0, 0.02), still the trial's seed's, and no chunk repeats another."""
    from autotune.trials.model_builder import PARALLEL_NORMAL_MIN

    wide = LLAMA | {"vocab_size": PARALLEL_NORMAL_MIN // 64, "num_hidden_layers": 1}
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        first = _build({"config": wide})[0].model.embed_tokens.weight
        again = _build({"config": wide})[0].model.embed_tokens.weight
        other = _build({"config": wide}, seed=1)[0].model.embed_tokens.weight
    finally:
        torch.set_num_threads(threads)
    assert first.numel() >= PARALLEL_NORMAL_MIN
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert first.std().item() == pytest.approx(0.02, rel=0.01)
    assert abs(first.mean().item()) < 1e-4
    halves = first.flatten().chunk(4)
    assert not torch.equal(halves[0], halves[1])  # each chunk its own generator's


def test_a_quantized_base_is_the_plain_build_quantized_with_nothing_written():
    plain, _ = _build({"config": LLAMA})
    quantized, how = _build({"config": LLAMA}, NF4)
    assert how["quantized"] and quantized.is_loaded_in_4bit
    assert quantized.hf_quantizer is not None
    # Nothing of the model written: the old path saved the 4-bit base and read it back.
    # Not 0: what this process prints meanwhile lands in pytest's capture file, and a
    # pytest-xdist worker once counted that page (4096 bytes) as the build's.
    saved = sum(t.numel() * t.element_size() for t in quantized.state_dict().values())
    assert how["disk_write_bytes"] < min(16 * 1024, saved / 4), (how, saved)
    from bitsandbytes.functional import dequantize_4bit

    packed = quantized.model.layers[1].self_attn.o_proj.weight
    restored = dequantize_4bit(packed.data, packed.quant_state)
    original = plain.model.layers[1].self_attn.o_proj.weight
    # the same draw, one NF4 level off at most: the quantized base is the plain one's
    assert torch.corrcoef(torch.stack([restored.flatten(), original.flatten()]))[0, 1] > 0.99
    assert torch.equal(quantized.model.embed_tokens.weight, plain.model.embed_tokens.weight)


def test_what_a_build_writes_is_its_own_not_its_rss_watchers(tmp_path):
    """A trial's RSS watcher rewrites its figure file while the model builds: those
    pages are not the build's (they showed as 4-48 KiB "written" by every trial of a
    search); what the rest of the process writes still counts."""
    import os
    import threading

    from autotune.trials.model_builder import _disk_io

    def write_to_disk(path: Path) -> None:
        path.write_text("x" * 100)
        with path.open() as f:
            os.fsync(f.fileno())

    before = _disk_io()
    write_to_disk(tmp_path / "mine")
    if _disk_io()["write"] == before["write"]:
        pytest.skip(f"writes to {tmp_path} are not counted (a tmpfs?)")

    go, wrote, done = threading.Event(), threading.Event(), threading.Event()

    def watcher() -> None:  # alive throughout, as a trial's
        go.wait()
        write_to_disk(tmp_path / "watcher")
        wrote.set()
        while not done.is_set():  # then beside the build, as fast as it can
            write_to_disk(tmp_path / "watcher")

    beside = threading.Thread(target=watcher)
    beside.start()
    try:
        everything, aside = _disk_io(), _disk_io((beside,))
        go.set()
        assert wrote.wait(timeout=30)
        assert _disk_io()["write"] - everything["write"] >= 4096
        assert _disk_io((beside,))["write"] == aside["write"]
        _, how = build_model({"config": LLAMA}, NF4, "cpu", io_aside=(beside,))
        # The watcher's pages (one each time round) are not the build's; a page of what
        # the process prints to pytest's capture file may be (see the test above).
        assert how["disk_write_bytes"] < 16 * 1024, how
    finally:
        done.set()
        go.set()
        beside.join()


def test_nf4_on_cpu_is_bitsandbytes_quantization():
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Params4bit

    w = torch.empty(96, 80).normal_(0, 0.02)
    for double in (True, False):
        theirs = Params4bit(w.clone(), requires_grad=False, quant_type="nf4",
                           compress_statistics=double).to("cpu")
        ours = nf4_on_cpu(w, {"blocksize": 64, "compress_statistics": double,
                              "quant_type": "nf4", "quant_storage": torch.uint8})
        assert ours.data.shape == theirs.data.shape and ours.bnb_quantized
        assert (ours.data != theirs.data).float().mean() < 1e-3  # bin edges only
        assert torch.equal(ours.quant_state.absmax, theirs.quant_state.absmax)
        apart = (dequantize_4bit(ours.data, ours.quant_state)
                 - dequantize_4bit(theirs.data, theirs.quant_state)).abs()
        assert (apart > 0).float().mean() < 1e-3 and apart.mean() < 1e-5
    odd = torch.randn(7, 3)  # an odd count: the pad code is zero's, as bitsandbytes'
    assert torch.equal(nf4_on_cpu(odd, {"compress_statistics": False}).data, Params4bit(
        odd.clone(), requires_grad=False, quant_type="nf4",
        compress_statistics=False).to("cpu").data)


def test_an_nf4_base_built_on_the_device_trains_its_adapters():
    from autotune.tasks.lora import with_lora
    from autotune.trials.model_builder import prepare_quantized

    model, _ = _build({"config": LLAMA}, NF4)
    model = with_lora(prepare_quantized(model), {"r": 8, "alpha": 16, "dropout": 0.0,
                                                 "target_modules": "all-linear"}, "causal-lm")
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in trainable)
        assert any(p.grad.abs().sum() > 0 for p in trainable)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses


def test_a_checkpoint_is_read_when_asked_and_an_inline_config_has_none(tmp_path):
    from autotune.errors import SpecError
    from autotune.spec import load_spec

    set_seed(1)
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model(**LLAMA))
    saved.save_pretrained(tmp_path)
    model, how = _build({"name_or_path": str(tmp_path), "weights": "checkpoint"})
    assert how["weights"] == "checkpoint"
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight,
                       saved.model.layers[0].mlp.up_proj.weight)
    random, _ = _build({"name_or_path": str(tmp_path)})  # the default: random, same shape
    assert not torch.equal(random.model.layers[0].mlp.up_proj.weight,
                           saved.model.layers[0].mlp.up_proj.weight)
    with pytest.raises(SpecError, match="weights: checkpoint"):
        load_spec({"model": {"config": LLAMA, "weights": "checkpoint"}})


def test_an_moe_model_keeps_its_checkpoints_routers(tmp_path):
    moe = {"model_type": "mixtral", "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 128, "num_local_experts": 4, "num_experts_per_tok": 2}
    set_seed(2)
    saved = AutoModelForCausalLM.from_config(AutoConfig.for_model(**moe))
    saved.save_pretrained(tmp_path)
    model, how = _build({"name_or_path": str(tmp_path)})
    assert how["routing"].startswith("the checkpoint's routers")
    routers = [n for n, _ in saved.named_parameters() if n.endswith("gate.weight")
               and ".experts" not in n]
    assert routers
    ours, theirs = dict(model.named_parameters()), dict(saved.named_parameters())
    for name in routers:
        assert torch.equal(ours[name], theirs[name]), name
    experts = next(n for n in theirs if ".experts" in n)
    assert not torch.equal(ours[experts], theirs[experts])  # the experts stay random
    _, inline = _build({"config": moe})
    assert inline["routing"].startswith("random router")


def _evicted(folder) -> int:
    """Drop `folder`'s files from the page cache (written out first), as a node that has
    not read them yet; their total size."""
    import os

    size = 0
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        size += path.stat().st_size
    return size


@pytest.mark.slow
def test_random_weights_train_the_checkpoints_model(tmp_path, tiny_spec):
    """A trial from random weights stands in for one from the checkpoint: the same model,
    parameter for parameter, on the same micro-batches (a dense model's step time does not
    depend on its values; a timed comparison failed CI on a busy machine, so none is made
    here). The checkpoint is read from storage once: the page cache serves the trials after."""
    shape = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 344,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "vocab_size": 512, "max_position_embeddings": 128}
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**shape)).save_pretrained(tmp_path)
    size = _evicted(tmp_path)
    tiny_spec["measure"] = {"warmup_steps": 1, "steps": 2}
    outs = []
    for weights in ("random", "checkpoint", "checkpoint"):
        tiny_spec["model"] = {"name_or_path": str(tmp_path), "weights": weights}
        out = run_trial(trial_request(tiny_spec, TrialConfig(4, 4)))
        assert out.status == "ok", out.error
        assert out.phases.model_build.weights == weights
        outs.append(out)

    def work(out):
        built, measured = out.phases.model_build, out.measured
        return (built.parameter_bytes, measured.num_parameters, measured.trainable_parameters,
                measured.flop_parameters, measured.micro_batches)

    assert all(work(outs[0])) and work(outs[0]) == work(outs[1]) == work(outs[2])
    reads = [out.phases.model_build.disk_read_bytes for out in outs[1:]]
    assert reads[0] > size / 4 and reads[1] < 2**20, (size, reads)


@pytest.mark.slow
def test_a_zero3_rank_holds_its_partitions_only(tiny_spec):
    tiny_spec["hardware"] = {"gpus_per_trial": 2}
    tiny_spec["model"] = {"config": LLAMA | {"num_hidden_layers": 4, "hidden_size": 128,
                                             "intermediate_size": 352}}
    out = run_trial(trial_request(tiny_spec, TrialConfig.of(2, 4, zero_stage=3)))
    assert out.status == "ok", out.error
    built = out.phases.model_build
    assert built.partitioned and out.ran_with.wrapped_as == "DeepSpeedEngine"
    # each of two ranks holds half of every parameter (DeepSpeed pads a partition a little)
    assert built.held_parameter_bytes < 0.55 * built.parameter_bytes
    phases = out.phases.seconds()
    assert set(phases) == {"launch", "model", "engine", "warmup", "steps"}
    assert phases["steps"] == pytest.approx(out.timed_seconds, rel=0.05)
