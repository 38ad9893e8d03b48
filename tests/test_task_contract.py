"""One contract, run over every registered task and trainer (as Optuna runs one test case
over every sampler): each builds, traces, trains one step on CPU and exports files that
load in the class its report names. A task added to autotune/tasks/ is held to it with no
test of its own written first."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autotune.config import TrialConfig
from autotune.device import named_device
from autotune.plan.memory import Physics
from autotune.plan.shape import model_shape
from autotune.records import SAMPLES_PER_SECOND, TOKENS_PER_SECOND
from autotune.spec import load_spec
from autotune.tasks import TASKS, TRAINERS, objective_of

DATA = Path(__file__).resolve().parents[1] / "examples" / "data"
TOKENIZER = str(DATA / "chat-tokenizer")
# The smallest model of each task's usual architecture, and the rows each trainer reads.
MODELS = {
    "causal-lm": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
                  "vocab_size": 128, "n_positions": 64},
    "masked-lm": {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 32,
                  "num_attention_heads": 2, "intermediate_size": 64, "vocab_size": 128},
    "sequence-classification": {"model_type": "bert", "num_hidden_layers": 2,
                                "hidden_size": 32, "num_attention_heads": 2,
                                "intermediate_size": 64, "vocab_size": 128},
    "seq2seq-lm": {"model_type": "t5", "d_model": 32, "d_ff": 64, "d_kv": 8, "num_layers": 2,
                   "num_heads": 4, "vocab_size": 128},
    "image-classification": {"model_type": "vit", "hidden_size": 32, "num_hidden_layers": 2,
                             "num_attention_heads": 2, "intermediate_size": 64,
                             "image_size": 16, "patch_size": 8},
}
ROWS = {"sft": "chat.jsonl", "dpo": "preference.jsonl", "grpo": "prompts.jsonl"}
# What a trainer's own section holds, at the smallest that shows it.
SECTIONS = {"grpo": {"grpo": {"num_generations": 2, "max_completion_length": 8}}}


def _spec(task: str, trainer: str, tmp_path: Path) -> dict:
    data: dict = {"seq_len": 32}
    if trainer in ROWS:
        data |= {"source": str(DATA / ROWS[trainer]), "tokenizer": TOKENIZER}
    if TASKS[task].reads_images:
        data = {}
    if TASKS[task].has_target:
        data["target_len"] = 8
    return {"model": {"config": MODELS[task], "task": task}, "data": data,
            "trainer": trainer, "target_batch_size": 2,
            "measure": {"warmup_steps": 0, "steps": 1},
            "output": str(tmp_path / "out")} | SECTIONS.get(trainer, {})


def _pairs() -> list[tuple[str, str]]:
    """Every task under Trainer, and every other trainer on each task it takes."""
    out = []
    for trainer in TRAINERS:
        for task in TASKS:
            try:
                load_spec(_spec(task, trainer, Path("/nonexistent")))
            except Exception:  # noqa: BLE001 - the trainer refuses the task: not a pair
                continue
            out.append((task, trainer))
    return out


def test_every_task_and_trainer_is_covered():
    """Each task has a model here, and each trainer takes at least one task."""
    pairs = _pairs()
    assert set(MODELS) == set(TASKS)
    assert {t for _, t in pairs} == set(TRAINERS)
    assert {task for task, trainer in pairs if trainer == "trainer"} == set(TASKS)


def test_the_driver_picks_the_objective_from_the_spec(tmp_path):
    """What a search maximises is the driver's choice, made from the spec before any
    trial runs: real (non-pad) tokens/s on real rows of text, where padding and packing
    make tokens differ from samples; samples/s on synthetic rows, for images (as many
    patches in each, real images too) and for a generating trainer's completions (each
    forced to full length)."""
    samples, tokens = SAMPLES_PER_SECOND, TOKENS_PER_SECOND
    want = {("causal-lm", "trainer"): samples, ("seq2seq-lm", "trainer"): samples,
            ("image-classification", "trainer"): samples, ("causal-lm", "sft"): tokens,
            ("causal-lm", "dpo"): tokens, ("causal-lm", "grpo"): samples}
    assert {pair: objective_of(load_spec(_spec(*pair, tmp_path))) for pair in want} == want
    real = load_spec(_spec("causal-lm", "sft", tmp_path))
    assert TASKS["image-classification"].objective(real) == SAMPLES_PER_SECOND


@pytest.mark.parametrize(("task", "trainer"), _pairs())
def test_each_task_and_trainer_builds_traces_trains_and_exports(task, trainer, tmp_path):
    import transformers

    from autotune.outputs.export import export_config, spec_exports, trainer_file
    from autotune.tasks import task_of, trainer_of
    from autotune.trials.worker import run
    from tests.conftest import trial_request

    spec = load_spec(_spec(task, trainer, tmp_path))
    kind, trained_by = task_of(spec), trainer_of(spec)
    # 1) Its shape, counted on the meta device, as the built model has it.
    shape = model_shape(spec)
    assert shape.kind is kind and shape.num_parameters > 0
    assert shape.preference_pairs is trained_by.preference_pairs
    # 2) A fake training step traced for a GPU plan, where its trainer can be traced.
    config = TrialConfig.of(1, 2, precision="bf16")
    physics = Physics(shape, named_device("A100-80GB"))
    assert (physics.trace(config) is not None) is trained_by.traced
    assert physics.physics(config).total_bytes > 0
    # 3) One real step on this CPU, in this process: ok, its micro-batches counted.
    out = run(trial_request(spec, TrialConfig.of(1, 2)), str(tmp_path / "result.json"))
    assert out.status == "ok", out.error
    assert out.measured.micro_batches == [1, 1]
    assert out.samples_per_second and out.peak_memory_bytes is not None
    # 4) The winner's files: its trainer's config loads in the class that trains it.
    exported = export_config(config, tmp_path / "x", on_cpu=True,
                             **spec_exports(spec, config))
    path = tmp_path / "x" / trainer_file(spec)
    assert exported[trained_by.name if trained_by.export_file else "training_args"] == (
        path.name)
    kwargs = json.loads(path.read_text()) | {"output_dir": str(tmp_path / "run")}
    cls = trained_by.config_class or kind.arguments_class
    library = __import__("trl") if trained_by.config_class else transformers
    args = getattr(library, cls)(**kwargs)
    assert (args.per_device_train_batch_size, args.bf16) == (1, True)
    # ... the class the report tells the user to load it with.
    from autotune.outputs.report import exports_of
    from autotune.summary import Summary

    summary = Summary(model=shape.to_dict(), device=None, memory_limit_bytes=0,
                      target_batch_size=2, world_size=1, trials=[])
    summary.exports = exported
    usage = dict(exports_of(summary))[path.name]
    assert f"{cls}(**json.load(open(\"{path.name}\"))" in usage
