"""The results store without a search: fingerprints, the store on SQLite and on a real
PostgreSQL, the check on read, translating a record's winners, the calibration it carries
and what seeding is worth in the bench. (The searches: test_remember.py.)"""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune import versions
from autotune.config import Family, TrialConfig
from autotune.device import DeviceSpec, named_device
from autotune.space import build_space, load_space
from autotune.spec import load_spec
from autotune.store.db import ResultStore, StoreError, default_url, store_url
from autotune.store.fingerprint import fingerprint_of
from autotune.store.record import SCHEMA_VERSION, StoredResult
from autotune.summary import Confirmation, ConfirmedConfig
from autotune.tuning.reconfirm import Check, band, noise, t_quantile, verdict
from autotune.tuning.strategies.base import SearchContext
from autotune.tuning.strategies.seeded import translate
from tests.conftest import TINY_SPEC

ROOT = Path(__file__).resolve().parents[1]
CPU = DeviceSpec("cpu", "cpu", 16 * 2**30)


def _fingerprint(spec_dict: dict, device: DeviceSpec = CPU):
    from autotune.plan.shape import model_shape

    spec = load_spec(spec_dict)
    space = build_space(spec, device, load_space("default", spec.target_batch_size))
    return fingerprint_of(spec, device, space, model_shape(spec))


# --- fingerprints -----------------------------------------------------------------------

def test_the_same_model_inline_or_in_a_folder_is_one_fingerprint(tmp_path):
    import transformers

    inline = copy.deepcopy(TINY_SPEC)
    cfg = dict(inline["model"]["config"])
    transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(
        tmp_path / "ckpt")
    folder = copy.deepcopy(TINY_SPEC) | {"model": {"name_or_path": str(tmp_path / "ckpt")}}
    a, b = _fingerprint(inline), _fingerprint(folder)
    assert a.key == b.key and a.near_key == b.near_key
    wider = copy.deepcopy(TINY_SPEC)
    wider["model"]["config"]["n_embd"] = 64
    assert _fingerprint(wider).key != a.key and _fingerprint(wider).near_key != a.near_key


def test_a_rule_added_since_makes_a_record_a_near_match():
    """A newer autotune that rules out more of the same space (2026-11-27: ZeRO-3 alone
    on one rank) may not be answered by a winner chosen among what it now rules out."""
    from autotune.plan.shape import model_shape

    spec = load_spec(TINY_SPEC)
    space = build_space(spec, CPU, load_space("default", spec.target_batch_size))
    now = fingerprint_of(spec, CPU, space, model_shape(spec))
    assert "zero_stage=3 without offload=optimizer+param on one rank" in now.exact["ruled_out"]
    before = dataclasses.replace(space, pruned={
        k: v for k, v in space.pruned.items() if "on one rank" not in k})
    then = fingerprint_of(spec, CPU, before, model_shape(spec))
    assert then.key != now.key and then.near_key == now.near_key


def test_real_rows_are_keyed_by_their_lengths_not_their_path(tmp_path):
    from tests.test_data import make_tokenizer  # a local tokenizer, no download

    rows = [{"text": " ".join(["word"] * n)} for n in (5, 20, 40, 80, 12, 33)]
    make_tokenizer(tmp_path / "tok", [r["text"] + " more" for r in rows])
    tok = str(tmp_path / "tok")
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"text": r["text"] + " more"}) + "\n"
                                              for r in rows))

    def spec(source: str, seq: int = 32) -> dict:
        return copy.deepcopy(TINY_SPEC) | {"data": {"source": str(tmp_path / source),
                                                    "tokenizer": tok, "seq_len": seq}}

    a, b, c = (_fingerprint(spec(s)) for s in ("a.jsonl", "b.jsonl", "c.jsonl"))
    assert a.key == b.key  # other rows of the same lengths (a copy moved elsewhere)
    assert c.key != a.key  # longer rows
    shorter = _fingerprint(spec("a.jsonl", 24))
    assert shorter.key != a.key and shorter.near_key == a.near_key  # another seq_len: near
    assert _fingerprint(copy.deepcopy(TINY_SPEC)).near_key != a.near_key  # synthetic


def test_a_kin_device_or_other_versions_are_near_not_exact(monkeypatch):
    spec = copy.deepcopy(TINY_SPEC)
    a10g, l4 = _fingerprint(spec, named_device("A10G-24GB")), _fingerprint(spec, named_device(
        "L4-24GB"))
    assert a10g.key != l4.key and a10g.near_key == l4.near_key  # both compute capability 8.x
    a100, h100 = _fingerprint(spec, named_device("A100-80GB")), _fingerprint(
        spec, named_device("H100-80GB"))
    assert a100.near_key != h100.near_key  # 8.0 and 9.0: another family
    before = _fingerprint(spec)
    newer = versions.library_versions() | {"bitsandbytes": "0.41.0"}
    monkeypatch.setattr(versions, "library_versions", lambda: newer)
    after = _fingerprint(spec)
    assert after.key != before.key and after.near_key == before.near_key
    assert after.exact["versions"]["cuda"] and "liger-kernel" in after.exact["versions"]


def test_a_resumed_study_refuses_each_upgrade_that_makes_a_record_near(tmp_path, monkeypatch):
    """One list of the measuring libraries (autotune/versions.py) for both: each one's
    upgrade, torch's CUDA too, makes the store's record a near match and a resumed study
    refuse to mix its trials with the old ones. (The study's own list once missed TRL,
    PEFT, flash-attn, Liger and CUDA, and resumed across them.)"""
    from autotune.errors import SpecError
    from autotune.plan.shape import model_shape
    from autotune.tuning.run import fingerprint as study_key
    from autotune.tuning.study import StudyLog

    spec = load_spec(TINY_SPEC)
    space = build_space(spec, CPU, load_space("default", spec.target_batch_size))
    shape, storage = model_shape(spec), f"sqlite:///{tmp_path / 'study.db'}"
    real = versions.library_versions()
    assert set(real) == {*versions.MEASURING_LIBRARIES, "cuda"} and len(real) == 10
    assert {"trl", "peft", "flash-attn", "liger-kernel"} <= set(real)
    record = fingerprint_of(spec, CPU, space, shape)
    StudyLog.open(storage, "s", study_key(spec, CPU, space.space), {}, 1 << 30)
    for name in real:
        monkeypatch.setattr(versions, "library_versions", lambda n=name: real | {n: "0.0.1"})
        now = fingerprint_of(spec, CPU, space, shape)
        assert now.key != record.key and now.near_key == record.near_key, name
        with pytest.raises(SpecError, match="library versions"):
            StudyLog.open(storage, "s", study_key(spec, CPU, space.space), {}, 1 << 30)
    monkeypatch.setattr(versions, "library_versions", lambda: dict(real))
    assert fingerprint_of(spec, CPU, space, shape).key == record.key
    StudyLog.open(storage, "s", study_key(spec, CPU, space.space), {}, 1 << 30)  # resumes


def test_the_store_is_the_flag_then_the_environment_then_the_user_cache(monkeypatch,
                                                                        tmp_path):
    monkeypatch.delenv("AUTOTUNE_STORE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert store_url() == default_url() == f"sqlite:///{tmp_path}/cache/autotune/results.db"
    monkeypatch.setenv("AUTOTUNE_STORE", "postgresql://team@db/autotune")
    assert store_url() == "postgresql://team@db/autotune"
    assert store_url("sqlite:///x.db") == "sqlite:///x.db"
    assert store_url("off") is None
    monkeypatch.setenv("AUTOTUNE_STORE", "off")
    assert store_url() is None
    assert load_spec(copy.deepcopy(TINY_SPEC) | {"search": {"store": False}}).search.store == (
        "off")  # YAML's bare `off`
    with pytest.raises(Exception, match="search.store: .*mysql"):
        load_spec(copy.deepcopy(TINY_SPEC) | {"search": {"store": "mysql://u@h/db"}})


# --- the store, on SQLite and on PostgreSQL -----------------------------------------------

@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'results.db'}"
    return request.getfixturevalue("postgres_url")


def _record(key: str = "k1", near: str = "n1", seq: int = 128, model: str = "gpt2",
            created: str = "2026-11-27T10:00:00+00:00", **kw) -> StoredResult:
    summary = {"model": {"name": model}, "device": {"name": "L4-24GB", "count": 1},
               "seq_len": seq, "target_batch_size": 32, "best": None, "confirmation": None}
    return StoredResult(key, near, {"versions": {"torch": "2.13.0"}}, {}, summary, "/runs/x",
                        created=created, **kw)


def test_records_go_in_and_come_back_by_exact_and_near_key(url):
    store = ResultStore.open(url)
    old, new = _record(created="2026-11-20T00:00:00+00:00"), _record()
    other = _record("k2", seq=96, model="llama-8b")
    for r in (old, new, other):
        assert store.put(r)
    assert not store.put(new)  # the same record again (an import twice) is not doubled
    assert [r.uid for r in store.exact("k1").records] == [new.uid, old.uid]  # newest first
    assert {r.uid for r in store.near("n1").records} == {old.uid, new.uid, other.uid}
    assert [r.uid for r in store.records(model="LLAMA").records] == [other.uid]
    assert store.records(device="h100").records == []
    assert store.exact("k1").records[0].to_dict() == new.to_dict()
    store.close()
    assert len(ResultStore.open(url).records().records) == 3  # a new connection sees them


def test_a_newer_autotunes_record_is_skipped_with_a_note_and_moves_whole(url, tmp_path):
    store = ResultStore.open(url)
    mine = _record()
    newer = _record(created="2026-12-01T00:00:00+00:00").to_dict() | {
        "schema": SCHEMA_VERSION + 1, "autotune_version": "9.9.0", "a_field_we_lack": [1]}
    store.put(mine)
    store.put(newer)
    found = store.exact("k1")
    assert [r.uid for r in found.records] == [mine.uid]
    assert found.notes == [f"skipped 1 record written by autotune 9.9.0 (a newer record "
                           f"schema than this autotune's {SCHEMA_VERSION}): upgrade autotune "
                           "to use them"]
    # Export keeps it as it was; import elsewhere keeps it too.
    lines = list(store.export_lines())
    assert len(lines) == 2 and any('"a_field_we_lack": [1]' in line for line in lines)
    other = ResultStore.open(f"sqlite:///{tmp_path / 'other.db'}")
    counts = other.import_lines([*lines, "not json", '{"schema": 1}', ""])
    assert (counts["added"], counts["present"], counts["newer"]) == (2, 0, 1)
    assert [b.split(":")[0] for b in counts["bad"]] == ["line 3", "line 4"]
    assert other.import_lines(lines)["present"] == 2


HOLD_S = 0.2  # SQLite: how long a writer holds its transaction open for the other to wait


def _writer(url: str, who: str, other: str, n: int, folder: str) -> None:
    """One of two processes writing at once (run by the test below). They take turns: in
    round i one inserts its record and holds the transaction open, uncommitted, until the
    other has called put and it has returned (PostgreSQL: both transactions open at once)
    or HOLD_S has passed (SQLite: the other's put waits for its lock). Each writes what it
    saw to `folder`/`who`.json."""
    from autotune.store.db import ResultStore

    here, store, seen = Path(folder), ResultStore.open(url), []
    wait_s = HOLD_S if url.startswith("sqlite") else 60.0

    def wait(name: str, timeout: float = 60.0) -> bool:
        deadline = time.time() + timeout
        while not (here / name).exists():
            if time.time() > deadline:
                return False
            time.sleep(0.001)
        return True

    for i in range(n):
        record = _record(key=f"k-{who}-{i}", near="n")
        if (i % 2 == 0) == (who == "a"):  # this round's holder
            with store.engine.begin() as conn:
                conn.execute(store.table.insert().values(**store._row(record)))
                (here / f"held-{i}").touch()
                assert wait(f"asked-{i}"), f"round {i}: {other} never asked"
                answered = wait(f"put-{i}", wait_s)  # committed on leaving the block
            seen.append({"round": i, "answered_while_held": answered})
        else:
            assert wait(f"held-{i}"), f"round {i}: {other} never held"
            (here / f"asked-{i}").touch()
            store.put(record)
            (here / f"put-{i}").touch()
    (here / f"{who}.json").write_text(json.dumps(seen))


def test_two_processes_writing_at_once_lose_no_record(url, tmp_path):
    """What two searches that finish together do, provably at once: in each of 20 rounds
    one process holds its insert's transaction open while the other puts its record.
    PostgreSQL writes the other's record meanwhile; SQLite makes it wait for the lock
    (up to 30 s) and then writes it. Neither loses one."""
    ResultStore.open(url).close()  # the table, as the first search would make it
    n, folder = 20, tmp_path / "turns"
    folder.mkdir()
    procs = [subprocess.Popen(
        [sys.executable, "-c", f"from tests.test_store import _writer; _writer({url!r}, "
         f"{who!r}, {other!r}, {n}, {str(folder)!r})"], cwd=ROOT, stderr=subprocess.PIPE,
        text=True) for who, other in (("a", "b"), ("b", "a"))]
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read()
    held = [t for who in "ab" for t in json.loads((folder / f"{who}.json").read_text())]
    assert sorted(t["round"] for t in held) == list(range(n))  # each round held once
    # PostgreSQL: every other put ended while the holder's transaction was still open;
    # SQLite: none could (it waited for the holder's commit).
    on_postgres = url.startswith("postgresql")
    assert [t["answered_while_held"] for t in held] == [on_postgres] * n, held
    keys = {r.key for r in ResultStore.open(url).near("n").records}
    assert keys == {f"k-{who}-{i}" for who in "ab" for i in range(n)}


def test_an_unreachable_or_read_only_store_says_so_in_one_line(tmp_path, postgres_url):
    with pytest.raises(StoreError) as e:
        ResultStore.open("postgresql://autotune@127.0.0.1:1/nothing")
    assert "unreachable" in str(e.value) and "\n" not in str(e.value)
    for bad, said in (("mysql://u@h/db", "the mysql driver is not installed"),
                      ("nonsense", "is not a database URL")):
        with pytest.raises(StoreError, match=said):
            ResultStore.open(bad)
    made = tmp_path / "made.db"
    ResultStore.open(f"sqlite:///{made}").put(_record())
    for ro in (f"sqlite:///file:{made}?mode=ro&uri=true",
               postgres_url + "?options=-c%20default_transaction_read_only%3Don"):
        if ro.startswith("postgresql"):
            ResultStore.open(postgres_url).put(_record())
        store = ResultStore.open(ro)
        assert len(store.exact("k1").records) == 1  # read: yes
        with pytest.raises(StoreError, match="cannot write .*read") as e:
            store.put(_record())
        assert "\n" not in str(e.value)


# --- the check on read --------------------------------------------------------------------

def _row(role: str, xs: list[float], batch: int = 8) -> ConfirmedConfig:
    return ConfirmedConfig(role, TrialConfig.of(batch, 16 // batch), None, xs)


def test_the_recorded_interval_is_a_prediction_interval_from_the_records_own_noise():
    import math

    c = Confirmation(3, 10, [_row("best", [100.0, 103.0, 97.0]),
                             _row("baseline", [50.0, 51.5, 48.5], 16)], None)
    s, df = noise(c)
    assert df == 4 and s == pytest.approx(0.03, abs=0.001)  # each row ±3%: sd of the logs
    low, high = band(c.rows[0], s, df)
    centre = math.exp(sum(math.log(x) for x in (100.0, 103.0, 97.0)) / 3)
    half = 4.604 * s * math.sqrt(1 + 1 / 3)  # t(0.995, 4 df), one new run against 3
    assert (low, high) == pytest.approx((centre * math.exp(-half), centre * math.exp(half)))
    slower = Check("winner", "b8x2 fp32", c.rows[0].samples_per_second, low, high, 0.82 * centre,
                   "ok")
    assert not slower.ok and slower.why().startswith("the winner ran 18% slower than recorded")
    # Quiet repeats are held to the 2% floor, not to their chance agreement.
    quiet = Confirmation(3, 10, [_row("best", [100.0, 100.1, 99.9])], None)
    assert noise(quiet) == (0.02, 2)
    held = Check("baseline", "b16x1 fp32", [50.0], 45.0, 55.0, 50.5, "ok")
    assert held.ok and verdict([held], {"torch": "2.14.0", "cuda": "12.8"}) is None
    said = verdict([slower, held], {"torch": "2.14.0", "cuda": "12.8"})
    assert said.endswith("with torch 2.14.0 (CUDA 12.8)") and "\n" not in said
    # No repeats: no noise measured, a stated width and the normal quantile.
    assert noise(Confirmation(1, 10, [_row("best", [100.0])], None)) == (0.10, 0)
    assert t_quantile(0) == pytest.approx(2.576)
    oom = Check("winner", "b8x2 fp32", [100.0], 80, 120, None, "oom", "out of memory")
    assert oom.why() == "the winner's run ended oom: out of memory"


# --- seeding --------------------------------------------------------------------------------

def _ctx(batches=(1, 2, 4, 8, 16), families=None) -> SearchContext:
    families = families or [Family.of({"precision": p, "optim": o})
                            for p in ("fp32", "bf16") for o in ("adamw_torch",
                                                                "adamw_torch_fused")]
    candidates = [f.config(b, 16) for f in families for b in batches]
    return SearchContext(candidates, CPU, 1, 16, 2**30)


def test_a_recorded_winner_is_translated_to_this_space():
    ctx = _ctx()
    recorded = TrialConfig.of(8, 2, precision="bf16", optim="adamw_torch_fused").to_dict()
    # The same seq_len: the same config.
    assert translate(recorded, ctx) == TrialConfig.of(8, 2, precision="bf16",
                                                      optim="adamw_torch_fused")
    # Recorded at seq 128, searched at 32: as many tokens a micro-batch is 32 rows (16 here).
    assert translate(recorded, ctx, 128 / 32).per_device_train_batch_size == 16
    assert translate(recorded, ctx, 128 / 256).per_device_train_batch_size == 4
    # A value this space lacks takes what Trainer's defaults have here.
    lion = recorded | {"optim": "adamw_bnb_8bit"}
    assert translate(lion, ctx).optim == "adamw_torch"
    # A family the device rules took out here is no seed.
    fp32_only = _ctx(families=[Family.of({"precision": "fp32"})])
    assert translate(recorded | {"optim": "adamw_torch"}, fp32_only).precision == "fp32"
    odd = recorded | {"per_device_train_batch_size": 3}  # nearest on a log scale: 4
    assert translate(odd, ctx).per_device_train_batch_size == 4


def test_a_near_records_calibration_starts_the_memory_model():
    """Measured peaks of the CPU landscape (in the repository) calibrate a model; a model
    started from its term scales predicts an unmeasured config as the calibrated one
    does, before it has measured anything, where the uncalibrated physics is off."""
    from autotune.bench.landscape import load_landscape
    from autotune.plan.calibration import MemoryModel
    from autotune.records import Record

    land = load_landscape(ROOT / "benchmarks" / "landscapes" / "cpu-tiny-gpt2-2core")
    ok = [(c, o) for c, o in sorted(land.table.items()) if o.ok]
    seen, unseen = ok[::2], ok[1::2]
    records = [Record(c, o, "model") for c, o in seen]
    fitted = MemoryModel.from_history(land.shape, land.device, 1, records,
                                      land.device.memory_bytes)
    started = MemoryModel(land.shape, land.device, 1, prior=fitted.term_scales())
    bare = MemoryModel(land.shape, land.device, 1)

    def error(model: MemoryModel) -> float:
        return sum(abs(model.predict_total(c) - o.peak_memory_bytes) / o.peak_memory_bytes
                   for c, o in unseen) / len(unseen)

    assert error(started) < 0.8 * error(bare)
    assert started.term_scales() == pytest.approx(fitted.term_scales())
    assert MemoryModel(land.shape, land.device, 1, prior={"gone": 3.0}).term_scales() == (
        bare.term_scales())


def test_bench_seeding_runs_the_recorded_winners_first(tmp_path, monkeypatch):
    """`autotune bench --seeded-from`: on a pair our own simulator makes (GPT-2 on an
    A100 at seq 1024, then 768), the seeded search's first trial is the recorded winner,
    far above the unseeded one's first (Trainer's defaults)."""
    import importlib.util

    from rich.console import Console

    from autotune.bench.seeding import seeding_main

    spec = importlib.util.spec_from_file_location(
        "simulate_landscape", ROOT / "benchmarks" / "simulate_landscape.py")
    sim = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "simulate_landscape", sim)  # its dataclasses look it up
    spec.loader.exec_module(sim)
    gpt2 = next(s for s in sim.GPUKNOB_SCENARIOS if "gpt2-small" in s.name)
    sim.main(str(tmp_path), near_too=True, scenarios=[gpt2])
    out = Console(record=True, width=250)
    records = seeding_main([str(tmp_path / sim.near(gpt2).name)], [str(tmp_path / gpt2.name)],
                           0.005, 1, out)
    r = records[0]
    assert r["seeds"] >= 1
    assert r["seeded"]["first_trial_quality"] > 0.9 > r["unseeded"]["first_trial_quality"]
    assert "sim2-gpt2-small-a100-40gb-gpuknobs-seq768" in out.export_text()


def test_a_studys_postgresql_url_opens_with_the_driver_autotune_installs(postgres_url):
    """`search.storage: postgresql://...` (the URL a team writes) is psycopg 3's, as the
    results store's is, whatever SQLAlchemy's default driver (psycopg2 before 2.1, which
    autotune does not install)."""
    from autotune.dburl import sqlalchemy_url
    from autotune.spec import Spec
    from autotune.tuning.study import StudyLog, summary_from_storage
    from tests.conftest import TINY_SPEC

    assert postgres_url.startswith("postgresql://")
    assert sqlalchemy_url(postgres_url).drivername == "postgresql+psycopg"
    assert sqlalchemy_url("postgresql+psycopg2://u@h/db").drivername == "postgresql+psycopg2"
    spec = Spec.model_validate(TINY_SPEC | {"search": TINY_SPEC["search"] | {
        "storage": postgres_url}})
    log = StudyLog.open(spec.search.storage, "shared", "key", {}, 1 << 30)
    log.save_summary({"autotune_version": "test"})
    assert StudyLog.open(postgres_url, "shared", "key", {}, 1 << 30).study.study_name == (
        "shared")
    assert summary_from_storage(postgres_url, "shared")["autotune_version"] == "test"
