"""How long `autotune estimate` takes on a first run, the figure issue 41 asks to keep low.

Each spec is planned in a fresh Python process, timed from after `import autotune,
autotune.plan.estimate, transformers, torch` to the result, so nothing a run before it
traced or replayed helps; what the estimate imports on its own (a model type's modules,
peft under LoRA) is inside the figure, as a user's first run pays it. Wall time and the
process's CPU time are both printed: on a shared machine the CPU time moves less.

    .venv/bin/python benchmarks/estimate_time.py [--repeat 3] [SPEC ...]

Without specs: the 70B example (80 layers, 16 ranks: 768 configs, 36 allocator replays),
the 8B QLoRA example, and the same 8B model fully fine-tuned on one H100 (traced and
replayed at 32 layers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def default_cases() -> dict[str, dict]:
    """Label: spec, for the examples the issue names and an 8B full fine-tune."""
    eight = yaml.safe_load((EXAMPLES / "llama-8b-qlora-24gb.yaml").read_text())
    full = {k: v for k, v in eight.items() if k != "hardware"} | {
        "model": {k: v for k, v in eight["model"].items() if k != "lora"},
        "hardware": {"device": "H100-80GB"}}
    return {"llama-70b-16gpu.yaml": {"path": str(EXAMPLES / "llama-70b-16gpu.yaml")},
            "llama-8b-qlora-24gb.yaml": {"path": str(EXAMPLES / "llama-8b-qlora-24gb.yaml")},
            "llama-8b-qlora-24gb.yaml without lora, H100": {"spec": full}}


def child(case: dict) -> None:
    """In the fresh process: the imports, then one estimate, timed; JSON on stdout."""
    import torch  # noqa: F401
    import transformers  # noqa: F401

    import autotune
    import autotune.plan.estimate  # noqa: F401

    wall, cpu = time.perf_counter(), time.process_time()
    result = autotune.estimate(case.get("path") or case["spec"])
    print(json.dumps({"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                      "rows": len(result.rows)}))


def timed(case: dict) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)],
                         capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"the estimate of {case} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("specs", nargs="*", help="spec files (default: the examples above)")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per spec")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    cases = ({Path(p).name: {"path": str(Path(p).resolve())} for p in args.specs}
             or default_cases())
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the start; "
          f"seconds after the imports, {args.repeat} fresh processes each")
    for label, case in cases.items():
        runs = [timed(case) for _ in range(args.repeat)]
        wall, cpu = ([r[k] for r in runs] for k in ("wall", "cpu"))
        print(f"{label:45s} {runs[0]['rows']:5d} configs  wall median "
              f"{statistics.median(wall):5.2f} s (min {min(wall):5.2f})  cpu median "
              f"{statistics.median(cpu):5.2f} s (min {min(cpu):5.2f})", flush=True)


if __name__ == "__main__":
    main()
