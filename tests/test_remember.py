"""Searches that remember: the same setup answered from the results store after its
winner and baseline ran once more, --fresh, a near setup seeded, `autotune results`, on
SQLite and on a real PostgreSQL; a store that cannot be reached or written. Real Optuna,
Ray and Trainer throughout."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

import autotune
from autotune.store.db import ResultStore
from autotune.tuning.result import SearchResult
from tests.conftest import TINY_SPEC

pytestmark = pytest.mark.slow

# fp32 AdamW with and without checkpointing, at every batch: ten candidates, so a search
# is six trials and its confirmation, as the tiny example's is a dozen and its own.
SPACE = {"per_device_train_batch_size": "auto", "precision": ["fp32"],
         "optim": ["adamw_torch"], "gradient_checkpointing": [False, True],
         "zero_stage": [0], "offload": ["none"]}


def _spec(tmp_path: Path, out: str, seq_len: int = 32, **search) -> Path:
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(SPACE))
    spec = copy.deepcopy(TINY_SPEC)
    spec["data"]["seq_len"] = seq_len
    spec["search"] |= {"space": str(tmp_path / "space.yaml"), "n_trials": 6,
                       "confirm_repeats": 3, "timeout": "10m"} | search
    spec["output"] = str(tmp_path / out)
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True,
                          text=True, timeout=600,
                          env=dict(os.environ, COLUMNS="1000") | (env or {}))


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _store_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "results store:" in line]


def test_a_setup_searched_twice_is_remembered_fresh_searches_and_a_near_one_is_seeded(
        tmp_path, postgres_url):
    from transformers import TrainingArguments

    sqlite = f"sqlite:///{tmp_path / 'results.db'}"
    # 1) The first search, from the Python API: a full search, recorded.
    first = autotune.search(_spec(tmp_path, "first"), store=sqlite, progress=False)
    assert first.summary.remembered is None and first.best is not None
    assert sum(t.counted for t in first.trials) >= 2
    [record] = ResultStore.open(sqlite).records().records
    assert record.output == str(tmp_path / "first") and record.calibration

    # 2) Again in another folder: answered from the record, the two runs checked.
    began = time.time()
    again = autotune.search(_spec(tmp_path, "again"), store=sqlite, progress=False)
    again_wall = time.time() - began
    assert isinstance(again, SearchResult)
    remembered = _summary(tmp_path / "again")["remembered"]
    assert remembered["reconfirmed"] is True and remembered["from"] == record.created
    assert remembered["output"] == str(tmp_path / "first")
    assert [c["role"] for c in remembered["checks"]][0] == "winner"
    assert all(c["within"] and c["status"] == "ok" for c in remembered["checks"])
    # A run or two, not a search: the winner and Trainer's defaults, once each (one run
    # where the defaults won).
    configs = [c["config"] for c in remembered["checks"]]
    assert len(configs) == len(set(configs)) <= 2, remembered["checks"]
    # Its two runs plus a few seconds: the lookup, Ray's stop, the study and the files.
    assert again_wall - remembered["check_seconds"] < 15, (again_wall, remembered)
    assert again.best.config == first.best.config and again.speedup == first.speedup
    args = again.training_arguments(output_dir=str(tmp_path / "long"))
    exported = json.loads((tmp_path / "again" / "training_args.json").read_text())
    assert TrainingArguments(**exported | {"output_dir": str(tmp_path / "x")}).to_dict()[
        "per_device_train_batch_size"] == args.per_device_train_batch_size
    assert "Remembered" in (tmp_path / "again" / "report.md").read_text()

    # 3) The team's store: the record moves to PostgreSQL as JSON lines.
    lines = tmp_path / "records.jsonl"
    assert _cli("results", "export", str(lines), "--store", sqlite).returncode == 0
    imported = _cli("results", "import", str(lines), "--store", postgres_url)
    assert imported.returncode == 0 and "imported 1 record" in imported.stdout
    # A record a newer autotune wrote under the same fingerprint is skipped with a note.
    newer = record.to_dict() | {"uid": "newer", "schema": 99, "autotune_version": "9.9.0",
                                "created": "2099-01-01T00:00:00+00:00"}
    ResultStore.open(postgres_url).put(newer)

    # 4) The CLI against PostgreSQL: remembered too, and says so.
    proc = _cli("search", str(_spec(tmp_path, "team")), "--store", postgres_url)
    assert proc.returncode == 0, proc.stderr[-3000:]
    team = _summary(tmp_path / "team")["remembered"]
    assert team["from"] == record.created, proc.stderr[-3000:]
    # The check is statistical (99% bands around a tiny model's short runs, one of which
    # missed once in a fresh-clone CI): step 2 holds it to passing; here the PostgreSQL
    # path is under test: the record answers, or the search says why it did not.
    if team["reconfirmed"]:
        assert "remembered: answered from the search of" in proc.stdout
    else:
        assert team["why"] and "was not reconfirmed" in proc.stderr, proc.stderr[-3000:]
    assert any("skipped 1 record written by autotune 9.9.0" in line
               for line in _store_lines(proc.stderr))

    # 5) --fresh searches in full; a read-only store keeps it from being recorded, said
    # in one line, and the search's files are all there.
    read_only = postgres_url + "?options=-c%20default_transaction_read_only%3Don"
    proc = _cli("search", str(_spec(tmp_path, "fresh", confirm_repeats=1)), "--store",
                read_only, "--fresh", "--trials", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = _summary(tmp_path / "fresh")
    assert fresh["remembered"] is None and fresh["search"]["trials_run"] == 1
    assert fresh["confirmation"]["configs"] and fresh["seeded_by"] == []
    said = _store_lines(proc.stderr)
    assert len(said) == 1 and "not recorded" in said[0] and "read-only" in said[0], said
    assert (tmp_path / "fresh" / "training_args.json").is_file()

    # 6) The same spec at seq_len 24: a near match, seeded by the record.
    autotune.search(_spec(tmp_path, "shorter", seq_len=24, n_trials=3, confirm_repeats=1),
                    store=postgres_url, progress=False)
    shorter = _summary(tmp_path / "shorter")
    [seed] = shorter["seeded_by"]
    assert seed["from"] == record.created and seed["seq_len"] == 32 and seed["calibration"]
    # The recorded winners run first, but for one on the references' chains (their
    # probes run it under their own reason).
    assert seed["configs"] or seed["left_to_the_probes"]
    if seed["configs"]:
        assert shorter["trials"][0]["reason"] == "seeded"
        assert shorter["trials"][0]["config"]["precision"] == "fp32"
    assert "Seeded by" in (tmp_path / "shorter" / "report.md").read_text()

    # 7) `autotune results` lists both setups.
    proc = _cli("results", "--store", postgres_url)
    assert proc.returncode == 0, proc.stderr
    assert "seq 32, batch 16" in proc.stdout and "seq 24, batch 16" in proc.stdout
    assert "skipped 1 record" in proc.stdout  # the newer one, noted, not listed
    assert len(ResultStore.open(postgres_url).records().records) == 2


def test_an_unreachable_store_is_one_line_and_the_search_goes_on(tmp_path):
    proc = _cli("search", str(_spec(tmp_path, "out", confirm_repeats=0)), "--trials", "1",
                env={"AUTOTUNE_STORE": "postgresql://autotune@127.0.0.1:1/nowhere"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = _store_lines(proc.stderr)
    assert len(said) == 1 and "unreachable" in said[0] and "searching without it" in said[0]
    assert "@" not in said[0].split("postgresql")[0]
    assert _summary(tmp_path / "out")["trials"]
