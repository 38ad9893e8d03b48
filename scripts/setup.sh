#!/usr/bin/env bash
# Create .venv with autotune and its dependencies (CPU torch unless one is installed).
# Usage: scripts/setup.sh          # to run searches
#        scripts/setup.sh --test   # also test tools and the headless browser for report tests
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==${AUTOTUNE_TORCH_VERSION:-2.13.0}"
if [ "${1:-}" = "--test" ]; then
  .venv/bin/python -m pip install -q -e '.[test]'
  bash scripts/setup_test_browser.sh
else
  .venv/bin/python -m pip install -q -e .
fi
# DeepSpeed's JIT ops (CPU Adam for offload, shared-memory collectives on CPU), built once
# here rather than inside the first trial that needs one (a few minutes on 2 cores).
.venv/bin/python -m autotune.trials.ops
