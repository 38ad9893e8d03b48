"""Where a QLoRA step's memory goes under torch.compile and Liger, on the trial's own path.

The first GPU search of examples/llama-8b-qlora-24gb.yaml (H100, 2026-11-27) ran the
guide's recipe (bf16, checkpointing, compile, SDPA, a 4-bit base, Liger) out of a 24 GiB
budget at every batch, down to 1, where the memory model predicted 19-23 GiB; the same
base without compile peaked at 12.7 GiB at batch 2. This runs real trials (Trainer,
the warm launcher, the model built on the device) of the Llama-3-8B width with a few
layers at seq 4096, batch 1, each lever on and off, so the per-layer slope and the
fixed part of each combination can be read from two depths, and prints each trial's
peak beside the memory model's prediction. On a CPU (no Liger, no CUDA) it runs a tiny
Llama, compile on and off, to rehearse the path.

    benchmarks/qlora_compile_memory.py OUTDIR [--budget SECONDS]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The 8B example's architecture (its width; the depth is each run's).
EXAMPLE = ROOT / "examples" / "llama-8b-qlora-24gb.yaml"
TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 2048,
        "max_position_embeddings": 512}
# (layers, compile, liger), most telling first: a call cut short still says the most.
RUNS = [(4, False, True), (4, True, True), (4, True, False), (8, True, True),
        (8, False, True), (4, False, False), (8, True, False), (8, False, False)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--budget", type=float, default=600.0, help="seconds for all trials")
    args = ap.parse_args()
    import yaml

    from autotune.config import TrialConfig
    from autotune.device import local_device, node_cpus
    from autotune.plan.calibration import MemoryModel
    from autotune.plan.estimate import model_shape
    from autotune.spec import load_spec
    from autotune.trials.launch import run_trial
    from autotune.trials.protocol import make_request

    width = yaml.safe_load(EXAMPLE.read_text())["model"]["config"]
    started = time.time()
    device = local_device()
    gpu = device.is_cuda
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for layers, compiled, liger in RUNS:
        if not gpu and liger:
            continue
        left = args.budget - (time.time() - started)
        if left < 30:
            print(f"stopping: {left:.0f} s left of the budget", flush=True)
            break
        config = (width if gpu else TINY) | {"num_hidden_layers": layers if gpu else 2}
        spec = load_spec({"model": {"config": config, "lora": {"r": 16, "alpha": 32,
                                                               "target_modules": "all-linear"}},
                          "data": {"seq_len": 4096 if gpu else 128}, "target_batch_size": 1,
                          "measure": {"warmup_steps": 1, "steps": 1},
                          "search": {"trial_timeout": "150s"}})
        trial = TrialConfig.of(1, 1, precision="bf16", quantization="nf4",
                               gradient_checkpointing=True, attn_implementation="sdpa",
                               torch_compile=compiled, use_liger_kernel=liger)
        shape = model_shape(spec)
        predicted = MemoryModel(shape, device, spec.world_size).predict(trial)
        request = make_request(spec, trial, on_cpu=not gpu, shape=shape.to_dict(),
                               memory_budget_bytes=None, timeout_s=min(150, left - 10),
                               cpu_threads=node_cpus())
        o = run_trial(request)
        row = {"layers": layers, "compile": compiled, "liger": liger, "status": o.status,
               "peak_gib": (o.peak_memory_bytes or 0) / 2**30,
               "predicted_gib": predicted.total_bytes / 2**30,
               "components_gib": {k: v / 2**30 for k, v in predicted.components.items()},
               "phases": o.phases.seconds(), "ran_with": o.ran_with.to_dict(),
               "error": (o.error or "")[-400:]}
        rows.append(row)
        (args.out / "qlora_compile_memory.json").write_text(json.dumps(rows, indent=1))
        print(f"L={layers} compile={compiled} liger={liger}: {o.status} peak "
              f"{row['peak_gib']:.2f} GiB, predicted {row['predicted_gib']:.2f} GiB "
              f"({time.time() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
