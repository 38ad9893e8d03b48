"""What a task and a trainer are: the two contracts every module in autotune/tasks/ fills.

A spec names one of each: the task (`model.task`: what the model learns, its head) and
the trainer (`trainer`: what trains it, Trainer or one of TRL's). Each is a registered
object (autotune/tasks/__init__.py); the rest of the package asks it what it needs and
never compares a name. Facts are class attributes; what needs the spec, the model or a
library is a method, which imports its library when called (the driver imports no
trainer it does not run).

A trial asks, in this order (trials/worker.py): `TrainerKind.arguments` (before the
model: ZeRO-3 builds under zero.Init), the task's `prepare_config` and `auto_class` (the
model), `TrainerKind.reference_model`, `TrainerKind.make_trainer` (its rows: the task's
`rows` under a plain Trainer), `TrainerKind.counter` (the task's `counter`, or its own),
and once the steps are timed `TrainerKind.finish` (the task's `finish` first).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.records import Outcome
    from autotune.spec import Spec


class Task:
    """What a model learns: its head, the model class and inputs that go with it, the rows
    a trial trains it on and how a micro-batch counts."""

    name: ClassVar[str]
    auto_class: ClassVar[str]  # transformers' Auto class that builds the model for it
    # PEFT's task type for its adapters (None: PEFT has none, the model is wrapped as it
    # is), and the modules that train whole beside them (a new classifier head).
    lora_task_type: ClassVar[str | None]
    lora_trained_modules: ClassVar[tuple[str, ...]] = ()
    lm_logits: ClassVar[bool] = False  # a vocabulary-sized output per token
    causal: ClassVar[bool] = False  # next-token prediction: Liger's loss, packing, TRL
    # The allocator replay follows its step (one stack of token ids): plan/memory.py.
    replayable: ClassVar[bool] = True
    arguments_class: ClassVar[str] = "TrainingArguments"  # transformers' class
    has_target: ClassVar[bool] = False  # a target length of its own (an encoder-decoder)
    reads_images: ClassVar[bool] = False  # its sequence is its images' patches
    # (a sample, its tokens, a note saying so) in the report's figures
    units: ClassVar[tuple[str, str, str]] = ("samples", "tokens", "")
    # `autotune init`'s shapes whose usual head this is (bert: a classifier), and what its
    # data section says
    model_types: ClassVar[tuple[str, ...]] = ()
    data_comment: ClassVar[str] = ""
    # The config keys of a second stack of layers (an encoder-decoder's decoder)
    second_stack_keys: ClassVar[tuple[str, ...]] = ()

    def prepare_config(self, hf_config: Any) -> Any:
        """`hf_config` with what training this head needs and an inline config may leave
        out."""
        return hf_config

    def lengths(self, spec: Spec) -> dict[str, int]:
        """The sequence lengths the spec asks of the model's positions, by spec field."""
        return {"seq_len": spec.data.seq_len}

    def shape_fields(self, spec_target_len: int | None) -> dict[str, Any]:
        """What a ModelShape of this task carries beyond the common fields (a target
        length)."""
        return {}

    def check(self, spec: Spec) -> str | None:
        """Why the spec's data cannot train this task, one line naming the field; None."""
        data = spec.data
        if data.target_len is not None and not self.has_target:
            return (f"data.target_len: {data.target_len}: only a seq2seq-lm model has a "
                    f"target; this model's task is {self.name}")
        if data.format == "image":
            return (f"data.format: image rows are for model.task image-classification; "
                    f"this model's task is {self.name}")
        if data.source != "synthetic" and data.tokenizer is None:
            return (f"data.tokenizer: source {data.source!r} is text: data.tokenizer is "
                    "required")
        return None

    def notes(self, spec: Spec) -> list[str]:
        """Defaults the spec left that change what is measured, one line each."""
        return []

    def trace_inputs(self, hf_config: Any, seq_len: int, batch: int, target_len: int,
                     rows: int) -> dict[str, Any]:
        """A micro-batch's inputs as the model takes them, for a fake step (plan/trace.py):
        `rows` rows of token ids per sample (two under DPO) and their labels."""
        import torch

        vocab = int(getattr(hf_config, "vocab_size", 2) or 2)
        ids = torch.randint(0, vocab, (rows * batch, seq_len))
        return {"input_ids": ids, "labels": ids}

    def row_labels(self, ids: Any, mask: Any, labels: Any, generator: Any) -> Any:
        """A text row's labels: the tokens (or the given ones), padding ignored."""
        from autotune.tasks.data import IGNORE

        lab = ids.clone() if labels is None else labels.clone()
        lab[mask == 0] = IGNORE
        return lab

    def rows(self, spec: Spec, model: Any, n_samples: int,
             seed: int) -> tuple[Any, dict[str, float] | None]:
        """`n_samples` rows a plain Trainer trains on, and their real tokens' lengths where
        the rows are real."""
        from autotune.tasks.data import build_dataset

        rows = build_dataset(spec.model_dump(), model, n_samples, self, seed=seed)
        return rows, rows.lengths

    def trainer_class(self) -> Any:
        from transformers import Trainer

        return Trainer

    def arguments_fields(self, spec: Spec) -> dict[str, Any] | None:
        """What its arguments class adds to TrainingArguments' kwargs (None: nothing)."""
        return None

    def counter(self, shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
        """(samples, tokens) of a micro-batch's inputs, or None for the worker's own count
        (rows and their attention mask)."""
        return None

    def objective(self, spec: Spec) -> str:
        """What a search of it maximises, the driver's choice (a trial measures both):
        real (non-pad) tokens/s on real data, where padding and packing make them differ
        from samples; samples/s on synthetic rows, every one seq_len tokens."""
        from autotune.records import SAMPLES_PER_SECOND, TOKENS_PER_SECOND

        return TOKENS_PER_SECOND if spec.data.source != "synthetic" else SAMPLES_PER_SECOND

    def finish(self, outcome: Outcome) -> None:
        """What the task adds to a measured outcome (none has anything yet)."""


class TrainerKind:
    """What trains the model: transformers' Trainer, or one of TRL's with its config
    class; the rows it takes, the arguments it adds, what it keeps beside the model."""

    name: ClassVar[str]
    config_class: ClassVar[str | None] = None  # TRL's config class; None: the task's
    export_file: ClassVar[str | None] = None  # the file its config is exported as
    # The modules its trials import beyond Trainer's: the warm launcher imports them once
    # for the search's trials (TRL: 0.4 s of every trial's launch otherwise)
    preload: ClassVar[tuple[str, ...]] = ()
    preference_pairs: ClassVar[bool] = False  # a sample is a chosen and a rejected row
    # Its config turns the model's dropout off by default (TRL's `disable_dropout`)
    disables_dropout: ClassVar[bool] = False
    adds_adapters: ClassVar[bool] = False  # it adds LoRA's adapters itself
    adapters_note: ClassVar[str] = ""  # what it makes of them, said beside lora_config.json
    keeps_reference: ClassVar[bool] = False  # a reference model beside the policy
    generates: ClassVar[bool] = False  # completions generated in every step (RL)
    # A fake step can imitate its step (plan/trace.py); where not, the formulas stand
    traced: ClassVar[bool] = True
    # Its step is transformers' Trainer's own, which the long-context levers patch (its
    # accelerator's ParallelismConfig, compute_loss, training_step: trials/long_context.py)
    long_context_levers: ClassVar[bool] = False
    # Its step's loss on the same weights and data is comparable across configs, so a
    # precision that drifts from the reference's is caught (tuning/numerics.py); not where
    # the loss is of completions sampled anew by each config's policy
    comparable_loss: ClassVar[bool] = True
    # The section of a space file that applies under it (space.py's SECTIONS)
    space_section: ClassVar[str | None] = None
    # Knobs whose values other than the baseline's it cannot take, and why
    refuses: ClassVar[dict[str, str]] = {}
    # What its knob reads only it has (None: every trainer's)
    units: ClassVar[tuple[str, str, str] | None] = None
    # What a user who sets nothing gets (the search's baseline): the knob values its
    # config class defaults to beside Trainer's, whether it takes auto_find_batch_size
    # (without, its defaults run at the target's batch alone), and its name in the report
    defaults: ClassVar[dict[str, Any]] = {}
    auto_find_batch_size: ClassVar[bool] = True
    defaults_name: ClassVar[str] = "Trainer's defaults"

    def check(self, spec: Spec) -> str | None:
        """Why the spec cannot run under this trainer, one line naming the field; None."""
        if spec.grpo is not None:
            return (f"grpo: the GRPO algorithm is read under trainer: grpo only; this spec's "
                    f"trainer is {self.name}")
        return None

    def shape_fields(self, spec: Spec) -> dict[str, Any]:
        """What a ModelShape trained by it carries (a generating trainer's lengths)."""
        return {}

    def fields(self, spec: Spec, config: TrialConfig) -> dict[str, Any] | None:
        """What its config class adds to the TrainingArguments kwargs (None: no class of
        its own)."""
        return None

    def arguments(self, task: Task, kwargs: dict[str, Any]) -> Any:
        """The arguments object a trial builds from the one builder's kwargs."""
        import transformers

        return getattr(transformers, task.arguments_class)(**kwargs)

    def reference_model(self, spec: Spec, config: TrialConfig,
                        build: Callable[[], Any]) -> Any:
        """A second model it keeps beside the policy (`build` makes one as the policy
        was), or None."""
        return None

    def make_trainer(self, spec: Spec, task: Task, model: Any, args: Any, samples: int,
                     timer: Any, seed: int, reference: Any = None,
                     collator: Any = None) -> tuple[Any, dict[str, float] | None]:
        """The trainer on `samples` samples, with the step timer; and the rows' token
        lengths where they are real. `collator`: a data collator the config asks for."""
        rows, lengths = task.rows(spec, model, samples, seed)
        extra = {"data_collator": collator} if collator is not None else {}
        return task.trainer_class()(model=model, args=args, train_dataset=rows,
                                    callbacks=[timer], **extra), lengths

    def counter(self, task: Task,
                shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
        return task.counter(shape)

    def objective(self, spec: Spec, task: Task) -> str:
        """What a search under it maximises: its task's, but a generating trainer's
        samples are completions forced to full length (padding decides nothing): their
        rate."""
        from autotune.records import SAMPLES_PER_SECOND

        return SAMPLES_PER_SECOND if self.generates else task.objective(spec)

    def finish(self, spec: Spec, task: Task, outcome: Outcome, trainer: Any) -> None:
        task.finish(outcome)

    def usage(self, exported: str, with_lora: bool) -> str:
        """How its exported config file is loaded (the report's files)."""
        return ""
