"""model.yaml: what the user wants tuned, validated before anything runs.

Every field is typed and documented once here; unknown keys are errors, and each error
names the field, the bad value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from autotune import tasks
from autotune.errors import SpecError, not_allowed

# The names a spec may give: the registered tasks and trainers (autotune/tasks/).
TaskName = Literal[tuple(tasks.TASKS)]  # type: ignore[valid-type]
TrainerName = Literal[tuple(tasks.TRAINERS)]  # type: ignore[valid-type]

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2,
          "gib": 1024**3, "tib": 1024**4}


def parse_bytes(value: str | int | float) -> int:
    """'2GiB' / '512MB' / 1e9 -> bytes, more than zero."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a size; use e.g. 2GiB, 512MiB, 16GB")
    if isinstance(value, int | float):
        size = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{value!r} is not a size; use e.g. 2GiB, 512MiB, 16GB")
        size = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"{value!r} is no memory at all; use e.g. 2GiB, 512MiB, 16GB")
    return size


_DURATION = re.compile(r"(?:([0-9]*\.?[0-9]+)\s*h)?\s*(?:([0-9]*\.?[0-9]+)\s*m)?"
                       r"\s*(?:([0-9]*\.?[0-9]+)\s*s)?")


def parse_duration(value: str | int | float) -> float:
    """'30m' / '90s' / '1h30m' / 120 -> seconds: more than zero, each unit once, in
    h-m-s order ('30mm' and '1h30' are refused rather than read one way or another)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration; use e.g. 30m, 90s, 1h30m")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = str(value).strip()
        bare = re.fullmatch(r"[0-9]*\.?[0-9]+", text)
        m = None if bare else _DURATION.fullmatch(text)
        if not bare and (m is None or not any(m.groups())):
            raise ValueError(f"{value!r} is not a duration; use e.g. 30m, 90s, 1h30m")
        seconds = float(text) if bare else sum(
            float(n) * unit for n, unit in zip(m.groups(), (3600, 60, 1), strict=True) if n)
    if seconds <= 0:
        raise ValueError(f"{value!r} is no time at all; use e.g. 30m, 90s, 1h30m")
    return seconds


def _base(info: ValidationInfo) -> Path:
    """The folder a spec's relative paths are relative to: its own file's (see load_spec)."""
    return Path((info.context or {}).get("base") or Path.cwd())


def _local(value: str | None, info: ValidationInfo) -> Path | None:
    """`value` as a local path resolved against the spec's folder, or None where it names
    no local path (a hub id such as 'gpt2')."""
    if value is None:
        return None
    path = (_base(info) / Path(value).expanduser()).resolve()
    explicit = value.startswith(("/", "./", "../", "~"))
    return path if explicit or path.exists() else None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        """YAML's `true` is not 1: a number field given a boolean is refused, not read."""
        if isinstance(v, bool) and info.field_name is not None:
            kinds = set(getattr(cls.model_fields[info.field_name].annotation, "__args__", ())
                        ) | {cls.model_fields[info.field_name].annotation}
            if bool not in kinds and kinds & {int, float}:
                raise ValueError(f"{v} is a boolean, not a number")
        return v


class LoraSpec(_Strict):
    """LoRA adapters through PEFT: the tuner searches everything else as for a full
    fine-tune. `lora: {}` takes these defaults (rank 8 on every linear layer)."""

    r: int = Field(8, ge=1)
    """The adapters' rank."""
    alpha: int = Field(16, ge=1)
    """LoRA's scaling numerator (the update is scaled by alpha / r)."""
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input."""
    target_modules: list[str] | Literal["all-linear"] = "all-linear"
    """Module names to adapt, or every linear layer but the output head."""


class ModelSpec(_Strict):
    """The model to tune: a local folder (or hub id), an inline config with random
    weights, or a factory; one of them."""

    name_or_path: str | None = None
    """A local model folder (or a Hugging Face id where the hub is reachable)."""
    config: dict[str, Any] | None = None
    """An inline config (model_type plus fields): random weights, no download."""
    task: TaskName = tasks.DEFAULT_TASK
    """The head trained: next-token prediction, masked tokens, a class per row, an
    encoder-decoder's target tokens (T5, BART: Seq2SeqTrainer), or a class per image
    (ViT: the images' patches are its sequence)."""
    factory: str | None = None
    """'package.module:function' returning a torch model (takes the HF config or None)."""
    attn_implementation: str | None = None
    """Passed to the model (eager, sdpa, flash_attention_2); None: the model's default.
    It is what the attention knob's "auto" means; the space can search the knob."""
    lora: LoraSpec | None = None
    """Train LoRA adapters instead of every weight."""
    weights: Literal["random", "checkpoint"] = "random"
    """What a trial's model holds: random weights of the exact shape, made on the trial's
    device by the model's own init (a dense model's step time does not depend on its
    values; an MoE model keeps its checkpoint's routers), or `checkpoint`: name_or_path's
    weights, read onto the device (the page cache serves every trial after the first)."""

    @field_validator("factory")
    @classmethod
    def _factory_form(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[\w.]+:\w+", v):
            raise ValueError(f"{v!r} must look like 'package.module:function'")
        return v

    @field_validator("name_or_path")
    @classmethod
    def _path_exists(cls, v: str | None, info: ValidationInfo) -> str | None:
        path = _local(v, info)
        if path is None:
            return v  # a hub id
        if not (path / "config.json").is_file():
            raise ValueError(f"{v!r} is not a model folder (no config.json in {path})")
        return str(path)

    @field_validator("config")
    @classmethod
    def _config_has_type(cls, v: dict | None) -> dict | None:
        if v is not None and "model_type" not in v:
            raise ValueError("an inline config needs model_type (e.g. gpt2, bert, llama)")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in ("name_or_path", "config") if getattr(self, k) is not None]
        if len(given) > 1:
            raise ValueError("give either name_or_path or config, not both")
        if not given and self.factory is None:
            raise ValueError("give one of name_or_path, config or factory")
        if self.weights == "checkpoint" and (self.name_or_path is None or self.factory):
            raise ValueError("weights: checkpoint reads model.name_or_path's weights; "
                             + ("a factory builds its own" if self.factory
                                else "an inline config has none (use weights: random)"))
        return self

    def display_name(self) -> str:
        if self.name_or_path:
            return Path(self.name_or_path).name or self.name_or_path
        if self.config:
            return f"{self.config['model_type']}-custom"
        return str(self.factory).split(":")[-1]


DATA_FILES = (".jsonl", ".json", ".parquet")


# A seq2seq-lm spec without data.target_len trains on targets of this many tokens (said
# once where the search or estimate starts): the summaries and translations
# Seq2SeqTrainer is most used for fit in 128 tokens (HF's examples' max_target_length).
DEFAULT_TARGET_LEN = 128


class DataSpec(_Strict):
    """What each trial trains on: synthetic tokens or images, or rows as people have
    them."""

    seq_len: int | Literal["longest"] = 128
    """Tokens per row: longer rows are truncated, shorter ones padded (or packed). A
    seq2seq-lm model's source; under trainer: dpo, each of a pair's two rows (prompt and
    chosen, prompt and rejected). Not read for image-classification: a ViT's sequence is
    its patches. `longest`: the longest length any config of the space is predicted to
    fit, a multiple of 256, found when the search starts and said then (`autotune
    estimate --longest` shows it per config family)."""
    target_len: int | None = Field(None, gt=0)
    """A seq2seq-lm model's target (decoder) tokens per row, truncated and padded to it.
    None: 128, said when the search starts."""
    source: str = "synthetic"
    """'synthetic' (random tokens, as in the seeds), a .jsonl/.json/.parquet file, a saved
    dataset folder, or a hub dataset id where the hub is reachable."""
    tokenizer: str | None = None
    """Tokenizer folder (or hub id), needed for a text source."""
    processor: str | None = None
    """An image source's image processor (a folder or hub id with its
    preprocessor_config.json). None: model.name_or_path's."""
    format: Literal["auto", "text", "messages", "prompt-completion", "preference",
                    "image"] = "auto"
    """What the rows hold: text (one column, data.text_field); messages (role/content
    lists, rendered by the tokenizer's chat template); prompt and completion (strings,
    or lists of messages); preference pairs for trainer: dpo (chosen and rejected, with
    a prompt: strings or lists of messages); image and label (an image folder with a
    subfolder per class, or a dataset with those columns). auto: found from the
    columns."""
    text_field: str = "text"
    """The column of a text source."""
    completion_only_loss: bool = False
    """Loss on the completion (the assistant's turns) only, not on the prompt."""

    @field_validator("seq_len")
    @classmethod
    def _positive_length(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"{v}: a length of at least 1 token, or longest")
        return v

    @field_validator("source")
    @classmethod
    def _source_exists(cls, v: str, info: ValidationInfo) -> str:
        if v == "synthetic":
            return v
        path = _base(info) / Path(v).expanduser()
        if path.exists():
            return str(path.resolve())
        if path.suffix in DATA_FILES or v.startswith(("/", "./", "../", "~")):
            raise ValueError(f"{v!r}: no such file or folder ({path.resolve()}; allowed: "
                             "synthetic, a .jsonl/.json/.parquet file, a saved dataset "
                             "folder, a hub dataset id)")
        return v  # a hub dataset id, read by the trial where the hub is reachable

    @field_validator("tokenizer", "processor")
    @classmethod
    def _tokenizer_folder(cls, v: str | None, info: ValidationInfo) -> str | None:
        path = _local(v, info)
        return str(path) if path is not None else v

    @model_validator(mode="after")
    def _text_source(self) -> DataSpec:
        if self.completion_only_loss and (self.source == "synthetic"
                                          or self.format in ("text", "image")):
            raise ValueError("completion_only_loss needs rows with a completion (format "
                             "messages or prompt-completion), not "
                             + ("synthetic tokens" if self.source == "synthetic" else "text"))
        return self


class HardwareSpec(_Strict):
    """What one trial runs on, and how many run at once."""

    gpus_per_trial: int = Field(1, ge=1)
    """GPUs (on CPU: processes) one trial uses, as data-parallel ranks."""
    nodes_per_trial: int | None = Field(None, ge=1)
    """Nodes a trial's ranks span (an equal share on each), on a Ray cluster. None: as
    few as hold its ranks (one where a node has them all: its GPUs, or on a cluster of
    CPUs a core per rank)."""
    parallel_trials: int | None = Field(None, ge=1)
    """Trials at once per node: on GPUs at most GPUs / gpus_per_trial (the default); on
    CPU 1 unless set, the node's cores and RAM then shared among them."""
    memory_budget: str | int | None = None
    """Cap on one trial's peak memory (e.g. 2GiB). None: the GPU's memory, or on CPU a
    share of free RAM."""
    device: str | None = None
    """The GPU `autotune estimate` plans for when --device is not given (e.g. L4-24GB, a
    name of plan.device's table); a search always runs on the device it finds."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, v: str | None) -> str | None:
        if v is not None:
            from autotune.device import named_device

            try:
                named_device(v)
            except Exception as exc:  # noqa: BLE001 - its message names the known ones
                raise ValueError(str(exc).removeprefix("--device: ")) from None
        return v

    @field_validator("memory_budget")
    @classmethod
    def _size(cls, v: str | int | None) -> str | int | None:
        if v is not None:
            parse_bytes(v)
        return v

    def budget_bytes(self) -> int | None:
        return None if self.memory_budget is None else parse_bytes(self.memory_budget)


class SearchSpec(_Strict):
    """How the search runs: its space, its budget, where its study is kept."""

    space: str = "default"
    """A space autotune carries (`default`, `no-deepspeed`: autotune/search_spaces/) or a
    path to a space YAML of your own."""
    n_trials: int = Field(40, ge=1)
    """Trials to run in total (a resumed search counts the earlier ones)."""
    timeout: str | int = "30m"
    """Wall time for this invocation of the search, its confirmation included: a
    confirmation run starts only where, priced at its trials' times, it ends by then."""
    trial_timeout: str | int = "10m"
    """Wall time for one trial, model load included; it is killed after that. A compiled
    trial's torch.compile seconds are not counted, up to as long again."""
    storage: str | None = None
    """The Optuna storage URL (default: sqlite:///OUTPUT/study.db); several drivers on one
    database share a search."""
    study_name: str | None = None
    """The Optuna study's name (default: autotune- and a fingerprint of what makes two
    searches' measurements comparable)."""
    seed: int = 0
    """One seed for every trial and for the exported TrainingArguments."""
    sampler: Literal["autotune", "tpe", "gp", "random"] = "autotune"
    """Who proposes trials: autotune's structured strategy, or one of Optuna's samplers
    (with the same memory prediction in front of them)."""
    store: str | None = None
    """The results store that remembers confirmed searches: a database URL
    (postgresql://user:password@host/db for a team, sqlite:///results.db), or off. None:
    $AUTOTUNE_STORE, else results.db in the user's cache folder. The same setup searched
    again is answered from it after its winner and baseline run once more; a similar one
    starts from its winners (docs/store.md)."""
    confirm_repeats: int = Field(3, ge=0)
    """After the search, the winner, the runner-ups within noise and the baseline run this
    many more times each (interleaved, twice the steps, from the exported files); the
    winner is chosen on those figures. Counts against search.timeout; 0 turns it off."""

    @field_validator("space")
    @classmethod
    def _space_file(cls, v: str, info: ValidationInfo) -> str:
        """A space given as a file is relative to the spec; a bare name is one of ours."""
        if not Path(v).suffix:
            return v
        return str((_base(info) / Path(v).expanduser()).resolve())

    @field_validator("timeout", "trial_timeout")
    @classmethod
    def _duration(cls, v: str | int) -> str | int:
        parse_duration(v)
        return v

    @field_validator("store", mode="before")
    @classmethod
    def _store(cls, v: Any) -> Any:
        """`store: off` (YAML reads a bare off as false) turns the store off; a URL must be
        one whose driver is here."""
        if v is False:
            return "off"
        if isinstance(v, str) and v.strip().lower() not in ("off", "none", "no", "false"):
            from autotune.dburl import url_problem

            problem = url_problem(v.strip(), "sqlite:///results.db")
            if problem:
                raise ValueError(problem)
        return v

    @field_validator("storage")
    @classmethod
    def _storage(cls, v: str | None) -> str | None:
        """A database URL whose driver is here: caught now, not as a SQLAlchemy traceback
        when the study opens."""
        if v is None:
            return v
        from autotune.dburl import url_problem

        problem = url_problem(v, "sqlite:///study.db")
        if problem:
            raise ValueError(problem)
        return v


class MeasureSpec(_Strict):
    """How each trial is timed."""

    warmup_steps: int = Field(2, ge=0)
    """Optimizer steps run first and not timed (allocator, kernels, compilation)."""
    steps: int = Field(5, ge=1)
    """Optimizer steps timed per trial (a confirmation run times twice as many)."""
    loss_tolerance: float = Field(0.05, gt=0)
    """How far a trial's mean step loss may be from the full-precision reference's (same
    weights, data and order), past the noise of the paired steps, and how far beyond the
    reference's range a step may go, as a share of its mean loss, before its precision
    is rejected."""


class GRPOSpec(_Strict):
    """TRL's GRPO algorithm under `trainer: grpo`: the user's choice, never searched."""

    num_generations: int = Field(4, ge=2)
    """Completions generated per prompt, whose rewards are compared (TRL's group)."""
    max_completion_length: int = Field(256, gt=0)
    """Tokens a completion may have. Trials force every completion to this length: the
    worst case, where GRPO's OOMs come from."""
    beta: float = Field(0.0, ge=0)
    """The KL coefficient: above 0 a reference model is kept (its memory and its forward
    in every step; under LoRA the base with the adapters off)."""
    reward: str = "length"
    """A built-in reward for timing (length: a completion's characters), or
    'package.module:function' taking completions and returning a float each."""


class RunSpec(_Strict):
    """The long run the user is tuning for, to project its wall time in the report."""

    steps: int | None = Field(None, gt=0)
    """Optimizer steps of target_batch_size samples; torch.compile's one-time cost is
    charged once against them."""
    tokens: int | None = Field(None, gt=0)
    """Or the run's length in tokens."""


class Spec(_Strict):
    model: ModelSpec
    data: DataSpec = DataSpec()
    trainer: TrainerName = tasks.DEFAULT_TRAINER
    """What trains each trial and the long run: transformers' Trainer (Seq2SeqTrainer for
    a seq2seq-lm model), TRL's SFTTrainer (its SFTConfig is exported as sft_config.json),
    or TRL's DPOTrainer on preference pairs (DPOConfig, dpo_config.json; a sample is a
    pair, its chosen and rejected rows)."""
    target_batch_size: int = Field(64, gt=0)
    """The effective batch per optimizer step, all ranks: batch x accumulation x ranks.
    Every config trains exactly this (accumulation is derived)."""
    hardware: HardwareSpec = HardwareSpec()
    search: SearchSpec = SearchSpec()
    measure: MeasureSpec = MeasureSpec()
    grpo: GRPOSpec | None = None
    """The GRPO algorithm, under `trainer: grpo` (its defaults where left out)."""
    run: RunSpec = RunSpec()
    output: str = "reports/autotune"
    """The folder the winner's files, summary.json, the report and the study go to."""

    @model_validator(mode="after")
    def _trainer(self) -> Spec:
        """What the trainer asks of the spec (TRL's: a causal LM, a tokenizer)."""
        said = tasks.trainer_of(self).check(self)
        if said:
            raise ValueError(said)
        return self

    @model_validator(mode="after")
    def _task_data(self) -> Spec:
        """What the task reads: a tokenizer for text rows, a processor (or the model's
        folder) for images, a target length for an encoder-decoder only."""
        said = tasks.task_of(self).check(self)
        if said:
            raise ValueError(said)
        return self

    def notes(self) -> list[str]:
        """Defaults the spec left to autotune that change what is measured, one line each
        (said once where a search or an estimate starts)."""
        return tasks.task_of(self).notes(self)

    def grpo_algorithm(self) -> GRPOSpec:
        """The GRPO section, its defaults where the spec has none."""
        return self.grpo or GRPOSpec()

    @property
    def target_len(self) -> int:
        """A seq2seq-lm model's target tokens per row (data.target_len or the default)."""
        return self.data.target_len or DEFAULT_TARGET_LEN

    @model_validator(mode="after")
    def _divisible(self) -> Spec:
        world = self.hardware.gpus_per_trial
        nodes = self.hardware.nodes_per_trial
        if nodes is not None and world % nodes:
            raise ValueError(f"hardware.gpus_per_trial {world} is not divisible by "
                             f"hardware.nodes_per_trial {nodes} (each node runs an equal "
                             "share of the ranks)")
        if self.target_batch_size % world:
            raise ValueError(f"target_batch_size {self.target_batch_size} is not divisible by "
                             f"hardware.gpus_per_trial {world}")
        return self

    _base_dir: str | None = PrivateAttr(default=None)

    @property
    def world_size(self) -> int:
        return self.hardware.gpus_per_trial

    @property
    def per_rank_batch(self) -> int:
        """Samples one rank takes per optimizer step at the target (batch × accumulation)."""
        return self.target_batch_size // self.world_size

    @property
    def base_dir(self) -> str | None:
        """The spec file's folder, where its relative paths were resolved."""
        return self._base_dir

    def fingerprint(self) -> str:
        """What makes two searches comparable: the model, data and target, not the budget."""
        # Fields added later count only where set: a study made before them resumes.
        later = {"format": "auto", "completion_only_loss": False, "device": None,
                 "trainer": tasks.DEFAULT_TRAINER, "nodes_per_trial": None, "weights": "random",
                 "target_len": None, "processor": None}
        unset = object()

        def given(section: BaseModel) -> dict[str, Any]:
            return {k: v for k, v in section.model_dump().items() if later.get(k, unset) != v}

        data, hw = given(self.data), given(self.hardware)
        key = {"model": given(self.model), "data": data,
               "target": self.target_batch_size, "hw": hw,
               "space": self.search.space, "measure": self.measure.model_dump()}
        key |= {k: v for k, v in {"trainer": self.trainer}.items() if later[k] != v}
        if self.grpo is not None:  # the algorithm decides what a step does
            key["grpo"] = self.grpo.model_dump()
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _keys_at(loc: tuple) -> list[str]:
    """The keys the spec allows at `loc` (a path of section names), or none where it does
    not lead to a section."""
    section: type[BaseModel] = Spec
    for name in loc:
        annotation = section.model_fields.get(str(name))
        kind = annotation.annotation if annotation else None
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return []
        section = kind
    return list(section.model_fields)


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if not where:
            lines.append(msg)
            continue
        if e["type"] == "extra_forbidden":
            keys = _keys_at(e["loc"][:-1])
            lines.append(f"{where}: unknown key (value {e['input']!r})" + (
                f"; the key {not_allowed(str(e['loc'][-1]), keys)}" if keys else
                "; check the spelling against the keys in README.md"))
        elif e["type"] == "literal_error":
            options = re.findall(r"'([^']*)'", str(e.get("ctx", {}).get("expected", "")))
            lines.append(f"{where}: " + (not_allowed(e["input"], options) if options
                                          else f"{e['input']!r} is not allowed; {msg}"))
        # Pydantic's own messages never quote the value ("greater than 0" is no echo of 0).
        elif "input" in e and not isinstance(e["input"], dict) and (
                e["type"] != "value_error" or repr(e["input"]) not in msg):
            lines.append(f"{where}: {e['input']!r}: {msg}")
        else:
            lines.append(f"{where}: {msg}")
    return "; ".join(lines)


def load_spec(source: str | Path | dict | Spec, **overrides: Any) -> Spec:
    """Read and validate a spec; overrides use dotted keys ('search.n_trials': 5)."""
    if isinstance(source, Spec):
        data = source.model_dump()
    elif isinstance(source, dict):
        data = json.loads(json.dumps(source))
    else:
        path = Path(source)
        if not path.is_file():
            raise SpecError(f"spec file {str(path)!r} not found")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise SpecError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
        if not isinstance(data, dict):
            raise SpecError(f"{path}: expected a mapping of keys (model, data, ...)")
    if isinstance(source, Spec):
        base = Path(source.base_dir or Path.cwd())
    else:
        base = Path.cwd() if isinstance(source, dict) else Path(source).resolve().parent
    for dotted, value in overrides.items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for i, p in enumerate(parents):
            child = node.get(p)
            if child is None:  # absent, or a bare `search:` in the file
                child = node[p] = {}
            elif not isinstance(child, dict):
                where = ".".join(parents[:i + 1])
                raise SpecError(f"{where}: expected a mapping of keys, got {child!r}")
            node = child
        node[leaf] = value
    try:
        # Relative paths are relative to the spec's own file, as in most config files, so
        # a search runs the same from any folder (and in trials, which run in a scratch one).
        spec = Spec.model_validate(data, context={"base": str(base)})
    except ValidationError as exc:
        raise SpecError(_format_error(exc)) from None
    spec._base_dir = str(base)
    if not isinstance(source, Spec):  # a Spec given back was loaded, and said, before
        for note in spec.notes():
            logger.warning(note)
    return spec
