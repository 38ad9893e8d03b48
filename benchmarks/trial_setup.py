"""What a trial spends before its first step, at real size, on this machine's CPU.

    .venv/bin/python benchmarks/trial_setup.py                 # 50M, 0.5B, 1.5B; both builders
    .venv/bin/python benchmarks/trial_setup.py --sizes 0.5b --variants nf4 --trials 2

For Qwen2-shaped models of about 50M, 0.5B and 1.5B parameters, plain (LoRA on the base in
the trial's precision) and nf4 (LoRA on a 4-bit base), it prints:

- `build`: the model alone, each in a fresh process, by the builder trials use now
  (`new`: on the device from the meta device, the model's own init, a 4-bit base quantized
  a block at a time) and the one they used before 2026-11-27 (`before`: random init on the
  host in fp32, a 4-bit base saved to a folder and reloaded through bitsandbytes): seconds,
  the process's peak RSS growth, and the bytes it wrote to and read from storage;
- `trial`: real trials (trials.launch.run_trial, warm launcher, seq 64, batch 2, one
  warm-up and one timed step), their phases: launch, model, engine, warm-up, steps, and
  the model build's peak RSS growth and bytes written.

The `before` builder is kept here only to measure against; nothing else uses it.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

QWEN = {"model_type": "qwen2", "num_key_value_heads": 2, "vocab_size": 151936,
        "max_position_embeddings": 32768, "tie_word_embeddings": True,
        "rope_theta": 1000000.0}
SIZES = {
    "50m": QWEN | {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 8,
                   "num_attention_heads": 4},
    "0.5b": QWEN | {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                    "num_attention_heads": 14},
    "1.5b": QWEN | {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                    "num_attention_heads": 12},
}
LORA = {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear"}


def _io() -> dict[str, int]:
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return {"read": int(fields["read_bytes"]), "write": int(fields["write_bytes"])}


def legacy_build(config: dict, quantization: dict | None, scratch: Path):
    """The builder as trials ran it before 2026-11-27 (trials/model_builder.py then)."""
    import transformers

    from autotune.tasks.models import load_hf_config

    hf_config = load_hf_config({"config": config})
    auto = transformers.AutoModelForCausalLM
    if quantization is None:
        return auto.from_config(hf_config)
    folder = scratch / "base-weights"
    auto.from_config(hf_config).save_pretrained(str(folder))
    return auto.from_pretrained(str(folder), config=hf_config, quantization_config=(
        transformers.BitsAndBytesConfig(**quantization)))


def build_once(size: str, variant: str, builder: str) -> dict:
    """One build in this process (run by `--one`): seconds, peak RSS growth, disk bytes."""
    import torch  # noqa: F401 - imports are not the build's
    import transformers  # noqa: F401
    from transformers import set_seed

    from autotune.knobs import quantization_config
    from autotune.tasks.models import model_class
    from autotune.trials.model_builder import build_model

    config = SIZES[size]
    model_class({"config": config})  # the modeling module, as a warm launcher has it
    quantization = quantization_config("nf4", "bf16") if variant == "nf4" else None
    set_seed(0)
    base, io = psutil.Process().memory_info().rss, _io()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if builder == "new":
            build_model({"config": config}, {"quantization_config": quantization}
                        if quantization else {}, "cpu")
        else:
            legacy_build(config, quantization, Path(scratch))
        seconds = time.perf_counter() - started
    after = _io()
    return {"seconds": seconds,
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base,
            "written_bytes": after["write"] - io["write"], "read_bytes": after["read"] - io["read"]}


def build(size: str, variant: str, builder: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", size, variant, builder],
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def trial(size: str, variant: str) -> dict:
    from autotune.config import TrialConfig
    from autotune.device import local_device, node_cpus
    from autotune.spec import load_spec
    from autotune.trials.launch import run_trial
    from autotune.trials.protocol import make_request

    spec = load_spec({"model": {"config": SIZES[size], "lora": LORA},
                      "data": {"seq_len": 64}, "target_batch_size": 2,
                      "measure": {"warmup_steps": 1, "steps": 1},
                      "search": {"trial_timeout": "20m"}})
    config = TrialConfig.of(2, 1, precision="bf16", quantization=variant)
    request = make_request(spec, config, on_cpu=not local_device().is_cuda, shape=None,
                           memory_budget_bytes=None, timeout_s=1200, cpu_threads=node_cpus())
    out = run_trial(request)
    built = out.phases.model_build
    return {"status": out.status, "error": (out.error or "")[-300:],
            "phases": out.phases.seconds(), "launch": out.launch.kind,
            "peak_rss_bytes": built.host_peak_rss_bytes if built else None,
            "written_bytes": built.disk_write_bytes if built else None}


def _gib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="50m,0.5b,1.5b")
    parser.add_argument("--variants", default="plain,nf4")
    parser.add_argument("--builders", default="before,new", help="for the build table")
    parser.add_argument("--trials", type=int, default=1, help="trials per size and variant")
    parser.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(build_once(*args.one)))
        return
    sizes, variants = args.sizes.split(","), args.variants.split(",")
    print("build: the model alone, a fresh process each "
          "(seconds | peak RSS growth | written | read)")
    for size in sizes:
        for variant in variants:
            for builder in args.builders.split(","):
                b = build(size, variant, builder)
                print(f"  {size:5s} {variant:5s} {builder:6s} {b['seconds']:7.2f} s | "
                      f"{_gib(b['peak_rss_bytes'])} | {_gib(b['written_bytes'])} | "
                      f"{_gib(b['read_bytes'])}", flush=True)
    if args.trials < 1:
        return
    print("trial: real trials, warm launcher (phases in seconds | model's peak RSS growth"
          " | written)")
    for size in sizes:
        for variant in variants:
            for _ in range(args.trials):
                t = trial(size, "nf4" if variant == "nf4" else "none")
                p = t["phases"]
                phases = " ".join(f"{k} {p[k]:.2f}" for k in
                                  ("launch", "model", "engine", "warmup", "steps") if k in p)
                first = sum(p.get(k, 0.0) for k in ("launch", "model", "engine"))
                print(f"  {size:5s} {variant:5s} {t['status']:4s} {phases} | before the first"
                      f" step {first:.2f} | {_gib(t['peak_rss_bytes'])} | "
                      f"{_gib(t['written_bytes'])} {t['error'] if t['status'] != 'ok' else ''}",
                      flush=True)


if __name__ == "__main__":
    main()
