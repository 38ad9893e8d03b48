"""Build DeepSpeed's JIT ops once, at set-up, into this environment's extensions folder.

Otherwise the first trial that needs one (ZeRO-Offload's CPU Adam; DeepSpeed's shared-
memory collectives on a CPU) compiles it inside its own time limit: a minute or more of
a trial's wall time that measures the compiler, not the config.

    python -m autotune.trials.ops
"""

from __future__ import annotations

import os
import time


def build() -> list[str]:
    """Load (building where not yet built) the ops a CPU or offload trial uses; return what
    could not be built, each with its reason (a missing compiler, say): trials then build or
    fail on their own, as before."""
    from autotune.trials.build_lock import install as guard_build_locks
    from autotune.trials.launch import extensions_dir

    os.environ["TORCH_EXTENSIONS_DIR"] = extensions_dir()
    try:
        guard_build_locks()
        import deepspeed.ops.op_builder as builders
    except Exception as exc:  # noqa: BLE001 - reported, never fatal to set-up
        return [f"deepspeed: {type(exc).__name__}: {exc}"[:300]]
    failed = []
    for name in ("CPUAdamBuilder", "ShareMemCommBuilder"):
        builder = getattr(builders, name, None)  # an accelerator's build may lack one
        if builder is None:
            failed.append(f"{name}: not in this DeepSpeed build")
            continue
        try:
            builder().load(verbose=False)
        except Exception as exc:  # noqa: BLE001 - reported, never fatal to set-up
            failed.append(f"{name}: {type(exc).__name__}: {exc}"[:300])
    return failed


def main() -> None:
    started = time.time()
    failed = build()
    for line in failed:
        print(f"not built (trials will build it when needed): {line}")
    print(f"DeepSpeed ops ready in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
