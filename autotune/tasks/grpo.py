"""TRL's GRPOTrainer (`trainer: grpo`): reinforcement learning of a causal LM from its own
completions. A step generates `grpo.num_generations` completions of each prompt, scores
them with the reward, and trains on them; the algorithm (`grpo:` in the spec) is the
user's and never searched. What is searched is what a step spends its time and memory
on: the batch split, precision, optimizer, checkpointing, ZeRO (gathering the weights for
generation under ZeRO-3), and the generation path (knobs.py: the KV cache, transformers'
continuous batching, vLLM colocated on a GPU).

A trial forces every completion to `grpo.max_completion_length` tokens (the worst case,
where users' OOMs come from: TRL #2688, #2927, #3128), keeps each step's generation
seconds apart from its training seconds, and counts a completion as a sample: its
objective is completions per second. Its GRPOConfig is exported as grpo_config.json.
TRL's own advice for GRPO is its recipe (docs/grpo.md).
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from autotune.errors import SetupError
from autotune.tasks.base import Task, TrainerKind
from autotune.tasks.sft import tokenizer_check, trl_check

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.records import Outcome
    from autotune.spec import GRPOSpec, Spec

# The rewards a spec may name without code of its own: for timing, any will do, since
# completions are forced to their full length whatever they score.
BUILT_IN_REWARDS = ("length",)


class GRPO(TrainerKind):
    name = "grpo"
    config_class = "GRPOConfig"
    export_file = "grpo_config.json"
    preload = ("trl.trainer.grpo_trainer",)
    generates = True
    traced = False  # a step generates, then trains through TRL's chunked head: formulas
    # Its loss is of completions each config's policy samples anew (near 0 on-policy with
    # beta 0): no drift check, only non-finite losses and gradients (the worker's).
    comparable_loss = False
    adds_adapters = True  # TRL adds LoRA's adapters (peft_config): its reference is the base
    adapters_note = ("given to GRPOTrainer: where grpo.beta > 0 its reference is the base "
                     "with the adapters off")
    space_section = "grpo"
    units = ("completions", "tokens", "a sample is a completion: its prompt's tokens and its "
             "generated ones, every completion forced to grpo.max_completion_length")
    refuses = {"padding_free": "GRPOTrainer pads its completions itself"}
    # GRPOConfig's own defaults: bf16 and gradient checkpointing on; auto_find_batch_size
    # refused (a smaller batch would break up a prompt's group of completions).
    defaults = {"precision": "bf16", "gradient_checkpointing": True}
    auto_find_batch_size = False
    defaults_name = "GRPOConfig's defaults"

    def check(self, spec: Spec) -> str | None:
        said = trl_check(spec, self, "GRPOTrainer")
        if said:
            return said
        grpo = algorithm(spec)
        n, target = grpo.num_generations, spec.target_batch_size
        if target % n:
            return (f"target_batch_size: {target} completions a step is no multiple of "
                    f"grpo.num_generations {n}: TRL's generation batch holds whole groups "
                    f"of a prompt's completions (e.g. {n * max(1, target // n)})")
        if spec.data.source == "synthetic":
            return ("trainer: grpo generates from prompts: give data.source, rows with "
                    "prompt (text or messages)")
        return tokenizer_check(spec, self, "GRPOTrainer") or reward_problem(grpo.reward)

    def shape_fields(self, spec: Spec) -> dict[str, Any]:
        grpo = algorithm(spec)
        return {"generated_len": grpo.max_completion_length, "reference": grpo.beta > 0}

    def fields(self, spec: Spec, config: TrialConfig) -> dict[str, Any]:
        """The algorithm as the spec gives it; completions forced to their full length
        (min_new_tokens); one generation of the whole step's completions (TRL's default);
        the generation path the config's knobs choose; under ZeRO-3 the weights gathered
        for generation (TRL's default, said)."""
        grpo = algorithm(spec)
        mode = config.vllm
        out: dict[str, Any] = {
            "num_generations": grpo.num_generations,
            "max_completion_length": grpo.max_completion_length, "beta": grpo.beta,
            "generation_kwargs": forced_length(config, grpo.max_completion_length),
            "cache_implementation": (None if config.generation_cache == "dynamic"
                                     else config.generation_cache),
            "use_transformers_continuous_batching": bool(config.continuous_batching),
            "use_vllm": mode != "none", "ds3_gather_for_generation": True}
        if config.continuous_batching:
            out["transformers_continuous_batching_config"] = paged_cache(spec, config)
        if mode != "none":
            _, share, *sleep = mode.split("-")
            out |= {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": float(share),
                    "vllm_enable_sleep_mode": bool(sleep)}
        return out

    def arguments(self, task: Task, kwargs: dict[str, Any]) -> Any:
        from trl import GRPOConfig

        return GRPOConfig(**kwargs)

    def make_trainer(self, spec: Spec, task: Task, model: Any, args: Any, samples: int,
                     timer: Any, seed: int, reference: Any = None,
                     collator: Any = None) -> tuple[Any, dict[str, float] | None]:
        """GRPOTrainer on the source's prompts (each cut at data.seq_len tokens) with the
        GRPOConfig the driver built; under LoRA the adapters are TRL's to add. Where
        grpo.beta > 0 without LoRA, TRL makes its reference from the policy's checkpoint
        id: the reference built here as the policy was (`reference`) stands in for it."""
        from autotune.tasks.data import load_tokenizer

        data = spec.data.model_dump()
        tok = load_tokenizer(data)
        peft = None
        if spec.model.lora is not None:
            from peft import LoraConfig

            from autotune.tasks.lora import lora_config_kwargs

            peft = LoraConfig(**lora_config_kwargs(spec.model.lora.model_dump(), task))
        rows, _ = prompt_rows(data, tok, samples)
        try:
            with _reference_as(reference):
                trainer = _grpo_class()(model=model, reward_funcs=[reward_function(
                    algorithm(spec).reward)], args=args, train_dataset=rows,
                    processing_class=tok, peft_config=peft, callbacks=[timer])
        except (ValueError, KeyError) as exc:  # TRL's word on the rows or the template
            raise SetupError("data", f"GRPOTrainer refused the data: "
                             f"{' '.join(str(exc).split())[:400]}") from exc
        # No rows' lengths: padding does not decide a step's work here (every completion
        # is forced to full length), so the objective stays completions per second.
        return trainer, None

    def reference_model(self, spec: Spec, config: TrialConfig,
                        build: Callable[[], Any]) -> Any:
        """A reference where grpo.beta > 0 without LoRA: a second copy built as the policy
        was (TRL would load the policy's checkpoint again, which an inline config or a
        trial's random weights do not have)."""
        if algorithm(spec).beta == 0 or spec.model.lora is not None:
            return None
        return build()

    def counter(self, task: Task,
                shape: dict[str, Any] | None) -> Callable[[dict], tuple] | None:
        """A micro-batch is completions: each its prompt's tokens and its own."""
        return lambda x: (x["completion_ids"].shape[0],
                          x["prompt_mask"].sum() + x["completion_mask"].sum())

    def finish(self, spec: Spec, task: Task, outcome: Outcome, trainer: Any) -> None:
        """Each timed step's generation seconds beside its training seconds (a step is
        both), and the completions' real length: what the forcing promised."""
        task.finish(outcome)
        per_step = getattr(trainer, "generation_by_step", None)
        if not per_step or not outcome.step_seconds:
            return
        warmup = spec.measure.warmup_steps
        timed = [per_step.get(i, 0.0) for i in range(warmup, len(outcome.step_seconds))]
        steps = outcome.step_seconds[warmup:]
        from autotune.records import Generation

        lengths = getattr(trainer, "completion_lengths", None)
        outcome.generation = Generation(
            seconds=timed, training_seconds=[max(0.0, s - g) for s, g in
                                             zip(steps, timed, strict=False)],
            share=sum(timed) / sum(steps) if sum(steps) else None,
            completion_length=min(lengths) if lengths else None)

    def usage(self, exported: str, with_lora: bool) -> str:
        return ("from trl import GRPOConfig, GRPOTrainer\nargs = GRPOConfig(**"
                f"json.load(open(\"{exported}\")) | {{\"output_dir\": \"runs/my-run\"}})"
                "\n# GRPOTrainer(model, reward_funcs=..., args=args, train_dataset=prompts, "
                "processing_class=tok" + (", peft_config=lora)" if with_lora else ")")
                + "\n# generation_kwargs forces full-length completions, as the trials "
                "timed them: drop it for your run")


GRPO_TRAINER = GRPO()


def forced_length(config: TrialConfig, length: int) -> dict[str, Any]:
    """What makes every completion `length` tokens on the config's generation path:
    model.generate takes min_new_tokens; transformers' continuous batching does not, so
    it is given no end-of-sequence token to stop at; vLLM takes min_tokens."""
    if config.vllm != "none":
        return {"min_tokens": length}
    if config.continuous_batching:
        return {"eos_token_id": None}
    return {"min_new_tokens": length}


# transformers' continuous batching pages its KV cache in blocks of this many tokens.
CACHE_PAGE = 256


def paged_cache(spec: Spec, config: TrialConfig) -> dict[str, Any]:
    """Continuous batching's cache sized to the step's generation batch (a rank's b x
    accumulation rows, each a prompt and its completion long, a block more each for the
    part-filled one), not to a share of the device's memory, its default: what the step
    needs is what the trial measures and the memory model counts."""
    rows = config.per_device_train_batch_size * config.gradient_accumulation_steps
    tokens = spec.data.seq_len + algorithm(spec).max_completion_length
    return {"page_size": CACHE_PAGE, "num_blocks": -(-rows * tokens // CACHE_PAGE) + rows}


def algorithm(spec: Spec) -> GRPOSpec:
    """The spec's GRPO section (its defaults where it has none)."""
    return spec.grpo_algorithm()


def reward_problem(reward: str) -> str | None:
    """Why `reward` names no reward function (one line naming the field), or None."""
    try:
        reward_function(reward)
    except SetupError as exc:
        return str(exc)
    return None


def reward_function(reward: str) -> Callable:
    """A built-in reward by name, or 'package.module:function' imported."""
    if reward == "length":
        return length_reward
    module, _, name = reward.partition(":")
    if not module or not name:
        raise SetupError("grpo.reward", f"{reward!r} is no built-in reward "
                         f"({', '.join(BUILT_IN_REWARDS)}) and no 'package.module:function'")
    try:
        found = getattr(importlib.import_module(module), name)
    except Exception as exc:  # noqa: BLE001 - whatever the import raised, named
        raise SetupError("grpo.reward", f"{reward!r} does not import: {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0][:200] if str(exc) else ''}") from exc
    if not callable(found):
        raise SetupError("grpo.reward", f"{reward!r} is not a function")
    return found


def length_reward(completions: list, **kwargs: Any) -> list[float]:
    """A completion's characters: a reward that costs nothing to compute."""
    return [float(len(c if isinstance(c, str) else str(c))) for c in completions]


def prompt_rows(data: dict[str, Any], tok: Any, n_samples: int) -> tuple[Any, dict[str, float]]:
    """The source's prompts as GRPOTrainer takes them, each cut at data.seq_len tokens
    (a chat prompt rendered by the template first), `n_samples` of them; and their
    lengths. Prompts cut are said once (a log line)."""
    import logging

    import datasets

    from autotune.tasks.data import IGNORE, length_stats, read_rows

    rows = read_rows(data["source"], n_samples)
    if "prompt" not in rows.column_names:
        raise SetupError("data.source", f"trainer: grpo generates from prompts: "
                         f"{data['source']!r} has {', '.join(rows.column_names)} (no prompt)")
    seq, prompts, encoded, cut = int(data["seq_len"]), [], [], 0
    for i, row in enumerate(rows):
        prompt = row["prompt"]
        if isinstance(prompt, list):  # chat messages: the template's text
            if not getattr(tok, "chat_template", None):
                raise SetupError("data.tokenizer", f"{data['tokenizer']!r} has no chat "
                                 "template, which prompts of messages are rendered with")
            prompt = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        if not isinstance(prompt, str):
            raise SetupError("data.source", f"row {i}: prompt is neither text nor messages")
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) > seq:
            cut += 1
            prompt = tok.decode(ids[:seq])
            ids = ids[:seq]
        prompts.append({"prompt": prompt})
        encoded.append((ids, [IGNORE] * len(ids)))
    if cut:
        logging.getLogger("autotune").warning(
            "%d of %d prompts are longer than data.seq_len %d tokens: cut there", cut,
            len(prompts), seq)
    many = (prompts * (n_samples // len(prompts) + 1))[:n_samples]
    return datasets.Dataset.from_list(many), length_stats(encoded, seq)


@contextlib.contextmanager
def _reference_as(reference: Any) -> Iterator[None]:
    """TRL builds its reference with `create_model_from_path(the policy's id)`, which a
    model built from an inline config or a trial's random weights cannot answer: while
    the trainer is made, that call returns `reference` (built as the policy was)."""
    if reference is None:
        yield
        return
    import trl.trainer.grpo_trainer as grpo

    made = grpo.create_model_from_path
    grpo.create_model_from_path = lambda *args, **kwargs: reference
    try:
        yield
    finally:
        grpo.create_model_from_path = made


def _grpo_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that keeps each optimizer step's generation seconds (its completions
        generated and scored, the device synchronised after, as TRL's own read of the
        rewards does) and the completions' lengths."""

        generation_by_step: dict[int, float]
        completion_lengths: list[int]

        def _generate_and_score_completions(self, inputs):
            import torch

            began = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            if torch.cuda.is_available() and out["completion_ids"].is_cuda:
                torch.cuda.synchronize()
            step = self.state.global_step
            spent = self.__dict__.setdefault("generation_by_step", {})
            spent[step] = spent.get(step, 0.0) + time.perf_counter() - began
            self.__dict__.setdefault("completion_lengths", []).extend(
                out["completion_mask"].sum(dim=1).tolist())
            return out

    return TimedGRPOTrainer
