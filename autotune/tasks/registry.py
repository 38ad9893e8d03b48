"""The registry itself: tasks and trainers by name, and the lookups. A leaf, importing no
task module: `autotune/tasks/__init__.py` imports each and fills it, so whatever reaches
a task's module has it filled, and a module that looks a task up by name (the data, LoRA,
the model's class, the knob table) imports this, not the package above it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from autotune.errors import SpecError, not_allowed

if TYPE_CHECKING:
    from autotune.spec import Spec
    from autotune.tasks.base import Task, TrainerKind

TASKS: dict[str, Task] = {}
TRAINERS: dict[str, TrainerKind] = {}
DEFAULT_TASK = "causal-lm"  # a model section without `task`, a shape without one
DEFAULT_TRAINER = "trainer"


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
