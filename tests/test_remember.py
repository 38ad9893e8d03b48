"""Searches that remember: the same setup answered from the results store after its
winner and baseline ran once more, a record that fails that check searched again, --fresh,
a near setup seeded, `autotune results`, on SQLite and on a real PostgreSQL that asks for
a password (which no output holds); a store that cannot be reached or written. Each path
is forced by the stored record's figures, never left to the check's chance. Real Optuna,
Ray and Trainer throughout."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import optuna
import pytest
import yaml

import autotune
from autotune.config import TrialConfig
from autotune.store.db import ResultStore, StoreError
from autotune.store.record import StoredResult
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
    # n_trials ends each search; the timeout is a backstop a busy machine must not reach
    # (in a full suite on 2 slow cores, a search once began its first trial 7 min in).
    spec["search"] |= {"space": str(tmp_path / "space.yaml"), "n_trials": 6,
                       "confirm_repeats": 3, "timeout": "30m"} | search
    spec["output"] = str(tmp_path / out)
    path = tmp_path / f"{out}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    # Above the searches' own 30-minute timeout (_spec), which ends them first.
    return subprocess.run([sys.executable, "-m", "autotune", *args], capture_output=True,
                          text=True, timeout=2400,
                          env=dict(os.environ, COLUMNS="1000") | (env or {}))


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


def _store_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "results store:" in line]


def _edited(record: StoredResult, figures: Callable[[float], list[float]]) -> dict:
    """`record` with its figures edited, so that its check must pass or must fail: WINNER
    is its confirmed winner (a trial and a row of the baseline's figures under WINNER's
    config, the runner-ups gone), and each row's repeats are `figures(its median)`."""
    d = copy.deepcopy(record.to_dict())
    summary, winner = d["summary"], WINNER.to_dict()
    c = summary["confirmation"]
    base = next(r for r in c["configs"] if r["role"] == "baseline")
    c["configs"] = [r for r in c["configs"] if r["role"] in ("baseline", "recipe")] + [
        base | {"role": "best", "config": winner, "label": WINNER.label()}]
    trial = next(t for t in summary["trials"] if t["config"] == base["config"]
                 and t["reason"] == "baseline")
    summary["trials"].append(trial | {"number": len(summary["trials"]), "config": winner,
                                      "reason": "model"})
    c["winner"] = winner
    summary["best"] = summary["trials"][-1]
    for row in c["configs"]:
        row["samples_per_second"] = figures(row["median"])
    return d


# Off the references' chains here and at seq_len 24 (their probes would run it under their
# own reasons), so where it seeds a search it runs first, as "seeded".
WINNER = TrialConfig.of(4, 4, precision="fp32", optim="adamw_torch",
                        gradient_checkpointing=True)


def _wide(m: float) -> list[float]:
    """Repeats a thousandfold apart: any run of the config is within its band."""
    return [m / 1000, m, m * 1000]


def _far(m: float) -> list[float]:
    """Quiet repeats 10,000 times faster than this machine ran: no run is within."""
    return [m * 1e4] * 3


@pytest.fixture
def ray_logs(monkeypatch) -> Iterator[Path]:
    """A Ray temp folder of the test's own, to read Ray's logs (short: Ray's sockets are
    in it)."""
    folder = Path(tempfile.mkdtemp(prefix="rt52-"))
    monkeypatch.setenv("RAY_TMPDIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_a_setup_searched_twice_is_remembered_fresh_searches_and_a_near_one_is_seeded(
        tmp_path, postgres_server, ray_logs, capfd):
    """Each path forced by the record's own figures (the check is statistical: on 2 shared
    cores two-step runs vary tenfold, so an unedited record passes or fails by chance).
    The team's store is a real PostgreSQL that asks for a password: it reaches no output."""
    from transformers import TrainingArguments

    from autotune.dburl import shown
    from tests.postgres import PASSWORD

    team = postgres_server.new_database(password=True)
    printed: list[str] = []

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        proc = _cli(*args)
        printed.extend((proc.stdout, proc.stderr))
        return proc

    sqlite = f"sqlite:///{tmp_path / 'results.db'}"
    # 1) The first search, from the Python API: a full search, recorded.
    first = autotune.search(_spec(tmp_path, "first"), store=sqlite, progress=False)
    assert first.summary.remembered is None and first.best is not None
    assert sum(t.counted for t in first.trials) >= 2
    [record] = ResultStore.open(sqlite).records().records
    assert record.output == str(tmp_path / "first") and record.calibration

    # 2) Again in another folder, the record's repeats a thousandfold apart: answered from
    # the record after its winner and Trainer's defaults ran once each.
    wide = f"sqlite:///{tmp_path / 'wide.db'}"
    ResultStore.open(wide).put(_edited(record, _wide))
    again = autotune.search(_spec(tmp_path, "again"), store=wide, progress=False)
    assert isinstance(again, SearchResult)
    remembered = _summary(tmp_path / "again")["remembered"]
    assert remembered["reconfirmed"] is True and remembered["from"] == record.created
    assert remembered["output"] == str(tmp_path / "first")
    assert [(c["role"], c["config"], c["status"], c["within"]) for c in remembered["checks"]] \
        == [("winner", WINNER.label(), "ok", True),
            ("baseline", "b16x1 fp32 adamw_torch", "ok", True)]
    # Its two runs and no search that ran on: the study, where a search's trials go, is
    # empty (the checks are the summary's), rather than a bound on its wall time, which a
    # busy machine can break.
    study = optuna.load_study(study_name=remembered["study_name"],
                              storage=f"sqlite:///{tmp_path / 'again' / 'study.db'}")
    assert study.trials == []
    assert again.best.config == WINNER and again.speedup == first.speedup
    args = again.training_arguments(output_dir=str(tmp_path / "long"))
    assert (args.per_device_train_batch_size, args.gradient_checkpointing) == (4, True)
    exported = json.loads((tmp_path / "again" / "training_args.json").read_text())
    assert TrainingArguments(**exported | {"output_dir": str(tmp_path / "x")}).to_dict()[
        "per_device_train_batch_size"] == 4
    assert "Remembered" in (tmp_path / "again" / "report.md").read_text()

    # 3) The team's store: the record moves to PostgreSQL as JSON lines.
    lines = tmp_path / "records.jsonl"
    assert cli("results", "export", str(lines), "--store", wide).returncode == 0
    imported = cli("results", "import", str(lines), "--store", team)
    assert imported.returncode == 0 and "imported 1 record" in imported.stdout
    # A record a newer autotune wrote under the same fingerprint is skipped with a note.
    newer = record.to_dict() | {"uid": "newer", "schema": 99, "autotune_version": "9.9.0",
                                "created": "2099-01-01T00:00:00+00:00"}
    ResultStore.open(team).put(newer)

    # 4) The CLI against PostgreSQL: remembered too, and says so.
    proc = cli("search", str(_spec(tmp_path, "team")), "--store", team)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = _summary(tmp_path / "team")["remembered"]
    assert said["from"] == record.created and said["reconfirmed"] is True, proc.stderr[-3000:]
    assert (f"remembered: answered from the search of {record.date} ({tmp_path / 'first'})"
            in proc.stdout), proc.stdout
    assert any("skipped 1 record written by autotune 9.9.0" in line
               for line in _store_lines(proc.stderr))

    # 5) A record whose winner now runs 10,000 times slower than recorded: the search runs
    # again, says why in one line, and starts from the record's winner.
    fails = f"sqlite:///{tmp_path / 'fails.db'}"
    ResultStore.open(fails).put(_edited(record, _far))
    proc = cli("search", str(_spec(tmp_path, "checked", n_trials=1, confirm_repeats=0)),
               "--store", fails)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checked = _summary(tmp_path / "checked")
    checks = checked["remembered"]["checks"]
    assert [(c["role"], c["config"], c["status"]) for c in checks] == [
        ("winner", WINNER.label(), "ok"), ("baseline", "b16x1 fp32 adamw_torch", "ok")]
    versions = record.versions
    why = "; ".join(
        f"the {c['role']} ran {1 - c['measured'] / c['recorded'][0]:.0%} slower than recorded "
        f"({c['measured']:,.1f} against {c['low']:,.1f}-{c['high']:,.1f} samples/s)"
        for c in checks) + f", with torch {versions['torch']} (CUDA {versions['cuda']})"
    assert "ran 100% slower" in why and not any(c["within"] for c in checks)
    assert checked["remembered"] | {"checks": None, "check_seconds": None} == {
        "from": record.created, "output": str(tmp_path / "first"),
        "autotune_version": record.autotune_version, "key": record.key[:12],
        "checks": None, "check_seconds": None, "reconfirmed": False, "why": why}
    assert [line.split("results store: ", 1)[1].strip()
            for line in _store_lines(proc.stderr)][0] == (
        f"the result of {record.date} ({tmp_path / 'first'}) was not reconfirmed: {why}; "
        "searching again"), proc.stderr[-3000:]
    assert f"searched again: the record of {record.date} was not reconfirmed: {why}" in (
        " ".join(proc.stdout.split()))
    # The failed record seeds the search that replaces it: its winner is the first trial.
    assert [s["from"] for s in checked["seeded_by"]] == [record.created]
    assert checked["seeded_by"][0]["configs"] == [WINNER.label()]
    assert (checked["trials"][0]["reason"], checked["trials"][0]["config"]) == (
        "seeded", WINNER.to_dict())

    # 6) --fresh searches in full, its study in the team's PostgreSQL too; a read-only
    # store keeps it from being recorded, said in one line, and the search's files are all
    # there.
    read_only = team + "?options=-c%20default_transaction_read_only%3Don"
    proc = cli("search", str(_spec(tmp_path, "fresh", confirm_repeats=1)), "--store",
               read_only, "--storage", team, "--fresh", "--trials", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = _summary(tmp_path / "fresh")
    assert fresh["remembered"] is None and fresh["search"]["trials_run"] == 1
    assert fresh["confirmation"]["configs"] and fresh["seeded_by"] == []
    said = _store_lines(proc.stderr)
    assert len(said) == 1 and "not recorded" in said[0] and "read-only" in said[0], said
    assert (tmp_path / "fresh" / "training_args.json").is_file()
    assert f"study: {shown(team)}" in proc.stdout and fresh["search"]["storage"] == shown(team)

    # 7) The same spec at seq_len 24: a near match, seeded by the record: its winner first.
    autotune.search(_spec(tmp_path, "shorter", seq_len=24, n_trials=3, confirm_repeats=1),
                    store=team, progress=False)
    shorter = _summary(tmp_path / "shorter")
    [seed] = shorter["seeded_by"]
    assert seed["from"] == record.created and seed["seq_len"] == 32 and seed["calibration"]
    assert (seed["configs"], seed["left_to_the_probes"]) == ([WINNER.label()], [])
    assert (shorter["trials"][0]["reason"], shorter["trials"][0]["config"]) == (
        "seeded", WINNER.to_dict())
    assert "Seeded by" in (tmp_path / "shorter" / "report.md").read_text()

    # 8) `autotune results` lists both setups.
    proc = cli("results", "--store", team)
    assert proc.returncode == 0, proc.stderr
    assert "seq 32, batch 16" in proc.stdout and "seq 24, batch 16" in proc.stdout
    assert "skipped 1 record" in proc.stdout  # the newer one, noted, not listed
    assert len(ResultStore.open(team).records().records) == 2

    # 9) The password reached no output: what the CLI and this process printed, the files
    # of every search (summary.json, the reports, the exports, the confirmation's folders,
    # the study), Ray's logs. And it was asked for: a wrong one is refused.
    out, err = capfd.readouterr()
    printed += [out, err]
    assert "***" in "".join(printed)  # the URL was printed, without its password
    assert not [text for text in printed if PASSWORD in text]
    files = [f for root in (tmp_path, ray_logs) for f in root.rglob("*") if f.is_file()]
    assert len(files) > 20 and any(f.name.endswith(".log") for f in files)
    assert [f for f in files if PASSWORD.encode() in f.read_bytes()] == []
    with pytest.raises(StoreError, match="password authentication failed") as e:
        ResultStore.open(team.replace(PASSWORD, "wrong-Pw52"))
    assert "wrong-Pw52" not in str(e.value)


def test_an_unreachable_store_is_one_line_and_the_search_goes_on(tmp_path):
    url = "postgresql://autotune:Pw52-unreachable@127.0.0.1:1/nowhere"
    proc = _cli("search", str(_spec(tmp_path, "out", confirm_repeats=0)), "--trials", "1",
                env={"AUTOTUNE_STORE": url})
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = _store_lines(proc.stderr)
    assert len(said) == 1 and "unreachable" in said[0] and "searching without it" in said[0]
    assert "postgresql+psycopg://autotune:***@127.0.0.1:1/nowhere: unreachable" in said[0]
    assert "Pw52-unreachable" not in proc.stdout + proc.stderr + (
        tmp_path / "out" / "summary.json").read_text()
    assert _summary(tmp_path / "out")["trials"]
