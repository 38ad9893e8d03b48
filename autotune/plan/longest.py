"""The longest sequence each config family is predicted to fit (`autotune estimate
--longest`, `data.seq_len: longest`).

At long context the activations and the logits, not the model states, decide what fits,
and each grows with the length (linearly, or quadratically where attention is eager), so
the predicted peak is monotonic in it: a bisection over multiples of STEP finds the
longest length at which a family's smallest batch fits the limit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from autotune.config import Family, TrialConfig
from autotune.device import DeviceSpec
from autotune.errors import SpecError
from autotune.plan.calibration import MemoryModel
from autotune.plan.shape import ModelShape

STEP = 256  # lengths are multiples of this (kernels' tiles; a sequence split's shares)
UNBOUNDED = 1 << 20  # where the model names no limit of its positions


@dataclass(frozen=True)
class Longest:
    family: Family
    config: TrialConfig  # the family's smallest batch, where its length is read
    seq_len: int  # 0: not even STEP tokens fit
    peak_bytes: int  # predicted at seq_len (at STEP where nothing fits)
    capped: bool = False  # seq_len is the model's position limit, not the memory's


def anchored(shape: ModelShape, device: DeviceSpec, world_size: int,
             configs: Sequence[TrialConfig]) -> Callable[[ModelShape, TrialConfig], int]:
    """The peak at any length: the formulas' (no trace, no allocator replay), scaled per
    config by the full model's ratio to them at `shape`'s own length. A GPU's traces and
    replays are made once, not at every length a bisection tries (an 8B's at 16 lengths
    ran past 10 minutes); on a CPU, which traces nothing, the ratio is 1."""
    full = MemoryModel(shape, device, world_size)
    bare = MemoryModel(shape, device, world_size)
    bare.traced = False
    ratio = {c: full.predict(c).total_bytes / max(1, bare.predict(c).total_bytes)
             for c in configs}
    models: dict[int, MemoryModel] = {}

    def predict(s: ModelShape, c: TrialConfig) -> int:
        model = models.get(s.seq_len)
        if model is None:
            model = models[s.seq_len] = MemoryModel(s, device, world_size)
            model.traced = False
        return int(model.predict(c).total_bytes * ratio[c])
    return predict


def longest_fitting(shape: ModelShape, device: DeviceSpec, world_size: int,
                    candidates: Sequence[TrialConfig], limit: int, *,
                    max_len: int | None = None,
                    predict: Callable[[ModelShape, TrialConfig], int] | None = None
                    ) -> list[Longest]:
    """Per family (at its smallest batch among `candidates`), the longest multiple of
    STEP up to `max_len` predicted to fit `limit` per rank, longest first; `predict`
    defaults to the formulas anchored at `shape`'s length (`anchored`)."""
    smallest: dict[Family, TrialConfig] = {}
    for c in sorted(candidates, key=lambda c: c.per_device_train_batch_size):
        smallest.setdefault(c.family, c)
    if predict is None:
        predict = anchored(shape, device, world_size, list(smallest.values()))
    top = (max_len or UNBOUNDED) // STEP
    shapes: dict[int, ModelShape] = {}

    def peak(n: int, c: TrialConfig) -> int:
        s = shapes.setdefault(n, dataclasses.replace(shape, seq_len=n * STEP))
        return predict(s, c)

    out = []
    for family, c in smallest.items():
        if peak(1, c) > limit:
            out.append(Longest(family, c, 0, peak(1, c)))
            continue
        lo, hi = 1, top  # peak(lo) fits; find the largest n <= hi that fits
        if peak(hi, c) <= limit:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if peak(mid, c) <= limit:
                lo = mid
            else:
                hi = mid
        out.append(Longest(family, c, lo * STEP, peak(lo, c), capped=lo == top
                           and max_len is not None))
    return sorted(out, key=lambda r: -r.seq_len)


def search_length(rows: Sequence[Longest]) -> int:
    """The length `data.seq_len: longest` searches at: the longest any family reaches
    (the others' trials are then predicted not to fit and pruned, or measured), a
    multiple of STEP."""
    best = max((r.seq_len for r in rows), default=0)
    if best == 0:
        raise SpecError(f"data.seq_len: longest: no config of the space is predicted to fit "
                        f"even {STEP} tokens a row in the memory limit")
    return best
