"""Everything the project claims about GPUs, proved in two device calls: a smoke call of at
most 4 minutes, then the full proof with what is left of the session's 15.

    benchmarks/gpu_proof.sh --smoke OUTDIR      first: one trial per CUDA path (at most 4 min)
    benchmarks/gpu_proof.sh OUTDIR              then: the searches (at most 8 minutes)
    benchmarks/gpu_proof.sh --rehearse [--smoke] OUTDIR   the same steps on CPU, tiny shapes

The smoke call runs one trial each of torch.compile, the attention kernel (flash-attention
where installed, else SDPA), Liger, a 4-bit base and a 2-rank warm launch, and asserts
what each really ran with (TF32, compiled, Liger applied, the kernel, warm or cold, the
4-bit base quantized on the device): a defect in a CUDA path shows there, in a minute, not
as a failed search. It refuses to start without liger-kernel or bitsandbytes.

Two searches on the default space, each with about four minutes of its own: GPT-2 124M at
seq 1024 (examples/gpt2-small-gpu.yaml) and the seeds' BERT-large at seq 512. Each runs
Trainer's defaults and the guide's recipe beside its own trials and confirms both with
the winner; the summary gives each one's samples/s, MFU and speedups with intervals, and
the memory error of every trial that ran (the configs the search chose, not a curated
family). Then the GPT-2 search's trials as a measured landscape (`simulated: false`).
Asked for with --only (a second call): the GPU tests, the seeds' vanilla BERT trial, the
memory step (memory accuracy on two shapes with the ZeRO rows' allocator histories), and
a QLoRA search of a TinyLlama-1.1B shape at seq 2048 (a 4-bit base under LoRA).
Each step runs in its own process with its own time box, so a slow step cannot starve
the rest. What comes back is at most 8 files: summary.md, versions.json, results.tar.gz
(every step's log and outputs) and the landscape's two files.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("torch", "transformers", "accelerate", "deepspeed", "bitsandbytes", "peft", "ray",
            "optuna", "pynvml", "flash_attn", "liger_kernel")
# The seeds' figures for BERT-large, seq 512, vanilla batch 4 fp32 (two guides, two GPUs).
SEED_BERT = [("seed 1 (vanilla, bs 4, fp32)", 12.5, 12.9), ("seed 2 (vanilla, bs 4, fp32)",
                                                            8.86, 14.9)]

# The default steps, in order of value, with their boxes (seconds): the two searches sum
# to 500 s, which with the wheels' install, versions and pip check (25 s on the H200,
# 2026-11-26) and the report (FINISH_S) fits 9 minutes. Each box is also cut to what is
# left of the call (--budget), and each search's own timeout to its box.
GPU_BOXES = {"gpt2_search": 215, "bert_search": 215}
# Asked for with --only, in a call of their own (the boxes they had when they were part
# of every call: the GPU tests took 52 s, the vanilla trial 25 s, the memory step 95 s);
# the Llama-8B QLoRA search on a 24 GiB budget (issue 41) takes a whole call.
EXTRA_BOXES = {"gpu_tests": 70, "bert_vanilla": 60, "memory": 120, "qlora_search": 215,
               "llama8b_qlora": 440, "llama8b_long": 440}
STEPS = {**GPU_BOXES, **EXTRA_BOXES}
REHEARSAL_BOXES = {"gpt2_search": 150, "bert_search": 150, "gpu_tests": 60,
                   "bert_vanilla": 60, "memory": 120, "qlora_search": 150,
                   "llama8b_qlora": 150, "llama8b_long": 150, "smoke": 200}
SEARCHES = ("gpt2_search", "bert_search", "qlora_search", "llama8b_qlora",
            "llama8b_long")
SEARCH_S = 240  # each search's own time on a GPU (its timeout), when its box allows
REHEARSAL_SEARCH_S = 110
# From gpu_proof.sh's start (GPU_PROOF_T0): the full proof in 8 minutes, after a smoke
# call of 4 (the session's 15 minutes hold both and the machine's start).
GPU_BUDGET_S = 480
SMOKE_BUDGET_S = 240
SMOKE_BOX_S = 200
# What the proof cannot do without: each is a path the smoke call proves.
REQUIRED = ("bitsandbytes", "liger_kernel")
GRACE_S = 8  # a step is interrupted (Ctrl-C) this long before its box ends, then killed
STARTUP_S = 12  # a search step's process start and its exports, beside its timeout
FINISH_S = 15  # kept back for the landscape and the report after the last step


def boxes_for(wanted: set[str], boxes: dict[str, int]) -> dict[str, int]:
    """Each asked-for step's box, with the time of the default steps left out shared among
    them in proportion: `--only memory` may take the whole call, and every box is still
    cut to what is left of the call."""
    asked = sum(boxes[s] for s in wanted)
    total = max(asked, sum(boxes[s] for s in GPU_BOXES))
    return {s: boxes[s] * total // asked for s in wanted}


def _bert_spec(rehearse: bool, out: Path, timeout_s: int = 60) -> dict:
    """The seeds' benchmark: BERT-large for sequence classification, seq 512, dummy data,
    at effective batch 16, on the default space."""
    if rehearse:
        config = {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64,
                  "num_attention_heads": 2, "intermediate_size": 256, "vocab_size": 1024,
                  "max_position_embeddings": 128}
        seq, budget = 64, "400MiB"
    else:
        config = {"model_type": "bert", "num_hidden_layers": 24, "hidden_size": 1024,
                  "num_attention_heads": 16, "intermediate_size": 4096, "vocab_size": 30522,
                  "max_position_embeddings": 512}
        seq, budget = 512, None
    spec = {"model": {"config": config, "task": "sequence-classification"},
            "data": {"seq_len": seq}, "target_batch_size": 16,
            "search": {"n_trials": 40, "timeout": f"{timeout_s}s",
                       # a cold start and BERT-large's first compile (the recipe compiles)
                       "trial_timeout": "180s", "confirm_repeats": 3,
                       "space": str(ROOT / "autotune" / "search_spaces" / "default.yaml")},
            "measure": {"warmup_steps": 2, "steps": 4}, "run": {"steps": 10000},
            "output": str(out / "bert-search")}
    if budget:
        spec["hardware"] = {"memory_budget": budget}
    return spec


def _gpt2_spec(rehearse: bool, out: Path, timeout_s: int) -> dict:
    """GPT-2 124M at seq 1024 on a GPU, on the whole device (not the example's plan for a
    40 GiB card: the proof measures what this GPU does against the recipe a user would
    run on it); the tiny example in a rehearsal, with room past the references' probes
    for a trial of its own."""
    import yaml

    name = "tiny-gpt2.yaml" if rehearse else "gpt2-small-gpu.yaml"
    spec = yaml.safe_load((ROOT / "examples" / name).read_text())
    spec["search"] |= {"timeout": f"{timeout_s}s", "n_trials": 7 if rehearse else 40}
    if not rehearse:
        spec["hardware"].pop("memory_budget", None)
    return spec | {"output": str(out / "gpt2-search")}


def _qlora_spec(rehearse: bool, out: Path, timeout_s: int) -> dict:
    """A QLoRA search (issue 36): a TinyLlama-1.1B shape at seq 2048 with LoRA r=16 on
    synthetic rows, on the default space (its lora section adds a 4-bit base); the
    bundled chat example in a rehearsal."""
    import yaml

    if rehearse:
        spec = yaml.safe_load((ROOT / "examples" / "qlora-chat.yaml").read_text())
        for key in ("source", "tokenizer"):
            spec["data"][key] = str(ROOT / "examples" / spec["data"][key])
        spec["search"]["space"] = str(ROOT / "examples" / spec["search"]["space"])
        spec["search"] |= {"timeout": f"{timeout_s}s", "n_trials": 7}
        return spec | {"output": str(out / "qlora-search")}
    return {"model": {"config": {"model_type": "llama", "hidden_size": 2048,
                                 "intermediate_size": 5632, "num_hidden_layers": 22,
                                 "num_attention_heads": 32, "num_key_value_heads": 4,
                                 "vocab_size": 32000, "max_position_embeddings": 2048},
                      "lora": {"r": 16, "alpha": 32}},
            "data": {"seq_len": 2048}, "target_batch_size": 16,
            "search": {"n_trials": 40, "timeout": f"{timeout_s}s", "trial_timeout": "180s",
                       "space": str(ROOT / "autotune" / "search_spaces" / "default.yaml")},
            "measure": {"warmup_steps": 2, "steps": 4}, "run": {"steps": 10000},
            "output": str(out / "qlora-search")}


def _llama8b_spec(rehearse: bool, out: Path, timeout_s: int) -> dict:
    """examples/llama-8b-qlora-24gb.yaml on this GPU under its 24 GiB budget (issue 41):
    at least 8 trials and the confirmation; a tiny Llama in a rehearsal."""
    import yaml

    spec = yaml.safe_load((ROOT / "examples" / "llama-8b-qlora-24gb.yaml").read_text())
    spec["hardware"].pop("device", None)  # the search runs on the device it finds
    # A step here is 16 rows of 4096 tokens (about 10 s on an H100): one warm-up and two
    # timed steps, and one confirmation round, are what leave room for 8 trials in a call.
    spec["search"] |= {"timeout": f"{timeout_s}s", "n_trials": 8 if rehearse else 40,
                       "trial_timeout": "180s", "confirm_repeats": 1}
    spec["measure"] = {"warmup_steps": 1, "steps": 2}
    if rehearse:
        spec["model"]["config"] |= {"hidden_size": 64, "intermediate_size": 176,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "vocab_size": 512}
        spec["data"]["seq_len"] = 64
        spec["hardware"]["memory_budget"] = "600MiB"
    return spec | {"output": str(out / "llama8b-search")}


def _llama8b_long_spec(rehearse: bool, out: Path, timeout_s: int) -> dict:
    """examples/llama-8b-32k.yaml (issue 54): Llama-3-8B with LoRA at 32k tokens on one
    GPU, the default space's long-context levers (checkpointing variants, the tiled MLP
    and loss, activation offloading) each checked against its twin; a tiny Llama at
    8192 tokens in a rehearsal. Before it, `autotune estimate --longest` is printed into
    the step's log (the predicted longest per family; benchmarks/longest_bisection.py
    --spec measures it, a call of its own)."""
    import yaml

    from autotune.plan.estimate import estimate

    spec = yaml.safe_load((ROOT / "examples" / "llama-8b-32k.yaml").read_text())
    spec["search"] |= {"timeout": f"{timeout_s}s", "n_trials": 6 if rehearse else 24,
                       "trial_timeout": "240s", "confirm_repeats": 1}
    if rehearse:
        spec["model"]["config"] |= {"hidden_size": 64, "intermediate_size": 176,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "num_key_value_heads": 2, "vocab_size": 512}
        spec["data"]["seq_len"] = 8192
        spec["target_batch_size"] = 2
        spec["hardware"]["memory_budget"] = "2GiB"
    spec = spec | {"output": str(out / "llama8b-long")}
    rows = estimate(spec, longest=True).longest or []
    for row in rows[:5] + rows[5:][-5:]:  # the five longest and the five shortest
        print(f"longest predicted: {row.config.label()}: {row.seq_len} tokens, "
              f"{row.peak_bytes / 2**30:.2f} GiB", flush=True)
    return spec


def search_timeout(box: int, rehearse: bool) -> int:
    """A search step's own time: what its box leaves after its process's start and its
    exports, and before the interrupt, up to SEARCH_S."""
    return max(10, min(REHEARSAL_SEARCH_S if rehearse else SEARCH_S,
                       box - GRACE_S - STARTUP_S))


def search_step(name: str, rehearse: bool, out: Path, box: int) -> None:
    """One search of the proof, in this process: interrupted at its box's end, it writes
    what it finished (the search's own Ctrl-C path)."""
    import autotune

    timeout = search_timeout(box, rehearse)
    if name in ("llama8b_qlora", "llama8b_long") and not rehearse:  # a call of its own
        timeout = max(timeout, box - GRACE_S - STARTUP_S)
    spec = {"gpt2_search": _gpt2_spec, "bert_search": _bert_spec,
            "qlora_search": _qlora_spec, "llama8b_qlora": _llama8b_spec,
            "llama8b_long": _llama8b_long_spec}[name](rehearse, out, timeout)
    # fresh: a proof measures, whatever the results store remembers of an earlier one.
    result = autotune.search(spec, fresh=True)
    print(f"{name}: best {result.best.config.label() if result.best else 'none'}")


GPT2_TINY = {"model_type": "gpt2", "n_layer": 2, "n_embd": 128, "n_head": 4,
             "vocab_size": 2048, "n_positions": 256}
LLAMA_TINY = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 2048, "max_position_embeddings": 256}


def smoke_trials(gpu: bool, gpus: int, installed: set[str]) -> list[dict]:
    """One trial per CUDA path, each with what it must have run with; on a CPU (the
    rehearsal) the GPU-only ones are named and left out."""
    half = "bf16"  # a CPU with native bf16 runs it too; the rehearsal's runs bf16 where it can
    attn = "flash_attention_2" if gpu and "flash_attn" in installed else "sdpa"
    lora = {"r": 8, "alpha": 16}
    out = [
        {"name": "compile", "model": {"config": GPT2_TINY},
         "config": {"precision": half, "torch_compile": True},
         "expect": {"compiled": True, "compile_mode": "default"}},
        # accelerate compiles a DeepSpeed engine in place (no OptimizedModule): such
        # trials were thrown away as "not compiled" until 2026-11-28 (issue 50).
        {"name": "compile_zero1", "model": {"config": GPT2_TINY},
         "config": {"precision": half, "torch_compile": True, "zero_stage": 1},
         "expect": {"compiled": True, "wrapped_as": "DeepSpeedEngine"}},
        {"name": "attention", "model": {"config": LLAMA_TINY},
         "config": {"precision": half, "attn_implementation": attn},
         "expect": {"attn_implementation": attn}},
        {"name": "nf4", "model": {"config": LLAMA_TINY, "lora": lora},
         "config": {"precision": half, "quantization": "nf4"},
         "expect": {}, "built": {"quantized": "on the device, a block at a time"}},
        {"name": "ranks", "model": {"config": LLAMA_TINY}, "config": {"precision": half},
         "expect": {}, "ranks": 2, "on_cpu": gpus < 2},
    ]
    cuda_only = [{"name": "tf32", "model": {"config": GPT2_TINY},
                  "config": {"precision": "tf32"}, "expect": {"tf32": True}},
                 {"name": "liger", "model": {"config": LLAMA_TINY},
                  "config": {"precision": half, "use_liger_kernel": True},
                  "expect": {"liger": True}}]
    return out + [t | ({} if gpu else {"skip": "needs a CUDA GPU"}) for t in cuda_only]


def smoke_step(rehearse: bool, out: Path) -> int:
    """The smoke call's trials, one after another in this process's warm launcher; each
    checked against what it asked for. Writes smoke.json; non-zero if any failed."""
    from autotune.config import TrialConfig
    from autotune.device import local_device, node_cpus
    from autotune.files import write_atomically
    from autotune.records import ModelBuild
    from autotune.spec import load_spec
    from autotune.trials.launch import run_trial
    from autotune.trials.protocol import make_request

    device = local_device()
    found, _ = versions()
    installed = {name for name in PACKAGES if name in found}
    rows, failed = [], 0
    for t in smoke_trials(device.is_cuda, device.count if device.is_cuda else 0, installed):
        if t.get("skip"):
            rows.append({"name": t["name"], "asked": t["config"], "ranks": 1, "on": "—",
                         "status": "skipped", "launch": None, "ran_with": {}, "built": {},
                         "phases": {}, "problems": [t["skip"]]})
            continue
        ranks = t.get("ranks", 1)
        spec = load_spec({"model": t["model"], "data": {"seq_len": 64},
                          "target_batch_size": 4 * ranks, "hardware": {"gpus_per_trial": ranks},
                          "measure": {"warmup_steps": 1, "steps": 2},
                          "search": {"trial_timeout": "150s"}})
        on_cpu = t.get("on_cpu", False) or not device.is_cuda
        request = make_request(spec, TrialConfig.of(4, 1, **t["config"]), on_cpu=on_cpu,
                               shape=None, memory_budget_bytes=None, timeout_s=150,
                               cpu_threads=node_cpus())
        o = run_trial(request)
        facts, built = o.ran_with, o.phases.model_build or ModelBuild()
        problems = [] if o.ok else [f"{o.status}: {(o.error or '')[-300:]}"]
        problems += [f"{k} {getattr(facts, k)!r}, expected {v!r}"
                     for k, v in t["expect"].items() if getattr(facts, k) != v]
        problems += [f"model_build {k} {getattr(built, k)!r}, expected {v!r}"
                     for k, v in t.get("built", {}).items() if getattr(built, k) != v]
        if (built.disk_write_bytes or 0) > 2**20:
            problems.append(f"the build wrote {built.disk_write_bytes} bytes to disk")
        if o.launch.kind != "warm":
            problems.append(f"launched {o.launch.kind} ({o.launch.cold_because}), not warm")
        failed += bool(problems)
        rows.append({"name": t["name"], "asked": t["config"], "ranks": ranks,
                     "on": "cpu" if on_cpu else "cuda", "status": o.status,
                     "launch": o.launch.kind, "ran_with": facts.to_dict(),
                     "built": {"weights": built.weights, "quantized": built.quantized,
                               "disk_write_bytes": built.disk_write_bytes},
                     "phases": o.phases.seconds(), "problems": problems})
        print(json.dumps(rows[-1]), flush=True)
    write_atomically(out / "smoke.json", json.dumps(rows, indent=2))
    return 1 if failed else 0


def smoke_lines(path: Path) -> list[str]:
    try:
        rows = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return []
    lines = ["", "## Smoke: one trial per CUDA path", "",
             "| trial | asked | on | status | launch | TF32 | compiled | Liger | attention | "
             "4-bit base | model s | problems |", "|" + " --- |" * 12]
    for r in rows:
        f, p = r["ran_with"], r["phases"] or {}
        # a 4-bit base: how it was built, and the native library its ops ran in
        base = ", ".join(str(x) for x in (r["built"].get("quantized"), f.get("bitsandbytes"))
                         if x) or "—"
        lines.append(f"| {r['name']} | {' '.join(f'{k}={v}' for k, v in r['asked'].items())}"
                     f" x{r['ranks']} | {r['on']} | {r['status']} | {r['launch']} | "
                     f"{f.get('tf32')} | {f.get('compiled')} | {f.get('liger')} | "
                     f"{f.get('attn_implementation')} | {base} | "
                     f"{_num(p.get('model'), '{:.2f}')} | {'; '.join(r['problems']) or 'none'} |")
    return lines


def versions() -> tuple[dict[str, str], list[str]]:
    found, missing = {"python": sys.version.split()[0]}, []
    for name in PACKAGES:
        try:
            module = importlib.import_module(name)
            found[name] = str(getattr(module, "__version__", "installed"))
        except Exception as exc:  # noqa: BLE001 - a missing or broken package is a skip
            missing.append(f"{name}: {type(exc).__name__}")
    try:
        import torch

        found["cuda"] = str(torch.version.cuda)
        found["device"] = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                           else "cpu")
    except Exception:  # noqa: BLE001
        pass
    return found, missing


def pip_check() -> list[str]:
    """What `pip check` finds broken, carried wheels included (they are on the path)."""
    try:
        done = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True,
                              text=True, timeout=45)
    except Exception as exc:  # noqa: BLE001 - a check that cannot run says so
        return [f"pip check did not run: {type(exc).__name__}"]
    return [] if done.returncode == 0 else done.stdout.strip().splitlines()


def _interruptible_child() -> None:
    """In the step's process before it runs: it dies with this script, and takes Ctrl-C
    even where this script was started with SIGINT ignored (a shell's background job
    is): Python installs its KeyboardInterrupt handler only where SIGINT is not ignored
    at its start, and without it the step could not write what it has at its box."""
    from autotune.trials.forkserver import die_with_parent

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    die_with_parent()


def _cut(box: int, deadline: float | None) -> int:
    """A box cut to what is left of the call before its report."""
    return box if deadline is None else min(box, int(deadline - FINISH_S - time.time()))


def _step(name: str, cmd: list[str], box: int, out: Path, log: list[dict],
          deadline: float | None = None, grace: int = GRACE_S) -> int | None:
    """Run one step in its own process group within its time box, cut to what is left
    before `deadline`, and die with this script (a device call cut off at its limit).
    Past the box less `grace` the step is interrupted as Ctrl-C would (a search then
    writes its summary and exports with the trials it finished), and killed at the box."""
    box = _cut(box, deadline)
    if box < max(2 * grace, 1):  # a box of none (grace 0) is no box either
        log.append({"step": name, "exit": "no time left", "seconds": 0, "box": box,
                    "log": ""})
        print(f"[{name}] skipped: {box} s left before the call's end", flush=True)
        return None
    started = time.time()
    path = out / f"{name}.log"
    with path.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True, preexec_fn=_interruptible_child)
        try:
            code = proc.wait(timeout=box - grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            code = None
    took = time.time() - started
    log.append({"step": name, "exit": code, "seconds": round(took, 1), "box": box,
                "log": path.name})
    print(f"[{name}] {'past its box' if code is None else f'exit {code}'} after {took:.0f} s "
          f"(box {box} s)", flush=True)
    return code


def _vanilla_trial(spec: dict) -> dict:
    """The seeds' vanilla run, as one trial: batch 4, accumulation 1, fp32, AdamW."""
    from autotune.config import TrialConfig
    from autotune.device import local_device, node_cpus
    from autotune.plan.shape import model_shape
    from autotune.spec import load_spec
    from autotune.trials.launch import run_trial
    from autotune.trials.protocol import make_request

    loaded = load_spec(spec | {"target_batch_size": 4})
    shape = model_shape(loaded)
    result = run_trial(make_request(loaded, TrialConfig.of(4, 1), on_cpu=not local_device()
                                    .is_cuda, shape=shape.to_dict(), memory_budget_bytes=None,
                                    timeout_s=120, cpu_threads=node_cpus()))
    return result.to_dict()


def bert_vanilla_step(rehearse: bool, out: Path) -> None:
    """The seeds' vanilla run on this device, as one trial; saved whole for the report."""
    from autotune.files import write_atomically
    from autotune.records import Outcome

    vanilla = Outcome.from_dict(_vanilla_trial(_bert_spec(rehearse, out)))
    row = {"config": "b4x1 fp32 adamw_torch",
           "samples_per_second": vanilla.samples_per_second,
           "peak_memory_bytes": vanilla.peak_memory_bytes,
           "mfu": vanilla.measured.mfu, "status": vanilla.status}
    write_atomically(out / "bert-vanilla.json", json.dumps(row, indent=2))
    print(json.dumps(row, indent=2))


def memory_step(rehearse: bool, out: Path) -> None:
    """Two shapes, the first with the ZeRO rows; four trials at a time on a GPU (two in
    the rehearsal)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "memory_accuracy.py"), "--proof",
           "--parallel", "2" if rehearse else "4"]  # CI proves the threaded path too
    # The ZeRO rows' allocator histories come back in the tarball, to replay against here.
    env = os.environ | {"AUTOTUNE_MEMORY_TRACES": str(out / "allocator-traces")}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)


class _Report:
    """The files that come back from a device call (at most 8: these five), written again
    after every step, so a call cut off at its limit still returns what it measured."""

    def __init__(self, out: Path, final: Path, found: dict[str, str], log: list[dict],
                 skipped: list[str], rehearse: bool, started: float) -> None:
        self.out, self.final, self.found, self.log = out, final, found, log
        self.skipped, self.rehearse, self.started = skipped, rehearse, started

    def publish(self, land: Path | None = None, done: bool = False) -> list[str]:
        out, final = self.out, self.final
        title = f"# GPU proof {'rehearsal (CPU, tiny shapes)' if self.rehearse else ''}".rstrip()
        lines = [title + ("" if done else " (in progress)"), "",
                 f"device: {self.found.get('device')} · {time.time() - self.started:.0f} s "
                 "in all", "", "| step | exit | seconds | box |", "| --- | --- | --- | --- |"]
        lines += [f"| {s['step']} | {'past its box' if s['exit'] is None else s['exit']} | "
                  f"{s['seconds']} | {s['box']} |" for s in self.log]
        lines += smoke_lines(out / "smoke.json")
        for folder, title in (("gpt2-search", "GPT-2 search"), ("bert-search", "BERT search"),
                              ("qlora-search", "QLoRA search"),
                              ("llama8b-search", "Llama-8B QLoRA on 24 GiB"),
                              ("llama8b-long", "Llama-8B LoRA at 32k tokens")):
            lines += search_lines(out / folder, title)
        lines += bert_lines(out, self.rehearse)
        lines += memory_lines(out / "memory.log")
        lines += ["", "skipped: " + ("; ".join(self.skipped) if self.skipped else "nothing")]
        (out / "summary.md").write_text("\n".join(lines) + "\n")
        partial = final / "results.tar.gz.part"
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(out, arcname="gpu-proof")
        partial.replace(final / "results.tar.gz")
        for f in ("summary.md", "versions.json"):
            shutil.copy(out / f, final / f)
        if land is not None:  # the landscape's files also come back on their own
            for f in ("meta.json", "trials.csv"):
                shutil.copy(land / f, final / f"landscape-{f}")
        return lines


def _num(value: float | None, fmt: str = "{:.1f}") -> str:
    return "—" if value is None else fmt.format(value)


def _ratio(value: float | None, low: float | None, high: float | None) -> str:
    if value is None:
        return "—"
    return f"{value:.2f}×" + (f" ({low:.2f}–{high:.2f})" if low is not None
                              and high is not None and low != high else "")


def search_lines(folder: Path, title: str) -> list[str]:
    """One search's figures: the winner and both references (confirmed medians, MFU,
    peak), the speedups with their intervals, and every trial that ran with its
    predicted and measured peak memory."""
    from autotune.errors import AutotuneError
    from autotune.summary import load_summary

    try:
        summary = load_summary(folder)
    except AutotuneError:
        return []
    c = summary.confirmation
    lines = ["", f"## {title}: {summary.model.get('name', 'model')} · "
             f"{sum(t.counted for t in summary.trials)} trials, "
             f"{_num(summary.search.get('wall_seconds'), '{:.0f}')} s · efficiency "
             f"{_num(summary.efficiency, '{:.2f}')} (timed steps over wall time)", "",
             "| role | config | samples/s | confirmation runs | MFU | peak memory GiB |",
             "| --- | --- | --- | --- | --- | --- |"]
    for role, rec in (("winner", summary.best), ("guide's recipe", summary.recipe),
                      ("Trainer defaults", summary.baseline)):
        if rec is None:
            lines.append(f"| {role} | — | | | | |")
            continue
        row = c.row(rec.config) if c else None
        runs = len(row.samples_per_second) if row else 0
        peak = rec.outcome.peak_memory_bytes
        lines.append(f"| {role} | {rec.config.label()} | {_num(summary.samples_per_second(rec))} | "
                     f"{runs} | {_num(rec.outcome.measured.mfu, '{:.1%}')} | "
                     f"{_num(peak / 2**30 if peak else None, '{:.2f}')} |")
    vs = (c.vs_recipe or {}) if c else {}
    defaults = ("their smallest batch did not fit" if summary.defaults_do_not_fit else
                _ratio(summary.speedup, c.speedup_low if c else None,
                       c.speedup_high if c else None))
    recipe = _ratio(summary.vs_recipe, vs.get("low"), vs.get("high"))
    lines += ["", f"speedup vs Trainer defaults: {defaults} · vs the guide's recipe: {recipe}"]
    errors = []
    lines += ["", "| # | config | reason | status | samples/s | predicted GiB | peak GiB | "
              "error | model s | before step 1 s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for t in summary.trials:
        o = t.outcome
        if not o.ran:
            continue
        pred, peak = o.predicted_memory_bytes, o.peak_memory_bytes
        phases = o.phases
        err = (pred - peak) / peak if o.ok and pred and peak else None
        if err is not None:
            errors.append(abs(err))
        lines.append(f"| {t.number} | {t.config.label()} | {t.reason} | {o.status} | "
                     f"{_num(o.samples_per_second)} | "
                     f"{_num(pred / 2**30 if pred else None, '{:.2f}')} | "
                     f"{_num(peak / 2**30 if peak else None, '{:.2f}')} | "
                     f"{_num(err, '{:+.1%}')} | {_num(phases.model)} | "
                     f"{_num(phases.before_first_step)} |")
    if errors:
        lines += ["", f"memory: predicted against measured peak over {len(errors)} ok trials: "
                  f"median {statistics.median(errors):.1%}, max {max(errors):.1%}"]
    return lines


def bert_lines(out: Path, rehearse: bool) -> list[str]:
    """The tuned BERT-large against the seeds' vanilla runs (their GPUs) and, where the
    step ran, the vanilla run on this device."""
    from autotune.errors import AutotuneError
    from autotune.summary import load_summary

    try:
        summary = load_summary(out / "bert-search")
    except AutotuneError:
        summary = None
    tuned = summary.samples_per_second(summary.best) if summary and summary.best else None
    rows = [] if rehearse else [(label, sps) for label, sps, _ in SEED_BERT]
    with contextlib.suppress(OSError, json.JSONDecodeError):
        vanilla = json.loads((out / "bert-vanilla.json").read_text())
        rows.append(("vanilla on this device", vanilla.get("samples_per_second")))
    if not rows or tuned is None:
        return []
    return ["", "| BERT-large vanilla (b4x1 fp32) | samples/s | the winner over it |",
            "| --- | --- | --- |"] + [f"| {label} | {_num(sps)} | "
                                      f"{_num(tuned / sps if sps else None, '{:.1f}×')} |"
                                      for label, sps in rows]


def memory_lines(log: Path) -> list[str]:
    """The memory step's table and its per-trial notes (where each ZeRO row's memory is)
    for the summary, which comes back on its own: the libraries' warnings left out."""
    if not log.is_file():
        return []
    kept = [line for line in log.read_text(errors="replace").splitlines()
            if line.startswith((" ", "overall:", "device:"))
            or re.fullmatch(r"[\w.-]+", line)]  # a shape's name
    return ["", "Memory step (`benchmarks/memory_accuracy.py --proof`):", "", "```", *kept,
            "```"] if kept else []


def landscape(out: Path, rehearse: bool) -> Path | None:
    """The search's measured trials in the shared landscape format: one row per config at
    the target effective batch (the baseline's probes train other batches), its
    confirmation runs folded in as the median, with the memory limit the search ran under
    as the landscape's device memory (its trials over that limit were told `oom`)."""
    from autotune.bench.landscape import landscape_row, write_landscape
    from autotune.errors import AutotuneError
    from autotune.records import LOST
    from autotune.summary import at_target, load_summary

    try:
        summary = load_summary(out / "gpt2-search")
    except AutotuneError:
        return None
    runs: dict = {}
    measured = [r for r in summary.trials if r.outcome.ran and r.outcome.status != LOST]
    for r in at_target(measured, summary.per_rank_target):
        runs.setdefault(r.config, []).append(r)  # the search's own trial first
    rows = []
    for config, records in runs.items():
        ok = [r.outcome.samples_per_second for r in records
              if r.outcome.ok and r.outcome.samples_per_second]
        rows.append(landscape_row(config, records[0].outcome,
                                  statistics.median(ok) if ok else None))
    device = summary.device
    name = ("cpu-rehearsal-" if rehearse else "") + "gpt2-" + device.name.lower().replace(
        " ", "-")
    meta = {"description": f"measured: the autotune search of benchmarks/gpu_proof.sh on "
                           f"{device.name}", "simulated": False,
            "model": summary.model,
            "device": {"name": device.name,
                       "memory_gib": summary.memory_limit_bytes / 2**30,
                       "device_memory_gib": device.memory_bytes / 2**30,
                       "count": device.count},
            "world_size": summary.world_size,
            "target_effective_batch_size": summary.target_batch_size}
    return write_landscape(out / "landscape" / name, meta, rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--rehearse", action="store_true", help="CPU, tiny shapes")
    ap.add_argument("--budget", type=float, help="seconds from gpu_proof.sh's start that "
                    f"all steps must end within (default {GPU_BUDGET_S} on a GPU, none in a "
                    "rehearsal)")
    ap.add_argument("--only", metavar="STEPS", help="a comma-separated subset of "
                    f"{','.join(STEPS)} (default: {','.join(GPU_BOXES)})")
    ap.add_argument("--smoke", action="store_true", help="the first call: one trial per "
                    f"CUDA path, at most {SMOKE_BUDGET_S} s")
    ap.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step in-process
    ap.add_argument("--box", type=int, help=argparse.SUPPRESS)  # that step's box
    args = ap.parse_args()
    wanted = set(GPU_BOXES) if args.only is None else {s for s in args.only.split(",") if s}
    if not wanted:
        ap.error(f"--only: name one step or more of {', '.join(STEPS)}")
    if wanted - set(STEPS):
        ap.error(f"--only: {', '.join(sorted(wanted - set(STEPS)))} is no step; the "
                 f"steps are {', '.join(STEPS)}")
    out = Path(args.outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.step is None:  # the steps work beside OUTDIR; only the final files go in it
        final, out = out, Path(tempfile.mkdtemp(prefix="gpu-proof-"))
    if args.step in SEARCHES:
        search_step(args.step, args.rehearse, out, args.box or STEPS[args.step])
        return 0
    if args.step == "bert_vanilla":
        bert_vanilla_step(args.rehearse, out)
        return 0
    if args.step == "memory":
        memory_step(args.rehearse, out)
        return 0
    if args.step == "smoke":
        return smoke_step(args.rehearse, out)

    started = time.time()
    found, missing = versions()
    broken = pip_check()
    (out / "versions.json").write_text(json.dumps(
        {"found": found, "missing": missing, "pip_check": broken}, indent=2))
    if broken:  # carried wheels that need newer packages than the machine's own
        print("pip check:", *broken[:10], sep="\n  ", flush=True)
    print("versions:", ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    gpu = found.get("device", "cpu") != "cpu"
    lacking = [name for name in REQUIRED if name not in found]
    if gpu and lacking:  # a proof that would prune their levers and say nothing of them
        print(f"refusing to start: {', '.join(lacking)} not installed; carry them "
              "(scripts/gpu_wheels.py puts them in .whl/)", file=sys.stderr)
        return 2
    skipped = [f"missing {m}" for m in missing] + ([] if args.smoke else [
        f"{name}: not asked for (--only)" for name in STEPS if name not in wanted])
    if not gpu and not args.rehearse:
        print("no CUDA device: run with --rehearse to prove the steps on CPU",
              file=sys.stderr)
        return 2
    if args.smoke:
        wanted = {"smoke"}
    boxes = ({"smoke": REHEARSAL_BOXES["smoke"] if args.rehearse else SMOKE_BOX_S}
             if args.smoke else boxes_for(wanted, REHEARSAL_BOXES if args.rehearse else STEPS))
    budget = args.budget if args.budget is not None else (
        None if args.rehearse else SMOKE_BUDGET_S if args.smoke else GPU_BUDGET_S)
    t0 = float(os.environ.get("GPU_PROOF_T0") or started)
    deadline = None if budget is None else t0 + budget
    me = [sys.executable, str(Path(__file__).resolve())] + (["--rehearse"] if args.rehearse
                                                             else [])
    print(f"working in {out}; results go to {final}", flush=True)
    log: list[dict] = []
    report = _Report(out, final, found, log, skipped, args.rehearse, started)
    if args.smoke:
        _step("smoke", [*me, "--step", "smoke", str(out)], boxes["smoke"], out, log, deadline)
    if "gpu_tests" in wanted and gpu:
        _step("gpu_tests", [sys.executable, "-m", "pytest", "-m", "gpu", "-x", "-q",
                            "-p", "no:cacheprovider", "tests"], boxes["gpu_tests"], out, log,
              deadline)
    elif "gpu_tests" in wanted:
        skipped.append("gpu_tests: no CUDA device (pytest -m gpu would skip every test)")
    report.publish()
    for name in (*SEARCHES, "bert_vanilla"):
        if name in wanted:
            box = _cut(boxes[name], deadline)
            _step(name, [*me, "--step", name, "--box", str(box), str(out)], box, out, log,
                  deadline)
            report.publish()
    if "memory" in wanted:
        # Killed at its box, not interrupted first: its launchers would die of the Ctrl-C
        # and take their trials with them (it prints each trial's figures as it ends).
        _step("memory", [*me, "--step", "memory", str(out)], boxes["memory"], out, log,
              deadline, grace=0)
    land = landscape(out, args.rehearse)
    if land is None and "gpt2_search" in wanted:
        skipped.append("landscape: the GPT-2 search left no summary.json")
    print("\n".join(report.publish(land, done=True)))
    shutil.rmtree(out, ignore_errors=True)
    failed = [s for s in log if s["exit"] != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
