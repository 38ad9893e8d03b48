"""autotune: find the fastest training configuration that fits, by running real trials."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from autotune.summary import autotune_version

# bitsandbytes (imported through transformers and PEFT) warns on every import, on a CPU
# with AVX512-BF16, that a 4-bit inference kernel is missing: autotune uses its 8-bit
# optimizers only, so that line would be noise in every command and API call.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

__version__ = autotune_version()

if TYPE_CHECKING:
    from autotune.plan.estimate import EstimateResult
    from autotune.tuning.result import SearchResult


def search(spec_or_path: Any, *, address: str | None = None, progress: bool = True,
           fresh: bool = False, **overrides: Any) -> SearchResult:
    """Run or resume a search. `spec_or_path`: a model.yaml path, a dict or a Spec;
    overrides use dotted keys, e.g. `autotune.search("m.yaml", **{"search.n_trials": 8})`
    or the short forms n_trials=, timeout=, output=, storage=, store=. With `progress`, a
    line per finished trial goes to stderr, and a search that ends without a winner warns
    why (`result.best` is then None). A setup the results store remembers comes back as
    a SearchResult like any other, after its winner and baseline ran once more
    (`result.summary.remembered` says from when); `fresh` searches anyway."""
    import sys
    import warnings

    from autotune.tuning.run import run_search

    def said(record: Any) -> None:
        o = record.outcome
        if o.ran:
            figure = f" {o.samples_per_second:.1f} samples/s" if o.ok else ""
            print(f"autotune: trial {record.number} {record.config.label()} "
                  f"({record.reason}): {o.status}{figure}", file=sys.stderr, flush=True)

    result = run_search(spec_or_path, address=address, on_record=said if progress else None,
                        fresh=fresh, **_expand(overrides))
    if progress and result.best is None:
        why = result.summary.no_winner_why or "no trial succeeded"
        warnings.warn(f"autotune: no winner: {why} (see {result.output / 'summary.json'})",
                      stacklevel=2)
    return result


def estimate(spec_or_path: Any, *, device: str | None = None,
             memory: str | None = None) -> EstimateResult:
    """Predicted peak memory per config, without running anything."""
    from autotune.plan.estimate import estimate as _estimate

    return _estimate(spec_or_path, device=device, memory=memory)


_SHORT = {"n_trials": "search.n_trials", "trials": "search.n_trials", "timeout": "search.timeout",
          "storage": "search.storage", "study_name": "search.study_name",
          "store": "search.store",
          "space": "search.space", "seed": "search.seed", "sampler": "search.sampler",
          "memory_budget": "hardware.memory_budget"}


def _expand(overrides: dict[str, Any]) -> dict[str, Any]:
    return {_SHORT.get(k, k): v for k, v in overrides.items()}


__all__ = ["__version__", "estimate", "search"]
