"""What `autotune.search()` hands back: the summary, with the winner ready for a Trainer."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autotune.errors import NoResultError

if TYPE_CHECKING:
    from autotune.config import TrialConfig
    from autotune.device import DeviceSpec
    from autotune.records import Record
    from autotune.spec import Spec
    from autotune.summary import Summary


@dataclass
class SearchResult:
    spec: Spec
    device: DeviceSpec
    summary: Summary
    output: Path

    @property
    def trials(self) -> list[Record]:
        return self.summary.trials

    @property
    def best(self) -> Record | None:
        return self.summary.best

    @property
    def baseline(self) -> Record | None:
        return self.summary.baseline

    @property
    def recipe(self) -> Record | None:
        """The guide's recipe, the reference a careful user would have written by hand."""
        return self.summary.recipe

    @property
    def speedup(self) -> float | None:
        """The winner over Trainer's defaults (None where they do not fit)."""
        return self.summary.speedup

    @property
    def vs_recipe(self) -> float | None:
        """The winner over the guide's recipe."""
        return self.summary.vs_recipe

    def _winner(self) -> TrialConfig:
        if self.best is None:
            why = self.summary.no_winner_why or "no trial succeeded"
            raise NoResultError(f"{why}, so there is no configuration to export; see the "
                                "trials in summary.json")
        return self.best.config

    def training_arguments(self, output_dir: str, **overrides: Any):
        """The winner as a real `transformers.TrainingArguments`."""
        from transformers import TrainingArguments

        from autotune.trials.trainargs import training_arguments_kwargs

        kwargs = training_arguments_kwargs(
            self._winner(), seed=self.spec.search.seed, world_size=self.spec.world_size,
            on_cpu=not self.device.is_cuda, output_dir=output_dir)
        return TrainingArguments(**(kwargs | overrides))

    def deepspeed_config(self) -> dict[str, Any] | None:
        """The winner's DeepSpeed config, or None when it uses no ZeRO."""
        from autotune.trials.trainargs import deepspeed_config

        return deepspeed_config(self._winner(), world_size=self.spec.world_size)
