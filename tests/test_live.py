"""A newcomer's first minutes: `autotune init` writes a commented spec from a model's
config, `autotune knobs` prints the knob table, a running search shows its status live
(plain lines in a log), and Optuna's dashboard opens the study."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from rich.console import Console
from typer.testing import CliRunner

from autotune.cli import SearchView, _print_study, app
from autotune.config import TrialConfig
from autotune.records import Outcome, Record
from autotune.spec import load_spec
from autotune.tuning.strategies.base import Proposal


def test_init_writes_a_commented_spec_that_loads_and_never_overwrites(tmp_path):
    out = tmp_path / "model.yaml"
    run = CliRunner().invoke(app, ["init", "qwen2-0.5b", "--lora", "--seq-len", "2048",
                                   "--device", "A10G-24GB", "--output", str(out)])
    assert run.exit_code == 0, run.output
    text = out.read_text()
    # Qwen2-0.5B's 494.0M and its r=16 adapters' 8.8M (on all seven projections).
    assert text.startswith("# autotune spec for the qwen2-0.5b shape (random weights: point "
                           "model.name_or_path at your checkpoint): 502.8M parameters.\n")
    assert "quantization: nf4, none" in text  # the default space's lora section, allowed
    assert "flash_attention_2 needs flash-attn" in text  # what the device leaves out, why
    spec = load_spec(out)  # the commented YAML is a spec
    assert spec.model.lora is not None and spec.data.seq_len == 2048
    assert spec.hardware.device == "A10G-24GB"
    again = CliRunner().invoke(app, ["init", "qwen2-0.5b", "--output", str(out)])
    assert again.exit_code == 2 and "exists" in again.output and out.read_text() == text


def test_init_reads_a_local_folder_and_names_what_it_cannot_read(tmp_path):
    from transformers import AutoConfig

    folder = tmp_path / "my-model"
    AutoConfig.for_model("llama", hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128).save_pretrained(folder)
    out = tmp_path / "a.yaml"
    run = CliRunner().invoke(app, ["init", str(folder), "--output", str(out)])
    assert run.exit_code == 0, run.output
    assert yaml.safe_load(out.read_text())["model"]["name_or_path"] == str(folder)
    assert not list(folder.glob("*.safetensors"))  # the config alone was read
    bad = CliRunner().invoke(app, ["init", "llama-13q", "--output", str(tmp_path / "b.yaml")])
    assert bad.exit_code == 2 and "llama comes in 1b, 3b, 8b, 70b" in bad.output


@pytest.mark.slow
def test_a_spec_from_init_on_a_saved_llama_folder_searches_as_written(tmp_path):
    """A newcomer's path: a saved checkpoint folder (weights of 256 positions), `autotune
    init` on it with no options, `autotune search` on what it wrote (fewer trials, to keep
    the suite quick). The sequence length follows the model: init's 1024 once failed its
    own spec check on such a model."""
    import subprocess
    import sys

    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2,
                                 vocab_size=128, max_position_embeddings=256)
                     ).save_pretrained(tmp_path / "tiny-llama")
    run = subprocess.run([sys.executable, "-m", "autotune", "init", "tiny-llama"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    spec = yaml.safe_load((tmp_path / "model.yaml").read_text())
    assert spec["data"]["seq_len"] == 256 and spec["model"]["name_or_path"].endswith(
        "tiny-llama")
    # As written, less the confirmation (6 runs, 40 of the search's 90 s alone): the
    # confirmation of a real search is tested in test_search_cli (TPE) and test_remember.
    spec.setdefault("search", {})["confirm_repeats"] = 0
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(spec))
    search = subprocess.run([sys.executable, "-m", "autotune", "search", "model.yaml",
                             "--trials", "3"], capture_output=True, text=True, timeout=900,
                            cwd=tmp_path)
    assert search.returncode == 0, search.stdout[-3000:] + search.stderr[-3000:]
    summary = json.loads((tmp_path / "runs" / "model" / "summary.json").read_text())
    assert any(t["outcome"]["status"] == "ok" for t in summary["trials"])
    assert summary["model"]["seq_len"] == 256


def test_knobs_prints_what_a_device_allows_and_why_not_the_rest():
    run = CliRunner().invoke(app, ["knobs", "--device", "V100-16GB"], env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    text = " ".join(run.output.split())
    assert "bf16 needs compute capability 8.0+" in text  # a V100 has none
    assert "quantization" in text and "use_liger_kernel" in text


def _record(n: int, reason: str, sps: float | None, status: str = "ok") -> Record:
    return Record(TrialConfig.of(8, 4, precision="bf16" if reason != "baseline" else "fp32"),
                  Outcome(status, samples_per_second=sps, wall_seconds=3.0), reason, n)


def test_a_terminal_sees_what_runs_the_best_so_far_and_the_budget():
    console = Console(force_terminal=True, width=140, record=True)
    view = SearchView(12, console, budget_s=900)
    base = _record(0, "baseline", 10.0)
    view.on_start(Proposal(base.config, "baseline"))
    view.on_record(base)
    running = TrialConfig.of(4, 8, precision="bf16", optim="adamw_bnb_8bit")
    view.on_start(Proposal(running, "model"))
    view.on_record(_record(1, "model", 25.0))
    view.on_record(Record(TrialConfig.of(32, 1), Outcome("pruned"), "predicted-oom: ...", 2))
    console.print(view)
    text = " ".join(console.export_text().split())
    assert "2/12 done · 1 running · 1 pruned by prediction" in text and "of 15 min 00 s" in text
    assert f"running {running.label()} (model)" in text
    assert "best b8x4 bf16 adamw_torch: 25.0, 2.50x Trainer's defaults so far" in text


def test_a_log_gets_one_line_per_trial_and_the_study_first():
    console = Console(force_terminal=False, width=160, record=True)
    view = SearchView(12, console)
    view.on_record(_record(0, "baseline", 10.0))
    assert console.export_text().startswith(
        "trial 0: b8x4 fp32 adamw_torch (baseline) ok 10.0 samples/s")
    spec = load_spec({"model": {"config": {"model_type": "gpt2"}}, "output": "/tmp/x"})
    _print_study(console, spec)
    assert console.export_text().endswith(
        "study: sqlite:////tmp/x/study.db\nwatch it live: pip install 'autotune[dashboard]' && "
        "optuna-dashboard sqlite:////tmp/x/study.db\n")


def test_optuna_dashboard_opens_a_search_study(tmp_path):
    """The extra the search's first lines name, on a study as a search keeps it."""
    from io import BytesIO

    from optuna_dashboard import wsgi

    from autotune.tuning.study import StudyLog

    storage = f"sqlite:///{tmp_path / 'study.db'}"
    log = StudyLog.open(storage, "autotune-abc", "abc", {"per_device_train_batch_size": [8],
                                                         "precision": ["fp32", "bf16"]}, 2**30)
    config = TrialConfig.of(8, 4, precision="bf16")
    number = log.start(Proposal(config, "model"))
    log.finish(number, Proposal(config, "model"), Outcome("ok", samples_per_second=12.5))
    app_ = wsgi(storage)
    seen: dict = {}

    def start_response(status, headers, exc_info=None):
        seen["status"] = status

    body = b"".join(app_({"REQUEST_METHOD": "GET", "PATH_INFO": "/api/studies",
                          "QUERY_STRING": "", "SERVER_NAME": "x", "SERVER_PORT": "80",
                          "wsgi.input": BytesIO(), "wsgi.errors": BytesIO(),
                          "wsgi.url_scheme": "http"},
                         start_response))
    assert seen["status"].startswith("200")
    studies = json.loads(body)["study_summaries"]
    assert [s["study_name"] for s in studies] == ["autotune-abc"]
    assert Path(tmp_path / "study.db").is_file()


def _read_pty(master: int, proc, timeout: float) -> str:
    """Everything the process writes to its terminal until it exits."""
    import os
    import select
    import time

    chunks, deadline = [], time.time() + timeout
    while time.time() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                data = os.read(master, 65536)
            except OSError:  # the other end closed: the process has gone
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks).decode(errors="replace")


@pytest.mark.slow
def test_a_search_in_a_terminal_shows_what_runs_and_the_best_so_far(tmp_path, tiny_spec):
    """`autotune search` on a pseudo-terminal: the live block names the trial in flight and
    the best so far while the search runs; through a pipe the same search writes its plain
    lines, one per trial, and no live block."""
    import os
    import re
    import subprocess
    import sys

    tiny_spec["search"] |= {"n_trials": 3, "confirm_repeats": 0}
    spec = tmp_path / "model.yaml"
    spec.write_text(yaml.safe_dump(tiny_spec))
    master, slave = os.openpty()
    env = os.environ | {"TERM": "xterm-256color", "COLUMNS": "160", "LINES": "50"}
    env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "search", str(spec)],
                            stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
    os.close(slave)
    try:
        raw = _read_pty(master, proc, timeout=600)
        assert proc.wait(timeout=60) == 0, raw[-3000:]
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw)
    assert re.search(r"running\s+b\d+x\d+ \S+ \S+.*\(baseline\), \d+ s", text), text[-3000:]
    assert re.search(r"best\s+b\d+x\d+ .*Trainer's defaults so far", text), text[-3000:]
    assert "done ·" in text

    tiny_spec["output"] = str(tmp_path / "piped")
    spec.write_text(yaml.safe_dump(tiny_spec))
    piped = subprocess.run([sys.executable, "-m", "autotune", "search", str(spec)],
                           capture_output=True, text=True, timeout=600,
                           env={k: v for k, v in env.items() if k != "COLUMNS"})
    assert piped.returncode == 0, piped.stderr[-3000:]
    both = piped.stdout + piped.stderr
    assert "\x1b[" not in both and "so far" not in both and "running b" not in both
    assert re.search(r"^trial 0: b\d+x\d+ .*\(baseline\) ok", both, re.MULTILINE), both[-3000:]
