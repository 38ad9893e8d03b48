"""How long `autotune estimate` takes on a first run, the figure issue 41 asks to keep low.

Each spec is planned in a fresh Python process, timed from after `import autotune,
autotune.plan.estimate, transformers, torch` to the result, so nothing a run before it
traced or replayed helps; what the estimate imports on its own (a model type's modules,
peft under LoRA) is inside the figure, as a user's first run pays it. Wall time and the
process's CPU time are both printed: on a shared machine the CPU time moves less.

    .venv/bin/python benchmarks/estimate_time.py [--repeat 3] [SPEC ...]
    .venv/bin/python benchmarks/estimate_time.py --gate [SPEC ...]   # the search's gate

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


def gate(path: str) -> None:
    """The search's memory gate on a spec, in this process: its first pass (every
    candidate predicted, the traces made first as the search makes them), then a pass
    after three measured trials refit the model (as after each trial of a search)."""
    from autotune.device import node_cpus
    from autotune.plan.calibration import MemoryModel
    from autotune.plan.estimate import planned_device
    from autotune.plan.shape import model_shape
    from autotune.plan.trace import prefetch
    from autotune.records import Outcome, Record
    from autotune.space import build_space
    from autotune.spec import load_spec

    spec = load_spec(path)
    device = planned_device(spec, spec.hardware.device)
    candidates = build_space(spec, device).candidates
    model = MemoryModel(model_shape(spec), device, spec.world_size)
    began = time.perf_counter()
    prefetch([a for c in candidates if (a := model.trace_args(c))], workers=node_cpus())
    first = [model.predict_total(c) for c in candidates]
    first_s = time.perf_counter() - began
    for c in [c for c, p in zip(candidates, first, strict=True)
              if p < device.memory_bytes][:3]:
        model.learn(Record(c, Outcome("ok", peak_memory_bytes=int(
            model.predict_total(c) * 1.05))), device.memory_bytes)
    began = time.perf_counter()
    for c in candidates:
        model.predict_total(c)
    print(f"{Path(path).name}: memory gate over {len(candidates)} candidates: first pass "
          f"{first_s:.2f} s, after a refit {1000 * (time.perf_counter() - began):.0f} ms")


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
    ap.add_argument("--gate", action="store_true", help="time the search's memory gate "
                    "on each spec instead (a spec file needs a named device)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    if args.gate:
        for path in args.specs or [str(EXAMPLES / "llama-70b-16gpu.yaml")]:
            gate(path)
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
