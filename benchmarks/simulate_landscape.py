"""Simulated tuning landscapes of our own, to judge the search where it was not tuned.

Written apart from autotune's memory and throughput models on purpose, with other
physics, so a strategy that does well here has not merely learned its own formulas:
- model states as DeepSpeed keeps them (2 + 18/N bytes per parameter under mixed
  precision at stage 1-2, its estimator's figure), not the seeds' 6+4+8 replicated;
- activations 1.7x Korthikanti's (as HF GPT-2 measured on an H100), the s^2 term where
  attention is eager, checkpointing keeping layer inputs plus two layers;
- time: 6N FLOPs per token at a per-precision peak times an efficiency that saturates
  with the tokens of the micro-batch (half at about 1k tokens in 16-bit), an optimizer step
  bound by memory bandwidth (fused faster, 8-bit state reads cheaper), ZeRO collectives
  over the link, offload over PCIe with a CPU optimizer, checkpointing recomputing the
  forward;
- log-normal noise per config, failures (fp16 that diverges, bf16 without Ampere).

    .venv/bin/python benchmarks/simulate_landscape.py OUT_DIR
writes OUT_DIR/<name>/{meta.json,trials.csv} for each scenario below.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

GiB = 1024**3
FIELDS = ["per_device_train_batch_size", "gradient_accumulation_steps", "precision", "optim",
          "gradient_checkpointing", "zero_stage", "offload", "status", "samples_per_second",
          "peak_memory_gib", "seconds"]
OPTIMS = ["adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "adafactor", "sgd"]
OFFLOADABLE = {"adamw_torch"}


@dataclass
class Device:
    name: str
    memory_gib: float
    cc: tuple[int, int]
    peak: dict[str, float]  # TFLOP/s by precision
    bandwidth: float  # GB/s of device memory
    link: float  # GB/s between ranks
    pcie: float = 25.0  # GB/s to the host


@dataclass
class Scenario:
    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    device: Device
    world: int
    target: int
    causal: bool = True
    eager: bool = False
    fp16_diverges: bool = False
    noise: float = 0.03
    seed: int = 0
    extra: dict = field(default_factory=dict)


A100_40 = Device("A100-40GB", 40, (8, 0), {"fp32": 19.5, "tf32": 156, "fp16": 312,
                                           "bf16": 312}, 1555, 300)
T4 = Device("T4-16GB", 16, (7, 5), {"fp32": 8.1, "fp16": 65}, 320, 16)
H100 = Device("H100-80GB", 80, (9, 0), {"fp32": 67, "tf32": 495, "fp16": 989, "bf16": 989},
              3350, 450)
L4 = Device("L4-24GB", 24, (8, 9), {"fp32": 30.3, "tf32": 60, "fp16": 121, "bf16": 121},
            300, 16)

SCENARIOS = [
    Scenario("sim2-llama-3b-4xa100-40gb", 3.2e9, 26, 3200, 32, 32000, 2048, A100_40, 4, 256),
    Scenario("sim2-bert-base-t4-16gb", 110e6, 12, 768, 12, 30522, 512, T4, 1, 256,
             causal=False, eager=True, noise=0.05, seed=1),
    Scenario("sim2-mistral-7b-h100-80gb", 7.2e9, 32, 4096, 32, 32000, 4096, H100, 1, 64,
             seed=2),
    Scenario("sim2-gpt-neo-1.3b-l4-24gb", 1.3e9, 24, 2048, 16, 50257, 2048, L4, 1, 64,
             eager=True, fp16_diverges=True, noise=0.04, seed=3),
]


def _mixed(p: str) -> bool:
    return p in ("fp16", "bf16")


def memory_gib(s: Scenario, b: int, p: str, o: str, ck: bool, z: int, off: str) -> float:
    n, world = s.params, s.world
    state = {"adamw_torch": 8, "adamw_torch_fused": 8, "adamw_bnb_8bit": 2, "adafactor": 0.1,
             "sgd": 0}[o]
    if z == 0:  # Trainer AMP: fp32 weights and grads, autocast copies transient
        weights, grads, opt = 4 * n, 4 * n, state * n
        if _mixed(p):
            weights += 2 * n * 0.5  # autocast's cached 16-bit copies of the matmul weights
    else:  # DeepSpeed: 16-bit weights, 16-bit and fp32 gradient partitions, fp32 master
        w16 = 2 if _mixed(p) else 4
        weights = w16 * n
        grads = (w16 + (4 if _mixed(p) else 0)) * n / world
        opt = (state + (4 if _mixed(p) else 0)) * n / world
        if z >= 3:
            weights = weights / world + 2 * 12 * s.hidden**2 * w16
    if off != "none":
        opt, grads = 0.0, grads * 0.1  # reduction buckets stay
    if off == "optimizer+param":
        weights = 2 * 12 * s.hidden**2 * (2 if _mixed(p) else 4)
    act_bytes = 2 if _mixed(p) else 4
    per_layer = s.seq * s.hidden * 34 * act_bytes / 2 * 1.7
    quad = 5 * s.heads * s.seq * s.seq * act_bytes / 2 if s.eager else 0.0
    if ck:
        act = b * (s.layers * s.seq * s.hidden * act_bytes + 2 * (per_layer + quad))
    else:
        act = b * s.layers * (per_layer + quad)
    logits = b * s.seq * s.vocab * 12 if s.causal else 0.0
    return (weights + grads + opt + act + logits) * 1.06 / GiB + 1.0  # + context


def step_seconds(s: Scenario, b: int, gas: int, p: str, o: str, ck: bool, z: int,
                 off: str) -> float:
    dev = s.device
    tokens = b * s.seq
    peak = dev.peak[p] * 1e12
    # Tokens per micro-batch at which the GEMMs run at half their best efficiency.
    half = {"fp32": 256, "tf32": 512}.get(p, 1024) / s.seq
    eff = 0.55 * b / (b + half)
    flops = 6 * s.params * tokens + 12 * s.layers * s.hidden * s.seq * tokens
    compute = flops / (peak * eff) * (1.33 if ck else 1.0) + 0.004  # launch overhead
    micro = compute * gas
    bytes_per_param = {"adamw_bnb_8bit": 6, "adafactor": 8, "sgd": 8}.get(o, 16)
    opt_step = s.params * bytes_per_param / (dev.bandwidth * 1e9) * (
        0.6 if o == "adamw_torch_fused" else 1.0)
    comm = 0.0
    if s.world > 1:
        grad_bytes = s.params * (2 if _mixed(p) else 4)
        comm = 2 * grad_bytes / (dev.link * 1e9) * (s.world - 1) / s.world
        if z >= 3:
            comm += 2 * gas * grad_bytes / (dev.link * 1e9)  # gathers every micro-step
    elif z >= 3:
        comm = 0.02 * gas
    if off != "none":
        opt_step = s.params * 16 / 6e9 + s.params * 4 / (dev.pcie * 1e9)  # CPU Adam + PCIe
    if off == "optimizer+param":
        opt_step += gas * s.params * 2 * 2 / (dev.pcie * 1e9)
    return micro + opt_step + comm


def status(s: Scenario, p: str, o: str, z: int, off: str) -> str | None:
    if p not in s.device.peak:
        return "error"
    if off != "none" and (z == 0 or o not in OFFLOADABLE):
        return "error"
    if off == "optimizer+param" and z != 3:
        return "error"
    if p == "fp16" and s.fp16_diverges:
        return "nan"
    return None


def landscape(s: Scenario) -> tuple[dict, list[dict]]:
    rng = np.random.default_rng(s.seed)
    per_rank = s.target // s.world
    batches = [b for b in (1, 2, 4, 8, 16, 32, 64) if per_rank % b == 0]
    rows = []
    for b, p, o, ck, z, off in itertools.product(
            batches, ["fp32", "tf32", "fp16", "bf16"], OPTIMS, [False, True], [0, 1, 2, 3],
            ["none", "optimizer", "optimizer+param"]):
        gas = per_rank // b
        bad = status(s, p, o, z, off)
        mem = memory_gib(s, b, p, o, ck, z, off)
        startup = 25 + 6 * (z > 0) + 4 * (off != "none")
        if bad is None and mem > s.device.memory_gib * 0.97:
            bad = "oom"
        if bad is None:
            step = step_seconds(s, b, gas, p, o, ck, z, off) * math.exp(rng.normal(0, s.noise))
            sps = s.target / step
            cost = startup + 6 * step
        else:
            sps, cost = 0.0, startup * (0.6 if bad == "error" else 1.0)
        rows.append({"per_device_train_batch_size": b, "gradient_accumulation_steps": gas,
                     "precision": p, "optim": o, "gradient_checkpointing": str(ck).lower(),
                     "zero_stage": z, "offload": off, "status": bad or "ok",
                     "samples_per_second": round(sps, 4),
                     "peak_memory_gib": round(min(mem, s.device.memory_gib) if bad != "error"
                                              else 0.0, 3), "seconds": round(cost, 1)})
    meta = {"description": f"simulated by benchmarks/simulate_landscape.py: {s.name}",
            "simulated": True,
            "model": {"name": s.name.split("-", 1)[1], "num_parameters": int(s.params),
                      "num_layers": s.layers, "hidden_size": s.hidden,
                      "num_attention_heads": s.heads, "vocab_size": s.vocab,
                      "causal_lm": s.causal, "seq_len": s.seq},
            "device": {"name": s.device.name, "memory_gib": s.device.memory_gib,
                       "count": s.world},
            "world_size": s.world, "target_effective_batch_size": s.target}
    return meta, rows


def main(out: str) -> None:
    for s in SCENARIOS:
        folder = Path(out) / s.name
        folder.mkdir(parents=True, exist_ok=True)
        meta, rows = landscape(s)
        (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        with (folder / "trials.csv").open("w", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            w.writeheader()
            w.writerows(rows)
        ok = sum(r["status"] == "ok" for r in rows)
        print(f"{folder}: {len(rows)} configs, {ok} ok")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/landscapes")
