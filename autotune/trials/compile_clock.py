"""torch.compile's seconds in a trial, kept apart from its time limit.

The search's first compiled trial compiles with a cold Inductor cache; later ones reuse
the cache (a one-layer GPT-2's first step here: 30 s cold, 4.6 s warm). A time limit that
counted compilation would cut a config off for coming first. So a compiled trial's rank
keeps the seconds dynamo's compile callbacks report (each frame's compile, a lazy
backward's, a CUDA graph's recording) in a file beside its result, and the launcher
does not count them against the limit, up to the request's compile allowance. The trial
records its compile seconds and whether Inductor's caches were cold or warm.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from autotune.files import write_atomically


class CompileClock:
    """The seconds torch.compile has spent in this process, written to `path` as they
    change: `seconds` done, and `since`, the wall time an unfinished compile began (so a
    long one still counts while it runs). Only the outermost of nested compiles counts
    (dynamo's handler calls its callbacks once for them)."""

    def __init__(self, path: str) -> None:
        self.path, self.seconds, self.since = path, 0.0, None
        self._lock = threading.Lock()

    def start(self) -> CompileClock:
        from torch._dynamo.callback import callback_handler

        callback_handler.register_start_callback(self._began)
        callback_handler.register_end_callback(self._ended)
        self._say()
        return self

    def stop(self) -> None:
        from torch._dynamo.callback import callback_handler

        with contextlib.suppress(ValueError):
            callback_handler.remove_start_callback(self._began)
            callback_handler.remove_end_callback(self._ended)

    def _began(self, args: Any = None) -> None:
        with self._lock:
            self.since = time.time()
            self._say()

    def _ended(self, args: Any = None) -> None:
        with self._lock:
            if self.since is not None:
                self.seconds += time.time() - self.since
            self.since = None
            self._say()

    def _say(self) -> None:
        with contextlib.suppress(OSError):
            write_atomically(self.path, json.dumps({"seconds": self.seconds,
                                                    "since": self.since}))


def spent(paths: list[Path], now: float | None = None) -> float:
    """The most seconds any rank has spent compiling, by the clocks at `paths` (an
    unfinished compile counted to `now`); 0 where none was written."""
    now = time.time() if now is None else now
    most = 0.0
    for path in paths:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            clock = json.loads(path.read_text())
            since = clock["since"]
            most = max(most, float(clock["seconds"]) + (max(0.0, now - since) if since else 0.0))
    return most


def deadline(begun: float, timeout_s: float, allowance_s: float, compiled_s: float) -> float:
    """When a trial begun at `begun` is past its limit: `timeout_s` of its own time, its
    compilation not counted up to `allowance_s`. The same for a cold cache as a warm one,
    unless the compile alone runs past the allowance."""
    return begun + timeout_s + min(max(0.0, compiled_s), allowance_s)


def cache_state() -> dict[str, Any]:
    """Whether this process's compiles found their graphs in Inductor's caches (the
    FX-graph cache and AOTAutograd's, on disk under TORCHINDUCTOR_CACHE_DIR): `cold`
    (every lookup missed), `warm` (every one hit), `partial`, or `none` (no lookup: a
    backend without them, or caching off)."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    if dynamo is None:
        return {"cache": "none", "cache_hits": 0, "cache_misses": 0}
    counters = dynamo.counters
    hits = (counters["inductor"]["fxgraph_cache_hit"]
            + counters["aot_autograd"]["autograd_cache_hit"])
    misses = (counters["inductor"]["fxgraph_cache_miss"]
              + counters["aot_autograd"]["autograd_cache_miss"])
    state = ("none" if not hits and not misses else "cold" if not hits
             else "warm" if not misses else "partial")
    return {"cache": state, "cache_hits": int(hits), "cache_misses": int(misses)}
