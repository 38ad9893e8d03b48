"""`autotune estimate`: predicted peak memory of every config, before any trial runs.

Works with no GPU and no weights: the model is counted on the meta device, and the
device can be one the user plans to rent (`--device A100-80GB`) or a bare limit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from autotune.config import Family, TrialConfig
from autotune.device import (
    DeviceSpec,
    GiB,
    local_device,
    memory_limit,
    named_device,
    node_cpus,
)
from autotune.errors import SpecError
from autotune.plan.calibration import MemoryModel
from autotune.plan.longest import STEP, Longest, longest_fitting, search_length
from autotune.plan.memory import COMPONENTS, MemoryEstimate
from autotune.plan.shape import ModelShape, model_shape
from autotune.plan.trace import prefetch
from autotune.space import build_space
from autotune.spec import load_spec, parse_bytes

if TYPE_CHECKING:
    from rich.console import Console

    from autotune.spec import Spec


@dataclass
class EstimateRow:
    config: TrialConfig
    estimate: MemoryEstimate
    fits: bool
    # Its weights, gradients and optimizer states alone exceed the device: its other
    # components are the formulas' (nothing traced or replayed for it).
    beyond_device: bool = False


@dataclass
class EstimateResult:
    shape: ModelShape
    device: DeviceSpec
    limit_bytes: int
    rows: list[EstimateRow]
    pruned_by_rules: dict[str, str]
    limit_from: str = "the device's memory"  # where the limit came from, said beside it
    world_size: int = 1  # ranks of one trial; the rows are per rank
    longest: list[Longest] | None = None  # `--longest`: per family, longest first

    def largest_fitting(self) -> list[EstimateRow]:
        """Per family, the largest batch predicted to fit (or the smallest batch when none
        fits): the row a user planning a run looks for."""
        by_family: dict[Family, list[EstimateRow]] = {}
        for row in self.rows:
            by_family.setdefault(row.config.family, []).append(row)
        picked = []
        for rows in by_family.values():
            rows.sort(key=lambda r: r.config.per_device_train_batch_size)
            fitting = [r for r in rows if r.fits]
            picked.append(fitting[-1] if fitting else rows[0])
        return picked

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.shape.to_dict(), "device": self.device.name,
                "limit_bytes": self.limit_bytes,
                "rows": [{"config": r.config.to_dict(), "fits": r.fits}
                         | ({"beyond_device": True} if r.beyond_device else {})
                         | r.estimate.to_dict() for r in self.rows]}


def planned_device(spec: Spec, device: str | None) -> DeviceSpec:
    """The device a plan is for: `device` by name (the spec's ranks, spread over its nodes
    where a trial spans several), or this machine's."""
    dev = named_device(device, spec.world_size) if device else local_device()
    nodes = spec.hardware.nodes_per_trial or 1
    if nodes > 1:
        dev = dataclasses.replace(dev, count=spec.world_size, nodes=nodes)
    return dev


def estimate(spec_or_path: Any, *, device: str | None = None,
             memory: str | None = None, longest: bool = False) -> EstimateResult:
    """Every config of the spec's space with its predicted memory and whether it fits;
    `longest` (or data.seq_len: longest): also each family's longest fitting length, the
    rows then at the longest any family reaches."""
    spec = load_spec(spec_or_path)
    if spec.data.seq_len == "longest":
        spec, longest = at_anchor(spec), True
    device = device or spec.hardware.device
    dev = planned_device(spec, device)
    shape = model_shape(spec)
    if shape is None:
        raise SpecError("model: estimate needs an architecture (model.config or "
                        "model.name_or_path); a bare model.factory has none to read")
    # A plan for a named device uses that device's memory: the spec's budget is for the
    # machine the search runs on (a CPU's 600MiB says nothing of an A100).
    planned = device is not None and device == spec.hardware.device
    budget = None if device and not planned else spec.hardware.budget_bytes()
    limit_from = "hardware.memory_budget" if budget else "the device's memory"
    if device and not planned and spec.hardware.budget_bytes():
        limit_from += (f"; the spec's hardware.memory_budget {spec.hardware.memory_budget} "
                       "is for its own machine: --memory sets one for this plan")
    if memory is not None:
        try:
            budget = parse_bytes(memory)
        except ValueError as exc:
            raise SpecError(f"--memory: {memory!r} is not a size like 40GiB or 512MB") from exc
        limit_from = "--memory"
    limit = memory_limit(dev, budget)
    if budget and limit < budget:
        limit_from += ", capped at the device's"
    space = build_space(spec, dev)
    found = None
    if longest:
        found = longest_fitting(shape, dev, spec.world_size, space.candidates, int(limit),
                                max_len=position_limit(shape))
        spec = load_spec(spec, **{"data.seq_len": search_length(found)})
        shape = model_shape(spec)
        space = build_space(spec, dev)
    model = MemoryModel(shape, dev, spec.world_size)
    # The few activation traces every config is read from, made side by side first.
    calls = [a for c in space.candidates if (a := model.trace_args(c))]
    prefetch(calls, workers=node_cpus())
    rows = []
    for cfg in space.candidates:
        est = model.predict(cfg)
        rows.append(EstimateRow(cfg, est, est.total_bytes <= limit, model.beyond_device(cfg)))
    return EstimateResult(shape, dev, int(limit), rows, space.pruned, limit_from,
                          spec.world_size, found)


def position_limit(shape: ModelShape) -> int | None:
    """The longest sequence the model's config allows, where it says (its hf_config is
    held as a dict)."""
    hf = shape.hf_config or {}
    return next((v for k in ("n_positions", "max_position_embeddings", "n_ctx")
                 if isinstance(v := hf.get(k), int)), None)


# Where `data.seq_len: longest` leaves no length to anchor the bisection's formulas to
# the traced model at (plan/longest.py `anchored`): this, or the model's positions.
ANCHOR = 4096


def at_anchor(spec: Spec) -> Spec:
    """A `seq_len: longest` spec at ANCHOR tokens (fewer where the model has fewer
    positions)."""
    shape = model_shape(load_spec(spec, **{"data.seq_len": STEP}))
    limit = position_limit(shape) if shape is not None else None
    return load_spec(spec, **{"data.seq_len": min(ANCHOR, limit or ANCHOR)})


def resolve_longest(spec: Spec, device: DeviceSpec, limit: int) -> tuple[Spec, str]:
    """`data.seq_len: longest` made a length for a search on `device`, and the line that
    says what was found; a spec with a length is returned as it is, with no line."""
    if spec.data.seq_len != "longest":
        return spec, ""
    anchor = at_anchor(spec)
    shape = model_shape(anchor)
    if shape is None:
        raise SpecError("data.seq_len: longest needs the model's architecture "
                        "(model.config or model.name_or_path); a bare model.factory has none")
    found = longest_fitting(shape, device, spec.world_size,
                            build_space(anchor, device).candidates, limit,
                            max_len=position_limit(shape))
    n = search_length(found)
    best = found[0]
    short = sum(r.seq_len < n for r in found)
    line = (f"data.seq_len: longest: {n} tokens, the longest predicted to fit "
            f"({best.config.label()}, {_gib(best.peak_bytes)} GiB of {_gib(limit)}"
            + (", the model's position limit" if best.capped else "")
            + f"); {short} of {len(found)} config families reach less "
            "(autotune estimate --longest lists them)")
    return load_spec(spec, **{"data.seq_len": n}), line


def describe(s: ModelShape) -> str:
    """The shape's layers and sequences, as its task and trainer have them."""
    if s.decoder_layers:
        return (f"{s.num_layers} encoder and {s.decoder_layers} decoder layers, hidden "
                f"{s.hidden_size}, source {s.seq_len} and target {s.target_len} tokens")
    if s.pixels:
        return (f"{s.num_layers} layers, hidden {s.hidden_size}, {s.seq_len} patches an "
                "image (its tokens)")
    text = f"{s.num_layers} layers, hidden {s.hidden_size}, seq {s.seq_len}"
    if s.generates:
        return (text + f" a prompt, {s.generated_len} tokens generated after it: a sample "
                "is a completion, its step generates the whole step's completions at once "
                "(their KV cache) and then trains on them"
                + (" beside a reference model" if s.reference else ""))
    if s.preference_pairs:
        text += (" a row, a sample is a preference pair (chosen and rejected rows) and "
                 + ("the base with the adapters off as the reference" if s.lora else
                    "a second copy as the reference unless its log-probs are precomputed"))
    return text


_SHORT = {"weights": "weights", "quantized": "quant", "gradients": "grads",
          "optimizer": "optim", "activations": "activ", "generation": "gen",
          "runtime": "runtime"}


def _gib(n: float) -> str:
    return f"{n / GiB:.2f}"


COMPONENTS_WIDTH = 126


def render_estimate(result: EstimateResult, console: Console, *, all_rows: bool = False) -> None:
    from rich import box
    from rich.table import Table

    s = result.shape
    console.print(f"[bold]{s.name}[/]: {s.num_parameters / 1e6:,.1f}M parameters, "
                  f"{describe(s)}, attention {s.attn_implementation}", highlight=False)
    console.print(f"device {result.device.name}, limit {_gib(result.limit_bytes)} GiB per rank "
                  f"({result.limit_from})", highlight=False, soft_wrap=True)
    ranks, nodes = result.world_size, result.device.nodes
    if ranks > 1:
        where = (f" over {nodes} nodes, {ranks // nodes} on each: a node's host memory is "
                 f"{ranks // nodes}x the host column" if nodes > 1 else " on one node")
        console.print(f"{ranks} ranks{where}; every figure is one rank's", highlight=False,
                      soft_wrap=True)
    if result.longest is not None:
        _render_longest(result, console)
    rows = result.rows if all_rows else result.largest_fitting()
    title = "every config" if all_rows else "largest batch predicted to fit, per family"
    # Below COMPONENTS_WIDTH columns the components would squeeze the labels to nothing:
    # the totals alone then, and a line saying how to see the rest. A figure is never cut;
    # a long label folds.
    components = COMPONENTS if console.width >= COMPONENTS_WIDTH else ()
    table = Table(title=f"predicted peak memory (GiB): {title}", box=box.SIMPLE_HEAD)
    table.add_column("config", overflow="fold", ratio=1, min_width=16)
    for name in [*(_SHORT.get(c, c) for c in components), "host", "total"]:
        table.add_column(name, justify="right", no_wrap=True, min_width=max(6, len(name)))
    table.add_column("fits", no_wrap=True, min_width=4)
    for row in sorted(rows, key=lambda r: (not r.fits, r.estimate.total_bytes)):
        comps = row.estimate.components
        table.add_row(row.config.label(), *(_gib(comps[c]) for c in components),
                      _gib(row.estimate.host_bytes), _gib(row.estimate.total_bytes),
                      "[green]yes[/]" if row.fits else "[red]no[/]"
                      + (" (states)" if row.beyond_device else ""))
    console.print(table)
    if not components:
        console.print(f"[dim]per component ({', '.join(COMPONENTS)}): on a terminal "
                      f"{COMPONENTS_WIDTH}+ columns wide, or COLUMNS={COMPONENTS_WIDTH}[/]")
    n_fit = sum(r.fits for r in result.rows)
    console.print(f"{n_fit} of {len(result.rows)} configs predicted to fit")
    beyond = sum(r.beyond_device for r in result.rows)
    if beyond:
        console.print(f"[dim]no (states): in {beyond} configs the weights, gradients and "
                      "optimizer states alone exceed the device; their activations are the "
                      "formulas' (nothing traced or replayed for them)[/]", soft_wrap=True)
    for label, why in result.pruned_by_rules.items():
        console.print(f"[dim]not considered: {label}: {why}[/]")


def _render_longest(result: EstimateResult, console: Console) -> None:
    from rich import box
    from rich.table import Table

    found = result.longest or []
    table = Table(title="longest seq_len predicted to fit, per family (a multiple of "
                  f"{STEP}, at the family's smallest batch)", box=box.SIMPLE_HEAD)
    table.add_column("config", overflow="fold", ratio=1, min_width=16)
    table.add_column("longest", justify="right", no_wrap=True)
    table.add_column("peak GiB", justify="right", no_wrap=True)
    for r in found:
        said = f"{r.seq_len:,}" + (" (positions)" if r.capped else "") if r.seq_len else "none"
        table.add_row(r.config.label(), said, _gib(r.peak_bytes))
    console.print(table)
    if found and found[0].seq_len:
        console.print(f"the rows below are at seq_len {result.shape.seq_len:,}, the longest "
                      "any family reaches (what data.seq_len: longest searches at)",
                      highlight=False, soft_wrap=True)
