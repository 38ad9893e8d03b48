"""trainer: grpo (issue 53): TRL's GRPOTrainer, run for real on CPU. The spec refuses bad
input in one line; every split the space holds builds a GRPOConfig (no trial lost to
TRL's batch rules); a trial forces full-length completions and keeps generation apart from
training; the memory model holds the generation's KV cache and the reference; a search's
files train from another folder."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config import TrialConfig
from autotune.errors import SpecError
from autotune.spec import load_spec
from tests.conftest import cli_search
from tests.test_host_malloc import GLIBC

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "examples" / "data"
TOKENIZER = str(DATA / "chat-tokenizer")
QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "max_position_embeddings": 256}


def grpo_spec(tmp_path: Path, **grpo) -> dict:
    return {"model": {"config": QWEN2}, "trainer": "grpo",
            "grpo": {"num_generations": 4, "max_completion_length": 8} | grpo,
            "data": {"source": str(DATA / "prompts.jsonl"), "tokenizer": TOKENIZER,
                     "seq_len": 16},
            "target_batch_size": 8, "measure": {"warmup_steps": 1, "steps": 1},
            "output": str(tmp_path / "out")}


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"target_batch_size": 6}, "target_batch_size", "no multiple of grpo.num_generations 4"),
    ({"grpo": {"reward": "no_such_module:reward"}}, "grpo.reward", "does not import"),
    ({"grpo": {"reward": "lengthy"}}, "grpo.reward", "no built-in reward"),
    ({"grpo": {"num_generations": 1}}, "grpo.num_generations", "greater than or equal to 2"),
    ({"data": {"seq_len": 16}}, "data.source", "generates from prompts"),
    ({"trainer": "trainer"}, "grpo", "read under trainer: grpo only"),
])
def test_bad_grpo_input_is_one_line_naming_the_field(tmp_path, change, field, words):
    raw = grpo_spec(tmp_path)
    for key, value in change.items():
        raw[key] = raw[key] | value if isinstance(value, dict) and key != "data" else value
    with pytest.raises(SpecError) as err:
        load_spec(raw)
    said = str(err.value)
    assert field in said and words in said and "\n" not in said.strip(), said


def test_every_split_of_the_space_builds_its_grpo_config(tmp_path):
    """TRL refuses a generation batch that is no multiple of num_generations: every
    candidate's GRPOConfig is built here, as the trial builds it (no trial is lost)."""
    from trl import GRPOConfig

    from autotune.device import local_device
    from autotune.space import build_space
    from autotune.trials.trainargs import trainer_kwargs

    spec = load_spec(grpo_spec(tmp_path) | {"target_batch_size": 16})
    candidates = build_space(spec, local_device()).candidates
    assert {c.per_device_train_batch_size for c in candidates} == {1, 2, 4, 8, 16}
    assert {c.generation_cache for c in candidates} == {"dynamic", "static"}
    for c in candidates:
        kwargs = trainer_kwargs(spec, c, on_cpu=True) | {"output_dir": str(tmp_path / "x")}
        args = GRPOConfig(**kwargs)
        assert args.generation_batch_size == 16 and args.steps_per_generation == (
            c.gradient_accumulation_steps)


def test_completions_are_forced_to_full_length_on_each_generation_path(tmp_path):
    from autotune.tasks.grpo import GRPO_TRAINER

    spec = load_spec(grpo_spec(tmp_path))
    fields = {label: GRPO_TRAINER.fields(spec, TrialConfig.from_label(label))
              for label in ("b4x2", "b4x2 paged", "b4x2 static-kv", "b4x2 vllm:colocate-0.5")}
    assert fields["b4x2"]["generation_kwargs"] == {"min_new_tokens": 8}
    assert fields["b4x2 paged"]["generation_kwargs"] == {"eos_token_id": None}
    # continuous batching's cache holds the step's 8 rows of 16 + 8 tokens, not a share of
    # the machine's memory
    assert fields["b4x2 paged"]["transformers_continuous_batching_config"] == {
        "page_size": 256, "num_blocks": 1 + 8}
    assert fields["b4x2 static-kv"]["cache_implementation"] == "static"
    vllm = fields["b4x2 vllm:colocate-0.5"]
    assert {k: vllm[k] for k in ("use_vllm", "vllm_mode", "vllm_gpu_memory_utilization",
                                 "vllm_enable_sleep_mode", "generation_kwargs")} == {
        "use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.5,
        "vllm_enable_sleep_mode": False, "generation_kwargs": {"min_tokens": 8}}


def test_long_prompts_are_cut_at_seq_len_and_said(caplog):
    from transformers import AutoTokenizer

    from autotune.tasks.grpo import prompt_rows

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    data = {"source": str(DATA / "prompts.jsonl"), "tokenizer": TOKENIZER, "seq_len": 16}
    with caplog.at_level(logging.WARNING, logger="autotune"):
        rows, lengths = prompt_rows(data, tok, 48)
    assert lengths["max"] == 16 and lengths["truncated"] > 0
    assert all(len(tok(r["prompt"], add_special_tokens=False)["input_ids"]) <= 16
               for r in rows)
    assert any("longer than data.seq_len 16 tokens: cut there" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("beta", [0.0, 0.1])
def test_a_trial_times_generation_apart_and_keeps_a_reference_where_beta_asks(tmp_path, beta):
    from autotune.trials.worker import run
    from tests.conftest import trial_request

    spec = grpo_spec(tmp_path, beta=beta)
    out = run(trial_request(spec, TrialConfig.of(4, 2)), str(tmp_path / "r.json"))
    assert out.status == "ok", out.error
    assert out.generation.completion_length == 8  # forced: the worst case
    assert out.measured.micro_batches == [4] * 4  # a sample is a completion
    generated, trained = out.generation.seconds, out.generation.training_seconds
    assert len(generated) == len(trained) == 1 and generated[0] > 0 and trained[0] > 0
    assert 0 < out.generation.share < 1


def test_the_memory_model_holds_the_kv_cache_and_the_reference(tmp_path):
    from autotune.device import named_device
    from autotune.plan.memory import Physics
    from autotune.plan.shape import model_shape

    a100 = named_device("A100-80GB")
    plain = model_shape(load_spec(grpo_spec(tmp_path)))
    kept = model_shape(load_spec(grpo_spec(tmp_path, beta=0.1)))
    assert (plain.generated_len, plain.train_len, plain.reference) == (8, 24, False)
    assert kept.reference
    cfg = TrialConfig.of(2, 4, precision="bf16")
    physics = Physics(plain, a100)
    # keys and values of 2 layers, 2 heads of 16, for the step's 8 rows of 24 tokens
    assert physics.generation_bytes(cfg) == 2 * 2 * 2 * 16 * 24 * 8 * 2 + 4 * 8 * 128
    # the same step's rows whatever the split: the cache does not shrink with the batch
    assert physics.generation_bytes(TrialConfig.of(8, 1, precision="bf16")) == (
        physics.generation_bytes(cfg))
    assert Physics(kept, a100).reference_bytes(cfg) == 4 * kept.num_parameters
    assert physics.reference_bytes(cfg) == 0
    assert physics.logits_bytes_per_sample(cfg) == 0  # TRL's chunked head: never whole
    assert physics.chunked_logits_bytes(cfg) > 0


def test_estimate_and_init_plan_a_grpo_spec(tmp_path):
    import autotune
    from autotune.plan import init

    planned = autotune.estimate(grpo_spec(tmp_path), device="A100-80GB")
    assert planned.rows and all(r.estimate.components["generation"] >= 0 for r in planned.rows)
    made = init.plan("qwen2-0.5b", grpo=True, spec_dir=tmp_path)
    written = tmp_path / "g.yaml"
    init.write(written, init.render(made))
    spec = load_spec(written)
    assert spec.trainer == "grpo" and spec.grpo_algorithm().num_generations == 4
    assert spec.data.source == init.GRPO_PROMPTS  # a placeholder, said in the file
    assert "REPLACE the placeholders" in written.read_text()


@pytest.mark.slow
def test_a_grpo_search_exports_a_config_that_trains_elsewhere(tmp_path):
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(
        {"per_device_train_batch_size": [4, 8], "precision": ["fp32"],
         "grpo": {"generation_cache": ["dynamic", "static"]}}))
    raw = grpo_spec(tmp_path) | {"search": {"space": str(tmp_path / "space.yaml"),
                                            "n_trials": 3, "confirm_repeats": 1,
                                            "trial_timeout": "3m", "timeout": "8m"}}
    out, _ = cli_search(raw, tmp_path)
    report = (out / "report.md").read_text()
    assert "completions/s" in report and "| gen share |" in report  # its own column
    # The trials held glibc's mmap threshold (a CPU's): the run is told to do the same.
    assert ("MALLOC_MMAP_THRESHOLD_=131072 in the environment" in report) is GLIBC
    kwargs = json.loads((out / "grpo_config.json").read_text())
    assert kwargs["num_generations"] == 4 and kwargs["max_completion_length"] == 8
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # The user's own loader: datasets' json reader takes one prompt type per file (the
    # example mixes text and messages, which autotune renders itself), so its text ones
    text = [r for r in map(json.loads, (DATA / "prompts.jsonl").read_text().splitlines())
            if isinstance(r["prompt"], str)]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in text))
    trained = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "train_task_from_exports.py"), "grpo",
         str(out), json.dumps(QWEN2), str(tmp_path / "run"), str(tmp_path / "text.jsonl"),
         TOKENIZER], cwd=elsewhere, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = json.loads(trained.stdout.strip().splitlines()[-1])
    assert done["global_step"] == 2 and done["args"] == "GRPOConfig"
