"""Replay a recorded search's outcomes, in order, through today's memory model.

    .venv/bin/python benchmarks/memory_replay.py RECORD [--spec SPEC] [--json FILE] \
        [--unmodelled liger-compiled]

RECORD is a search's `summary.json` (its folder will do: runs/..., reports/gpt2-h200) or
a GPU proof's `summary.md` (benchmarks/gpu_runs/*.md), whose trial table keeps each
trial's label, status and peak; such a record names its step, and the step's spec
(STEP_SPECS, or --spec) gives the model and the budget. The model starts fresh and
learns from each outcome as the search did (a measured peak, an OOM as a bound). Per
trial: the prediction before it ran (what chose it), after it ran, and the measured peak;
then the recipe's rungs as the model last ranked them, and the line
`winner: predicted P GiB against M GiB measured (E%)`, the winner's prediction before
its first trial. Run against another checkout's package to compare two models on one
record: `PYTHONPATH=../other .venv/bin/python benchmarks/memory_replay.py RECORD`.
`--unmodelled liger-compiled` takes compiled Liger's logits term out of the physics, as
the model was when the H100's 8B QLoRA search ran: its three OOMs then come from a
lever the model does not know.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))  # after PYTHONPATH: another checkout's package wins

from autotune.config import TrialConfig  # noqa: E402
from autotune.device import DeviceSpec, GiB, named_device  # noqa: E402
from autotune.plan.calibration import MemoryModel  # noqa: E402
from autotune.plan.shape import ModelShape, model_shape  # noqa: E402
from autotune.records import OK, Outcome, Record  # noqa: E402

# The GPU proof's steps whose summary.md a replay can read, and the spec each searched.
STEP_SPECS = {"llama8b_qlora": "examples/llama-8b-qlora-24gb.yaml"}
# A GPU proof's device line, by the name NVIDIA gives it, to the device table's.
DEVICE_NAMES = {"H100": "H100-80GB", "H200": "H200", "A100": "A100-80GB"}


def _no_compiled_liger() -> None:
    """The physics before 2026-11-27's measurement: compiled Liger keeps what eager Liger
    does (the H100's 8B QLoRA search ran with it)."""
    from autotune.plan.memory import Physics

    Physics._liger_compiled = lambda self, c: False  # type: ignore[method-assign]


# Terms a replay can take out of the physics, to see what the OOMs of a lever the model
# lacks teach it (docs/memory.md).
UNMODELLED = {"liger-compiled": _no_compiled_liger}


@dataclass
class Recorded:
    """What a replay needs of a search: the model, the device and limit, its trials in
    the order they finished, and the winner."""

    shape: ModelShape
    device: DeviceSpec
    world_size: int
    limit_bytes: int
    records: list[Record]
    winner: TrialConfig | None


def from_summary(path: Path) -> Recorded:
    from autotune.summary import load_summary

    s = load_summary(path.parent if path.is_file() else path)
    if s.device is None:
        raise SystemExit(f"{path}: the summary does not say which device its trials ran on")
    winner = s.confirmation.winner if s.confirmation and s.confirmation.winner else (
        s.best.config if s.best else None)
    records = [r for r in s.trials if r.outcome.ran and not r.confirming]
    return Recorded(ModelShape.from_dict(s.model), s.device, s.world_size,
                    s.memory_limit_bytes, records, winner)


def from_proof_markdown(path: Path, spec_path: str | None) -> Recorded:
    """A GPU proof's summary.md: its device line, its step's name, the trial table (#,
    config, reason, status, samples/s, predicted, peak GiB, ...) and the role table's
    winner. Peaks are read at the table's 0.01 GiB."""
    from autotune.spec import load_spec

    text = path.read_text()
    step = re.search(r"^\| (\w+) \| [^|]+ \| [\d.]+ \| \d+ \|$", text, re.M)
    spec_path = spec_path or (STEP_SPECS.get(step[1]) if step else None)
    if spec_path is None:
        raise SystemExit(f"{path}: no step with a known spec ({', '.join(STEP_SPECS)}); "
                         "give --spec")
    spec = load_spec(ROOT / spec_path if not Path(spec_path).is_absolute() else spec_path)
    device_line = re.search(r"^device: NVIDIA (\w+)", text, re.M)
    if device_line is None or device_line[1] not in DEVICE_NAMES:
        raise SystemExit(f"{path}: no device line naming one of {', '.join(DEVICE_NAMES)}")
    device = named_device(DEVICE_NAMES[device_line[1]], spec.world_size)
    records = []
    for m in re.finditer(r"^\| (\d+) \| (b\d+x\d+[^|]*?) \| (\w+) \| (\w+) \| [^|]* \| "
                         r"([\d.]+|—) \| ([\d.]+|—) \|", text, re.M):
        config = TrialConfig.from_label(m[2].strip())
        peak = None if m[6] == "—" else int(float(m[6]) * GiB)
        status = m[4]
        records.append(Record(config, Outcome(status, peak_memory_bytes=peak
                                              if status == OK else None),
                              m[3], int(m[1])))
    winner = re.search(r"^\| winner \| (b\d+x\d+[^|]*?) \|", text, re.M)
    return Recorded(model_shape(spec), device, spec.world_size,
                    spec.hardware.budget_bytes() or device.memory_bytes, records,
                    TrialConfig.from_label(winner[1].strip()) if winner else None)


def load(record: str, spec: str | None) -> Recorded:
    path = Path(record)
    if path.suffix == ".md":
        return from_proof_markdown(path, spec)
    return from_summary(path)


def replay(rec: Recorded) -> list[dict]:
    """Per trial, in order: the prediction before and after it taught the model."""
    model = MemoryModel(rec.shape, rec.device, rec.world_size)
    rows = []
    for r in rec.records:
        before = model.predict_total(r.config)
        model.learn(r, rec.limit_bytes)
        rows.append({"number": r.number, "config": r.config.label(), "reason": r.reason,
                     "status": r.outcome.status, "before": before,
                     "after": model.predict_total(r.config),
                     "measured": r.outcome.peak_memory_bytes if r.outcome.ok else None})
    return rows


def rungs(rec: Recorded, rows: list[dict]) -> list[str]:
    """Each family the recipe walked, its batches largest first as predicted before each
    ran: a prediction that rises as the batch falls is marked."""
    out = []
    walked: dict[str, list[tuple[int, float]]] = {}
    for r, row in zip(rec.records, rows, strict=True):
        if r.reason == "recipe":
            walked.setdefault(r.config.family.label(), []).append(
                (r.config.per_device_train_batch_size, row["before"]))
    for family, seen in walked.items():
        seen.sort(reverse=True)
        rises = any(b > a for (_, a), (_, b) in zip(seen, seen[1:], strict=False))
        out.append(f"recipe {family}: " + ", ".join(f"b{b} {p / GiB:.2f}" for b, p in seen)
                   + (" (rises as the batch falls)" if rises else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("record")
    ap.add_argument("--spec", help="the spec a GPU proof's summary.md searched")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--unmodelled", choices=sorted(UNMODELLED),
                    help="replay with the physics lacking this term, as an older model did")
    args = ap.parse_args(argv)
    if args.unmodelled:
        UNMODELLED[args.unmodelled]()
    rec = load(args.record, args.spec)
    rows = replay(rec)
    print(f"{args.record}: {rec.shape.name} on {rec.device.name}, limit "
          f"{rec.limit_bytes / GiB:.2f} GiB, {len(rows)} trials")
    print(f"{'#':>3} {'status':7} {'before':>7} {'after':>7} {'measured':>8} {'error':>7}  "
          "config")
    errors = []
    for row in rows:
        m = row["measured"]
        err = (row["before"] - m) / m if m else None
        if err is not None:
            errors.append(abs(err))
        print(f"{row['number'] if row['number'] is not None else '':>3} {row['status']:7} "
              f"{row['before'] / GiB:7.2f} {row['after'] / GiB:7.2f} "
              f"{m / GiB if m else float('nan'):8.2f} "
              f"{f'{err:+.1%}' if err is not None else '':>7}  {row['config']}")
    for line in rungs(rec, rows):
        print(line)
    if errors:
        errors.sort()
        print(f"ok trials: median error {errors[len(errors) // 2]:.1%}, max {errors[-1]:.1%}")
    first = next((row for r, row in zip(rec.records, rows, strict=True)
                  if rec.winner is not None and r.config == rec.winner and r.outcome.ok), None)
    if first is not None:
        p, m = first["before"], first["measured"]
        print(f"winner: predicted {p / GiB:.2f} GiB against {m / GiB:.2f} GiB measured "
              f"({(p - m) / m:+.1%})")
    else:
        print("winner: none measured")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
