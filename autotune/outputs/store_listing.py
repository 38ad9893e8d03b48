"""`autotune results`: what a store knows, and moving its records between stores as JSON
lines (a TopHub of a team's own)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.files import write_atomically
from autotune.store.db import ResultStore, StoreError, shown, store_url
from autotune.store.record import StoredResult
from autotune.tasks import DEFAULT_TRAINER

if TYPE_CHECKING:
    from rich.console import Console

# The versions a row shows (every one is in the record).
SHOWN_VERSIONS = ("torch", "cuda", "transformers", "deepspeed", "bitsandbytes")


def open_store(url: str | None) -> ResultStore:
    """The store named (or the default); an error where it is off or cannot be opened."""
    resolved = store_url(url)
    if resolved is None:
        raise StoreError("the results store is off (--store / $AUTOTUNE_STORE say off); "
                         "name one with --store URL")
    return ResultStore.open(resolved)


def _ratio(summary: dict[str, Any], which: str) -> str:
    c = summary.get("confirmation") or {}
    if which == "speedup":
        value, low, high = c.get("speedup"), c.get("speedup_low"), c.get("speedup_high")
    else:
        vs = c.get("vs_recipe") or {}
        value, low, high = vs.get("speedup"), vs.get("low"), vs.get("high")
    if value is None:
        return "—"
    return f"{value:.2f}x" + (f" ({low:.2f}-{high:.2f})" if low is not None
                              and high is not None else "")


def row(r: StoredResult) -> dict[str, str]:
    """One record as `autotune results` shows it."""
    s = r.summary
    best = s.get("best") or {}
    winner = best.get("config") or {}
    from autotune.config import TrialConfig

    try:
        label = TrialConfig.from_dict(winner).label() if winner else "—"
    except Exception:  # noqa: BLE001 - a knob this autotune does not know: shown raw
        label = str(winner)
    data = (r.fingerprint.get("data") or {}).get("rows")
    trainer = r.fingerprint.get("trainer", DEFAULT_TRAINER)
    v = r.versions
    return {"date": r.date, "model": r.model, "device": r.device,
            "setup": f"seq {r.seq_len}, batch {r.target_batch_size}, "
                     f"{'synthetic' if data == 'synthetic' else f'{data} real rows'}"
                     + (f", {trainer}" if trainer != DEFAULT_TRAINER else ""),
            "winner": label, "vs defaults": _ratio(s, "speedup"),
            "vs recipe": _ratio(s, "recipe"),
            "versions": " ".join(f"{k} {v[k]}" for k in SHOWN_VERSIONS
                                 if v.get(k) not in (None, "absent", "none")),
            "key": r.key[:8], "output": r.output}


def render_records(store: ResultStore, console: Console, model: str | None = None,
                   device: str | None = None) -> int:
    """The table of records, newest first; returns how many."""
    from rich import box
    from rich.table import Table

    found = store.records(model, device)
    for note in found.notes:
        console.print(f"note: {note}", highlight=False)
    if not found.records:
        said = " matching" + "".join(f" {k} {v!r}" for k, v in (("--model", model),
                                     ("--device", device)) if v) if model or device else ""
        console.print(f"no records{said} in {shown(store.url)}", highlight=False)
        return 0
    table = Table(box=box.SIMPLE_HEAD, title=f"{len(found.records)} records in "
                  f"{shown(store.url)}", title_justify="left")
    rows = [row(r) for r in found.records]
    for name in rows[0]:
        table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(*r.values())
    console.print(table)
    return len(rows)


def export_records(store: ResultStore, path: Path) -> int:
    lines = list(store.export_lines())
    write_atomically(path, "".join(line + "\n" for line in lines))
    return len(lines)


def import_records(store: ResultStore, path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise StoreError(f"{path}: no such file (a JSON-lines file of `autotune results "
                         "export`)")
    with path.open(encoding="utf-8") as f:
        return store.import_lines(f)
