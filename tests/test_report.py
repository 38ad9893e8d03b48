"""report.md / report.html / terminal summary from summary.json fixtures.

The fixtures are Summary objects, the schema a search writes; the slow test renders the
HTML in headless Chromium and checks every plot drew with no JavaScript error.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import pytest
from rich.console import Console

from autotune.config import TrialConfig
from autotune.device import DeviceSpec
from autotune.errors import AutotuneError
from autotune.outputs.report import (
    DASH,
    columns,
    fmt_seconds,
    headline,
    projected_seconds,
    render_summary,
    write_report,
)
from autotune.outputs.report_plots import PANELS, pareto_front, shown_knobs
from autotune.records import TOKENS_PER_SECOND, Measurement, Outcome, Phases, Record
from autotune.summary import Summary, load_summary

ROOT = Path(__file__).resolve().parents[1]
MiB = 1024**2
GiB = 1024**3
CHROMIUM = Path("/usr/bin/chromium")

# --- fixtures: the Summary a search builds ---------------------------------------------


def _config(batch: int, precision: str = "fp32", optim: str = "adamw_torch",
            ckpt: bool = False, zero: int = 0, offload: str = "none",
            target: int = 64) -> TrialConfig:
    return TrialConfig.of(batch, target // batch, precision=precision, optim=optim,
                          gradient_checkpointing=ckpt, zero_stage=zero, offload=offload)


def _outcome(status: str, sps: float | None = None, peak: int | None = None,
             predicted: int | None = None, error: str | None = None,
             seq_len: int = 128, mfu: float | None = None) -> Outcome:
    ran = status not in ("pruned",)
    return Outcome(status, samples_per_second=sps,
                   tokens_per_second=sps * seq_len if sps is not None else None,
                   peak_memory_bytes=peak, step_seconds=[64 / sps] * 5 if sps else [],
                   wall_seconds=14.5 if ran else None,
                   timed_seconds=5 * 64 / sps if sps else None,
                   predicted_memory_bytes=predicted, error=error,
                   measured=Measurement(mfu=mfu))


def _trial(number: int, config: TrialConfig, outcome: Outcome, reason: str) -> Record:
    return Record(config, outcome, reason, number)


TRACEBACK = ("Traceback (most recent call last):\n  File \"trial.py\", line 3, in run\n"
             "    trainer.train()\ntorch.OutOfMemoryError: CUDA out of memory. "
             "Tried to allocate 2.00 GiB | <script>alert(1)</script>")


def normal_trials() -> list[Record]:
    """A dozen trials covering every status, knob values and a pruned prediction."""
    return [
        _trial(0, _config(8), _outcome("ok", 410.0, 700 * MiB, 650 * MiB), "baseline"),
        _trial(1, _config(32), _outcome("ok", 520.0, 1300 * MiB, 1250 * MiB), "frontier"),
        _trial(2, _config(64), _outcome("oom", None, 2100 * MiB, 2300 * MiB, TRACEBACK),
               "frontier"),
        _trial(3, _config(32, "bf16", "adamw_torch_fused"),
               _outcome("ok", 760.0, 1100 * MiB, 1000 * MiB, mfu=0.41), "sampler"),
        _trial(4, _config(16, "bf16", "adamw_torch", ckpt=True),
               _outcome("ok", 600.0, 600 * MiB, 640 * MiB), "sampler"),
        _trial(5, _config(32, "bf16", "adamw_bnb_8bit", zero=2, offload="optimizer"),
               _outcome("ok", 380.0, 900 * MiB, 980 * MiB), "sampler"),
        _trial(6, _config(16, "fp32", "adamw_torch", zero=3, offload="optimizer+param"),
               _outcome("error", error="RuntimeError: boom\nValueError: last line"),
               "sampler"),
        _trial(7, _config(8, "bf16"), _outcome("nan", None, 500 * MiB, None), "sampler"),
        _trial(8, _config(4, "bf16", zero=1), _outcome("timeout"), "sampler"),
        _trial(9, _config(2), _outcome("crashed", peak=300 * MiB), "sampler"),
        _trial(10, _config(64, "bf16", ckpt=False), _outcome("pruned", predicted=3 * GiB),
               "predicted-oom: 3.0 GiB > 2.0 GiB"),
        _trial(11, _config(16, "bf16", "adamw_torch_fused"),
               _outcome("ok", 700.0, 800 * MiB, 760 * MiB), "sampler"),
    ]


def make_summary(kind: str = "normal") -> Summary:
    """The Summary of a search, for kind in: normal, empty, all_oom, no_baseline."""
    trials = {
        "normal": normal_trials,
        "empty": list,
        "all_oom": lambda: [_trial(i, _config(b), _outcome("oom", None, 2 * GiB, 3 * GiB,
                                                          TRACEBACK), "frontier")
                            for i, b in enumerate((64, 32, 16))],
        "no_baseline": lambda: [t for t in normal_trials() if t.reason != "baseline"],
    }[kind]()
    has_best = any(t.outcome.ok for t in trials)
    return Summary(
        model={"name": "tiny-gpt2", "num_parameters": 1_234_567, "num_layers": 2,
               "hidden_size": 64, "num_attention_heads": 2, "vocab_size": 1000,
               "seq_len": 128, "causal_lm": True},
        device=DeviceSpec("cpu", "cpu", 25_000_000_000),
        memory_limit_bytes=2 * GiB, target_batch_size=64, world_size=1, seq_len=128,
        trials=trials,
        pruned_by_rules={"fp16": "fp16 needs CUDA", "tf32": "tf32 needs an Ampere GPU"},
        search={"wall_seconds": 195.2, "study_name": "autotune-abc",
                "storage": "sqlite:///x.db"},
        exports={"training_args": "training_args.json", "deepspeed": None} if has_best else {},
        projection={"steps": 10_000, "tokens": None},
        memory_components={"weights": 400 * MiB, "gradients": 200 * MiB,
                           "optimizer": 300 * MiB, "activations": 150 * MiB,
                           "buffers": 50 * MiB} if has_best else None)


def write_summary(tmp_path: Path, summary: Summary) -> Path:
    summary.write(tmp_path)
    return tmp_path


# --- unit tests -----------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["normal", "empty", "all_oom", "no_baseline"])
def test_write_report_every_fixture(tmp_path: Path, kind: str) -> None:
    md, html = write_report(write_summary(tmp_path, make_summary(kind)))
    assert md == tmp_path / "report.md" and html == tmp_path / "report.html"
    text, page = md.read_text(), html.read_text()
    assert "-1" not in re.sub(r"\d-1|-1\d", "", text)  # no placeholder figures
    assert "None" not in text
    assert page.count("* plotly.js v") == 1  # the bundle is inlined once, whatever the plots
    assert html.stat().st_size < 5.5 * 1024**2
    n_trials = len(make_summary(kind).trials)
    assert f"Trials ({n_trials})" in text and f"Trials ({n_trials})" in page


def test_normal_report_has_every_plot_and_facts(tmp_path: Path) -> None:
    _, html = write_report(write_summary(tmp_path, make_summary("normal")))
    page = html.read_text()
    for panel in PANELS:
        assert f'id="{panel.div_id}"' in page
    assert "1.85×" in page  # 760 / 410
    assert "41.0%" in page  # MFU from outcome.measured
    assert "&lt;script&gt;alert(1)" in page and "<script>alert(1)" not in page
    assert "TrainingArguments(**json.load(open(&quot;training_args.json&quot;))" in page
    assert "--deepspeed" not in page  # no ds_config exported for this winner
    assert 'class="best"' in page and "fp16 needs CUDA" in page


def test_markdown_headline_table_and_files(tmp_path: Path) -> None:
    md, _ = write_report(write_summary(tmp_path, make_summary("normal")))
    text = md.read_text()
    assert "# autotune report: tiny-gpt2 on CPU" in text
    assert "| **Best config** | b32x2 bf16 adamw_torch_fused |" in text
    assert "[report.html](report.html)" in text and "[`training_args.json`]" in text
    rows = [ln for ln in text.splitlines() if re.match(r"\| \d+ \|", ln)]
    assert len(rows) == 12 and rows[0].startswith("| 3 |")  # fastest first
    assert "ValueError: last line" in text and "\\|" in text  # error tail, pipes escaped
    assert "&lt;script>" in text and "<script>" not in text  # < read as HTML; > as it is


def test_deepspeed_export_gives_the_flag(tmp_path: Path) -> None:
    summary = make_summary("normal")
    summary.exports = {"training_args": "training_args.json", "deepspeed": "ds_config.json"}
    md, html = write_report(write_summary(tmp_path, summary))
    assert "--deepspeed ds_config.json" in md.read_text()
    assert 'href="ds_config.json"' in html.read_text()


def test_empty_and_all_oom_show_dashes(tmp_path: Path) -> None:
    for kind in ("empty", "all_oom"):
        facts = {f.label: f for f in headline(make_summary(kind))}
        assert facts["Best config"].value == "none"
        assert facts["Throughput"].value == DASH and facts["MFU"].value == DASH
        assert facts["Speedup"].value == DASH
        assert facts["Full run"].value == DASH
    md, html = write_report(write_summary(tmp_path, make_summary("all_oom")))
    assert "No files exported" in md.read_text()
    assert 'id="plot-throughput"' in html.read_text()  # OOMs still placed by memory


def test_no_baseline_says_so() -> None:
    facts = {f.label: f for f in headline(make_summary("no_baseline"))}
    assert facts["Speedup"].detail == "no baseline trial succeeded"
    assert facts["Best config"].value == "b32x2 bf16 adamw_torch_fused"


def test_the_title_says_how_the_ranks_sit_and_are_linked() -> None:
    """A trial over two 8-GPU nodes: the nodes, the GPUs on each and the links the probe
    read; one node says nothing of a network it does not use."""
    from dataclasses import replace

    from autotune.outputs.report import _title

    summary = make_summary("normal")
    h100 = DeviceSpec("H100-80GB", "cuda", 80 * GiB, (9, 0))
    spread = replace(summary, device=replace(h100, count=16, nodes=2, links={
        "intra": "NVLink", "inter": "InfiniBand 400 Gb/s"}))
    assert _title(spread) == ("tiny-gpt2 on 2 nodes × 8× H100-80GB (NVLink inside, "
                              "InfiniBand 400 Gb/s between)")
    one = replace(summary, device=replace(h100, count=8, links={
        "intra": "NVLink", "inter": "Ethernet 100 Gb/s"}))
    assert _title(one) == "tiny-gpt2 on 8× H100-80GB (NVLink inside)"
    cpus = replace(summary, device=DeviceSpec("cpu", "cpu", 16 * GiB, count=2, nodes=2))
    assert _title(cpus) == "tiny-gpt2 on 2 nodes × CPU"


def test_projection_forms() -> None:
    s = make_summary("normal")
    best = s.best
    assert projected_seconds(s, best) == pytest.approx(10_000 * 64 / 760)
    s.projection = {"steps": None, "tokens": 760 * 128 * 30}
    assert projected_seconds(s, best) == pytest.approx(30)
    s.projection = {}
    assert projected_seconds(s, best) is None
    facts = {f.label: f for f in headline(s)}
    assert "set run.steps or run.tokens" in facts["Full run"].detail
    assert fmt_seconds(3 * 3600 + 125) == "3 h 02 min" and fmt_seconds(None) == DASH
    assert fmt_seconds(-1) == DASH


def test_pareto_front_keeps_only_undominated() -> None:
    front = [t.number for t in pareto_front(normal_trials())]
    assert front == [4, 11, 3]  # 600 MiB/600, 800 MiB/700, 1100 MiB/760


def test_render_summary_rich(tmp_path: Path) -> None:
    console = Console(record=True, width=160)
    render_summary(load_summary(write_summary(tmp_path, make_summary("normal"))), console)
    out = console.export_text()
    assert "tiny-gpt2 on CPU" in out and "b32x2 bf16 adamw_torch_fused" in out
    assert "top 10 of 12 trials" in out and "-1" not in out
    empty = Console(record=True, width=120)
    render_summary(make_summary("empty"), empty)
    assert "no trial ran" in empty.export_text()


def test_load_summary_errors(tmp_path: Path) -> None:
    with pytest.raises(AutotuneError, match="autotune search"):
        load_summary(tmp_path)
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(AutotuneError, match="not valid JSON"):
        load_summary(tmp_path)


def test_missing_figures_never_crash(tmp_path: Path) -> None:
    """A bare factory model and a single trial that measured nothing."""
    summary = Summary(model={"name": "m"}, device=None, memory_limit_bytes=0,
                      target_batch_size=64,
                      trials=[_trial(0, _config(8), Outcome("crashed"), "baseline")])
    md, html = write_report(write_summary(tmp_path, summary))
    assert DASH in md.read_text() and "No trial measured anything" in html.read_text()


# --- end to end: the page in a real browser -------------------------------------------

def _chromium() -> Path | None:
    """Chromium, installed on demand by the setup script where that is possible."""
    if not CHROMIUM.exists():
        script = ROOT / "scripts" / "setup_test_browser.sh"
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            subprocess.run(["bash", str(script)], check=False, timeout=900,
                           capture_output=True)
    return CHROMIUM if CHROMIUM.exists() else None


def _run_chromium(args: list[str], profile: str) -> subprocess.CompletedProcess[str]:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--hide-scrollbars", f"--user-data-dir={profile}",
             "--enable-logging=stderr", "--v=0", "--virtual-time-budget=15000"]
    return subprocess.run([str(CHROMIUM), *flags, *args], capture_output=True, text=True,
                          timeout=180, env=os.environ | {"HOME": profile})


# Recorded into the DOM so --dump-dom shows any error the page raised.
ERROR_PROBE = """<script>
(function(){ const name = "data-" + "jserrors", root = document.documentElement;
  const note = m => root.setAttribute(name, (root.getAttribute(name) || "") + m + ";");
  window.addEventListener("error", e => note(e.message));
  window.addEventListener("unhandledrejection", e => note(String(e.reason)));
  const ce = console.error; console.error = (...a) => { note(a.join(" ")); ce(...a); };
})();</script>"""


# Clicks a header of the trials table twice (descending, then ascending) and records the
# order of the first column after each click.
SORT_PROBE = """<script>
(function(){ const t = document.getElementById("trials"); if (!t) return;
  const order = () => Array.from(t.tBodies[0].rows).map(r => r.cells[0].textContent).join(",");
  const th = t.tHead.rows[0].cells[%d]; th.click(); const desc = order(); th.click();
  t.setAttribute("data-sorted", desc + "|" + order()); })();</script>"""


def _rendered_dom(html: Path, sort_column: int = 0) -> str:
    """The page's DOM after its scripts ran, asserting no script raised or logged an error."""
    page = html.read_text().replace("<head>", "<head>" + ERROR_PROBE, 1)
    with tempfile.TemporaryDirectory() as profile:
        probed = Path(profile) / "probed.html"  # the page is self-contained: any folder does
        probed.write_text(page.replace("</body>", SORT_PROBE % sort_column + "</body>", 1))
        run = _run_chromium(["--dump-dom", probed.as_uri()], profile)
    assert run.returncode == 0 and "</html>" in run.stdout, run.stderr[-2000:]
    assert "data-jserrors=" not in run.stdout, re.findall(r'data-jserrors="[^"]*"', run.stdout)
    assert "Uncaught" not in run.stderr, run.stderr[-2000:]
    return run.stdout


def _assert_plots_drew(dom: str, div_ids: list[str]) -> None:
    for div_id in div_ids:  # Plotly put its SVG inside each plot's div
        segment = dom.split(f'id="{div_id}"', 1)
        assert len(segment) == 2, f"{div_id} missing"
        body = re.split(r'id="plot-', segment[1], maxsplit=1)[0]
        assert 'class="main-svg"' in body, f"{div_id} did not draw"


@pytest.mark.slow
def test_report_renders_in_chromium(tmp_path: Path) -> None:
    if _chromium() is None:
        pytest.skip("chromium is not installed and could not be installed")
    _, html = write_report(write_summary(tmp_path, make_summary("normal")))
    dom = _rendered_dom(html)
    _assert_plots_drew(dom, [p.div_id for p in PANELS])
    assert dom.count('<tr class="best">') == 1
    desc, asc = re.search(r'data-sorted="([^"]*)"', dom).group(1).split("|")
    assert desc == ",".join(str(n) for n in range(11, -1, -1))  # sorted by "#"
    assert asc == ",".join(str(n) for n in range(12))
    sps = _rendered_dom(html, sort_column=columns(shown_knobs(make_summary("normal").trials))
                        .index("samples/s"))
    desc, _ = re.search(r'data-sorted="([^"]*)"', sps).group(1).split("|")
    assert desc.split(",")[:6] == ["3", "11", "4", "1", "0", "5"]  # unmeasured ones last
    screenshot(html, tmp_path / "shot.png")


def screenshot(html: Path, shot: Path) -> None:
    """Headless Chromium's picture of the page (after its scripts ran)."""
    shot.parent.mkdir(exist_ok=True)
    shot.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        run = _run_chromium([f"--screenshot={shot}", "--window-size=1400,3000",
                             html.as_uri()], profile)
    assert shot.exists() and shot.stat().st_size > 20_000, run.stderr[-2000:]


def check_real_report(html: Path, shot: Path) -> None:
    """For a report written by a real search: no script errors, every panel present drew,
    and a screenshot to look at."""
    page = html.read_text()
    present = [p.div_id for p in PANELS if f'id="{p.div_id}"' in page]
    assert present
    _assert_plots_drew(_rendered_dom(html), present)
    screenshot(html, shot)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["empty", "all_oom", "no_baseline"])
def test_sparse_reports_render_in_chromium(tmp_path: Path, kind: str) -> None:
    if _chromium() is None:
        pytest.skip("chromium is not installed and could not be installed")
    _, html = write_report(write_summary(tmp_path, make_summary(kind)))
    page = html.read_text()
    present = [p.div_id for p in PANELS if f'id="{p.div_id}"' in page]
    assert (kind == "empty") == (not present)
    _assert_plots_drew(_rendered_dom(html), present)


def test_a_write_that_fails_midway_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    """A search killed while writing (a time box, the kernel) must not leave half a
    summary.json where a whole one was: files are written beside and renamed over."""
    from pathlib import Path

    from autotune.files import write_atomically

    target = tmp_path / "summary.json"
    write_atomically(target, '{"trials": []}\n')

    def dies_midway(self, text, *args, **kwargs):
        with open(self, "w") as f:
            f.write(text[:3])
        raise KeyboardInterrupt  # as a kill would, mid-write

    monkeypatch.setattr(Path, "write_text", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        write_atomically(target, '{"trials": [1, 2, 3]}\n')
    monkeypatch.undo()
    assert target.read_text() == '{"trials": []}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no part left


def test_report_cli_writes_where_asked_and_refuses_a_missing_sqlite_file(tmp_path):
    """Found by a review: `report DIR --output X` wrote into DIR, and a mistyped SQLite
    URL left an empty database file behind."""
    from typer.testing import CliRunner

    from autotune.cli import app

    (tmp_path / "run").mkdir()
    src, out = write_summary(tmp_path / "run", make_summary()), tmp_path / "elsewhere"
    done = CliRunner().invoke(app, ["report", str(src), "--output", str(out)])
    assert done.exit_code == 0, done.output
    assert (out / "report.md").is_file() and not (src / "report.md").exists()
    typo = tmp_path / "typo.db"
    refused = CliRunner().invoke(app, ["report", f"sqlite:///{typo}"])
    assert refused.exit_code == 2 and "no such SQLite file" in refused.output
    assert not typo.exists()
    typo.write_bytes(b"")  # a file that is there, named with a query: read, not refused
    there = CliRunner().invoke(app, ["report", f"sqlite:///{typo}?timeout=30"])
    assert there.exit_code == 2 and "no such SQLite file" not in there.output
    assert "0 studies" in there.output, there.output
    assert CliRunner().invoke(app, ["--version"]).output.startswith("autotune ")


def test_one_confirmation_run_each_claims_no_interval() -> None:
    from autotune.summary import Confirmation

    summary = make_summary()
    best = summary.best
    summary.confirmation = Confirmation(1, 10, [], best.config, 1.19, 1.19, 1.19)
    fact = next(f for f in headline(summary) if f.label == "Speedup")
    assert fact.value == "1.19× Trainer defaults" and "no interval" in fact.detail


def test_a_confirmation_cut_short_says_how_many_runs_it_made() -> None:
    """Seen on an H200 (the GPU proof's 90 s GPT-2 search): the winner ran once and the
    baseline not at all, and the report said 'median of 3 confirmation runs' and 'these
    configs ran 3 more times each'."""
    from autotune.outputs.report import render_markdown
    from autotune.summary import Confirmation, ConfirmedConfig

    summary = make_summary()
    best, base = summary.best, summary.baseline
    summary.confirmation = Confirmation(3, 8, [
        ConfirmedConfig("best", best.config, best.number, [124.1]),
        ConfirmedConfig("baseline", base.config, base.number, [])], best.config)
    fact = next(f for f in headline(summary) if f.label == "Throughput")
    assert fact.detail.endswith("· one confirmation run")
    text = render_markdown(summary)
    assert "were to run 3 more times each (5 of those runs are missing" in text
    # Two contenders measured once each: their ratio is a speedup, with no interval.
    summary.confirmation.rows[1].samples_per_second.append(47.1)
    from autotune.records import CONFIRM_REASON, Outcome, Record
    from autotune.tuning import confirm

    history = list(summary.trials) + [
        Record(r.config, Outcome("ok", samples_per_second=sps), CONFIRM_REASON, 900 + i)
        for i, (r, sps) in enumerate([(best, 124.1), (base, 47.1)])]
    c = confirm.summarise(history, 3, 8, summary.per_rank_target)
    assert c.speedup == pytest.approx(124.1 / 47.1) and c.speedup_low is None
    summary.confirmation = c
    fact = next(f for f in headline(summary) if f.label == "Speedup")
    assert "no interval: the winner or the baseline made fewer than two" in fact.detail
    assert fact.value == f"{124.1 / 47.1:.2f}× Trainer defaults"
    summary.confirmation.rows[0].samples_per_second += [124.0, 125.0]
    fact = next(f for f in headline(summary) if f.label == "Throughput")
    assert fact.detail.endswith("· median of 3 confirmation runs")


def test_the_committed_example_report_is_what_the_code_renders() -> None:
    """reports/tiny-gpt2 is shown as the README's example: it must not drift from the code
    (`autotune report reports/tiny-gpt2` rewrites it)."""
    from autotune.outputs.report import render_markdown

    folder = ROOT / "reports" / "tiny-gpt2"
    assert render_markdown(load_summary(folder)) == (folder / "report.md").read_text()


def test_the_confirmation_header_is_in_the_unit_its_runs_measured() -> None:
    """Confirmation runs measure the objective: real tokens/s where padding or packing
    make tokens the measure, pairs/s for DPO, samples/s otherwise."""
    from autotune.outputs.report import confirm_columns

    summary = make_summary()
    assert confirm_columns(summary)[4] == "median samples/s"
    summary.model = summary.model | {"trainer": "dpo"}
    assert confirm_columns(summary)[6] == "pairs/s of each repeat"
    summary.best.objective = TOKENS_PER_SECOND
    assert confirm_columns(summary)[4] == "median real tokens/s"


def test_seconds_before_the_first_step_count_launch_model_and_engine():
    """One place for it (the proof's table and benchmarks/trial_overhead.py read it): a
    trial that never got to its engine has no such figure; a missing launch (a cold start
    records none) counts as nothing."""
    assert Phases(launch=0.5, model=2.0).before_first_step is None
    assert Phases(launch=0.5, model=2.0, engine=1.0, warmup=3.0,
                  steps=9.0).before_first_step == 3.5
    assert Phases(model=2.0, engine=1.0).before_first_step == 3.0
