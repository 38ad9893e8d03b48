"""TRL's DPOTrainer (`trainer: dpo`) on preference pairs: a sample is a pair, two rows
(prompt and chosen, prompt and rejected) through the policy and the reference's forward.
Under LoRA the reference is the base with the adapters off (TRL's, given the adapters as
`peft_config`); without it a second copy built as the policy was, or none where the
reference's log-probs are precomputed once (the `precompute_ref_log_probs` knob), whose
seconds are charged to the timed steps at their share. Its DPOConfig is exported as
dpo_config.json."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.tasks.base import Task, TrainerKind
from autotune.tasks.sft import tokenizer_check, trl_check

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.records import Outcome
    from autotune.spec import Spec


class DPO(TrainerKind):
    name = "dpo"
    config_class = "DPOConfig"
    export_file = "dpo_config.json"
    preload = ("trl.trainer.dpo_trainer",)
    preference_pairs = True
    disables_dropout = True  # DPOConfig.disable_dropout, True by default (TRL 1.16)
    adds_adapters = True  # TRL adds LoRA's adapters (peft_config): its reference is the base
    keeps_reference = True
    adapters_note = "given to DPOTrainer: its reference is the base with the adapters off"
    space_section = "dpo"
    units = ("pairs", "tokens", "a sample is a preference pair, its tokens both rows' "
             "(prompt and chosen, prompt and rejected)")
    refuses = {
        "use_liger_kernel": (
            "under trainer: dpo TRL computes the log-probabilities with its own chunked LM "
            "head and applies Liger's layer kernels only (use_liger_kernel is deprecated "
            "there); not searched"),
        "padding_free": ("under trainer: dpo, TRL has padding-free batching off since its "
                         "DPO rewrite (it pads each batch to its longest row)")}

    def check(self, spec: Spec) -> str | None:
        said = super().check(spec) or trl_check(spec, self, "DPOTrainer")
        if said:
            return said
        if spec.data.source == "synthetic":
            return ("trainer: dpo trains on preference pairs: give data.source, rows with "
                    "prompt, chosen and rejected (text or messages)")
        return tokenizer_check(spec, self, "DPOTrainer")

    def fields(self, spec: Spec, config: TrialConfig) -> dict[str, Any]:
        """Each of a pair's rows cut at data.seq_len, the reference's log-probs
        precomputed where the knob says, no padding-free batching (TRL has it off since
        its DPO rewrite)."""
        return {"max_length": int(spec.data.seq_len), "truncation_mode": "keep_start",
                "padding_free": False,
                "precompute_ref_log_probs": bool(config.precompute_ref_log_probs)}

    def arguments(self, task: Task, kwargs: dict[str, Any]) -> Any:
        from trl import DPOConfig

        return DPOConfig(**kwargs)

    def reference_model(self, spec: Spec, config: TrialConfig,
                        build: Callable[[], Any]) -> Any:
        """Without LoRA, a second copy of the policy, built the same way from the same seed
        (so with the same weights), frozen; None under LoRA or with precomputed log-probs
        (the policy before its first step computes them once)."""
        if spec.model.lora is not None or config.precompute_ref_log_probs:
            return None
        reference = build()
        reference.requires_grad_(False)
        return reference.eval()

    def make_trainer(self, spec: Spec, task: Task, model: Any, args: Any, samples: int,
                     timer: Any, seed: int, reference: Any = None,
                     collator: Any = None) -> tuple[Any, dict[str, float] | None]:
        """DPOTrainer on the source's preference rows (it renders, tokenizes and collates
        them) with the DPOConfig the driver built; under LoRA the adapters are TRL's to add
        (`peft_config`), so the reference is the base with them off."""
        from autotune.tasks.data import load_tokenizer, preference_rows

        data = spec.data.model_dump()
        tok = load_tokenizer(data)
        peft = None
        if spec.model.lora is not None:
            from peft import LoraConfig

            from autotune.tasks.lora import lora_config_kwargs

            peft = LoraConfig(**lora_config_kwargs(spec.model.lora.model_dump(), task))
        rows = preference_rows(data, samples)
        try:
            trainer = _dpo_class()(model=model, ref_model=reference, args=args,
                                   train_dataset=rows, processing_class=tok,
                                   peft_config=peft, callbacks=[timer])
        except (ValueError, KeyError) as exc:  # TRL's word on the rows or the template
            raise SetupError("data", f"DPOTrainer refused the data: "
                             f"{' '.join(str(exc).split())[:400]}") from exc
        return trainer, _pair_lengths(trainer.train_dataset, data["seq_len"])

    def counter(self, task: Task,
                shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
        """A batch is chosen rows then rejected rows: a sample is the pair, its tokens
        both rows'."""
        return lambda x: (x["input_ids"].shape[0] // 2, x["attention_mask"].sum())

    def finish(self, spec: Spec, task: Task, outcome: Outcome, trainer: Any) -> None:
        """The precomputed reference log-probs charged to the timed steps at their share of
        the pairs (a long run pays them for every pair)."""
        task.finish(outcome)
        batches = getattr(trainer, "precompute_batches", None)
        if not batches or not outcome.timed_seconds:
            return
        # One precomputed batch per micro-batch (the same batch size): the timed steps'
        # share is the typical batch's seconds (its first pays the warm-up) times their
        # micro-batches.
        typical = statistics.median(batches)
        share = typical * spec.measure.steps * trainer.args.gradient_accumulation_steps
        slower = outcome.timed_seconds / (outcome.timed_seconds + share)
        from autotune.records import Precompute

        outcome.precompute = Precompute(ref_seconds=sum(batches), charged_seconds=share)
        outcome.timed_seconds += share
        for name in ("samples_per_second", "tokens_per_second"):
            value = getattr(outcome, name)
            if value:
                setattr(outcome, name, value * slower)

    def usage(self, exported: str, with_lora: bool) -> str:
        return ("from trl import DPOConfig, DPOTrainer\nargs = DPOConfig(**"
                f"json.load(open(\"{exported}\")) | {{\"output_dir\": \"runs/my-run\"}})"
                "\n# DPOTrainer(model, args=args, train_dataset=pairs, processing_class=tok"
                + (", peft_config=lora)" if with_lora else ", ref_model=a copy)"))


DPO_TRAINER = DPO()


def _dpo_class():
    from trl import DPOTrainer

    class TimedDPOTrainer(DPOTrainer):
        """DPOTrainer that keeps the seconds of each batch of its precomputation of the
        reference's log-probs (a forward of the reference over every pair, before the
        first step, a micro-batch at a time): a cost per pair, as the reference's forward
        in every step is. The device is synchronised after each, as TRL's own copy of the
        result to the host does."""

        precompute_batches: list[float]

        def compute_ref_log_probs(self, model, inputs):
            import torch

            began = time.perf_counter()
            out = super().compute_ref_log_probs(model, inputs)
            if torch.cuda.is_available() and out[0].is_cuda:
                torch.cuda.synchronize()
            self.__dict__.setdefault("precompute_batches", []).append(
                time.perf_counter() - began)
            return out

    return TimedDPOTrainer


def _pair_lengths(rows, seq_len: int) -> dict[str, float]:
    """Both rows of every pair as the collator truncates them: prompt and reply, the
    loss on the reply."""
    from autotune.tasks.data import IGNORE, length_stats

    encoded = []
    for prompt, chosen, rejected in zip(rows["prompt_ids"], rows["chosen_ids"],
                                        rows["rejected_ids"], strict=True):
        for reply in (chosen, rejected):
            ids = (prompt + reply)[:seq_len]
            encoded.append((ids, ([IGNORE] * len(prompt) + reply)[:seq_len]))
    return length_stats(encoded, seq_len)
