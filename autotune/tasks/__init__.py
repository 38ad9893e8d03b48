"""The tasks a model learns and the trainers that train it: one module each, registered
here by name (as torchtitan registers a TrainSpec).

A spec names one of each (`model.task`, `trainer`); the rest of the package asks the
objects (`task_of(spec)`, `trainer_of(spec)`, or by name) and never compares their names.
What a task or a trainer is: tasks/base.py. Adding one is a module with its subclass,
listed below (docs/architecture.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.errors import SpecError, not_allowed
from autotune.tasks.base import Task, TrainerKind
from autotune.tasks.causal_lm import CAUSAL_LM
from autotune.tasks.classification import SEQUENCE_CLASSIFICATION
from autotune.tasks.dpo import DPO_TRAINER
from autotune.tasks.grpo import GRPO_TRAINER
from autotune.tasks.images import IMAGE_CLASSIFICATION
from autotune.tasks.masked_lm import MASKED_LM
from autotune.tasks.seq2seq import SEQ2SEQ_LM
from autotune.tasks.sft import SFT_TRAINER
from autotune.tasks.trainer import PLAIN

if TYPE_CHECKING:
    from autotune.spec import Spec

TASKS: dict[str, Task] = {t.name: t for t in (CAUSAL_LM, MASKED_LM, SEQUENCE_CLASSIFICATION,
                                              SEQ2SEQ_LM, IMAGE_CLASSIFICATION)}
TRAINERS: dict[str, TrainerKind] = {t.name: t for t in (PLAIN, SFT_TRAINER, DPO_TRAINER,
                                                        GRPO_TRAINER)}
DEFAULT_TASK = CAUSAL_LM.name  # a model section without `task`, a shape without one
DEFAULT_TRAINER = PLAIN.name

__all__ = ["DEFAULT_TASK", "DEFAULT_TRAINER", "TASKS", "TRAINERS", "Task", "TrainerKind",
           "objective_of", "task", "task_of", "trainer", "trainer_of"]


def task(name: str | None) -> Task:
    """The task by name (the default where none is given)."""
    found = TASKS.get(name or DEFAULT_TASK)
    if found is None:
        raise SpecError("model.task: " + not_allowed(name, sorted(TASKS)))
    return found


def trainer(name: str | None) -> TrainerKind:
    """The trainer by name (the default where none is given)."""
    found = TRAINERS.get(name or DEFAULT_TRAINER)
    if found is None:
        raise SpecError("trainer: " + not_allowed(name, sorted(TRAINERS)))
    return found


def task_of(spec: Spec) -> Task:
    return task(spec.model.task)


def trainer_of(spec: Spec) -> TrainerKind:
    return trainer(spec.trainer)


def objective_of(spec: Spec) -> str:
    """What a search of the spec maximises (Record.objective), its task's and trainer's
    word: samples/s, or real tokens/s on real data."""
    return trainer_of(spec).objective(spec, task_of(spec))


def task_for_model_type(model_type: str) -> Task:
    """The head a model type is usually tuned with (`autotune init`'s shapes)."""
    return next((t for t in TASKS.values() if model_type in t.model_types), task(None))
