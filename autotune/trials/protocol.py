"""What the launcher hands a trial process, and how the result comes back.

The request carries the TrainingArguments kwargs already built (the same kwargs the
exporter writes), so the worker applies no knob to TrainingArguments itself: a knob that
only sets TrainingArguments reaches every trial from its table row alone. The result is
an Outcome (autotune.records), written by the worker as JSON, with the model's shape
inside when the worker had to learn it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.files import write_atomically
from autotune.records import Outcome
from autotune.trials.trainargs import trainer_kwargs

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.spec import Spec


# The environment variable in which the launcher stamps when it started a trial's process
# (time.time()), from which the worker counts its launch phase.
SPAWNED_AT = "AUTOTUNE_SPAWNED_AT"


# A compiled trial's time limit does not count its compilation, up to this share of the
# limit: the search's first compiled trial compiles with a cold Inductor cache, later ones
# reuse it (30 s against 4.6 s for a one-layer GPT-2 here), and a limit that counted it would
# cut a config off for coming first.
COMPILE_ALLOWANCE = 1.0


@dataclass
class TrialRequest:
    spec: dict[str, Any]  # Spec.model_dump(mode="json"): the worker validates it with Spec
    config: dict[str, Any]  # TrialConfig.to_dict()
    training_args: dict[str, Any]  # trainargs' kwargs for the config, DeepSpeed inline
    shape: dict[str, Any] | None = None  # None: the worker reports the built model's
    memory_budget_bytes: int | None = None  # per rank; None: the device's
    timeout_s: float = 600.0
    cpu_threads: int = 1  # the trial's share of the node's cores, all its ranks together
    world_size: int = 1
    nodes: int = 1  # nodes its ranks span (world_size // nodes on each)
    on_cpu: bool = False  # which devices it leases (trials.lease)
    node_trials: int = 1  # trials its node runs at once, which share the node's RAM
    seed: int = 0
    import_paths: list[str] = field(default_factory=list)  # where a factory's module may be

    def compile_allowance_s(self) -> float:
        """The compilation a compiled trial may spend beyond its time limit (none for an
        eager one): see COMPILE_ALLOWANCE."""
        return COMPILE_ALLOWANCE * self.timeout_s if self.config.get("torch_compile") else 0.0

    def to_dict(self) -> dict[str, Any]:
        """The request as it travels: to a Ray task, and as JSON to the trial process."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrialRequest:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> TrialRequest:
        return cls.from_dict(json.loads(text))


def make_request(spec: Spec, config: TrialConfig, *, on_cpu: bool, shape: dict | None,
                 memory_budget_bytes: int | None, timeout_s: float,
                 cpu_threads: int, steps: int | None = None,
                 node_trials: int = 1, nodes: int = 1) -> TrialRequest:
    """The request for one trial of `spec`, built in the driver; `steps` replaces the
    spec's timed steps (confirmation measures longer)."""
    seed = spec.search.seed
    dumped = spec.model_dump(mode="json")
    # The results store is the driver's: its URL (a team's, with a password) never goes
    # to a trial's request file.
    dumped["search"]["store"] = None
    if steps is not None:
        dumped["measure"]["steps"] = steps
    return TrialRequest(
        spec=dumped, config=config.to_dict(),
        training_args=trainer_kwargs(spec, config, on_cpu=on_cpu),
        shape=shape, memory_budget_bytes=memory_budget_bytes, timeout_s=timeout_s,
        cpu_threads=cpu_threads, world_size=spec.world_size, nodes=nodes, on_cpu=on_cpu,
        node_trials=node_trials, seed=seed,
        import_paths=[p for p in (spec.base_dir, os.getcwd()) if p])


def rank_result_path(result_path: str | Path, rank: int, world: int) -> str:
    """Where rank `rank` of a trial of `world` ranks writes its result (the launcher merges
    them); a single process writes `result_path` itself."""
    return str(result_path) if world == 1 else f"{result_path}.rank{rank}"


def rss_path(result_path: str | Path) -> str:
    """Where a trial's host watch keeps its latest RSS growth: what it held when
    something outside killed it."""
    return f"{result_path}.rss"


def compile_clock_path(result_path: str | Path) -> str:
    """Where a compiled trial's rank keeps the seconds torch.compile has spent so far
    (JSON: `seconds` done, `since` the wall time an unfinished compile began, or null)."""
    return f"{result_path}.compile"


def write_result(path: str | Path, outcome: Outcome) -> None:
    """Atomically: a budget watch may end the process at any moment."""
    write_atomically(path, json.dumps(outcome.to_dict(), default=str))


def read_result(path: str | Path) -> Outcome:
    return Outcome.from_dict(json.loads(Path(path).read_text()))
