"""What happened to a config: a trial's Outcome, and the Record the study keeps of it.

One record type serves the search, the study, the summary, the report and the bench. An
Outcome's headline figures (samples/s, tokens/s, peak memory, step seconds) are fields of
its own; the rest of what a trial found out is in typed parts (`measured`, `phases`,
`ran_with`, `compile`, `launch`, `gpu_memory`, `failure`, and a trainer's own:
`precompute`, `generation`), each a small dataclass, so that what the package reads is an
attribute, not a key in a dict a worker filled. What the search maximises is the
driver's word, not the trial's: the Record's `objective`.
"""

from __future__ import annotations

import copy
import statistics
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Self

from autotune.config import TrialConfig

# A trial's verdicts. `pruned`: not run, because a prediction said it would not fit.
# `lost`: the infrastructure failed under it (a worker or node died, twice): no verdict
# on the config, which a later session runs again.
OK, OOM, NAN, ERROR, TIMEOUT, CRASHED, PRUNED, LOST = (
    "ok", "oom", "nan", "error", "timeout", "crashed", "pruned", "lost")
# The config itself failed (two such after a trial worked, and the strategy stops trying
# its knob values; three with none that worked, and it stops: tuning/strategies/structured.py).
FAILED = (NAN, ERROR, TIMEOUT, CRASHED)

# What a search maximises (Record.objective): samples/s, or real (non-pad) tokens/s
# where padding or packing make the two differ (tasks/base.py `Task.objective`).
SAMPLES_PER_SECOND, TOKENS_PER_SECOND = "samples_per_second", "tokens_per_second"


def _default(f) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


class Part:
    """A typed part of an Outcome, through one `to_dict` and one `from_dict`. A field at
    its default (not measured: None) is left out of the dict, so summary.json says what a
    trial found, not a page of nulls; `from_dict` ignores keys it does not know (a newer
    autotune's). A field whose value is itself a part names its class in its metadata
    (`part`); a dict keyed by rank says so (`int_keys`: JSON makes its keys strings)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if isinstance(value, Part):
                value = value.to_dict()
                if not value:
                    continue
            elif value == _default(f):
                continue
            out[f.name] = copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> Self:
        kwargs: dict[str, Any] = {}
        for f in fields(cls):  # type: ignore[arg-type]
            value = (d or {}).get(f.name)
            if value is None:
                continue
            if "part" in f.metadata:
                value = f.metadata["part"].from_dict(value)
            elif f.metadata.get("int_keys"):
                value = {int(k): v for k, v in value.items()}
            kwargs[f.name] = value
        return cls(**kwargs)

    @property
    def known(self) -> bool:
        """Anything in it was measured."""
        return bool(self.to_dict())


def _part(cls: type[Part]) -> Any:
    return field(default=None, metadata={"part": cls})


def _by_rank() -> Any:
    return field(default=None, metadata={"int_keys": True})


@dataclass
class Lengths(Part):
    """Real rows' tokens after truncation (tasks/data.py `length_stats`): the
    distribution padding and packing are judged on, and the share the loss sees."""

    min: float | None = None
    p50: float | None = None
    p90: float | None = None
    max: float | None = None
    mean: float | None = None
    seq_len: float | None = None
    padding: float | None = None  # of a padded batch
    truncated: float | None = None  # of the rows
    loss_tokens: float | None = None  # of the real tokens


@dataclass
class Measurement(Part):
    """What a trial measured beyond its headline figures: what its steps trained on, the
    losses the numerics checks read (and, set by the driver's review, how they compare
    with the reference's), MFU, the parameters counted, the threads it ran on."""

    micro_batches: list[int] | None = None  # this rank's micro-batch sizes, counted
    micro_batches_by_rank: dict[int, list[int] | None] | None = _by_rank()
    peak_memory_by_rank: dict[int, int | None] | None = _by_rank()
    # A GPU trial's running (allocated, reserved) allocator peaks after each step
    peaks_by_step: list[list[int]] | None = None
    warmup_seconds: float | None = None  # the untimed steps, compilation included
    losses: list[float] | None = None  # each optimizer step's, as Trainer logs it
    grad_norms: list[float] | None = None  # each step's, as Trainer's clipping returned it
    loss_scale_skips: int | None = None  # fp16's overflowed steps
    loss_drift: float | None = None  # against the fp32 reference (tuning/numerics.py)
    loss_drift_noise: float | None = None
    loss_accumulation_scale: float | None = None  # the model sums over micro-batches
    # A parity lever's first step against its twin's (tuning/numerics.py `parity`): the
    # larger relative gap of loss and gradient norm, and the twin's trial number.
    parity_gap: float | None = None
    parity_twin: int | None = None
    mfu: float | None = None  # model FLOPs utilisation (PaLM's appendix B)
    lengths: Lengths | None = _part(Lengths)  # real data's rows
    num_parameters: int | None = None
    trainable_parameters: int | None = None
    flop_parameters: int | None = None  # N for MFU: input embeddings left out
    flop_trainable_parameters: int | None = None
    cpu_threads: int | None = None
    # glibc's mmap threshold a CPU trial held (trials/host_malloc.py); None: not held
    mmap_threshold: int | None = None


@dataclass
class ModelBuild(Part):
    """How a trial's model was built (trials/model_builder.py): which weights, on which
    device, partitioned or quantized, the disk it read and wrote, what a rank holds."""

    weights: str | None = None  # random, checkpoint or factory
    device: str | None = None
    partitioned: bool | None = None  # built under ZeRO-3's zero.Init
    quantized: str | None = None  # how a 4-bit base was quantized
    routing: str | None = None  # an MoE's routers: the checkpoint's or random
    disk_read_bytes: int | None = None
    disk_write_bytes: int | None = None
    held_parameter_bytes: int | None = None  # this rank's (its partitions under ZeRO-3)
    parameter_bytes: int | None = None  # the model's whole
    host_peak_rss_bytes: int | None = None
    device_peak_bytes: int | None = None


# Where a trial's seconds go, in order (Phases' fields).
PHASES = ("launch", "model", "engine", "warmup", "steps")


@dataclass
class Phases(Part):
    """Where a trial's seconds went (trials/worker.py `PhaseClock`): `launch` (from the
    launcher's start of the process to its imports done), `model` (built, quantized,
    adapters added), `engine` (arguments, data, Trainer, and train() up to its first
    step), `warmup` (the untimed steps, compilation included), `steps` (the timed
    window); only those the trial reached. And how its model was built."""

    launch: float | None = None
    model: float | None = None
    engine: float | None = None
    warmup: float | None = None
    steps: float | None = None
    model_build: ModelBuild | None = _part(ModelBuild)

    def seconds(self) -> dict[str, float]:
        """The phases the trial reached, in order."""
        return {k: v for k in PHASES if (v := getattr(self, k)) is not None}

    @property
    def before_first_step(self) -> float | None:
        """Seconds from the launch to the first step, where the trial got as far as its
        engine (an OOM in the first step included); None before that."""
        if self.engine is None:
            return None
        return sum(v or 0.0 for v in (self.launch, self.model, self.engine))


@dataclass
class RanWith(Part):
    """What the run really was (trials/runtime.py `ran_with`): TF32, compiled or not and
    how, Liger, the attention kernel, the Trainer's wrapper (DDP, FSDP, a DeepSpeed engine:
    the proof a sharding knob took effect), the native library bitsandbytes ran in; and
    the long-context levers as they ran (trials/long_context.py `Levers.record`)."""

    tf32: bool | None = None
    compiled: bool | None = None
    compile_mode: str | None = None
    compiled_graphs: int | None = None  # graphs torch.compile compiled: compiled code ran
    liger: bool | None = None
    attn_implementation: str | None = None
    wrapped_as: str | None = None
    bitsandbytes: str | None = None
    # The sequence split accelerate ran with: Ulysses' size (its attention in place), and
    # context parallelism's
    sequence_parallel: int | None = None
    context_parallel: int | None = None
    tiled_mlps: int | None = None  # MLPs computed by DeepSpeed's TiledMLP
    tiled_loss_calls: int | None = None  # micro-batches whose loss was tiled
    checkpointing: str | None = None  # "<variant> <checkpointed>/<layers>"
    activation_offloading: bool | None = None  # the step ran in TRL's offloading context


@dataclass
class Compile(Part):
    """A compiled trial's compilation: torch's own seconds and Inductor's caches' state
    (trials/compile_clock.py), and what the objective charges once over the long run."""

    seconds: float | None = None  # torch's compile clock
    cache: str | None = None  # cold, warm, partial or none
    cache_hits: int | None = None
    cache_misses: int | None = None
    # The warm-up's seconds beyond its steps' (and recompiles'): paid once in a long run
    charged_seconds: float | None = None
    recompiled_steps: int | None = None
    run_seconds: float | None = None  # the spec's long run at the measured speed


@dataclass
class Launch(Part):
    """How and where the trial ran: its launcher, the devices' lease, its node and rank,
    its time limit, and the infrastructure's failures under earlier tries of it."""

    kind: str | None = None  # warm or cold (several nodes': each node's, comma-joined)
    cold_because: str | None = None
    lease_wait_s: float | None = None  # waiting for devices another search held
    # Starting the warm launcher (its imports): the first trial of a process pays it, the
    # next ones of that process do not.
    launcher_start_s: float | None = None
    node: str | None = None  # the Ray node
    nodes: int | None = None
    rank_nodes: dict[int, str | None] | None = _by_rank()  # node rank -> Ray node
    rank: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    time_limit_s: float | None = None
    compile_allowance_s: float | None = None
    compile_not_counted_s: float | None = None
    infrastructure_failures: list[str] | None = None


@dataclass
class GpuMemory(Part):
    """The allocator's and NVML's figures behind a GPU trial's peak
    (trials/gpu_memory.py); a figure that could not be read says why, as a string."""

    allocator_peak_reserved: int | None = None
    allocator_peak_allocated: int | None = None
    pinned_host_peak: int | str | None = None
    nvml_overhead: int | str | None = None  # what the allocator does not see
    nvml_process: str | None = None  # how NVML's process was found
    reserved_by_stream: dict[str, int] | str | None = None
    segment_growth: list[dict[str, Any]] | str | None = None
    large_segments: list[dict[str, Any]] | str | None = None
    history_events: int | None = None
    history_full: bool | None = None
    trace_file: str | None = None


@dataclass
class Failure(Part):
    """Why a failure says nothing of its config, or what it was of: a setup error (the
    model, the data: no config avoids it; the spec's field), an OOM of host memory."""

    setup_field: str | None = None
    setup_message: str | None = None
    host_memory: bool = False


@dataclass
class Precompute(Part):
    """DPO's precomputed reference log-probs: their seconds, and the share of them charged
    to the timed steps (tasks/dpo.py)."""

    ref_seconds: float | None = None
    charged_seconds: float | None = None


@dataclass
class Generation(Part):
    """A generating trainer's timed steps split into generation and training (GRPO), and
    the completions' real length (tasks/grpo.py)."""

    seconds: list[float] | None = None
    training_seconds: list[float] | None = None
    share: float | None = None  # of the timed steps' seconds
    completion_length: int | None = None


# An old summary's or study's `extra` key -> (part, field); None: the part's whole dict.
_EXTRA: dict[str, tuple[str, str | None]] = {
    **{k: ("measured", k) for k in (f.name for f in fields(Measurement))},
    "phases": ("phases", None), "model_build": ("phases", "model_build"),
    "ran_with": ("ran_with", None), "wrapped_as": ("ran_with", "wrapped_as"),
    "attn_implementation": ("ran_with", "attn_implementation"),
    "compile": ("compile", None), "compile_seconds": ("compile", "charged_seconds"),
    "recompiled_steps": ("compile", "recompiled_steps"),
    "run_seconds": ("compile", "run_seconds"),
    "launch": ("launch", "kind"),
    **{k: ("launch", k) for k in ("cold_because", "lease_wait_s", "node", "nodes",
                                  "rank_nodes", "rank", "started_at", "ended_at",
                                  "infrastructure_failures")},
    **{k: ("gpu_memory", k) for k in (f.name for f in fields(GpuMemory))},
    **{k: ("failure", k) for k in ("setup_field", "setup_message", "host_memory")},
    "precompute_ref_seconds": ("precompute", "ref_seconds"),
    "precompute_charged_seconds": ("precompute", "charged_seconds"),
    "generation_seconds": ("generation", "seconds"),
    "training_seconds": ("generation", "training_seconds"),
    "generation_share": ("generation", "share"),
    "completion_length": ("generation", "completion_length"),
}
_TIME_LIMIT = {"seconds": "time_limit_s", "compile_allowance_s": "compile_allowance_s",
               "compile_not_counted_s": "compile_not_counted_s"}


def _from_extra(extra: dict[str, Any]) -> dict[str, Any]:
    """The parts of an outcome written before they were typed (one `extra` dict): each
    key to its field; `objective` is the Record's (Record.from_dict); what no field
    holds is kept in `diagnostics`."""
    parts: dict[str, dict[str, Any]] = {}
    diagnostics = {}
    for key, value in extra.items():
        if key == "objective":
            continue
        if key == "time_limit" and isinstance(value, dict):
            parts.setdefault("launch", {}).update(
                {_TIME_LIMIT[k]: v for k, v in value.items() if k in _TIME_LIMIT})
            continue
        part, name = _EXTRA.get(key, (None, None))
        if part is None:
            diagnostics[key] = value
        elif name is None:
            for k, v in (value or {}).items():  # a fact given twice (wrapped_as): one value
                parts.setdefault(part, {}).setdefault(k, v)
        else:
            parts.setdefault(part, {})[name] = value
    return parts | ({"diagnostics": diagnostics} if diagnostics else {})


@dataclass
class Outcome:
    """What a trial measured: the result a trial process writes, and what the study keeps.
    Figures are None when they were not measured, never a placeholder."""

    status: str
    samples_per_second: float | None = None
    tokens_per_second: float | None = None
    peak_memory_bytes: int | None = None
    step_seconds: list[float] = field(default_factory=list)
    wall_seconds: float | None = None
    timed_seconds: float | None = None
    predicted_memory_bytes: int | None = None
    error: str | None = None
    shape: dict[str, Any] | None = None  # a factory model's shape, learned by the trial
    measured: Measurement = field(default_factory=Measurement)
    phases: Phases = field(default_factory=Phases)
    ran_with: RanWith = field(default_factory=RanWith)
    compile: Compile = field(default_factory=Compile)
    launch: Launch = field(default_factory=Launch)
    gpu_memory: GpuMemory = field(default_factory=GpuMemory)
    failure: Failure = field(default_factory=Failure)
    precompute: Precompute = field(default_factory=Precompute)  # DPO's
    generation: Generation = field(default_factory=Generation)  # GRPO's
    # Free-form notes no reader depends on: bitsandbytes' state where its library was
    # refused, keys an older autotune wrote that no field holds.
    diagnostics: dict[str, Any] = field(default_factory=dict)

    PARTS: ClassVar[tuple[str, ...]] = ("measured", "phases", "ran_with", "compile",
                                        "launch", "gpu_memory", "failure", "precompute",
                                        "generation")

    @property
    def ok(self) -> bool:
        return self.status == OK

    @property
    def is_oom(self) -> bool:
        return self.status == OOM

    def score_for(self, objective: str) -> float | None:
        """What the search maximises under `objective` (Record.objective): samples/s or
        real tokens/s; for a compiled trial over the whole long run, its compilation paid
        once in it (compile.run_seconds at the measured speed, compile.charged_seconds)."""
        rate = (self.tokens_per_second if objective == TOKENS_PER_SECOND
                else self.samples_per_second)
        run, once = self.compile.run_seconds, self.compile.charged_seconds
        if rate is None or not run or not once:
            return rate
        return rate * run / (run + once)

    @property
    def ran(self) -> bool:
        return self.status != PRUNED

    @property
    def repeat_seconds(self) -> float:
        """What running the config again would cost: its wall time less what only the
        first trial of a process pays (the warm launcher's start). A search's limits
        project this onto its next trials and the confirmation: one slow start on a busy
        machine (136 s, where the trial itself took 3) once ended a search after it."""
        return max(0.0, (self.wall_seconds or 0.0) - (self.launch.launcher_start_s or 0.0))

    @property
    def median_step(self) -> float | None:
        steps = [s for s in self.step_seconds if s is not None and s >= 0]
        return statistics.median(steps) if steps else None

    def parts(self) -> dict[str, Any]:
        """The typed parts and the diagnostics: what an outcome made again from this one
        (another status) keeps."""
        return {name: getattr(self, name) for name in (*self.PARTS, "diagnostics")}

    def to_dict(self) -> dict[str, Any]:
        """The headline figures all (None too), then the parts that hold anything."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in self.PARTS:
                value = value.to_dict()
            if f.name in (*self.PARTS, "diagnostics") and not value:
                continue
            out[f.name] = copy.deepcopy(value)
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Outcome:
        """An outcome of this layout, or of the one before its parts were typed (an old
        summary.json, a study or a store record made before: one `extra` dict)."""
        if "extra" in d:
            d = {k: v for k, v in d.items() if k != "extra"} | _from_extra(d["extra"] or {})
        kwargs: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in d:
                continue
            value = d[f.name]
            if f.name in cls.PARTS:
                value = f.default_factory.from_dict(value)  # type: ignore[union-attr]
            elif f.name == "diagnostics":
                value = dict(value or {})
            kwargs[f.name] = value
        return cls(**kwargs)


# The reason of a confirmation run: the one fact that sets such runs apart from the search's.
CONFIRM_REASON = "confirm"


@dataclass
class Record:
    """One trial of a search: the config, why it was chosen, what happened, its number in
    the study (None until the study has it), and the objective the driver scores it by
    (from the spec: `autotune.tasks.objective_of`; a landscape's: samples/s)."""

    config: TrialConfig
    outcome: Outcome
    reason: str = ""
    number: int | None = None
    objective: str = SAMPLES_PER_SECOND

    @property
    def confirming(self) -> bool:
        """A confirmation run (a contender measured again after the search), not one of
        the search's trials: search.n_trials does not count it."""
        return self.reason == CONFIRM_REASON

    @property
    def counted(self) -> bool:
        """One of the trials search.n_trials counts: it ran (was not pruned on a
        prediction) and is no confirmation run."""
        return self.outcome.ran and not self.confirming

    @property
    def score(self) -> float | None:
        """What the search maximises: the outcome's figure under the record's objective."""
        return self.outcome.score_for(self.objective)

    @property
    def throughput(self) -> float | None:
        return self.outcome.samples_per_second if self.outcome.ok else None

    def to_dict(self) -> dict[str, Any]:
        return {"number": self.number, "config": self.config.to_dict(),
                "outcome": self.outcome.to_dict(), "reason": self.reason,
                "objective": self.objective}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        """A record; one written before the driver chose the objective has it in its
        outcome's `extra` (the worker's word then), and samples/s where it had none."""
        outcome = d.get("outcome") or {"status": ERROR}
        objective = d.get("objective") or (outcome.get("extra") or {}).get("objective")
        return cls(TrialConfig.from_dict(d["config"]), Outcome.from_dict(outcome),
                   str(d.get("reason") or ""),
                   None if d.get("number") is None else int(d["number"]),
                   str(objective or SAMPLES_PER_SECOND))
