"""transformers' Trainer (`trainer: trainer`, the default): Seq2SeqTrainer for an
encoder-decoder, as its task says; the rows are the task's."""

from __future__ import annotations

from autotune.tasks.base import TrainerKind


class PlainTrainer(TrainerKind):
    name = "trainer"
    long_context_levers = True  # TRL's trainers override the step: not tried under them


PLAIN = PlainTrainer()
