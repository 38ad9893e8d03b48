"""autotune: find the fastest training configuration that fits, by running real trials."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from autotune.summary import autotune_version

__version__ = autotune_version()

if TYPE_CHECKING:
    from autotune.plan.estimate import EstimateResult
    from autotune.search.result import SearchResult


def search(spec_or_path: Any, *, address: str | None = None, **overrides: Any) -> SearchResult:
    """Run or resume a search. `spec_or_path`: a model.yaml path, a dict or a Spec;
    overrides use dotted keys, e.g. `autotune.search("m.yaml", **{"search.n_trials": 8})`
    or the short forms n_trials=, timeout=, output=, storage=."""
    from autotune.search.run import run_search

    return run_search(spec_or_path, address=address, **_expand(overrides))


def estimate(spec_or_path: Any, *, device: str | None = None,
             memory: str | None = None) -> EstimateResult:
    """Predicted peak memory per config, without running anything."""
    from autotune.plan.estimate import estimate as _estimate

    return _estimate(spec_or_path, device=device, memory=memory)


_SHORT = {"n_trials": "search.n_trials", "trials": "search.n_trials", "timeout": "search.timeout",
          "storage": "search.storage", "study_name": "search.study_name",
          "space": "search.space", "seed": "search.seed", "sampler": "search.sampler",
          "memory_budget": "hardware.memory_budget"}


def _expand(overrides: dict[str, Any]) -> dict[str, Any]:
    return {_SHORT.get(k, k): v for k, v in overrides.items()}


__all__ = ["__version__", "estimate", "search"]
