"""What people fine-tune: chat and prompt-completion data, a quantized base under LoRA
(QLoRA through bitsandbytes and PEFT, for real on CPU), Llama-family shapes and local
checkpoints, and TRL's SFTTrainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from autotune.config import TrialConfig
from autotune.device import named_device
from autotune.errors import SetupError, SpecError
from autotune.plan.calibration import MemoryModel
from autotune.plan.shape import model_shape
from autotune.spec import load_spec
from autotune.tasks.data import IGNORE, data_format, encode, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "examples" / "data" / "chat.jsonl"
TOKENIZER = ROOT / "examples" / "data" / "chat-tokenizer"
QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 128, "max_position_embeddings": 256}
FAMILIES = {
    "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "max_position_embeddings": 256},
    "qwen2": QWEN2,
    "mistral": {"model_type": "mistral", "num_hidden_layers": 2, "hidden_size": 64,
                "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 2,
                "vocab_size": 128, "max_position_embeddings": 256},
    "gemma": {"model_type": "gemma", "num_hidden_layers": 2, "hidden_size": 64,
              "intermediate_size": 172, "num_attention_heads": 4, "num_key_value_heads": 1,
              "head_dim": 16, "vocab_size": 128, "max_position_embeddings": 256},
}


def _data(tmp_path: Path, rows: list[dict], **extra) -> dict:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"source": str(path), "tokenizer": str(TOKENIZER), "seq_len": 64,
            "format": "auto", "text_field": "text", "completion_only_loss": False} | extra


CONVO = [{"role": "system", "content": "you are a good assistant ."},
         {"role": "user", "content": "how fast is the model ?"},
         {"role": "assistant", "content": "very fast ."},
         {"role": "user", "content": "why ?"},
         {"role": "assistant", "content": "compile and flash attention ."}]


# --- data as people have it ----------------------------------------------------------

def test_the_format_is_found_from_the_columns_or_said_in_one_line(tmp_path):
    assert data_format(_data(tmp_path, [{"text": "a"}]), ["text"]) == "text"
    assert data_format(_data(tmp_path, []), ["messages", "id"]) == "messages"
    assert data_format(_data(tmp_path, []), ["prompt", "completion"]) == "prompt-completion"
    with pytest.raises(SetupError, match="has the columns question, answer: none fits"):
        data_format(_data(tmp_path, []), ["question", "answer"])
    with pytest.raises(SetupError, match="messages needs the column"):
        data_format(_data(tmp_path, [], format="messages"), ["text"])


def test_chat_rows_train_on_the_assistants_turns_only_when_asked(tmp_path):
    data = _data(tmp_path, [{"messages": CONVO}], completion_only_loss=True)
    (ids, labels), = encode(data, 1)
    tok = load_tokenizer(data)
    assert ids == tok.apply_chat_template(CONVO, tokenize=True, return_dict=True)["input_ids"]
    kept = [tok.convert_ids_to_tokens(t) for t in labels if t != IGNORE]
    assert " ".join(kept) == "very fast . <|im_end|> compile and flash attention . <|im_end|>"
    (ids, labels), = encode(data | {"completion_only_loss": False}, 1)
    assert labels == ids


def test_prompt_completion_rows_mask_the_prompt(tmp_path):
    rows = [{"prompt": "why is the model slow ?", "completion": "the batch is small ."}]
    data = _data(tmp_path, rows, completion_only_loss=True)
    (ids, labels), = encode(data, 1)
    tok = load_tokenizer(data)
    prompt = len(tok("why is the model slow ?")["input_ids"])
    assert labels[:prompt] == [IGNORE] * prompt and labels[prompt:] == ids[prompt:]
    assert ids[-1] == tok.eos_token_id


def test_parquet_and_saved_datasets_are_read_like_jsonl(tmp_path):
    import datasets

    rows = [{"messages": CONVO}] * 3
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "rows.parquet"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    want = encode(_data(tmp_path, rows), 3)
    for source in (tmp_path / "rows.parquet", tmp_path / "saved"):
        assert encode(_data(tmp_path, rows) | {"source": str(source)}, 3) == want


def test_bad_data_is_one_line_naming_what_is_wrong(tmp_path):
    rows = [{"prompt": "a ?", "completion": "b ."}, {"prompt": "c ?"}]
    with pytest.raises(SetupError, match="row 1 has no 'completion'"):
        encode(_data(tmp_path, rows), 2)
    plain = tmp_path / "plain-tokenizer"
    load_tokenizer({"tokenizer": str(TOKENIZER)}).save_pretrained(str(plain))
    for name in ("chat_template.jinja",):
        (plain / name).unlink(missing_ok=True)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(SetupError, match="has no chat template"):
        encode(_data(tmp_path, [{"messages": CONVO}], tokenizer=str(plain)), 1)
    with pytest.raises(SpecError, match="completion_only_loss needs rows with a completion"):
        load_spec({"model": {"config": QWEN2}, "data": {"completion_only_loss": True}})
    hub = load_spec({"model": {"config": QWEN2},
                     "data": {"source": "someorg/chat-rows", "tokenizer": str(TOKENIZER)}})
    assert hub.data.source == "someorg/chat-rows"  # read where the hub is reachable
    with pytest.raises(SpecError, match="no such file"):
        load_spec({"model": {"config": QWEN2},
                   "data": {"source": "missing.jsonl", "tokenizer": str(TOKENIZER)}})


# --- a quantized base -------------------------------------------------------------------

def _lora_spec(tmp_path: Path, **extra) -> dict:
    return {"model": {"config": QWEN2, "lora": {}},
            "data": {"source": str(CHAT), "tokenizer": str(TOKENIZER), "seq_len": 128,
                     "completion_only_loss": True},
            "target_batch_size": 8, "output": str(tmp_path / "out"),
            "measure": {"warmup_steps": 1, "steps": 2}} | extra


def test_a_quantized_base_needs_lora_and_keeps_to_zero_1_and_2(tmp_path):
    from autotune import knobs
    from autotune.space import build_space

    (tmp_path / "q.yaml").write_text("quantization: [none, nf4]\n")
    full = load_spec({"model": {"config": QWEN2}, "search": {"space": str(tmp_path / "q.yaml")},
                      "target_batch_size": 8})
    with pytest.raises(SpecError, match="quantization nf4 needs model.lora"):
        build_space(full, named_device("A100-80GB"))
    lora = load_spec(_lora_spec(tmp_path))
    space = build_space(lora, named_device("A100-80GB"))  # the default space's lora section
    assert {c.quantization for c in space.candidates} == {"none", "nf4"}
    assert {c.zero_stage for c in space.candidates if c.quantization == "nf4"} == {0, 1, 2}
    assert "ZeRO-3 would partition" in space.pruned["quantization=nf4 with zero_stage=3"]
    assert knobs.quantization_config("nf4", "bf16")["bnb_4bit_compute_dtype"] == "bfloat16"


def test_the_memory_model_holds_the_packed_weights_and_one_dequantized_layer(tmp_path):
    shape = model_shape(load_spec(_lora_spec(tmp_path)))
    linear = shape.quantizable_parameters
    h, f, layers, kv = 64, 128, 2, 2 * 16
    assert linear == layers * (h * h * 2 + h * kv * 2 + 3 * h * f)  # q,o + k,v + mlp
    assert shape.largest_linear == h * f
    model = MemoryModel(shape, named_device("A100-80GB"))
    nf4 = model.physics(TrialConfig.of(4, 2, precision="bf16", quantization="nf4"))
    plain = model.physics(TrialConfig.of(4, 2, precision="bf16"))
    per = 0.5 + 1 / 64 + 4 / (64 * 256)
    assert nf4.components["quantized"] == pytest.approx(per * linear + 2 * h * f)
    assert plain.components["quantized"] == 0
    # The base's linear weights leave the fp32 weights (and their 16-bit copies).
    assert nf4.components["weights"] < plain.components["weights"] - 4 * linear


# --- Llama-family shapes -----------------------------------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_family_is_counted_as_the_real_model_is_built(family):
    """The meta-device count (what estimate and the memory model read) against the model
    really built, and the traced activations against what its step really saves."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotune.plan.trace import trace_activations

    cfg = dict(FAMILIES[family])
    spec = load_spec({"model": {"config": cfg}, "data": {"seq_len": 64}})
    shape = model_shape(spec)
    kind = cfg.pop("model_type")
    torch.manual_seed(0)
    real = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **cfg))
    assert shape.num_parameters == sum(p.numel() for p in real.parameters())
    trace = trace_activations(shape.hf_config, "causal-lm", 64, "fp32", False, "sdpa", False,
                              None)
    assert trace is not None and trace.per_sample > 0
    seen: dict[int, int] = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, 128, (4, 64))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = real(input_ids=ids, labels=ids).loss
    loss.backward()
    saved = sum(seen.values()) / 4
    # The trace's peak per sample holds what autograd saves, and the backward's own
    # transients on top (the logits' gradients above all): never less, at most a few
    # times as much on a model this small.
    assert saved * 0.9 < trace.per_sample < saved * 4, (family, saved, trace.per_sample)


@pytest.mark.slow
def test_each_family_and_a_local_checkpoint_train_a_quantized_lora_trial(tmp_path):
    """Llama, Qwen2, Mistral and Gemma shapes train a QLoRA trial on the chat rows; a
    checkpoint saved to a folder (config, safetensors, tokenizer) loads through
    model.name_or_path, quantized as from_pretrained loads it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotune.trials.launch import run_trial
    from tests.conftest import trial_request

    for family, cfg in FAMILIES.items():
        spec = _lora_spec(tmp_path) | {"model": {"config": cfg, "lora": {}}}
        out = run_trial(trial_request(spec, TrialConfig.of(4, 2, quantization="nf4"),
                                      timeout_s=240))
        assert out.status == "ok", (family, out.error)
        assert out.measured.lengths.loss_tokens < 1.0  # the assistant's turns only
        # On a CPU bitsandbytes' CPU library is the right one: timed, and said
        assert out.ran_with.bitsandbytes == "libbitsandbytes_cpu.so"
    folder = tmp_path / "checkpoint"
    raw = dict(QWEN2)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw)
                                     ).save_pretrained(str(folder))
    load_tokenizer({"tokenizer": str(TOKENIZER)}).save_pretrained(str(folder))
    assert (folder / "model.safetensors").is_file()
    spec = _lora_spec(tmp_path) | {"model": {"name_or_path": str(folder), "lora": {}}}
    spec["data"]["tokenizer"] = str(folder)
    for q in ("none", "nf4"):
        out = run_trial(trial_request(spec, TrialConfig.of(4, 2, quantization=q),
                                      timeout_s=240))
        assert out.status == "ok", (q, out.error)


# --- end to end: a QLoRA search, its exports, TRL ---------------------------------------

TRAIN = Path(__file__).with_name("train_qlora_from_exports.py")


def _search(tmp_path: Path, spec: dict) -> dict:
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.run([sys.executable, "-m", "autotune", "search", str(path)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((Path(spec["output"]) / "summary.json").read_text())


def _train_from(tmp_path: Path, export: Path) -> dict:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    proc = subprocess.run([sys.executable, str(TRAIN), str(export), str(CHAT), str(TOKENIZER),
                           json.dumps(QWEN2), str(tmp_path / "run")], cwd=elsewhere,
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("trainer", ["trainer", "sft"])
def test_a_qlora_search_on_chat_rows_exports_files_that_train(tmp_path, trainer):
    """quantization none and nf4, LoRA, a Qwen2-shaped model and chat rows: ok trials of
    both, quantization_config.json exported where the winner quantizes, and the exports
    train two steps from another folder; under SFTTrainer, sft_config.json too."""
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(
        {"per_device_train_batch_size": [4, 8], "precision": ["fp32"],
         "quantization": ["none", "nf4"]}))
    spec = _lora_spec(tmp_path, trainer=trainer, search={
        "space": str(tmp_path / "space.yaml"), "n_trials": 6, "confirm_repeats": 0,
        "trial_timeout": "3m", "timeout": "10m"})
    summary = _search(tmp_path, spec)
    ok = [t for t in summary["trials"] if t["outcome"]["status"] == "ok"]
    assert {t["config"]["quantization"] for t in ok} == {"none", "nf4"}, [
        (t["config"], t["outcome"]["status"], t["outcome"]["error"]) for t in summary["trials"]]
    out = Path(spec["output"])
    best = summary["best"]["config"]
    exports = summary["exports"]
    assert (exports["quantization"] == "quantization_config.json") == (
        best["quantization"] == "nf4")
    if trainer == "sft":
        from trl import SFTConfig

        kwargs = json.loads((out / "sft_config.json").read_text())
        assert kwargs["assistant_only_loss"] and kwargs["max_length"] == 128
        SFTConfig(**kwargs | {"output_dir": str(tmp_path / "x")})  # accepted
    # Train two steps from the winner's files, and from a quantized config's.
    assert _train_from(tmp_path, out)["global_step"] == 2
    from autotune.outputs.export import export_config

    nf4 = TrialConfig.from_dict(best | {"quantization": "nf4"})
    from autotune.tasks.sft import SFT_TRAINER

    export_config(nf4, tmp_path / "nf4", on_cpu=True, seed=0, lora={"r": 8, "alpha": 16,
                  "dropout": 0.0, "target_modules": "all-linear"},
                  trainer_fields=("sft", SFT_TRAINER.fields(load_spec(spec), nf4)))
    done = _train_from(tmp_path, tmp_path / "nf4")
    assert done["global_step"] == 2 and done["quantized"] == "Linear4bit"
