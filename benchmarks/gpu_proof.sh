#!/usr/bin/env bash
# Everything the project claims about GPUs, in one device call: see gpu_proof.py.
#   benchmarks/gpu_proof.sh OUTDIR               on a GPU machine (at most 9 minutes)
#   benchmarks/gpu_proof.sh --rehearse OUTDIR    the same steps on CPU, tiny shapes
# On a machine that reaches no package registry, carry missing wheels in .whl/ (the
# device tool's README says how); they are installed to a private target first.
set -uo pipefail
export GPU_PROOF_T0=${GPU_PROOF_T0:-$(date +%s)}  # the steps' boxes end within the call
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
args=()
for a in "$@"; do
  if [ "$a" = "--rehearse" ]; then args=(--rehearse "${args[@]}"); else args+=("$a"); fi
done
[ ${#args[@]} -ge 1 ] || { echo "usage: $0 [--rehearse] OUTDIR" >&2; exit 2; }
PYTHONPATH=".:${PYTHONPATH:-}" exec "$PY" benchmarks/gpu_proof.py "${args[@]}"
