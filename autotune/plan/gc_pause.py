"""Python's cyclic collector held off through the plan's allocation-heavy work.

A trace (thousands of fake tensors and autograd nodes) and an allocator replay (a block
object per split, a tuple per event: a million for a 70B model) create objects fast
enough to set off collection after collection, each of which walks every object alive:
torch's, transformers', the traced model's. That was 15% of a 70B plan's time. Held off
for the duration, the cycles they leave (linked blocks, autograd graphs) are collected
at the next collection after.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic collection inside; nested uses leave the switch to the outermost."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
