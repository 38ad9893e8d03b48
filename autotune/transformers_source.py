"""Facts about the installed transformers read from the source of training_args.py.

Importing transformers.training_args imports peft, bitsandbytes and torch's inductor: 1.5-
3.5 s on two cores, which a search's driver and a plan need for nothing else. Where the
module is imported already, or its source cannot be read so, the callers import it.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from functools import cache
from pathlib import Path

TRAINING_ARGS = "transformers.training_args"


@cache
def _source() -> Path | None:
    """training_args.py, found without importing transformers (finding the submodule
    imports the package, and torch with it: 1-2 s of a driver that may need neither)."""
    loaded = sys.modules.get(TRAINING_ARGS)
    if loaded is not None:
        origin = getattr(loaded, "__file__", None)
        return Path(origin) if origin else None
    package = importlib.util.find_spec("transformers")
    for folder in (package.submodule_search_locations or []) if package else []:
        path = Path(folder) / "training_args.py"
        if path.is_file():
            return path
    return None


@cache
def _classes() -> dict[str, ast.ClassDef] | None:
    """The top-level classes of training_args.py by name, or None where it is unreadable."""
    path = _source()
    if path is None:
        return None
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return None
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def optimizer_names() -> list[str] | None:
    """The string values of `OptimizerNames`, in order and each once (as the enum lists
    them), or None."""
    cls = (_classes() or {}).get("OptimizerNames")
    if cls is None:
        return None
    values = [s.value.value for s in cls.body if isinstance(s, ast.Assign)
              and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)]
    return list(dict.fromkeys(values)) or None


def training_arguments_fields() -> set[str] | None:
    """The fields `TrainingArguments` declares (its annotated class attributes), or None."""
    cls = (_classes() or {}).get("TrainingArguments")
    if cls is None:
        return None
    names = {s.target.id for s in cls.body
             if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
    return names or None


@cache
def mentions(word: str) -> bool:
    """Whether training_args.py's source mentions `word` (a field or key it documents)."""
    path = _source()
    if path is None:
        return False
    try:
        return word in path.read_text(encoding="utf-8")
    except OSError:
        return False
