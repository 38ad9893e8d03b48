"""A CPU trial's heap held to glibc's starting mmap threshold (trials/host_malloc.py): what
a step frees leaves the process's RSS, where glibc's own adjustment keeps it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from autotune.trials.host_malloc import THRESHOLD

GLIBC = platform.libc_ver()[0] == "glibc"  # asked without touching this process's heap

# A step's pattern in miniature: a block over the threshold freed (glibc raises the
# threshold to its size), then blocks of a layer's size written and freed among
# quarter-MiB ones that live on (the heap cannot give their pages back from under those).
# The RSS grown, after.
STEP = textwrap.dedent("""
    import ctypes, ctypes.util, json, os, sys
    from autotune.trials.host_malloc import hold_mmap_threshold
    held = hold_mmap_threshold() if sys.argv[1] == "held" else None
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    MiB = 1 << 20
    big = libc.malloc(8 * MiB); ctypes.memset(big, 1, 8 * MiB); libc.free(big)
    before = rss()
    blocks, kept = [], []
    for _ in range(64):
        b = libc.malloc(4 * MiB); ctypes.memset(b, 1, 4 * MiB); blocks.append(b)
        kept.append(libc.malloc(256 * 1024))
    for b in blocks:
        libc.free(b)
    print(json.dumps({"held": held, "kept_mib": (rss() - before) / MiB}))
""")


def _step(mode: str) -> dict:
    env = {k: v for k, v in os.environ.items()  # glibc's own defaults, whatever ours are
           if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", STEP, mode], capture_output=True, text=True,
                         check=True, env=env)
    return json.loads(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="not glibc: no mmap threshold")
def test_what_a_step_frees_leaves_the_rss_only_with_the_threshold_held():
    default, held = _step("default"), _step("held")
    assert default["held"] is None and held["held"] == THRESHOLD
    assert default["kept_mib"] > 200  # glibc kept the 256 MiB freed in its heap
    assert held["kept_mib"] < 16  # each block was its own mapping, unmapped when freed
