"""The long-context levers (issue 54): where each is ruled out and why, the data-parallel
ranks a sequence split leaves, real trials whose first step matches their twin's without
the lever (sequence parallelism on 2 CPU ranks, the tiled MLP and loss, each
checkpointing variant), a run whose tiled loss was scaled wrong refused, and the exports
of a sequence-parallel winner trained with `accelerate launch` on 2 CPU ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune import knobs
from autotune.config import Family, TrialConfig
from autotune.device import DeviceSpec, named_device
from autotune.spec import load_spec
from tests.conftest import accelerate_launch, trial_request

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 512, "max_position_embeddings": 256}
CPU = DeviceSpec("cpu", "cpu", 8 * 2**30)
SCRIPT = Path(__file__).with_name("train_long_context_from_exports.py")
DATA = Path(__file__).resolve().parents[1] / "examples" / "data"


def _spec(tmp_path, world: int = 1, target: int = 4, **more) -> dict:
    return {"model": {"config": LLAMA} | more.pop("model", {}), "data": {"seq_len": 128},
            "target_batch_size": target, "measure": {"warmup_steps": 0, "steps": 1},
            "search": {"trial_timeout": "3m"}, "hardware": {"gpus_per_trial": world},
            "output": str(tmp_path / "out")} | more


def _close(a: float, b: float, rel: float = 1e-5) -> bool:
    return abs(a - b) <= rel * abs(b)


# --- rules and where a lever applies ---------------------------------------------------

def test_sequence_parallel_below_zero_3_is_ruled_out_with_the_measured_gradient():
    cfg = Family.of(sequence_parallel=2, zero_stage=1).config(1, 2, 2)
    label, reason = knobs.device_rule(cfg, CPU)
    assert label == "sequence_parallel=2 with zero_stage=1"
    assert "3.148 vs 1.574" in reason and "0.0482 vs 0.0241" in reason
    assert knobs.device_rule(Family.of(sequence_parallel=2, zero_stage=3).config(1, 2, 2),
                             CPU) is None
    eager = Family.of(sequence_parallel=2, zero_stage=3, attn_implementation="eager")
    assert "eager" in knobs.device_rule(eager.config(1, 2, 2), CPU)[1]


def test_a_sequence_split_applies_where_it_divides_the_ranks_heads_and_length(tmp_path):
    sp = knobs.knob("sequence_parallel")
    assert sp.applies(load_spec(_spec(tmp_path, world=2)), 2) is None
    assert "gpus_per_trial 1" in sp.applies(load_spec(_spec(tmp_path)), 2)
    heads = sp.applies(load_spec(_spec(tmp_path, world=8, target=8)), 8)
    assert "attention heads (4) and key-value heads (2)" in heads
    sft = _spec(tmp_path, world=2, trainer="sft")
    sft["data"] |= {"source": str(DATA / "chat.jsonl"),
                    "tokenizer": str(DATA / "chat-tokenizer")}
    assert "trainer: trainer" in knobs.knob("tiled_loss").applies(load_spec(sft), True)
    gpt2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
            "vocab_size": 512, "n_positions": 256}
    spec = load_spec(_spec(tmp_path, model={"config": gpt2}))
    assert "has none" in knobs.knob("tiled_mlp").applies(spec, True)
    assert "tied" in knobs.knob("tiled_loss").applies(spec, True)  # GPT-2 ties its head
    assert knobs.knob("tiled_mlp").applies(load_spec(_spec(tmp_path)), True) is None
    cp = knobs.knob("context_parallel")
    assert cp.applies(load_spec(_spec(tmp_path, world=2)), 2) is None
    gpu = named_device("H100-80GB")
    assert "fsdp" in knobs.device_rule(Family.of(context_parallel=2).config(1, 2, 2), gpu)[1]
    assert knobs.device_rule(Family.of(context_parallel=2, fsdp="full_shard").config(
        1, 2, 2), gpu) is None
    on_cpu = Family.of(context_parallel=2, fsdp="full_shard").config(1, 2, 2)
    assert "CUDA GPUs" in cp.rules[0].check(on_cpu, CPU)[1]
    assert "on a CPU" in knobs.device_rule(Family.of(activation_offloading=True).config(
        1, 4), CPU)[1]


def test_checkpointing_variants_need_checkpointing_and_tiling_ddp_needs_zero():
    variant = Family.of(checkpointing_variant="every-2").config(1, 4)
    assert "how gradient_checkpointing=True recomputes" in knobs.device_rule(variant, CPU)[1]
    assert knobs.device_rule(Family.of(checkpointing_variant="every-2",
                                       gradient_checkpointing=True).config(1, 4), CPU) is None
    # TiledMLP under DDP: refused on several ranks, fine on one and under ZeRO.
    tiled = Family.of(tiled_mlp=True).config(1, 2, 2)
    assert "DDP refuses" in knobs.device_rule(tiled, CPU, world_size=2)[1]
    assert knobs.device_rule(tiled, CPU, world_size=1) is None
    assert knobs.device_rule(Family.of(tiled_mlp=True, zero_stage=2).config(1, 2, 2), CPU,
                             world_size=2) is None


def test_a_sequence_split_shares_a_batch_so_accumulation_counts_data_parallel_ranks():
    assert Family.of(zero_stage=3).config(1, 8, 2).gradient_accumulation_steps == 4
    sp = Family.of(zero_stage=3, sequence_parallel=2).config(1, 8, 2)
    assert sp.gradient_accumulation_steps == 8 and sp.data_parallel(2) == 1
    assert Family.of(sequence_parallel=2).config(1, 8, 4).gradient_accumulation_steps == 4


def test_the_space_keeps_sequence_parallel_under_zero_3_only(tmp_path):
    from autotune.space import build_space

    space = tmp_path / "space.yaml"
    space.write_text("per_device_train_batch_size: [1]\nsequence_parallel: [1, 2]\n"
                     "zero_stage: [1, 3]\n")
    spec = load_spec(_spec(tmp_path, world=2, search={"space": str(space)}))
    result = build_space(spec, CPU)
    kept = {(c.sequence_parallel, c.zero_stage, c.gradient_accumulation_steps)
            for c in result.candidates}
    assert kept == {(1, 1, 2), (1, 3, 2), (2, 3, 4)}
    assert "3.148" in result.pruned["sequence_parallel=2 with zero_stage=1"]


# --- the exports -----------------------------------------------------------------------------

def _export(tmp_path: Path) -> Path:
    from autotune.outputs.export import export_config, spec_exports

    spec = load_spec(_spec(tmp_path, world=2, target=2))
    cfg = Family.of(zero_stage=3, sequence_parallel=2).config(1, 2, 2)
    export_config(cfg, tmp_path / "x", on_cpu=True, **spec_exports(spec, cfg))
    return tmp_path / "x"


def test_the_accelerate_config_carries_the_parallelism_config(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    x = _export(tmp_path)
    loaded = load_config_from_file(str(x / "accelerate_config.yaml"))
    assert loaded.distributed_type == "DEEPSPEED" and loaded.num_processes == 2
    assert loaded.parallelism_config == {
        "parallelism_config_sp_size": 2, "parallelism_config_sp_backend": "deepspeed",
        "parallelism_config_sp_seq_length": 128,
        "parallelism_config_sp_seq_length_is_variable": False,
        "parallelism_config_sp_attn_implementation": "sdpa"}
    args = json.loads((x / "training_args.json").read_text())
    assert "parallelism_config" not in args  # no JSON holds one: the launcher's block does
    assert (args["per_device_train_batch_size"], args["gradient_accumulation_steps"]) == (1, 2)


@pytest.mark.slow
def test_accelerate_launch_trains_two_steps_with_sequence_parallelism(tmp_path):
    """The exports and the script's two additions (tests/train_long_context_from_exports.py)
    train under `accelerate launch` on 2 CPU ranks, which ran with sp_size 2."""
    x = _export(tmp_path)
    proc = accelerate_launch(["--config_file", str(x / "accelerate_config.yaml"),
                              "--main_process_port", "29573", str(SCRIPT), str(x),
                              str(tmp_path / "run")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["global_step"], out["world"], out["sp"]) == (2, 2, 2)


# --- real trials: each lever against its twin ------------------------------------------------

def _in_process(tmp_path, name: str, **values):
    """A one-rank trial in this process (no launcher: a second each), at b2 x gas 2 so the
    accumulation's scale is in play."""
    from autotune.trials.worker import run

    spec = _spec(tmp_path)
    out = run(trial_request(spec, Family.of(values).config(2, 4)), str(tmp_path / name))
    assert out.status == "ok", out.error
    return out


def _first_step(out) -> tuple[float, float]:
    return out.measured.losses[0], out.measured.grad_norms[0]


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> tuple[float, float]:
    """The first step (loss, grad norm) of the one-rank trial without any lever."""
    return _first_step(_in_process(tmp_path_factory.mktemp("twin"), "twin"))


def test_tiled_mlp_and_loss_match_their_twins_first_step(tmp_path, twin):
    mlp = _in_process(tmp_path, "mlp", tiled_mlp=True)
    loss = _in_process(tmp_path, "loss", tiled_loss=True)
    assert mlp.ran_with.tiled_mlps == 2 and loss.ran_with.tiled_loss_calls == 2
    for out in (mlp, loss):
        got = _first_step(out)
        assert _close(got[0], twin[0]) and _close(got[1], twin[1]), (got, twin)


def test_a_tiled_loss_normalised_outside_is_refused(tmp_path, monkeypatch, twin):
    """TiledFusedLogitsLoss makes the head's gradient inside its forward: a loss summed
    inside and normalised by its token count outside it (what the scale inside undoes)
    gives the head a gradient that many times too large. The backward reads the scale
    really applied, and the run is refused, not measured."""
    from autotune.trials import long_context

    monkeypatch.setattr(long_context, "outer_scale", lambda trainer, items: float(items))
    from autotune.trials.worker import run

    out = run(trial_request(_spec(tmp_path), Family.of(tiled_loss=True).config(2, 4)),
              str(tmp_path / "wrong"))
    assert out.status == "error"
    items = 2 * 2 * 127  # the step's predicted tokens: 2 micro-batches of 2 rows
    assert f"scaled the loss by {1 / items:.6g} x what the tiled loss assumed" in out.error
    loss, norm = _first_step(out)  # measured before it was refused: the loss is right...
    assert _close(loss, twin[0]) and norm > 10 * twin[1]  # ...its gradient far from it


@pytest.mark.parametrize(("variant", "ran"), [
    ("non-reentrant", "non-reentrant 2/2"), ("reentrant", "reentrant 2/2"),
    ("every-2", "non-reentrant 1/2"), ("selective", "selective 2/2")])
def test_each_checkpointing_variant_runs_as_asked_and_matches(tmp_path, variant, ran, twin):
    out = _in_process(tmp_path, variant, gradient_checkpointing=True,
                      checkpointing_variant=variant)
    assert out.ran_with.checkpointing == ran
    got = _first_step(out)
    assert _close(got[0], twin[0]) and _close(got[1], twin[1]), (got, twin)


@pytest.mark.slow
def test_sequence_parallel_trial_on_two_ranks_matches_its_twin(tmp_path):
    """SP=2 under ZeRO-3 on 2 CPU ranks (one data-parallel rank, so twice the
    accumulation) against the SP=1 twin at the same per-device batch: the same samples in
    the first step, the same loss and gradient norm; with the tiled MLP and loss on top,
    the same again."""
    from autotune.trials.launch import run_trial

    spec = _spec(tmp_path, world=2, target=2)
    runs = {}
    for name, values in (("twin", {}), ("sp", {"sequence_parallel": 2}),
                         ("sp+tiled", {"sequence_parallel": 2, "tiled_mlp": True,
                                       "tiled_loss": True})):
        cfg = Family.of(values, zero_stage=3).config(1, 2, 2)
        runs[name] = out = run_trial(trial_request(spec, cfg, timeout_s=180))
        assert out.status == "ok", out.error
    assert runs["twin"].ran_with.sequence_parallel is None
    assert runs["sp"].ran_with.sequence_parallel == 2
    assert runs["sp"].measured.micro_batches == [1, 1]  # gas 2 of one shard's sample
    tiled = runs["sp+tiled"].ran_with
    assert (tiled.sequence_parallel, tiled.tiled_mlps, tiled.tiled_loss_calls) == (2, 2, 2)
    twin = _first_step(runs["twin"])
    for name in ("sp", "sp+tiled"):
        got = _first_step(runs[name])
        assert _close(got[0], twin[0]) and _close(got[1], twin[1]), (name, got, twin)
    # Throughput counts the data-parallel ranks' samples: 2 per step, not 2 per rank.
    sp = runs["sp"]
    assert sp.samples_per_second * sp.timed_seconds == pytest.approx(2)


def test_trial_config_round_trips_its_long_context_knobs():
    cfg = TrialConfig.of(1, 2, sequence_parallel=2, zero_stage=3, tiled_loss=True,
                         checkpointing_variant="selective", gradient_checkpointing=True)
    assert TrialConfig.from_label(cfg.label()) == cfg
    assert cfg.label() == "b1x2 fp32 adamw_torch ckpt z3 ckpt:selective sp2 tloss"


# --- the driver: parity with the twin, the twin first, the memory terms, the longest length

def _ran(config, loss: float, norm: float, number: int):
    from autotune.records import OK, Measurement, Outcome, Record

    return Record(config, Outcome(OK, samples_per_second=1.0, measured=Measurement(
        losses=[loss, loss * 0.9], grad_norms=[norm, norm])), "model", number)


def test_a_lever_whose_gradient_departs_from_its_twin_is_wrong_with_both_figures():
    from autotune.records import NAN
    from autotune.tuning import numerics

    twin = _ran(Family.of(zero_stage=3).config(1, 2, 2), 6.2375, 1.574, 0)
    right = _ran(Family.of(zero_stage=3, sequence_parallel=2).config(1, 2, 2),
                 6.2375001, 1.5740003, 1)
    numerics.parity(right, [twin])
    assert right.outcome.ok and right.outcome.measured.parity_twin == 0
    assert right.outcome.measured.parity_gap < 1e-6
    # Ulysses' gradient at ZeRO-1 (were its rule lifted): the loss right, the norm 2x.
    wrong = _ran(Family.of(zero_stage=3, sequence_parallel=2, tiled_loss=True).config(
        1, 2, 2), 6.2375, 3.148, 2)
    numerics.parity(wrong, [twin, right])
    assert wrong.outcome.status == NAN
    assert wrong.outcome.error == (
        "sequence_parallel=2, tiled_loss=True changes the maths: its first step's gradient "
        "norm departs from the twin's without it (trial #0) by 100.0%, past 2%: loss 6.2375 "
        "vs 6.2375; gradient norm 3.148 vs 1.574")
    # bf16 rounds: 10% allowed, a factor never.
    bf16 = Family.of(zero_stage=3, precision="bf16")
    numerics.parity(r := _ran(bf16.replace(tiled_mlp=True).config(1, 2, 2), 6.3, 1.6, 4),
                    [_ran(bf16.config(2, 2, 1), 6.2375, 1.574, 3)])
    assert r.outcome.ok and 0.01 < r.outcome.measured.parity_gap < 0.1
    # No twin ran (it ran out of memory): unchecked, and the record says so by its None.
    alone = _ran(Family.of(tiled_mlp=True).config(1, 4), 6.0, 1.0, 5)
    numerics.parity(alone, [])
    assert alone.outcome.ok and alone.outcome.measured.parity_twin is None


def test_the_twin_runs_before_the_first_config_of_a_lever_family():
    from autotune.records import OOM, Outcome, Record
    from autotune.tuning.strategies.base import TWIN, Proposal, SearchContext, Strategy, Twins

    sp = Family.of(zero_stage=3, sequence_parallel=2)
    plain = Family.of(zero_stage=3)
    candidates = [plain.config(1, 2, 2), sp.config(1, 2, 2)]

    class Wants(Strategy):  # a strategy that asks for the sequence split, then nothing
        def ask(self, history, pending=()):
            done = {r.config for r in history} | set(pending)
            return next((Proposal(c, "model") for c in [candidates[1]] if c not in done),
                        None)

    twins = Twins(Wants(SearchContext(candidates, CPU, 2, 2, 2**30)))
    first = twins.ask([])
    assert (first.config, first.reason) == (candidates[0], TWIN)
    assert twins.ask([], [candidates[0]]) is None  # the lever waits for its twin
    # The twin ran (or ran out of memory: the lever is then unchecked): the lever's turn.
    oom = Record(candidates[0], Outcome(OOM), TWIN, 0)
    assert twins.ask([oom]).config == candidates[1]


def test_the_memory_model_splits_and_tiles_the_long_context_terms():
    from transformers import LlamaConfig

    from autotune.plan.calibration import MemoryModel
    from autotune.plan.shape import shape_from_hf_config

    cfg = LlamaConfig(**(LLAMA | {"max_position_embeddings": 65536, "vocab_size": 32000}))
    shape = shape_from_hf_config(cfg, 16384, "causal-lm")
    model = MemoryModel(shape, named_device("H100-80GB"), 2)

    def comps(**v):
        return model.physics(Family.of(v, zero_stage=3).config(1, 2, 2)).components

    base, sp = comps(), comps(sequence_parallel=2)
    assert sp["activations"] == pytest.approx(base["activations"] / 2, rel=1e-6)
    assert sp["logits"] == pytest.approx(base["logits"] / 2, rel=1e-6)
    # The tiled loss holds one shard of the logits at a time (at most LOGITS_SHARD_BYTES
    # of fp32, three copies), whatever the length: twice the tokens, the same shard.
    tiled = comps(tiled_loss=True)["logits"]
    assert tiled < base["logits"] / 1.9

    def tiled_at(n: int) -> int:
        at = MemoryModel(shape_from_hf_config(cfg, n, "causal-lm"), named_device("H100-80GB"), 2)
        return at.physics(Family.of(zero_stage=3, tiled_loss=True).config(1, 2, 2)
                          ).components["logits"]

    hidden = 32768 * 64 * 4  # the hidden states' fp32 gradient grows with the tokens
    assert tiled_at(65536) == pytest.approx(tiled_at(32768) + hidden, rel=1e-3)
    # Llama's MLP is gated (SwiGLU): its input and four ffn-wide tensors, 2 + 8 ffn/h of
    # Korthikanti's s h units (this MLP is half the usual width: 18 of 33 a layer), not
    # GPT-2's 3 + 4 ffn/h (11 of 26). Tiled, an MLP keeps its input only.
    assert shape.gated_mlp
    assert comps(tiled_mlp=True)["activations"] == pytest.approx(
        base["activations"] * 17 / 33, rel=0.02)
    # Offloaded, about one layer's activations stay on the device; the rest is host's.
    off = model.physics(Family.of(zero_stage=3, activation_offloading=True).config(1, 2, 2))
    assert off.components["activations"] == pytest.approx(base["activations"] / 2, rel=1e-6)
    assert off.host_bytes >= base["activations"] / 2
    ckpt = comps(gradient_checkpointing=True)["activations"]
    assert comps(gradient_checkpointing=True, checkpointing_variant="every-2")[
        "activations"] > ckpt
    assert comps(gradient_checkpointing=True, checkpointing_variant="selective")[
        "activations"] > ckpt


def test_the_longest_length_per_family_by_bisection(tmp_path):
    from autotune.plan.estimate import estimate, resolve_longest
    from autotune.plan.longest import STEP

    spec = _spec(tmp_path, world=2, target=2, data={"seq_len": "longest"},
                 model={"config": LLAMA | {"max_position_embeddings": 65536}},
                 hardware={"gpus_per_trial": 2, "memory_budget": "256MiB"})
    space = tmp_path / "space.yaml"
    space.write_text("per_device_train_batch_size: [1]\nzero_stage: [3]\n"
                     "sequence_parallel: [1, 2]\ntiled_loss: [false, true]\n")
    spec["search"] = {"space": str(space)}
    result = estimate(spec)
    found = {r.config.label(): r for r in result.longest}
    assert set(found) == {"b1x1 fp32 adamw_torch z3", "b1x2 fp32 adamw_torch z3 sp2",
                          "b1x1 fp32 adamw_torch z3 tloss",
                          "b1x2 fp32 adamw_torch z3 sp2 tloss"}
    for r in result.longest:  # a multiple of STEP that fits, STEP more that does not
        assert r.seq_len % STEP == 0 and r.peak_bytes <= result.limit_bytes
    lengths = {k: r.seq_len for k, r in found.items()}
    assert lengths["b1x2 fp32 adamw_torch z3 sp2"] > lengths["b1x1 fp32 adamw_torch z3"]
    assert result.shape.seq_len == max(lengths.values())  # the rows are at the longest
    resolved, said = resolve_longest(load_spec(spec), CPU, result.limit_bytes)
    assert resolved.data.seq_len == result.shape.seq_len
    assert f"data.seq_len: longest: {resolved.data.seq_len} tokens" in said
    with pytest.raises(Exception, match="data.seq_len: longest is found by"):
        from autotune.plan.shape import model_shape
        model_shape(load_spec(spec))


def test_the_default_space_holds_the_long_context_levers_from_8192_tokens(tmp_path):
    from autotune.space import load_space

    space = load_space("default", 8)
    short = load_spec(_spec(tmp_path, world=2, target=8))
    long = load_spec(_spec(tmp_path, world=2, target=8, data={"seq_len": 8192},
                           model={"config": LLAMA | {"max_position_embeddings": 8192}}))
    assert space.applied(CPU, short).values["sequence_parallel"] == [1]
    applied = space.applied(CPU, long).values
    assert applied["sequence_parallel"] == [1, 2, 4, 8]
    assert applied["tiled_loss"] == [False, True]
    assert applied["checkpointing_variant"] == ["non-reentrant", "every-2", "selective"]


def test_an_optuna_sampler_derives_the_accumulation_over_data_parallel_ranks():
    """TPE's config under a sequence split: the 2 ranks share a batch, so b1 needs an
    accumulation of 2 to train the target of 2 (not 1, as if each rank took its own)."""
    from autotune.tuning.strategies.base import SearchContext
    from autotune.tuning.strategies.samplers import SamplerStrategy, make_sampler
    from autotune.tuning.study import StudyLog

    configs = [Family.of(zero_stage=3, sequence_parallel=2).config(1, 2, 2)]
    choices = {"per_device_train_batch_size": [1], "zero_stage": [3],
               "sequence_parallel": [2]}
    log = StudyLog.in_memory(choices, 2**30, make_sampler("random", 0))
    ctx = SearchContext(configs, CPU, 2, 2, 2**30, None, 0)
    proposal = SamplerStrategy(ctx, log, "random", guarded=False).ask([], [])
    assert proposal.config == configs[0] and proposal.config.gradient_accumulation_steps == 2


def test_init_at_32k_writes_a_spec_whose_space_holds_the_levers(tmp_path):
    from autotune.plan.init import plan, render

    p = plan("llama-8b", seq_len=32768)  # its head is its own: the tiled loss applies
    assert p.spec["data"]["seq_len"] == 32768
    for lever in ("tiled_mlp", "tiled_loss", "checkpointing_variant"):
        assert lever in p.allowed, lever
    # One rank a trial: the sequence split is left out, saying why.
    assert "hardware.gpus_per_trial 1" in p.left_out["sequence_parallel=2"]
    assert "tiled_loss: False, True" in render(p)


def test_checkpointings_recomputed_layer_never_sits_beside_the_logits_on_a_cpu():
    """The loss's backward (the logits and their gradients) ends before the first layer is
    recomputed: on a CPU the checkpointed peak is the layer inputs and the larger of the
    two (the bisection's checkpointed family peaked 11-14% under their sum); on a GPU the
    formula keeps the sum where no trace says when each tensor lives."""
    from transformers import LlamaConfig

    from autotune.plan.calibration import MemoryModel
    from autotune.plan.shape import shape_from_hf_config

    cfg = LlamaConfig(**(LLAMA | {"max_position_embeddings": 4096, "vocab_size": 32000}))
    shape = shape_from_hf_config(cfg, 4096, "causal-lm")
    ckpt = Family.of(gradient_checkpointing=True).config(1, 1, 1)
    on_cpu, on_gpu = MemoryModel(shape, CPU, 1), MemoryModel(shape, named_device("H100-80GB"), 1)
    on_gpu.traced = False
    cpu, gpu = on_cpu.physics(ckpt).components, on_gpu.physics(ckpt).components
    inputs = 2 * 4096 * 64 * 4  # each layer's fp32 input, kept
    layer = on_cpu.recomputed_bytes_per_sample(ckpt)
    assert 0 < layer < cpu["logits"]  # a 32k vocabulary's logits outweigh a layer
    assert cpu["activations"] == pytest.approx(inputs, rel=1e-6)
    assert gpu["activations"] == pytest.approx(inputs + layer, rel=1e-6)
    assert on_gpu.recomputed_bytes_per_sample(ckpt) == 0
