"""report.md and report.html from a search's summary.json, and the terminal summary.

Everything is derived from summary.json alone, so `autotune report DIR` can regenerate the
report long after the search (or from a copy of the folder on a laptop). The HTML is one
self-contained file: plotly.js is inlined once in <head>, so it opens offline.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune import knobs
from autotune.errors import AutotuneError
from autotune.files import write_atomically
from autotune.outputs.report_plots import STATUS_COLORS, figures, known, shown_knobs
from autotune.records import Record
from autotune.summary import BASELINE, Summary, load_summary
from autotune.tasks import task, trainer

if TYPE_CHECKING:
    from rich.console import Console

MARKDOWN_FILE = "report.md"
HTML_FILE = "report.html"
DASH = "—"
TOP_TRIALS = 10  # rows of the terminal table; the HTML and Markdown list every trial


# --- formatting: every figure may be None, which shows as a dash ------------------------

def fmt_num(value: Any, digits: int = 1) -> str:
    v = known(value)
    return DASH if v is None else f"{v:,.{digits}f}"


def fmt_bytes(value: Any) -> str:
    v = known(value)
    if v is None:
        return DASH
    if v >= 1000 * 1024**2:  # "0.98 GiB" reads better than "1,000 MiB"
        return f"{v / 1024**3:,.2f} GiB"
    return f"{v / 1024**2:,.0f} MiB" if v >= 1024**2 else f"{v / 1024:,.0f} KiB"


def fmt_seconds(value: Any) -> str:
    s = known(value)
    if s is None:
        return DASH
    if s < 120:
        return f"{s:.1f} s"
    minutes, hours, days = s / 60, s / 3600, s / 86400
    if hours < 2:
        return f"{minutes:.0f} min"
    if days < 2:
        return f"{int(hours)} h {int(minutes % 60):02d} min"
    return f"{int(days)} d {int(hours % 24)} h"


def fmt_pct(value: Any) -> str:
    v = known(value)
    return DASH if v is None else f"{v:.1%}"


def error_tail(error: str | None, lines: int = 3, width: int = 240) -> str:
    """The last lines of a trial's error: where Python puts the exception that matters."""
    kept = [ln.rstrip()[:width] for ln in (error or "").splitlines() if ln.strip()]
    return "\n".join(kept[-lines:])


# --- the headline, shared by the terminal, Markdown and HTML ----------------------------

@dataclass(frozen=True)
class Fact:
    """One headline card: what it is, the figure, and a line of context."""

    label: str
    value: str
    detail: str


def _title(summary: Summary) -> str:
    model = summary.model.get("name") or "model"
    device = summary.device
    if device is None:
        return f"{model} on device"
    name, count, nodes, each = device.name, device.count, device.nodes, device.per_node
    if not device.is_cuda:  # the machine a CPU search ran on: its cores, its bf16
        threads = max((t.outcome.measured.cpu_threads or 0 for t in summary.trials),
                      default=0)
        name = (f"{threads} CPU core{'s' * (threads > 1)}" if threads else "CPU") + (
            " with native bf16" if device.native_bf16 else "")
    where = f"{count}× {name}" if count > 1 else name
    if nodes > 1:
        where = f"{nodes} nodes × {f'{each}× ' if each > 1 else ''}{name}"
    links = device.links
    said = [f"{links['intra']} inside" if links.get("intra") and each > 1 else "",
            f"{links['inter']} between" if links.get("inter") and nodes > 1 else ""]
    if any(said):
        where += f" ({', '.join(s for s in said if s)})"
    return f"{model} on {where}"


def _projection(summary: Summary) -> tuple[str, float | None, float | None] | None:
    """(what the user's full run is, samples, tokens) from the spec's run section
    {"steps", "tokens"}, where one step is one optimizer step of target_batch_size
    samples; None when the spec gives neither."""
    p = summary.projection
    target = known(summary.target_batch_size)
    steps, tokens = known(p.get("steps")), known(p.get("tokens"))
    if steps and target:
        return f"{int(steps):,} steps of {int(target):,} samples", steps * target, None
    if tokens:
        return f"{int(tokens):,} tokens", None, tokens
    return None


def projected_seconds(summary: Summary, record: Record | None) -> float | None:
    """Wall time of the user's full run at `record`'s measured throughput."""
    proj = _projection(summary)
    if proj is None or record is None:
        return None
    _, samples, tokens = proj
    sps = known(summary.samples_per_second(record))
    seq = known(summary.seq_len)
    o = record.outcome
    tps = (sps * o.tokens_per_second / o.samples_per_second if sps and o.tokens_per_second
           and o.samples_per_second else sps * seq if sps and seq else None)
    if samples is not None:
        return samples / sps if sps else None
    return tokens / tps if tokens and tps else None


def headline(summary: Summary) -> list[Fact]:
    """The figures a user looks for first, best config first."""
    best, base = summary.best, summary.baseline
    facts = [_best_fact(summary), _speedup_fact(summary, base),
             _throughput_fact(summary, best), _memory_fact(summary, best),
             _mfu_fact(summary, best), _projection_fact(summary, best, base),
             _search_fact(summary)]
    from autotune.outputs.store_notes import store_facts

    extra = [_data_fact(summary), _weights_fact(summary)]
    return facts + [f for f in extra if f] + [Fact(*f) for f in store_facts(summary)]


WEIGHTS = {"random": "random, of the model's exact shape, made on the device by its own "
                     "init (a dense model's step time does not depend on its values)",
           "checkpoint": "the checkpoint's, read onto the device",
           "factory": "the factory's"}


def _weights_fact(summary: Summary) -> Fact | None:
    """Which weights the trials trained, and an MoE model's routing (which decides its
    step time and memory)."""
    built = next((b for t in summary.trials if (b := t.outcome.phases.model_build)
                   and b.known), None)
    if built is None:
        return None
    weights = built.weights or "random"
    detail = WEIGHTS.get(weights, weights)
    if built.routing:
        detail += f" · experts' routing: {built.routing}"
    return Fact("Weights", weights, detail)


def _data_fact(summary: Summary) -> Fact | None:
    """Real data's rows: the length distribution padding and packing are judged on."""
    lengths = next((n for t in summary.trials if (n := t.outcome.measured.lengths)
                    and n.known), None)
    if lengths is None:
        return None
    seq = int(lengths.seq_len or 0)
    cut = ("source and target lengths" if task(summary.model.get("task")).has_target
           else "seq_len")
    return Fact("Rows", f"{lengths.p50:.0f} tokens (median)",
                f"of {cut} {seq}: p90 {lengths.p90:.0f}, max {lengths.max:.0f}, "
                f"min {lengths.min:.0f}; {lengths.padding:.0%} of a padded batch is "
                f"padding, {lengths.truncated:.0%} of rows truncated; the loss sees "
                f"{lengths.loss_tokens:.0%} of the real tokens · the objective is real "
                "(non-pad) tokens/s")


def _best_fact(summary: Summary) -> Fact:
    best = summary.best
    if best is None:
        return Fact("Best config", "none", summary.no_winner_why
                    or "no trial succeeded: see the errors in the table")
    compiled = known(best.outcome.compile.charged_seconds)
    paid = f" · compile {compiled:.0f} s, paid once" if compiled is not None else ""
    c = best.config
    # The review saw some trial log its loss at its accumulation's ratio: the model sums.
    sums = any(t.outcome.measured.loss_accumulation_scale is not None
               for t in summary.trials)
    ga = c.gradient_accumulation_steps
    summed = (f" · this model's loss and gradients are summed over the {ga} micro-batches, "
              "not averaged (Trainer leaves them undivided where a model takes loss kwargs "
              "it then ignores): max_grad_norm clips a gradient that many times larger"
              if sums and ga > 1 else "")
    return Fact("Best config", c.label(), f"trial #{best.number} · effective batch "
                f"{c.samples_per_rank * summary.world_size} ({c.per_device_train_batch_size}"
                f" × {c.gradient_accumulation_steps} accumulation × {summary.world_size} "
                f"rank{'s' if summary.world_size > 1 else ''}){paid}{summed}")


def _throughput_fact(summary: Summary, best: Record | None) -> Fact:
    value = summary.samples_per_second(best)
    sps = fmt_num(value)
    o = best.outcome if best else None
    real = summary.objective_is_tokens(best)
    if value and o is not None and o.samples_per_second and o.tokens_per_second:
        # Real (non-pad) tokens, at the confirmed samples/s.
        tps = fmt_num(value * o.tokens_per_second / o.samples_per_second, 0)
    else:
        tps = fmt_num(value * summary.seq_len if value and summary.seq_len else None, 0)
    row = summary.confirmation.row(best.config) if summary.confirmation and best else None
    runs = len(row.samples_per_second) if row else 0  # fewer than asked where time ran out
    how = ("one trial's measurement" if not runs else "one confirmation run" if runs == 1
           else f"median of {runs} confirmation runs")
    sample, token, note = units(summary)
    return Fact("Throughput", DASH if sps == DASH else f"{sps} {sample}/s",
                DASH if tps == DASH else f"{tps} {'real ' if real else ''}{token}/s · {how}"
                + (f" · {note}" if note else ""))


def units(summary: Summary) -> tuple[str, str, str]:
    """(what a sample is, what its tokens are, a note saying so) for the model's task and
    trainer: a DPO sample is a preference pair, an image's tokens are its patches, an
    encoder-decoder's are its source's and its target's."""
    model = summary.model
    by_trainer = trainer(model.get("trainer")).units
    return by_trainer or task(model.get("task")).units


def _mfu_fact(summary: Summary, best: Record | None) -> Fact:
    if best is None:
        return Fact("MFU", DASH, "no winner" if summary.no_winner_why else
                    "no successful trial")
    mfu = best.outcome.measured.mfu
    return Fact("MFU", fmt_pct(mfu), "model FLOPs utilisation" if known(mfu) is not None
                else "not known for this device (no peak FLOP/s)")


def _speedup_fact(summary: Summary, base: Record | None) -> Fact:
    """The winner against both references: Trainer's defaults and the guide's recipe,
    each with its interval where the confirmation gives one."""
    c = summary.confirmation
    parts, notes = [], []
    kind = trainer(summary.model.get("trainer"))
    defaults = kind.defaults_name  # what a user who sets nothing gets: Trainer's, GRPOConfig's
    short = defaults.replace("'s defaults", " defaults")
    if summary.defaults_do_not_fit:
        pruned = next((t.outcome.error for t in summary.searched if t.reason == BASELINE
                       and not t.outcome.ran), None)
        why = (pruned.removeprefix("not run: ") if pruned
               else "their smallest batch ran out of memory")
        notes.append(f"{defaults} do not fit this device ({why}): the speedup is "
                     "stated against the recipe alone")
    elif base is None:
        notes.append("no baseline trial succeeded")
    else:
        ratio = (summary.speedup, c.speedup_low, c.speedup_high) if c else (
            summary.speedup, None, None)
        parts.append(_ratio_text(ratio, short))
        notes.append(_how(c, ratio, "the baseline", c is not None and c.baseline_won,
                          f"no config it tried beat {defaults}"))
        effective = base.config.samples_per_rank * summary.world_size
        shrunk = (f", effective batch {effective} not {summary.target_batch_size}"
                  if effective != summary.target_batch_size else "")
        found = " with auto_find_batch_size" if kind.auto_find_batch_size else ""
        notes.append(f"baseline: {short}{found}, "
                     f"{base.config.label()}{shrunk}: "
                     f"{fmt_num(summary.samples_per_second(base))} {units(summary)[0]}/s")
    recipe = summary.recipe
    if recipe is not None:
        vs = c.vs_recipe if c is not None and c.vs_recipe else {}
        ratio = (summary.vs_recipe, vs.get("low"), vs.get("high"))
        parts.append(_ratio_text(ratio, "the guide's recipe"))
        notes.append(_how(c, ratio, "the recipe", c is not None and c.recipe_won,
                          "the tuner found nothing faster than the guide's recipe, which is "
                          "the winner"))
        notes.append(f"recipe: {recipe.config.label()}: "
                     f"{fmt_num(summary.samples_per_second(recipe))} {units(summary)[0]}/s")
    elif any(t.reason == "recipe" for t in summary.searched):
        notes.append("the guide's recipe did not run to the end (see its trials)")
    return Fact("Speedup", " · ".join(parts) or DASH, "; ".join(notes))


def _ratio_text(ratio: tuple, against: str) -> str:
    value, low, high = (known(x) for x in ratio)
    if value is None:
        return f"{DASH} {against}"
    interval = f" ({low:.2f}–{high:.2f})" if low is not None and high is not None and (
        low != high) else ""
    return f"{value:.2f}×{interval} {against}"


def _how(c: Any, ratio: tuple, name: str, won: bool, won_text: str) -> str:
    """How a ratio was measured, and what it does not show."""
    value, low, high = ratio
    if c is not None and won:
        return f"{name} confirmed fastest: {won_text}"
    if c is None or value is None:
        return f"vs {name}: single trials, not confirmed"
    if c.repeats < 2:
        return (f"vs {name}: one confirmation run each, no interval "
                "(search.confirm_repeats 3 gives one)")
    if low is None:
        return (f"vs {name}: no interval: the winner or {name} made fewer than two "
                "confirmation runs (the search's time ran out or runs failed)")
    how = f"vs {name}: 90% interval over the confirmation runs"
    if low <= 1 <= (high or 0):
        how += (": it holds 1, so the runs were too noisy to confirm a gain (raise "
                "search.confirm_repeats or measure.steps, on a quieter machine)")
    return how


def _memory_fact(summary: Summary, best: Record | None) -> Fact:
    peak = known(best.outcome.peak_memory_bytes) if best else None
    limit = known(summary.memory_limit_bytes)
    device = summary.device.memory_bytes if summary.device else None
    share = f"{peak / limit:.0%} of the {fmt_bytes(limit)} limit" if peak and limit else (
        f"limit {fmt_bytes(limit)}")
    return Fact("Peak memory", fmt_bytes(peak), f"{share} · device {fmt_bytes(device)}")


def _projection_fact(summary: Summary, best: Record | None, base: Record | None) -> Fact:
    proj = _projection(summary)
    if proj is None:
        return Fact("Full run", DASH, "no projection: set run.steps or run.tokens in the spec")
    secs = projected_seconds(summary, best)
    base_secs = projected_seconds(summary, base)
    return Fact("Full run", fmt_seconds(secs),
                f"{proj[0]} · baseline {fmt_seconds(base_secs)}")


def _search_fact(summary: Summary) -> Fact:
    wall = fmt_seconds(summary.search.get("wall_seconds"))
    searched = [t for t in summary.trials if t.counted]
    again = len(summary.ran) - len(searched)
    ooms = sum(t.outcome.is_oom for t in searched)
    return Fact("Search", f"{len(searched)} trials", f"{ooms} OOM · {wall} wall"
                + (f" · {again} confirmation run{'s' if again > 1 else ''} besides"
                   if again else "") + _where_time_went(summary))


PHASE_NAMES = {"launch": "launch", "model": "model", "engine": "engine",
               "warmup": "warm-up", "steps": "timed steps"}


def _where_time_went(summary: Summary) -> str:
    """The search's efficiency (timed steps over its cost) and a trial's median phases."""
    eff, phases = summary.efficiency, summary.phase_medians()
    if eff is None and not phases:
        return ""
    text = f" · efficiency {eff:.0%} (timed steps over wall time)" if eff is not None else ""
    if phases:
        text += " · a trial's median: " + ", ".join(
            f"{PHASE_NAMES[k]} {fmt_seconds(v)}" for k, v in phases.items())
    return text


# --- the trials table -------------------------------------------------------------------

# tokens/s is left out: it is samples/s × seq_len for every trial (the headline has it).
GENERATION = "gen share"  # a generating trainer's share of a step spent generating


def generates(trials: list[Record]) -> bool:
    """Whether the trials generated (GRPO): their generation share gets a column."""
    return any(t.outcome.generation.share is not None for t in trials)


def columns(shown: list[knobs.Knob] | None = None, generated: bool = False
            ) -> tuple[str, ...]:
    """Table headers; `shown`: the knob columns (shown_knobs of the trials), default all;
    `generated`: a column for the share of the step spent generating."""
    shown = list(knobs.table()) if shown is None else shown
    return ("#", "batch", "accum", *(k.column for k in shown), "status", "samples/s",
            "peak mem", "predicted", "step s", *([GENERATION] if generated else []),
            "reason", "error")


def _knob_cell(value: Any) -> tuple[str, Any]:
    if isinstance(value, bool):
        return ("yes" if value else "no"), int(value)
    return str(value), value


def trial_row(t: Record, shown: list[knobs.Knob] | None = None, generated: bool = False
              ) -> list[tuple[str, Any]]:
    """(shown text, sort key) per column; the key is None for a missing figure."""
    c, o = t.config, t.outcome
    shown = list(knobs.table()) if shown is None else shown
    sps = None if o.is_oom else o.samples_per_second  # an OOM's steps ran on what did not fit
    return [(str(t.number), t.number),
            (str(c.per_device_train_batch_size), c.per_device_train_batch_size),
            (str(c.gradient_accumulation_steps), c.gradient_accumulation_steps),
            *(_knob_cell(getattr(c, k.name)) for k in shown),
            (o.status, o.status),
            (fmt_num(sps), known(sps)),
            (fmt_bytes(o.peak_memory_bytes), known(o.peak_memory_bytes)),
            (fmt_bytes(o.predicted_memory_bytes), known(o.predicted_memory_bytes)),
            (fmt_num(o.median_step, 3), o.median_step),
            *([(fmt_pct(o.generation.share), known(o.generation.share))] if generated else []),
            (t.reason, t.reason),
            # A pruned config's error only repeats its reason ("not run: " and the reason).
            ("", "") if not o.ran else (error_tail(o.error), error_tail(o.error))]


def ranked(trials: list[Record]) -> list[Record]:
    """Fastest successful trials first, then the rest in the order they ran, and the
    configs pruned on a prediction (never run) last."""
    return sorted(trials, key=lambda t: (not t.outcome.ok, not t.outcome.ran,
                                         -(t.throughput or 0.0), t.number or 0))


# --- exported files ---------------------------------------------------------------------

def exports_of(summary: Summary) -> list[tuple[str, str]]:
    """(file name, how to use it) for each file the search exported."""
    ex = summary.exports
    out = []
    kind = task(summary.model.get("task"))
    args = kind.arguments_class
    if ex.get("training_args"):
        out.append((ex["training_args"], f"import json; from transformers import {args}\n"
                    f"args = {args}(**json.load(open("
                    f"\"{ex['training_args']}\")) | {{\"output_dir\": \"runs/my-run\"}})\n"
                    "# works from any folder: a DeepSpeed config, if any, is inline"))
    if ex.get("deepspeed"):
        out.append((ex["deepspeed"], f"python train.py ... --deepspeed {ex['deepspeed']}\n"
                    "# or: deepspeed train.py ... / accelerate launch ... with the same flag"))
    nodes = summary.device.nodes if summary.device else 1
    if ex.get("accelerate") and nodes > 1:
        from autotune.trials.trainargs import launch_commands

        out.append((ex["accelerate"], "\n".join(
            [f"# {nodes} machines: on each, its own rank (rank 0's node's address filled in)",
             *launch_commands(summary.world_size, nodes, ex["accelerate"])])))
    elif ex.get("accelerate"):
        out.append((ex["accelerate"], f"accelerate launch --config_file {ex['accelerate']} "
                    "train.py ...\n# DeepSpeed (from ds_config.json) or FSDP inside it"))
    if ex.get("model"):
        out.append((ex["model"], f"model = {kind.auto_class}"
                    ".from_pretrained(name, "
                    f"**json.load(open(\"{ex['model']}\")))\n# e.g. the attention kernel"))
    if ex.get("quantization"):
        out.append((ex["quantization"], "from transformers import BitsAndBytesConfig\n"
                    f"bnb = BitsAndBytesConfig(**json.load(open(\"{ex['quantization']}\")))\n"
                    "# also inside model_kwargs.json; then peft's "
                    "prepare_model_for_kbit_training(model)"))
    trained_by = trainer(summary.model.get("trainer"))
    config_file = ex.get(trained_by.name)  # its own config's file (sft_config.json, ...)
    if config_file:
        out.append((config_file, trained_by.usage(config_file, bool(ex.get("lora")))))
    if ex.get("lora") and trained_by.adds_adapters:
        out.append((ex["lora"], "import json; from peft import LoraConfig\nlora = "
                    f"LoraConfig(**json.load(open(\"{ex['lora']}\")))\n# "
                    f"{trained_by.adapters_note}"))
    elif ex.get("lora"):
        out.append((ex["lora"], "import json; from peft import LoraConfig, get_peft_model\n"
                    f"model = get_peft_model(model, LoraConfig(**json.load(open("
                    f"\"{ex['lora']}\"))))"))
    best = summary.best
    if out and best is not None and best.outcome.measured.mmap_threshold:
        from autotune.trials.host_malloc import ENVIRONMENT

        name, usage = out[0]  # the trials' peaks hold only with the heap held as theirs
        out[0] = (name, f"{usage}\n# on a CPU, run it with {ENVIRONMENT} in the "
                  "environment: the trials' peaks held glibc's mmap threshold there")
    return out


# --- Markdown ---------------------------------------------------------------------------

def _md_cell(text: str) -> str:
    """Literal text in a table cell: what Markdown would read as HTML (& and <) escaped,
    pipes escaped, newlines as <br>; a > stays as it is."""
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    return text.replace("|", "\\|").replace("\n", "<br>") or " "


def render_markdown(summary: Summary) -> str:
    """report.md: the headline, every trial, the files; the plots live in report.html."""
    lines = [f"# autotune report: {_title(summary)}", "",
             f"Interactive plots: [{HTML_FILE}]({HTML_FILE}).", "",
             "| | | |", "| --- | --- | --- |"]
    lines += [f"| **{f.label}** | {_md_cell(f.value)} | {_md_cell(f.detail)} |"
              for f in headline(summary)]
    trials = summary.trials
    lines += ["", f"## Trials ({len(trials)})", ""]
    if trials:
        shown, generated = shown_knobs(trials), generates(trials)
        cols = columns(shown, generated)
        lines += ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        lines += ["| " + " | ".join(_md_cell(text) for text, _ in
                                    trial_row(t, shown, generated)) + " |"
                  for t in ranked(trials)]
    else:
        lines.append("No trial ran.")
    lines += (_md_confirmation(summary) + _md_parity(trials) + _md_pruned(summary)
              + ["", "## Files", ""])
    files = exports_of(summary)
    for name, usage in files:
        lines += [f"- [`{name}`]({name})", "", "  ```", *("  " + u for u in
                                                        usage.splitlines()), "  ```"]
    if not files:
        lines.append(f"No files exported: {_no_files_why(summary)}.")
    return "\n".join(lines) + "\n"


def confirm_columns(summary: Summary) -> tuple[str, ...]:
    """The confirmation table's header, in the unit its runs measured: the objective, real
    tokens/s where padding or packing make tokens the measure, else samples (pairs,
    images) a second."""
    unit = ("real tokens/s" if summary.objective_is_tokens(summary.best)
            else f"{units(summary)[0]}/s")
    return ("role", "config", "search trial", "repeats", f"median {unit}", "spread",
            f"{unit} of each repeat")


def confirmation_rows(summary: Summary) -> list[list[str]]:
    c = summary.confirmation
    if c is None:
        return []
    return [[row.role + (" (winner)" if row.config == c.winner else ""), row.config.label(),
             f"#{row.searched_number}" if row.searched_number is not None else "none",
             str(len(row.samples_per_second)), fmt_num(row.median),
             fmt_pct(row.spread), ", ".join(f"{x:.1f}" for x in row.samples_per_second)]
            for row in c.rows]


def _confirmation_note(summary: Summary) -> str:
    c = summary.confirmation
    if c is None:
        return ""
    moved = next((r for r in c.rows if r.role == "baseline" and r.searched_number is None),
                 None)
    note = (f" The baseline ran out of memory in a longer run, so it moved down to "
            f"{moved.config.label()}, as auto_find_batch_size would." if moved else "")
    missing = sum(max(c.repeats - len(r.samples_per_second), 0) for r in c.rows)
    ran = (f"were to run {c.repeats} more times each ({missing} of those runs are missing: "
           "the search's time ran out or a run failed; the repeats column says how many "
           "each made)" if missing else f"ran {c.repeats} more times each")
    return (f"After the search, these configs {ran}, interleaved, {c.steps} timed steps, "
            "each from its exported training_args.json; the winner is the highest median."
            + note)


def _md_confirmation(summary: Summary) -> list[str]:
    rows = confirmation_rows(summary)
    if not rows:
        return []
    return (["", "## Confirmation", "", _confirmation_note(summary), "",
             "| " + " | ".join(columns := confirm_columns(summary)) + " |",
             "|" + " --- |" * len(columns)]
            + ["| " + " | ".join(_md_cell(x) for x in row) + " |" for row in rows])


def parity_lines(trials: list[Record]) -> list[str]:
    """Each trial with a lever that must not change the maths, against its twin: how
    close its first step came (tuning/numerics.py `parity`), or why it was not checked."""
    out = []
    for t in trials:
        if t.confirming or not t.outcome.ran or not knobs.parity_levers(t.config):
            continue
        m = t.outcome.measured
        if m.parity_twin is not None:
            verdict = (f"first step within {m.parity_gap:.2g} of twin #{m.parity_twin}'s"
                       if t.outcome.ok else f"wrong: {t.outcome.error}")
        elif t.outcome.ok:
            verdict = "unchecked: no twin without the lever ran to compare its first step"
        else:
            continue
        out.append(f"- #{t.number} {t.config.label()}: {verdict}")
    return out


def _md_parity(trials: list[Record]) -> list[str]:
    lines = parity_lines(trials)
    if not lines:
        return []
    return ["", "## Levers checked against their twins", "",
            "A lever that must not change the maths (a sequence split, tiled compute, how "
            "checkpointing recomputes) is checked by its first step's loss and gradient "
            "norm against the same config without it; one that departs is wrong, never "
            "fast.", ""] + lines


def _md_pruned(summary: Summary) -> list[str]:
    pruned = summary.pruned_by_rules
    if not pruned:
        return []
    return ["", "## Left out by device rules", ""] + [
        f"- `{k}`: {v}" for k, v in pruned.items()]


# --- terminal -----------------------------------------------------------------------------

def render_summary(summary: Summary, console: Console) -> None:
    """The headline and the fastest trials, for the end of `autotune search` and for
    `autotune show`."""
    from rich import box
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column(style="cyan")
    grid.add_column(style="dim")
    for f in headline(summary):
        grid.add_row(f.label, f.value, f.detail)
    console.print(Panel(grid, title=f"autotune: {_title(summary)}", expand=False))
    rows = confirmation_rows(summary)
    if rows:
        table = Table(box=box.SIMPLE_HEAD, title="confirmation", title_justify="left")
        for name in confirm_columns(summary):
            table.add_column(name)
        for row in rows:
            table.add_row(*row)
        console.print(table)
    trials = ranked(summary.trials)
    if not trials:
        console.print("[yellow]no trial ran[/yellow]")
        return
    table = Table(box=box.SIMPLE_HEAD, title=f"top {min(TOP_TRIALS, len(trials))} of "
                  f"{len(trials)} trials", title_justify="left")
    for name in ("#", "config", "status", "samples/s", "tokens/s", "peak mem", "reason"):
        if name in ("config", "reason"):  # fold on a narrow terminal; figures stay whole
            table.add_column(name, overflow="fold", ratio=1)
        else:
            table.add_column(name, justify="right" if name.endswith(("s", "mem", "#"))
                             else "left", no_wrap=True, min_width=len(name))
    for t in trials[:TOP_TRIALS]:
        color = "green" if t.outcome.ok else "red"
        table.add_row(str(t.number), t.config.label(), f"[{color}]{t.outcome.status}[/]",
                      fmt_num(t.throughput), fmt_num(t.outcome.tokens_per_second, 0),
                      fmt_bytes(t.outcome.peak_memory_bytes), t.reason[:40])
    console.print(table)


# --- HTML -------------------------------------------------------------------------------

CSS = """
:root { --ink:#1d2433; --muted:#5c6577; --line:#e3e6ec; --bg:#f5f6f8; --accent:#2a9d8f; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
  font:14px/1.45 system-ui,-apple-system,'Segoe UI',Roboto,sans-serif; }
main { max-width:1360px; margin:0 auto; padding:28px 24px 48px; }
header h1 { margin:0; font-size:24px; } header p { margin:4px 0 0; color:var(--muted); }
h2 { font-size:17px; margin:32px 0 12px; }
.cards { display:grid; grid-template-columns:repeat(4,1fr); gap:12px; margin-top:20px; }
.card { background:#fff; border:1px solid var(--line); border-radius:10px; padding:14px 16px; }
.card .label { color:var(--muted); font-size:12px; text-transform:uppercase;
  letter-spacing:.05em; }
.card .value { font-size:24px; font-weight:650; margin:4px 0 2px; overflow-wrap:anywhere; }
.card .detail { color:var(--muted); font-size:12.5px; }
.card.hero { grid-column:span 2; border-left:4px solid var(--accent); }
.card.hero .value { font-family:ui-monospace,SFMono-Regular,Menlo,monospace; font-size:21px; }
.plots { display:grid; grid-template-columns:1fr 1fr; gap:16px; }
.plot { background:#fff; border:1px solid var(--line); border-radius:10px; padding:8px 10px 10px;
  min-width:0; }
.plot.wide { grid-column:span 2; } .plot p { margin:2px 8px; color:var(--muted); font-size:12.5px; }
.tablewrap { overflow-x:auto; background:#fff; border:1px solid var(--line); border-radius:10px; }
table { border-collapse:collapse; width:100%; font-size:12.5px; }
th, td { padding:6px 7px; border-bottom:1px solid var(--line); text-align:left;
  vertical-align:top; white-space:nowrap; }
th { position:sticky; top:0; background:#fafbfc; cursor:pointer; user-select:none; }
th[data-dir=asc]::after { content:" ▲"; } th[data-dir=desc]::after { content:" ▼"; }
td.num { text-align:right; font-variant-numeric:tabular-nums; }
tr.best td { background:#eef8f6; }
.pill { color:#fff; border-radius:9px; padding:1px 8px; font-size:11.5px; font-weight:600; }
pre { margin:0; font:11.5px/1.35 ui-monospace,SFMono-Regular,Menlo,monospace; }
td.wrap { white-space:normal; min-width:110px; max-width:170px; }
td.err { white-space:normal; min-width:230px; max-width:360px; color:#8a1c24; }
td.err summary { cursor:pointer; overflow-wrap:anywhere; }
td.err pre { white-space:pre-wrap; margin-top:4px; color:#5c2128; }
.files pre { background:#1d2433; color:#e9edf5; padding:10px 12px; border-radius:8px;
  overflow-x:auto; }
.files li { margin-bottom:12px; } code { font-family:ui-monospace,Menlo,monospace; }
.note { color:var(--muted); } footer { margin-top:36px; color:var(--muted); font-size:12px; }
"""

# Click a header to sort by it; missing figures (empty data-v) always sort last.
SORT_JS = """
document.querySelectorAll("table.sortable th").forEach((th, col) => {
  th.addEventListener("click", () => {
    const body = th.closest("table").tBodies[0];
    const dir = th.dataset.dir === "desc" ? "asc" : "desc";
    th.closest("tr").querySelectorAll("th").forEach(h => delete h.dataset.dir);
    th.dataset.dir = dir;
    const key = row => row.cells[col].dataset.v;
    const rows = Array.from(body.rows).sort((a, b) => {
      const x = key(a), y = key(b);
      if (x === "" || y === "") return (x === "") - (y === "");
      const nx = Number(x), ny = Number(y);
      const c = isNaN(nx) || isNaN(ny) ? x.localeCompare(y) : nx - ny;
      return dir === "asc" ? c : -c;
    });
    rows.forEach(r => body.appendChild(r));
  });
});
"""

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": [
    "select2d", "lasso2d", "zoomIn2d", "zoomOut2d", "autoScale2d", "toggleSpikelines",
    "hoverClosestCartesian", "hoverCompareCartesian"]}
NUMERIC = {"#", "batch", "accum", "samples/s", "peak mem", "predicted", "step s", GENERATION}


def _numeric(column: str) -> bool:
    return column in NUMERIC or any(k.column == column and k.kind in (int, float)
                                    for k in knobs.table())


def esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def render_html(summary: Summary) -> str:
    """report.html: headline cards, the plots, every trial, the files; opens offline."""
    from plotly.offline import get_plotlyjs

    trials = summary.trials
    parts = [_html_header(summary), _html_plots(trials, summary), _html_table(summary, trials),
             _html_confirmation(summary), _html_pruned(summary), _html_files(summary),
             f"<footer>autotune {esc(summary.autotune_version)} · study "
             f"{esc(summary.search.get('study_name') or DASH)}</footer>"]
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>autotune: {esc(_title(summary))}</title><style>{CSS}</style>"
            f"<script type=\"text/javascript\">{get_plotlyjs()}</script></head>\n"
            f"<body><main>{''.join(parts)}</main><script>{SORT_JS}</script></body></html>\n")


def _html_header(summary: Summary) -> str:
    params = known(summary.model.get("num_parameters"))
    bits = [f"{params / 1e6:,.1f} M parameters" if params else None,
            f"seq len {summary.seq_len}" if summary.seq_len else None,
            f"target batch {summary.target_batch_size}" if summary.target_batch_size else None]
    cards = []
    for i, f in enumerate(headline(summary)):
        cls = "card hero" if i < 2 else "card"  # the best config and its speedups
        cards.append(f'<div class="{cls}"><div class="label">{esc(f.label)}</div>'
                     f'<div class="value">{esc(f.value)}</div>'
                     f'<div class="detail">{esc(f.detail)}</div></div>')
    return (f"<header><h1>autotune report: {esc(_title(summary))}</h1>"
            f"<p>{esc(' · '.join(b for b in bits if b))}</p></header>"
            f"<section class=\"cards\">{''.join(cards)}</section>")


def _html_plots(trials: list[Record], summary: Summary) -> str:
    panels = figures(trials, summary)
    if not panels:
        return "<h2>Plots</h2><p class=\"note\">No trial measured anything to plot.</p>"
    divs = []
    for panel, fig in panels:
        plot = fig.to_html(full_html=False, include_plotlyjs=False, div_id=panel.div_id,
                           default_width="100%", default_height=f"{fig.layout.height}px",
                           config=PLOT_CONFIG)
        cls = "plot wide" if panel.wide else "plot"
        divs.append(f'<div class="{cls}">{plot}<p>{esc(panel.caption)}</p></div>')
    return f"<h2>Plots</h2><section class=\"plots\">{''.join(divs)}</section>"


def _html_cell(name: str, text: str, key: Any) -> str:
    value = "" if key is None else esc(key)
    if name == "status":
        color = STATUS_COLORS.get(text, "#888")
        return f'<td data-v="{value}"><span class="pill" style="background:{color}">' \
               f"{esc(text)}</span></td>"
    if name == "error":
        return _html_error(text, value)
    if name == "reason":
        return f'<td class="wrap" data-v="{value}">{esc(text)}</td>'
    cls = ' class="num"' if _numeric(name) else ""
    return f'<td{cls} data-v="{value}">{esc(text)}</td>'


def _html_error(tail: str, value: str) -> str:
    """The exception line, with the lines before it one click away."""
    if not tail:
        return '<td data-v=""></td>'
    *before, last = tail.splitlines()
    if not before:
        return f'<td class="err" data-v="{value}">{esc(last)}</td>'
    return (f'<td class="err" data-v="{value}"><details><summary>{esc(last)}</summary>'
            f"<pre>{esc(tail)}</pre></details></td>")


def _html_table(summary: Summary, trials: list[Record]) -> str:
    if not trials:
        return "<h2>Trials (0)</h2><p class=\"note\">No trial ran.</p>"
    best_number = summary.best.number if summary.best else None
    shown, generated = shown_knobs(trials), generates(trials)
    cols = columns(shown, generated)
    head = "".join(f"<th>{esc(c)}</th>" for c in cols)
    rows = []
    for t in ranked(trials):
        cls = ' class="best"' if t.number == best_number and t.outcome.ok else ""
        cells = "".join(_html_cell(name, text, key)
                        for name, (text, key) in zip(cols, trial_row(t, shown, generated),
                                                     strict=True))
        rows.append(f"<tr{cls}>{cells}</tr>")
    return (f"<h2>Trials ({len(trials)}) <span class=\"note\">· click a column to sort"
            f"</span></h2><div class=\"tablewrap\"><table class=\"sortable\" id=\"trials\">"
            f"<thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table></div>")


def _html_confirmation(summary: Summary) -> str:
    rows = confirmation_rows(summary)
    if not rows:
        return ""
    head = "".join(f"<th>{esc(c)}</th>" for c in confirm_columns(summary))
    body = "".join("<tr>" + "".join(f"<td>{esc(x)}</td>" for x in row) + "</tr>"
                   for row in rows)
    return (f"<h2>Confirmation</h2><p class=\"note\">{esc(_confirmation_note(summary))}</p>"
            f"<div class=\"tablewrap\"><table id=\"confirmation\"><thead><tr>{head}</tr>"
            f"</thead><tbody>{body}</tbody></table></div>")


def _html_pruned(summary: Summary) -> str:
    pruned = summary.pruned_by_rules
    if not pruned:
        return ""
    items = "".join(f"<li><code>{esc(k)}</code>: {esc(v)}</li>" for k, v in pruned.items())
    return f"<h2>Left out by device rules</h2><ul>{items}</ul>"


def _no_files_why(summary: Summary) -> str:
    return ("no winner (see Best config)" if summary.no_winner_why
            else "no trial succeeded")


def _html_files(summary: Summary) -> str:
    files = exports_of(summary)
    if not files:
        return (f"<h2>Files</h2><p class=\"note\">No files exported: "
                f"{esc(_no_files_why(summary))}.</p>")
    items = "".join(f'<li><a href="{esc(name)}"><code>{esc(name)}</code></a>'
                    f"<pre>{esc(usage)}</pre></li>" for name, usage in files)
    return f"<h2>Files</h2><ul class=\"files\">{items}</ul>"


# --- writing ------------------------------------------------------------------------------

def write_report(output_dir: str | Path, to: str | Path | None = None) -> tuple[Path, Path]:
    """Write report.md and report.html next to summary.json, or into `to`; returns their
    paths."""
    summary = load_summary(Path(output_dir))
    out = Path(to) if to is not None else Path(output_dir)
    if out.exists() and not out.is_dir():
        raise AutotuneError(f"--output: {str(out)!r} is a file, not a folder")
    out.mkdir(parents=True, exist_ok=True)
    md_path, html_path = out / MARKDOWN_FILE, out / HTML_FILE
    write_atomically(md_path, render_markdown(summary))
    write_atomically(html_path, render_html(summary))
    return md_path, html_path


__all__ = ["render_html", "render_markdown", "render_summary", "write_report"]
