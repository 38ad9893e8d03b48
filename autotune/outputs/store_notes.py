"""What the CLI and the report say of the results store: a result answered from a
record, a record that failed its check, the near matches a search started from."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from autotune.summary import Summary


def _checks(remembered: dict) -> str:
    parts = []
    for c in remembered.get("checks") or []:
        if c.get("measured") is None:
            parts.append(f"{c['role']} {c.get('status') or 'did not run'}")
        else:
            parts.append(f"{c['role']} {c['measured']:,.1f} (recorded interval "
                         f"{c['low']:,.1f}-{c['high']:,.1f})")
    return ", ".join(parts)


def remembered_line(summary: Summary) -> str | None:
    """One line for the end of `autotune search`, or None."""
    r = summary.remembered
    if r and r.get("reconfirmed"):
        return (f"remembered: answered from the search of {r['from'][:10]} ({r['output']}), "
                f"reconfirmed by one run each: {_checks(r)} samples/s; --fresh searches "
                "again")
    if r:
        return f"searched again: the record of {r['from'][:10]} was not reconfirmed: {r['why']}"
    if summary.seeded_by:
        runs = sum(len(s.get("configs") or []) for s in summary.seeded_by)
        return (f"seeded: {runs} recorded winner{'s' if runs != 1 else ''} of "
                f"{len(summary.seeded_by)} similar search"
                f"{'es' if len(summary.seeded_by) > 1 else ''} ran first ("
                + "; ".join(f"{s['from'][:10]}, seq_len {s['seq_len']}, {s['device']}"
                            for s in summary.seeded_by) + ")")
    return None


def store_facts(summary: Summary) -> list[tuple[str, str, str]]:
    """(label, value, detail) headline facts for the report."""
    r = summary.remembered
    if r and r.get("reconfirmed"):
        was, now = summary.search.get("wall_seconds"), r.get("wall_seconds")
        took = f"; that search took {was / 60:.1f} min" if was else ""
        return [("Remembered", f"from {r['from'][:10]}",
                 f"the search in {r['output']} answered (autotune "
                 f"{r.get('autotune_version', '?')}{took}); reconfirmed now"
                 + (f" in {now:.0f} s" if now else "") + " by one run each, within the "
                 f"recorded intervals: {_checks(r)} samples/s; the trials below are that "
                 "search's")]
    facts = []
    if r:
        facts.append(("Searched again", f"record of {r['from'][:10]} not reconfirmed",
                      str(r.get("why"))))
    if summary.seeded_by:
        configs = [c for s in summary.seeded_by for c in s.get("configs") or []]
        facts.append(("Seeded by", f"{len(summary.seeded_by)} similar search"
                      f"{'es' if len(summary.seeded_by) > 1 else ''}",
                      "; ".join(f"{s['from'][:10]}, seq_len {s['seq_len']}, batch "
                                f"{s['target_batch_size']}, {s['device']}"
                                for s in summary.seeded_by)
                      + f": ran first {', '.join(configs) or 'none (none applies here)'}"))
    return facts
