"""The spec and knob references, written from the code itself so they cannot drift:
docs/spec.md from the pydantic models (each field's type, default and docstring),
docs/knobs.md and `autotune knobs` from the knob table (values, Trainer's default, the
guide's recipe, the rules and their reasons, what each value sets).

    .venv/bin/python -m autotune.outputs.reference docs/    # rewrites the two pages
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from autotune import knobs

if TYPE_CHECKING:
    from autotune.device import DeviceSpec

SPEC_PAGE, KNOBS_PAGE = "spec.md", "knobs.md"
GENERATED = "<!-- written by `python -m autotune.outputs.reference docs/`: do not edit -->"


# --- the spec ---------------------------------------------------------------------------

def _section(annotation: Any) -> type[BaseModel] | None:
    """The section model a field holds (directly or as Optional), or None for a value."""
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


def _type_text(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is dict:
        return "mapping"
    if typing.get_origin(annotation) is list:
        return f"list of {_type_text(args[0])}"
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if args:
        return " or ".join(_type_text(a) for a in args if a is not type(None)) + (
            " or none" if type(None) in args else "")
    return getattr(annotation, "__name__", str(annotation))


def spec_keys(model: type[BaseModel] | None = None, prefix: str = "") -> list[str]:
    """Every key of model.yaml, dotted, sections included."""
    from autotune.spec import Spec

    out = []
    for name, field in (model or Spec).model_fields.items():
        out.append(prefix + name)
        section = _section(field.annotation)
        if section is not None:
            out += spec_keys(section, f"{prefix}{name}.")
    return out


def spec_markdown() -> str:
    """docs/spec.md: every key of model.yaml, section by section."""
    from autotune.spec import Spec

    lines = [GENERATED, "", "# The spec (model.yaml)", "",
             "Every key, its type, default and meaning, read from `autotune/spec.py`. Unknown "
             "keys are errors naming the nearest known one; a relative path is relative to "
             "the spec's own folder.", ""]
    lines += _section_table(Spec, "")
    return "\n".join(lines) + "\n"


def _section_table(model: type[BaseModel], prefix: str) -> list[str]:
    rows, sections = [], []
    for name, field in model.model_fields.items():
        section = _section(field.annotation)
        key = prefix + name
        if section is not None:
            sections.append((key, section, field))
            rows.append(f"| `{key}` | section | {'required' if field.is_required() else '—'} "
                        f"| {_one_line(field.description or section.__doc__)} |")
            continue
        default = "required" if field.is_required() else f"`{field.default!r}`"
        rows.append(f"| `{key}` | {_type_text(field.annotation)} | {default} | "
                    f"{_one_line(field.description)} |")
    out = ["| key | type | default | meaning |", "| --- | --- | --- | --- |", *rows]
    for key, section, _ in sections:
        out += ["", f"## `{key}`", ""]
        if section.__doc__:
            out += [_one_line(section.__doc__), ""]
        out += _section_table(section, f"{key}.")
    return out


def _plain(text: str) -> str:
    """A rule's text without its placeholders (filled per config where it rules)."""
    import re

    text = text.replace("{cc}", "the device's").replace("{device}", "the device")
    return re.sub(r"\{(\w+)\}", r"\1", text)


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


# --- the knobs --------------------------------------------------------------------------

def knob_rows(device: DeviceSpec | None = None) -> list[dict[str, Any]]:
    """Per knob: its values, Trainer's default, the recipe's pick (on `device`), and with
    a device the values its rules allow there and why the others are out."""
    from autotune.config import Family, TrialConfig

    rows = []
    for k in knobs.table():
        row: dict[str, Any] = {
            "name": k.name, "label": k.label, "values": k.allowed(), "baseline": k.baseline,
            "listed_in": k.listed_in, "rules": [(r.label, r.reason) for r in k.rules],
            "sets": _sets(k), "scope": k.scope or "every spec", "recipe": None,
            "allowed": None, "out": {}}
        if device is not None:
            allowed = []
            for v in (row["values"] if not k.listed_in else [k.baseline, *_listed(k)]):
                hit = knobs.device_rule(TrialConfig(1, 1, Family.of({k.name: v})), device)
                if hit is None:
                    allowed.append(v)
                else:
                    row["out"][v] = hit[1]
            row["allowed"] = allowed
            row["recipe"] = k.preferred(device, False)
        rows.append(row)
    return rows


def _listed(k: knobs.Knob) -> list:
    """A long list's values worth showing (the optimizers: those autotune knows)."""
    from autotune.optimizers import OPTIMIZERS

    return [v for v in OPTIMIZERS if v != k.baseline and v in k.allowed()]


def _sets(k: knobs.Knob) -> str:
    if k.sets:
        return k.sets
    if k.training_args is not None:
        return "TrainingArguments"
    if k.loading is not None:
        return "from_pretrained kwargs"
    return "the trial (model, data or DeepSpeed config)"


def knobs_markdown() -> str:
    """docs/knobs.md: the knob table, device by device where the rules differ."""
    lines = [GENERATED, "", "# The knobs", "",
             "Every lever autotune searches, from its one row in `autotune/knobs.py`. A "
             "search space (`autotune/search_spaces/*.yaml`, or a file of your own) lists the "
             "values to search per knob; a knob left out keeps Trainer's default. `autotune "
             "knobs [--device NAME]` prints this for a device, with what its rules allow "
             "there. \"Applies to\" is where a value other than the default can run on the "
             "spec's model, data and trainer (causal LMs, seq2seq-lm encoder-decoders, "
             "image classifiers, trainer: trainer, sft or dpo); elsewhere the search leaves "
             "it out and says why.", "",
             "| knob | values | Trainer's default | sets | applies to | rules (what rules a "
             "value out) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in knob_rows():
        values = (f"see {row['listed_in']}" if row["listed_in"]
                  else ", ".join(f"`{v}`" for v in row["values"]))
        rules = "; ".join(f"{_plain(label)}: {_plain(why)}" for label, why in row["rules"]
                          ) or "—"
        lines.append(f"| `{row['name']}` ({row['label']}) | {values} | `{row['baseline']}` | "
                     f"{row['sets']} | {row['scope']} | {_one_line(rules)} |")
    lines += ["", "## The guide's recipe", "",
              "What a careful user picks by hand from the seeds' guide, best first (the first "
              "value the device's rules and the model allow is taken), on a GPU and on a CPU:",
              "", "| knob | on a GPU | on a CPU |", "| --- | --- | --- |"]
    from autotune.device import DeviceSpec, named_device

    gpu, cpu = named_device("H100-80GB"), DeviceSpec("cpu", "cpu", 2**34, native_bf16=True)
    for k in knobs.table():
        if k.recipe is None:
            continue
        lines.append(f"| `{k.name}` | {', '.join(f'`{v}`' for v in k.preferred(gpu, True))} | "
                     f"{', '.join(f'`{v}`' for v in k.preferred(cpu, True))} |")
    lines += ["", "Real data adds dataloader workers; a CPU without native bf16 keeps fp32. "
              "Where nothing fits, the recipe takes the guide's memory levers in order "
              "(`autotune/tuning/recipe.py`: checkpointing, 8-bit states, a 4-bit base under "
              "LoRA, ZeRO, offload)."]
    return "\n".join(lines) + "\n"


def render_knobs(device: DeviceSpec, console: Any) -> None:
    """`autotune knobs`: the table for one device."""
    from rich import box
    from rich.table import Table

    table = Table(title=f"knobs on {device.name}", box=box.SIMPLE_HEAD)
    for col in ("knob", "allowed here", "Trainer's default", "the guide's pick", "applies to",
                "not here"):
        table.add_column(col, overflow="fold")
    for row in knob_rows(device):
        recipe = row["recipe"] or []
        pick = next((v for v in recipe if v in (row["allowed"] or [])), row["baseline"])
        out = "; ".join(f"{v}: {why}" for v, why in row["out"].items())
        table.add_row(row["name"], ", ".join(map(str, row["allowed"] or [])),
                      str(row["baseline"]), str(pick), row["scope"], out)
    console.print(table)


def write_pages(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in ((SPEC_PAGE, spec_markdown()), (KNOBS_PAGE, knobs_markdown())):
        (folder / name).write_text(text)
        written.append(folder / name)
    return written


if __name__ == "__main__":
    for path in write_pages(Path(sys.argv[1] if len(sys.argv) > 1 else "docs")):
        print(f"wrote {path}")
