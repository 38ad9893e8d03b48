"""Real text as a new user brings it: a JSONL file and a tokenizer folder next to the spec,
named relative to it, with the search run from another folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.slow

TEXTS = ["the quick brown fox jumps over the lazy dog", "a tuner runs short real trials",
         "memory is predicted before anything runs", "the effective batch never changes"]


def make_tokenizer(folder: Path, texts: list[str]) -> None:
    """A word-level tokenizer trained on `texts`, saved as transformers saves one."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                            pad_token="[PAD]").save_pretrained(str(folder))


def _project(tmp_path: Path, *, broken: bool = False) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "data.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    if broken:
        (project / "tok").mkdir()
        (project / "tok" / "tokenizer.json").write_text("{not a tokenizer")
        (project / "tok" / "tokenizer_config.json").write_text("{}")
    else:
        make_tokenizer(project / "tok", TEXTS)
    (project / "space.yaml").write_text(yaml.safe_dump(
        {"per_device_train_batch_size": [4, 8], "precision": ["fp32"]}))
    spec = {"model": {"config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32,
                                 "n_head": 2, "vocab_size": 64, "n_positions": 32}},
            "data": {"seq_len": 16, "source": "data.jsonl", "tokenizer": "tok"},
            "target_batch_size": 8, "measure": {"warmup_steps": 1, "steps": 2},
            "search": {"space": "space.yaml", "n_trials": 2, "confirm_repeats": 0,
                       "trial_timeout": "2m"},
            "output": str(tmp_path / "out")}
    (project / "model.yaml").write_text(yaml.safe_dump(spec))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    return elsewhere


def _search(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", "search", "../project/model.yaml"],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def test_jsonl_and_tokenizer_relative_to_the_spec_run_from_another_folder(tmp_path):
    proc = _search(_project(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    trials = json.loads((tmp_path / "out" / "summary.json").read_text())["trials"]
    assert trials and all(t["outcome"]["status"] == "ok" for t in trials), trials


def test_a_broken_tokenizer_stops_the_search_after_one_trial_with_one_line(tmp_path):
    proc = _search(_project(tmp_path, broken=True))
    assert proc.returncode == 2, proc.stdout[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: data.tokenizer:"), proc.stderr
    assert "Traceback" not in proc.stderr
    trials = json.loads((tmp_path / "out" / "summary.json").read_text())["trials"]
    assert len(trials) == 1  # not one error per config
