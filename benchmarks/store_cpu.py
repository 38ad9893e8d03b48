"""The results store on the bundled example, for real (docs/results.md): the tiny GPT-2
searched at seq 128 into a fresh store, searched again (remembered: its wall time against
the first), then at seq 96 from nothing (the store off) and seeded by the seq-128 record.

    .venv/bin/python benchmarks/store_cpu.py OUT_DIR [PAIRS]

Each step is `autotune search` as a user runs it (its own process, Ray and all); the
wall times are those processes'. "Trials to 0.98": the search's trials (not its
confirmation runs) until one measured 0.98 of the best single trial of any seq-96
search, and the seconds those trials took; "winner first ran at": the search trial that
first ran the config the search confirmed. A shared machine's load moves every figure
(a record made under load fails its check once the load is gone, rightly): the load
average at each step's start is printed beside it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-gpt2.yaml"
TARGET = 0.98


def search(spec: Path, out: Path, store: str, *extra: str) -> tuple[float, dict]:
    began = time.time()
    proc = subprocess.run([sys.executable, "-m", "autotune", "search", str(spec), "--output",
                           str(out), "--store", store, *extra], capture_output=True, text=True)
    wall = time.time() - began
    if proc.returncode != 0:
        sys.exit(f"{out.name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return wall, json.loads((out / "summary.json").read_text())


def searched(summary: dict) -> list[dict]:
    return [t for t in summary["trials"] if t["reason"] != "confirm"
            and t["outcome"]["status"] != "pruned"]


def score(t: dict) -> float:
    return float(t["outcome"].get("samples_per_second") or 0.0) if (
        t["outcome"]["status"] == "ok") else 0.0


def to_target(summary: dict, best: float) -> tuple[int | None, float | None]:
    """(trials, their seconds) until one reached TARGET of `best`."""
    spent = 0.0
    for i, t in enumerate(searched(summary), 1):
        spent += float(t["outcome"].get("wall_seconds") or 0.0)
        if score(t) >= TARGET * best:
            return i, spent
    return None, None


def winner_at(summary: dict) -> int | None:
    """The search trial (1-based, confirmation runs aside) that first ran the config the
    search confirmed as its winner."""
    best = (summary.get("best") or {}).get("config")
    return next((i for i, t in enumerate(searched(summary), 1) if t["config"] == best), None)


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main(out: Path, pairs: int = 2) -> None:
    """seq 128 twice, then `pairs` pairs of seq-96 searches from nothing and seeded, in
    ABBA order (drift of the machine hits both alike), each seeded one from a copy of the
    store as the seq-128 search left it (a seeded search records itself: the next would
    be an exact match)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    store_file = (out / "results.db").resolve()
    store = f"sqlite:///{store_file}"
    seq96 = out / "tiny-gpt2-seq96.yaml"
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["data"]["seq_len"] = 96
    seq96.write_text(yaml.safe_dump(spec, sort_keys=False))
    runs, loads = {}, {}
    for name, path in (("seq128", EXAMPLE), ("seq128-again", EXAMPLE)):
        loads[name] = load()
        runs[name] = search(path, out / name, store)
    kept = out / "after-seq128.db"
    shutil.copy(store_file, kept)
    order = [k for i in range(pairs) for k in (("nothing", "seeded") if i % 2 == 0
                                               else ("seeded", "nothing"))]
    for i, kind in enumerate(order):
        name = f"seq96-{kind}-{i // 2 + 1}"
        loads[name] = load()
        if kind == "nothing":
            runs[name] = search(seq96, out / name, "off")
        else:
            copy = out / f"{name}.db"
            shutil.copy(kept, copy)
            runs[name] = search(seq96, out / name, f"sqlite:///{copy.resolve()}")
    best96 = max(score(t) for name in runs if name.startswith("seq96")
                 for t in searched(runs[name][1]))
    from autotune.config import TrialConfig

    print(f"date: {time.strftime('%Y-%m-%d')}; best single trial at seq 96: {best96:.1f} "
          "samples/s")
    print("| run | load at start | wall s | trials run | OOMs | trials to 0.98 | their s | "
          "winner first ran at trial | winner | vs defaults | remembered / seeded |")
    print("|" + " --- |" * 11)
    for name, (wall, s) in runs.items():
        remembered = (s.get("remembered") or {}).get("reconfirmed")
        ran = searched(s) if not remembered else []
        n, secs = to_target(s, best96) if name.startswith("seq96") else (None, None)
        best = (s.get("best") or {}).get("config")
        said = (f"reconfirmed ({len(s['remembered']['checks'])} runs)" if remembered else
                f"not reconfirmed: {s['remembered']['why']}" if s.get("remembered") else
                "seeded: " + ", ".join(c for r in s.get("seeded_by") or [] for c in r["configs"])
                if s.get("seeded_by") else "—")
        speedup = f"{s['speedup']:.2f}x" if s.get("speedup") else "—"
        at = winner_at(s) if ran else None
        print(f"| {name} | {loads[name]} | {wall:.0f} | {len(ran)} | "
              f"{sum(t['outcome']['status'] == 'oom' for t in ran)} | "
              f"{n if n is not None else '—'} | {f'{secs:.0f}' if secs else '—'} | "
              f"{at if at is not None else '—'} | "
              f"{TrialConfig.from_dict(best).label() if best else '—'} | {speedup} | {said} |")
    first, again = runs["seq128"][0], runs["seq128-again"][0]
    print(f"seq128 again: {again:.0f} s against {first:.0f} s ({again / first:.0%})")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/store-cpu"),
         int(sys.argv[2]) if len(sys.argv) > 2 else 2)
