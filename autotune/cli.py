"""The `autotune` command: search, init, knobs, estimate, bench, report, show, results."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from autotune.errors import AutotuneError
from autotune.files import write_atomically

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


def _version(value: bool) -> None:
    if value:
        from autotune.summary import autotune_version

        print(f"autotune {autotune_version()}")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", callback=_version,
                                                is_eager=True, help="print the version")]
          = False) -> None:
    """Find the fastest training configuration that fits, with real trials."""


def _make_console(stderr: bool = False) -> Console:
    """Rich wraps at 80 columns when its output is not a terminal, which folds the wide
    tables into empty cells in logs and files; there, use 160 unless COLUMNS says."""
    probe = Console(stderr=stderr)
    if probe.is_terminal or "COLUMNS" in os.environ:
        return probe
    return Console(stderr=stderr, width=160)


console = _make_console()
err_console = _make_console(stderr=True)


@contextlib.contextmanager
def _noting_interrupts():
    """Ctrl-C raises KeyboardInterrupt as usual, and is noted: one that lands inside a
    library's own error handling (an Optuna storage commit turns it into a
    StorageInternalError) surfaces as that library's error, and is an interruption all
    the same."""
    seen: list[int] = []
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    try:
        yield seen
    finally:
        signal.signal(signal.SIGINT, previous)


def _unless_interrupted(seen: list[int], callback: Callable[[Any], None]) -> Callable[[Any], None]:
    """`callback`, first raising KeyboardInterrupt where a Ctrl-C was seen: one that landed
    where Python ignores exceptions (a finalizer, a library that swallows them) would let
    the search run on to its end; the next trial started or recorded stops it instead."""
    def call(arg: Any) -> None:
        if seen:
            raise KeyboardInterrupt
        callback(arg)

    return call


def _interrupted() -> None:
    err_console.print("interrupted: finished trials are in the study; run the same "
                      "command again to resume")
    raise typer.Exit(130)


def _fail(exc: Exception) -> None:
    from autotune.errors import SetupError

    hint = (" (no config can avoid this, so the search stopped; fix it and run the same "
            "command again)") if isinstance(exc, SetupError) else ""
    err_console.print(f"[bold red]error:[/] {exc}{hint}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _show_warnings() -> None:
    """autotune's warnings (a budget capped, a cluster's shortfall) as one line each."""
    from rich.logging import RichHandler

    log = logging.getLogger("autotune")
    if not log.handlers:
        log.addHandler(RichHandler(console=err_console, show_time=False, show_path=False))
        log.setLevel(logging.WARNING)


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "—" if v is None else format(v, spec)


def _gib(b: int | None) -> str:
    return "—" if b is None else f"{b / 2**30:.2f}"


def _waited(outcome) -> str:
    """Time a trial spent waiting for devices another search on the machine held."""
    wait = outcome.launch.lease_wait_s or 0
    return f" (+{wait:.0f} s waiting for another search)" if wait >= 1 else ""


class SearchView:
    """Progress of a search. On a terminal: a live status block (trials done and in
    flight with their elapsed time, configs pruned, the best so far with its speedup over
    Trainer's defaults, elapsed against the time budget) over the table of the trials
    that ran; in a log: one line per finished trial. Configs pruned on a prediction are
    counted, not listed (the report lists them)."""

    STYLES = {"ok": "green", "oom": "yellow", "nan": "magenta"}
    SHOWN = 12  # rows of the trials table a terminal keeps in view

    def __init__(self, n_trials: int, out: Console, budget_s: float | None = None) -> None:
        import time

        self.out, self.live = out, out.is_terminal
        self.n_trials, self.budget_s, self.started = n_trials, budget_s, time.time()
        self.rows: list[tuple[str, ...]] = []
        self.in_flight: dict[str, tuple[str, float]] = {}  # label -> (reason, started)
        self.done = self.pruned = 0
        self.best: tuple[float, str] | None = None  # (score, label)
        self.baseline = 0.0

    def __rich__(self) -> Group:
        import time

        from rich.text import Text

        now = time.time()
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        elapsed = now - self.started
        budget = f" of {_duration(self.budget_s)}" if self.budget_s else ""
        grid.add_row("trials", f"{self.done}/{self.n_trials} done · {len(self.in_flight)} "
                     f"running · {self.pruned} pruned by prediction · "
                     f"{_duration(elapsed)}{budget}")
        for label, (reason, since) in self.in_flight.items():
            grid.add_row("running", f"{label} ({reason}), {now - since:.0f} s")
        if self.best is not None:
            score, label = self.best
            speedup = (f", {score / self.baseline:.2f}x Trainer's defaults so far"
                       if self.baseline else "")
            grid.add_row("best", f"{label}: {score:,.1f}{speedup}")
        table = Table(expand=False, box=None, header_style="bold")
        for col in ("#", "config", "why", "status", "samples/s", "peak GiB", "trial s"):
            table.add_column(col)
        for row in self.rows[-self.SHOWN:]:
            table.add_row(*row)
        hidden = len(self.rows) - self.SHOWN
        parts = [table] + ([Text(f"  ... and {hidden} earlier", style="dim")]
                           if hidden > 0 else []) + [grid]
        return Group(*parts)

    def on_start(self, proposal) -> None:
        import time

        self.in_flight[proposal.config.label()] = (proposal.reason, time.time())

    def on_record(self, record) -> None:
        o = record.outcome
        self.in_flight.pop(record.config.label(), None)
        if not o.ran:
            self.pruned += 1
            return
        if not record.confirming:
            self.done += 1
        score = record.score
        if o.ok and score:
            if record.reason == "baseline":
                self.baseline = max(self.baseline, score)
            if self.best is None or score > self.best[0]:
                self.best = (score, record.config.label())
        style = self.STYLES.get(o.status, "red")
        cells = (str(record.number), record.config.label(), record.reason,
                 f"[{style}]{o.status}[/]",
                 _fmt(None if o.is_oom else o.samples_per_second),
                 _gib(o.peak_memory_bytes), _fmt(o.wall_seconds))
        if self.live:
            self.rows.append((*cells[:-1], cells[-1] + _waited(o)))
        else:
            self.out.print(f"trial {cells[0]}: {cells[1]} ({cells[2]}) {cells[3]} "
                           f"{cells[4]} samples/s, peak {cells[5]} GiB, {cells[6]} s"
                           f"{_waited(o)}", highlight=False)

    def finish(self) -> None:
        if not self.live and self.pruned:
            self.out.print(f"{self.pruned} configs not run: predicted over the memory "
                           "limit (listed in the report)")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _study_lines(parsed) -> str:
    """Where the study is kept, and how to watch it (Optuna's dashboard reads it live)."""
    from autotune.dburl import shown

    storage = shown(parsed.search.storage or (
        f"sqlite:///{(Path(parsed.output) / 'study.db').resolve()}"))
    return (f"study: {storage}\nwatch it live: pip install 'autotune[dashboard]' && "
            f"optuna-dashboard {storage}")


def _print_study(console, parsed) -> None:
    # markup=False: rich would read "[dashboard]" as a style tag and drop it.
    console.print(_study_lines(parsed), highlight=False, soft_wrap=True, markup=False)


@app.command()
def search(
    spec: Annotated[Path, typer.Argument(help="model.yaml")],
    trials: Annotated[int | None, typer.Option("--trials", help="trials in total")] = None,
    timeout: Annotated[str | None, typer.Option(help="wall time, e.g. 30m")] = None,
    address: Annotated[str | None, typer.Option(help="Ray cluster address (default: "
                                                     "an embedded local Ray)")] = None,
    storage: Annotated[str | None, typer.Option(help="Optuna storage URL")] = None,
    output: Annotated[Path | None, typer.Option(help="output folder")] = None,
    study_name: Annotated[str | None, typer.Option(help="Optuna study name")] = None,
    store: Annotated[str | None, typer.Option(help="results store URL, or off (default: "
                                              "search.store, $AUTOTUNE_STORE, or the user's "
                                              "cache)")] = None,
    fresh: Annotated[bool, typer.Option("--fresh", help="search even where the results "
                                        "store remembers this setup")] = False,
) -> None:
    """Run (or resume) a search and write the winner's files; a setup the results store
    remembers is answered from it after its winner and baseline run once more."""
    from autotune.outputs.report import render_summary
    from autotune.spec import load_spec
    from autotune.tuning.run import run_search

    _show_warnings()
    with _noting_interrupts() as interrupts:
        try:
            parsed = load_spec(spec, **{"search.n_trials": trials, "search.timeout": timeout,
                                        "search.storage": storage,
                                        "search.study_name": study_name,
                                        "search.store": store,
                                        "output": str(output) if output else None})
            from autotune.spec import parse_duration

            _print_study(console, parsed)
            view = SearchView(parsed.search.n_trials, console,
                              parse_duration(parsed.search.timeout))
            live = Live(view, console=console, refresh_per_second=2,
                        transient=False) if view.live else contextlib.nullcontext()
            with live:
                result = run_search(
                    parsed, address=address, fresh=fresh,
                    on_start=_unless_interrupted(interrupts, view.on_start),
                    on_record=_unless_interrupted(interrupts, view.on_record))
            view.finish()
        except KeyboardInterrupt:
            _interrupted()
        except Exception as exc:
            if interrupts:
                _interrupted()
            if isinstance(exc, AutotuneError):
                _fail(exc)
            raise
    render_summary(result.summary, console)
    from autotune.outputs.store_notes import remembered_line

    if line := remembered_line(result.summary):
        console.print(line, highlight=False, soft_wrap=True)
    files = [f for f in result.summary.exports.values() if f]
    console.print(f"files in [bold]{result.output}[/]: "
                  + ", ".join([*files, "summary.json", "report.md", "report.html"]))
    if result.best is None:
        raise typer.Exit(1)


@app.command()
def init(
    model: Annotated[str, typer.Argument(help="a model folder, a shape such as llama-8b or "
                                         "qwen2-1.5b, or a hub id")],
    seq_len: Annotated[int | None, typer.Option(help="tokens per row (default: 1024, or the "
                                                     "model's positions where fewer)")] = None,
    target_batch: Annotated[int, typer.Option(help="effective batch per step")] = 32,
    device: Annotated[str | None, typer.Option(help='plan for a device, e.g. "A100-80GB" '
                                                    "(default: this machine's)")] = None,
    lora: Annotated[bool, typer.Option("--lora", help="train LoRA adapters")] = False,
    qlora: Annotated[bool, typer.Option("--qlora", help="LoRA on a base the search may "
                                        "quantize to 4 bits")] = False,
    grpo: Annotated[bool, typer.Option("--grpo", help="trained by TRL's GRPOTrainer on your "
                                       "prompts (reinforcement learning)")] = False,
    output: Annotated[Path, typer.Option(help="the spec to write")] = Path("model.yaml"),
) -> None:
    """Write a commented spec for a model, from its config alone (no weights)."""
    from autotune.plan import init as spec_init

    try:
        planned = spec_init.plan(model, seq_len=seq_len, target_batch=target_batch,
                                 device=device, lora=lora, qlora=qlora, grpo=grpo,
                                 output=f"runs/{output.stem}", spec_dir=output.parent)
        spec_init.write(output, spec_init.render(planned))
    except AutotuneError as exc:
        _fail(exc)
    console.print(f"wrote {output}: {planned.source}, {planned.parameters / 1e6:,.1f}M "
                  f"parameters; on {planned.device_name} {planned.fits} of {planned.configs} "
                  f"configs are expected to fit. Next: autotune search {output}",
                  highlight=False, soft_wrap=True)


@app.command()
def knobs(
    device: Annotated[str | None, typer.Option(help='a device, e.g. "A100-80GB" (default: '
                                                    "this machine's)")] = None,
) -> None:
    """The knob table: each lever's values, what this (or a named) device allows and why
    not the rest, Trainer's default and the guide's pick."""
    from autotune.device import local_device, named_device
    from autotune.outputs.reference import render_knobs

    try:
        render_knobs(named_device(device) if device else local_device(), console)
    except AutotuneError as exc:
        _fail(exc)


@app.command()
def estimate(
    spec: Annotated[Path, typer.Argument(help="model.yaml")],
    device: Annotated[str | None, typer.Option(help='plan for a device, e.g. "A100-80GB"')] = None,
    memory: Annotated[str | None, typer.Option(help="memory limit, e.g. 40GiB")] = None,
    all_rows: Annotated[bool, typer.Option("--all", help="every config, not only the "
                                           "largest fitting batch per family")] = False,
    longest: Annotated[bool, typer.Option("--longest", help="each family's longest seq_len "
                                          "predicted to fit (multiples of 256)")] = False,
) -> None:
    """Predicted peak memory per config; no GPU and no weights needed."""
    from autotune.plan.estimate import estimate as run_estimate
    from autotune.plan.estimate import render_estimate

    try:
        render_estimate(run_estimate(spec, device=device, memory=memory, longest=longest),
                        console, all_rows=all_rows)
    except AutotuneError as exc:
        _fail(exc)


@app.command()
def bench(
    landscape: Annotated[list[Path], typer.Option("--landscape", help="landscape folder "
                                                  "(meta.json + trials.csv); repeatable")],
    budget_fraction: Annotated[float | None, typer.Option(help="baselines' budget as a "
                                                          "fraction of the grid")] = None,
    repeats: Annotated[int, typer.Option(help="seeds to average over")] = 5,
    json_path: Annotated[Path | None, typer.Option("--json", help="write records here")] = None,
    workers: Annotated[str, typer.Option(help="trials in parallel, e.g. 1,4,8: the tuner's "
                                         "wall time to 0.98 quality per count")] = "1",
    strategies: Annotated[str | None, typer.Option(help="comma-separated subset of "
                                                   "autotune,random,tpe,halving,deepspeed "
                                                   "(default: all)")] = None,
    seeded_from: Annotated[list[Path] | None, typer.Option(
        "--seeded-from", help="a landscape of the same model whose search seeds each "
        "--landscape's (as a near match in the results store would): trials to 0.98 of "
        "the best with and without; repeatable")] = None,
) -> None:
    """Replay strategies on tuning landscapes and compare quality and cost."""
    from autotune.bench.bench import bench_main
    from autotune.errors import SpecError

    if seeded_from:
        from autotune.bench.bench import DEFAULT_BUDGET_FRACTION
        from autotune.bench.seeding import seeding_main

        try:
            records = seeding_main([str(p) for p in landscape], [str(p) for p in seeded_from],
                                   budget_fraction or DEFAULT_BUDGET_FRACTION, repeats,
                                   console)
        except AutotuneError as exc:
            _fail(exc)
        if json_path:
            import json

            write_atomically(json_path, json.dumps(records, indent=2) + "\n")
        raise typer.Exit(0)
    try:
        try:
            counts = [int(w) for w in workers.split(",")]
        except ValueError:
            raise SpecError(f"--workers: {workers!r} is not a list of counts like 1,4,8") from None
        code = bench_main([str(p) for p in landscape], budget_fraction, repeats,
                          str(json_path) if json_path else None, console, counts,
                          strategies.split(",") if strategies else None)
    except AutotuneError as exc:
        _fail(exc)
    raise typer.Exit(code)


@app.command()
def report(
    source: Annotated[str, typer.Argument(help="a search's output folder, or an Optuna "
                                          "storage URL holding its study")],
    study_name: Annotated[str | None, typer.Option(help="study in the storage")] = None,
    output: Annotated[Path | None, typer.Option(help="where to write (default: the folder "
                                                "itself; for a storage URL "
                                                "./autotune-report)")] = None,
) -> None:
    """Regenerate report.md and report.html, from summary.json or from the study storage."""
    import json

    from autotune.outputs.report import write_report

    try:
        if "://" in source:
            from autotune.tuning.study import summary_from_storage

            summary = summary_from_storage(source, study_name)
            folder = output or Path("autotune-report")
            folder.mkdir(parents=True, exist_ok=True)
            write_atomically(folder / "summary.json", json.dumps(summary, indent=2) + "\n")
            md, html = write_report(folder)
        else:
            md, html = write_report(source, output)
    except AutotuneError as exc:
        _fail(exc)
    console.print(f"wrote {md} and {html}")


@app.command()
def show(output_dir: Annotated[Path, typer.Argument(help="a search's output folder")]) -> None:
    """Print a finished search's summary again."""
    from autotune.outputs.report import render_summary
    from autotune.summary import load_summary

    try:
        render_summary(load_summary(output_dir), console)
    except AutotuneError as exc:
        _fail(exc)


results_app = typer.Typer(no_args_is_help=False, help="What the results store knows: list, "
                          "export, import.")
app.add_typer(results_app, name="results")
StoreOption = Annotated[str | None, typer.Option("--store", help="results store URL (default: "
                                                 "$AUTOTUNE_STORE or the user's cache)")]


@results_app.callback(invoke_without_command=True)
def results(
    ctx: typer.Context,
    store: StoreOption = None,
    model: Annotated[str | None, typer.Option(help="only models whose name holds this")] = None,
    device: Annotated[str | None, typer.Option(help="only devices whose name holds this")]
    = None,
) -> None:
    """List the recorded searches: setup, winner, speedups, date, versions."""
    if ctx.invoked_subcommand is not None:
        ctx.obj = store
        return
    from autotune.outputs.store_listing import open_store, render_records

    try:
        s = open_store(store)
        try:
            render_records(s, console, model, device)
        finally:
            s.close()
    except AutotuneError as exc:
        _fail(exc)


def _on_store(url: str | None, work: Callable[[Any], Any]) -> Any:
    """`work` on the results store at `url` (closed after); a store error is one line."""
    from autotune.outputs.store_listing import open_store

    try:
        s = open_store(url)
        try:
            return work(s)
        finally:
            s.close()
    except AutotuneError as exc:
        _fail(exc)


@results_app.command("export")
def results_export(ctx: typer.Context,
                   file: Annotated[Path, typer.Argument(help="JSON-lines file to write")],
                   store: StoreOption = None) -> None:
    """Write every record of the store to FILE, one JSON object a line."""
    from autotune.outputs.store_listing import export_records

    n = _on_store(store or ctx.obj, lambda s: export_records(s, file))
    console.print(f"exported {n} record{'s' if n != 1 else ''} to {file}", highlight=False)


@results_app.command("import")
def results_import(ctx: typer.Context,
                   file: Annotated[Path, typer.Argument(help="JSON-lines file of `autotune "
                                                    "results export`")],
                   store: StoreOption = None) -> None:
    """Add FILE's records to the store (a record already there is left as it is)."""
    from autotune.outputs.store_listing import import_records

    counts = _on_store(store or ctx.obj, lambda s: import_records(s, file))
    said = f"imported {counts['added']} record{'s' if counts['added'] != 1 else ''}"
    if counts["present"]:
        said += f", {counts['present']} already there"
    if counts["newer"]:
        said += (f" ({counts['newer']} of a newer autotune's record schema: kept for it, "
                 "not read by this one)")
    console.print(said, highlight=False)
    for bad in counts["bad"]:
        err_console.print(f"skipped {bad}", highlight=False)
    if counts["bad"]:
        raise typer.Exit(1)


def main() -> None:  # pragma: no cover - console script entry
    sys.exit(app())
