"""The tasks a model learns and the trainers that train it: one module each, registered
here by name (as torchtitan registers a TrainSpec).

A spec names one of each (`model.task`, `trainer`); the rest of the package asks the
objects (`task_of(spec)`, `trainer_of(spec)`, or by name) and never compares their names.
The lookups live in tasks/registry.py, a leaf this module fills, so that a module below
the tasks (the data, the knob table) can look one up without importing them all.
What a task or a trainer is: tasks/base.py. Adding one is a module with its subclass,
listed below (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.tasks.base import Task, TrainerKind
from autotune.tasks.causal_lm import CAUSAL_LM
from autotune.tasks.classification import SEQUENCE_CLASSIFICATION
from autotune.tasks.dpo import DPO_TRAINER
from autotune.tasks.grpo import GRPO_TRAINER
from autotune.tasks.images import IMAGE_CLASSIFICATION
from autotune.tasks.masked_lm import MASKED_LM
from autotune.tasks.plain import PLAIN
from autotune.tasks.registry import (
    DEFAULT_TASK,
    DEFAULT_TRAINER,
    TASKS,
    TRAINERS,
    task,
    task_of,
    trainer,
    trainer_of,
)
from autotune.tasks.seq2seq import SEQ2SEQ_LM
from autotune.tasks.sft import SFT_TRAINER

if TYPE_CHECKING:
    from autotune.spec import Spec

TASKS.update({t.name: t for t in (CAUSAL_LM, MASKED_LM, SEQUENCE_CLASSIFICATION, SEQ2SEQ_LM,
                                  IMAGE_CLASSIFICATION)})
TRAINERS.update({t.name: t for t in (PLAIN, SFT_TRAINER, DPO_TRAINER, GRPO_TRAINER)})
assert CAUSAL_LM.name == DEFAULT_TASK and PLAIN.name == DEFAULT_TRAINER

__all__ = ["DEFAULT_TASK", "DEFAULT_TRAINER", "TASKS", "TRAINERS", "Task", "TrainerKind",
           "objective_of", "task", "task_of", "trainer", "trainer_of"]


def objective_of(spec: Spec) -> str:
    """What a search of the spec maximises (Record.objective), its task's and trainer's
    word: samples/s, or real tokens/s on real data."""
    return trainer_of(spec).objective(spec, task_of(spec))


def task_for_model_type(model_type: str) -> Task:
    """The head a model type is usually tuned with (`autotune init`'s shapes)."""
    return next((t for t in TASKS.values() if model_type in t.model_types), task(None))
