"""TRL's SFTTrainer (`trainer: sft`): supervised fine-tuning of a causal LM on the
source's own rows, which TRL renders (chat templates), tokenizes and collates itself; its
SFTConfig is exported as sft_config.json."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.tasks.base import Task, TrainerKind

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.spec import Spec


class SFT(TrainerKind):
    name = "sft"
    config_class = "SFTConfig"
    export_file = "sft_config.json"
    preload = ("trl.trainer.sft_trainer",)
    refuses = {"padding_free": (
        "under trainer: sft, TRL batches padding-free only without max_length or with its "
        "own packing of several samples into a row, which would change the effective "
        "batch; SFTConfig's packing is yours to set")}

    def check(self, spec: Spec) -> str | None:
        return (super().check(spec) or trl_check(spec, self, "SFTTrainer")
                or tokenizer_check(spec, self, "SFTTrainer"))

    def fields(self, spec: Spec, config: TrialConfig) -> dict[str, Any]:
        from autotune.tasks.data import resolved_format

        data = spec.data.model_dump()
        return sft_fields(config, data, resolved_format(data))

    def arguments(self, task: Task, kwargs: dict[str, Any]) -> Any:
        from trl import SFTConfig

        return SFTConfig(**kwargs)

    def make_trainer(self, spec: Spec, task: Task, model: Any, args: Any, samples: int,
                     timer: Any, seed: int, reference: Any = None,
                     collator: Any = None) -> tuple[Any, dict[str, float] | None]:
        """SFTTrainer on the source's own rows with the SFTConfig the driver built; and
        the rows' token lengths as it tokenized them."""
        from trl import SFTTrainer

        from autotune.tasks.data import IGNORE, length_stats, load_tokenizer, sft_dataset

        data = spec.data.model_dump()
        tok = load_tokenizer(data)
        try:
            trainer = SFTTrainer(model=model, args=args, callbacks=[timer],
                                 train_dataset=sft_dataset(data, samples),
                                 processing_class=tok)
        except (ValueError, KeyError) as exc:  # TRL's word on the rows or the template
            raise SetupError("data", f"SFTTrainer refused the data: "
                             f"{' '.join(str(exc).split())[:400]}") from exc
        rows = trainer.train_dataset
        masks = [c for c in ("completion_mask", "assistant_masks") if c in rows.column_names]
        labels = rows[masks[0]] if masks and data["completion_only_loss"] else None
        encoded = [(ids, ids if labels is None else [t if m else IGNORE for t, m in
                                                    zip(ids, labels[i], strict=False)])
                   for i, ids in enumerate(rows["input_ids"])]
        return trainer, length_stats(encoded, int(data["seq_len"]))

    def usage(self, exported: str, with_lora: bool) -> str:
        return ("from trl import SFTConfig, SFTTrainer\nargs = SFTConfig(**"
                f"json.load(open(\"{exported}\")) | {{\"output_dir\": \"runs/my-run\"}})"
                "\n# SFTTrainer(model, args=args, train_dataset=..., processing_class=tok)")


SFT_TRAINER = SFT()


def trl_check(spec: Spec, kind: TrainerKind, trainer_class: str) -> str | None:
    """What every TRL trainer here asks of a spec: TRL installed, a causal LM, a
    tokenizer (TRL tokenizes the rows itself)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return (f"trainer: {kind.name} runs TRL's {trainer_class}, and TRL is not installed "
                "(pip install trl)")
    from autotune.tasks.registry import task_of

    task = task_of(spec)
    if not task.causal:
        return (f"trainer: {kind.name} trains causal LMs ({trainer_class}); this model's "
                f"task is {task.name} (use trainer: trainer)")
    return None


def tokenizer_check(spec: Spec, kind: TrainerKind, trainer_class: str) -> str | None:
    if spec.data.tokenizer is None:
        return (f"trainer: {kind.name} needs data.tokenizer ({trainer_class} tokenizes the "
                "rows itself)")
    return None


def sft_fields(config: TrialConfig, data: dict[str, Any], fmt: str) -> dict[str, Any]:
    """What an SFTConfig adds to the TrainingArguments kwargs (TRL's SFTTrainer tokenizes
    and collates itself): the sequence length, padding-free batching from its knob, no
    packing of rows into each other, and the loss on completions (prompt-completion rows)
    or on the assistant's turns (messages) where the spec asks. `fmt`: the data's format
    (data.resolved_format)."""
    only = bool(data.get("completion_only_loss"))
    return {"max_length": int(data["seq_len"]), "packing": False,
            "padding_free": bool(config.padding_free),
            "completion_only_loss": only and fmt == "prompt-completion",
            "assistant_only_loss": only and fmt == "messages",
            "dataset_text_field": data.get("text_field", "text")}
