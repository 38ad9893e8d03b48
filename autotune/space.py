"""Search spaces: each knob's values from a space file (the package's own in
autotune/search_spaces/*.yaml, or the user's), the derived accumulation, and the knob
table's rules, which remove what cannot run before anything runs."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from autotune import knobs
from autotune.config import BATCH, Family, TrialConfig
from autotune.errors import SpecError, not_allowed
from autotune.tasks import TRAINERS, TrainerKind, trainer_of

if TYPE_CHECKING:
    from autotune.device import DeviceSpec
    from autotune.spec import Spec

# The spaces a spec names (`search.space: default`): package data, inside the package so
# that an installed wheel has them too (pyproject.toml's package-data).
SPACES_DIR = Path(__file__).resolve().parent / "search_spaces"


@dataclass
class Space:
    batch_sizes: list[int]
    values: dict[str, list[Any]]  # knob -> values to search, in table order
    source: str = "default"
    # Knob lists that replace `values`' where a section's condition holds (SECTIONS)
    sections: dict[str, dict[str, list[Any]]] = field(default_factory=dict)

    def applied(self, device: DeviceSpec, spec: Spec | None = None) -> Space:
        """The lists this device and spec search: `values` with the sections whose
        condition holds laid over, in SECTIONS' order."""
        values = dict(self.values)
        for name, holds in SECTIONS.items():
            if name in self.sections and holds(device, spec):
                values |= self.sections[name]
        return Space(self.batch_sizes, {k.name: values[k.name] for k in knobs.table()},
                     self.source)

    def choices(self) -> dict[str, list[Any]]:
        """Every searched dimension's values, in a stable order (Optuna distributions)."""
        return {BATCH: self.batch_sizes} | self.values

    def families(self) -> list[Family]:
        names = list(self.values)
        return [Family.of(dict(zip(names, combo, strict=True)))
                for combo in itertools.product(*self.values.values())]


@dataclass
class SpaceResult:
    space: Space
    candidates: list[TrialConfig]
    pruned: dict[str, str] = field(default_factory=dict)  # rule label -> why


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_values(key: str, values: list, allowed: list, where: str,
                  listed_in: str = "") -> None:
    for v in values:
        if v not in allowed:
            raise SpecError(f"search space {where}: {key}: "
                            f"{not_allowed(v, allowed, listed_in)}")


def few_splits(per_rank: int) -> str | None:
    """A note where a prime per-rank target leaves the search only the micro-batches 1 and
    the whole target (accumulation is derived, so the effective batch never changes),
    naming the nearest target with more splits; None otherwise."""
    if per_rank < 5 or len(divisors(per_rank)) > 2:
        return None
    near = max((n for n in range(per_rank - 3, per_rank + 4) if n > 0),
               key=lambda n: (len(divisors(n)), -abs(n - per_rank)))
    return (f"target_batch_size gives {per_rank} samples per rank, a prime: the only "
            f"micro-batches are 1 and {per_rank}, so there is little to tune; {near} would "
            f"allow {len(divisors(near))} ({', '.join(map(str, divisors(near)))})")


def _values(raw: dict, key: str, default: list, where: str) -> list:
    value = raw.get(key, default)
    values = value if isinstance(value, list) else [value]
    if not values:  # an empty list would leave no config to run, silently
        left_out = "every divisor of the target" if key == BATCH else "the baseline's value"
        raise SpecError(f"search space {where}: {key}: the list is empty; leave the key out "
                        f"for {left_out}")
    return values


def space_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if not path.suffix:
        path = SPACES_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SPACES_DIR.glob("*.yaml")))
        raise SpecError(f"search.space: {name_or_path!r} is neither a file nor a space under "
                        f"autotune/search_spaces/ (known: {known})")
    return path


def load_space(name_or_path: str, target_batch_size: int, world_size: int = 1) -> Space:
    """A space file: each knob's list (a knob left out keeps its baseline value)."""
    path = space_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SpecError(f"search space {path.name}: not valid YAML: "
                        f"{' '.join(str(exc).split())}") from None
    if not isinstance(raw, dict):
        raise SpecError(f"search space {path.name}: expected a mapping of knob: [values], "
                        f"got a {type(raw).__name__}")
    allowed_keys = [BATCH, *knobs.names(), *SECTIONS]
    unknown = sorted(set(raw) - set(allowed_keys))
    if unknown:
        raise SpecError(f"search space {path.name}: key {not_allowed(unknown[0], allowed_keys)}")
    per_rank = target_batch_size // world_size
    batches = raw.get(BATCH, "auto")
    batches = (divisors(per_rank) if batches == "auto"
               else _values(raw, BATCH, [], path.name))
    _check_values(BATCH, batches, divisors(per_rank), path.name)
    values = _knob_values(raw, path.name, defaults=True)
    sections = {}
    for name in SECTIONS:
        section = raw.get(name) or {}
        where = f"{path.name} ({name}:)"
        if not isinstance(section, dict):
            raise SpecError(f"search space {where}: expected a mapping of knob: [values]")
        extra = sorted(set(section) - set(knobs.names()))
        if extra:
            raise SpecError(f"search space {where}: key {not_allowed(extra[0], knobs.names())}")
        sections[name] = _knob_values(section, where, defaults=False)
    return Space(sorted(int(b) for b in batches), values, str(path), sections)


def _under(kind: TrainerKind) -> Callable[[DeviceSpec, Spec | None], bool]:
    return lambda device, spec: spec is not None and trainer_of(spec) is kind


# From this many tokens a row the activations and the logits, not the model states, decide
# what fits: the default space's long_context levers are searched.
LONG_CONTEXT = 8192

# Sections of a space file whose knob lists replace the top level's where their condition
# holds: the default space searches the GPU's own levers on CUDA (and stays quick on a
# CPU), a quantized base where the model trains LoRA adapters, the long-context levers
# from LONG_CONTEXT tokens, and a trainer's own (DPO's reference log-probs).
SECTIONS: dict[str, Callable[[DeviceSpec, Spec | None], bool]] = {
    "cuda": lambda device, spec: device.is_cuda,
    "lora": lambda device, spec: spec is not None and spec.model.lora is not None,
    "long_context": lambda device, spec: spec is not None and isinstance(
        spec.data.seq_len, int) and spec.data.seq_len >= LONG_CONTEXT,
} | {  # a trainer's own section (trainer: dpo's reference log-probs)
    kind.space_section: _under(kind) for kind in TRAINERS.values() if kind.space_section}


def _knob_values(raw: dict, where: str, *, defaults: bool) -> dict[str, list[Any]]:
    """Each knob's parsed, checked list; knobs not given keep their baseline (`defaults`)
    or are left out."""
    values: dict[str, list[Any]] = {}
    for k in knobs.table():
        if k.name not in raw and not defaults:
            continue
        given = _values(raw, k.name, [k.baseline], where)
        try:
            parsed = [k.parse(v) for v in given]
        except SpecError as exc:  # the knob's own message names it
            raise SpecError(f"search space {where}: {exc}; allowed: "
                            f"{', '.join(map(str, k.allowed()))}") from None
        _check_values(k.name, parsed, k.allowed(), where, k.listed_in)
        values[k.name] = list(dict.fromkeys(parsed))
    return values


def applicable(spec: Spec, k: knobs.Knob, v: Any) -> str | None:
    """Why value `v` of knob `k` cannot apply to this spec's model or data, or None."""
    if k.applies is None or v == k.baseline:
        return None
    return k.applies(spec, v)


def _applicable(space: Space, spec: Spec, pruned: dict[str, str]) -> Space:
    """The space without the knob values that cannot apply to this spec's model or data
    (the table's `applies`), each removal recorded with its reason; a knob left with no
    value keeps its baseline's."""
    values = dict(space.values)
    for k in knobs.table():
        kept = []
        for v in values.get(k.name, []):
            reason = applicable(spec, k, v)
            if reason is None:
                kept.append(v)
            elif k.strict:
                raise SpecError(f"search space {space.source}: {k.name}: {reason}")
            else:
                pruned.setdefault(f"{k.name}={v}", reason)
        values[k.name] = kept or [k.baseline]
    return Space(space.batch_sizes, values, space.source)


def _one_rank_rule(cfg: TrialConfig, world_size: int) -> tuple[str, str] | None:
    """ZeRO-3 without its parameter offload on one rank: a config that ZeRO-2 dominates
    (the rules see no world size, so it is here)."""
    if world_size == 1 and cfg.zero_stage == 3 and cfg.offload != "optimizer+param":
        return ("zero_stage=3 without offload=optimizer+param on one rank",
                "on one rank ZeRO-3 partitions nothing: it holds what ZeRO-1 and 2 hold "
                "(with their optimizer offload) and pays a gather of each module's "
                "parameters at every step; only its parameter offload saves memory there")
    return None


def build_space(spec: Spec, device: DeviceSpec, space: Space | None = None) -> SpaceResult:
    """Every config the space allows on `device`, with accumulation derived from the target."""
    space = space or load_space(spec.search.space, spec.target_batch_size, spec.world_size)
    space = space.applied(device, spec)
    result = SpaceResult(space, [])
    space = result.space = _applicable(space, spec, result.pruned)
    for family in space.families():
        for b in space.batch_sizes:
            cfg = family.config(b, spec.target_batch_size, spec.world_size)
            rule = (knobs.device_rule(cfg, device, world_size=spec.world_size)
                    or _one_rank_rule(cfg, spec.world_size))
            if rule is None:
                result.candidates.append(cfg)
            else:
                result.pruned.setdefault(*rule)
    result.candidates.sort()
    return result
