"""Moved to autotune/outputs/store_notes.py: what the CLI and the report say is a
presenter's, not the store's. Left only for outputs/report.py's import, which is another
change's to make (`from autotune.outputs.store_notes import store_facts`); delete this
file with it."""

from autotune.outputs.store_notes import remembered_line, store_facts

__all__ = ["remembered_line", "store_facts"]
