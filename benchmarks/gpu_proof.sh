#!/usr/bin/env bash
# Everything the project claims about GPUs, in two device calls: see gpu_proof.py.
#   benchmarks/gpu_proof.sh --smoke OUTDIR       first: one trial per CUDA path (4 minutes)
#   benchmarks/gpu_proof.sh OUTDIR               then: the searches (at most 8 minutes)
#   benchmarks/gpu_proof.sh --rehearse [--smoke] OUTDIR   the same steps on CPU, tiny shapes
# On a machine that reaches no package registry, carry missing wheels in .whl/
# (scripts/gpu_wheels.py); they are named here, then installed to a private target.
set -uo pipefail
export GPU_PROOF_T0=${GPU_PROOF_T0:-$(date +%s)}  # the steps' boxes end within the call
cd "$(dirname "$0")/.."
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "carried wheels: $(cd .whl && ls *.whl | sed 's/-py.*//; s/-cp.*//' | tr '\n' ' ')"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
else
  echo "carried wheels: none"
fi
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
args=()
for a in "$@"; do
  if [ "$a" = "--rehearse" ]; then args=(--rehearse "${args[@]}"); else args+=("$a"); fi
done
[ ${#args[@]} -ge 1 ] || { echo "usage: $0 [--rehearse] [--smoke] OUTDIR" >&2; exit 2; }
PYTHONPATH=".:${PYTHONPATH:-}" exec "$PY" benchmarks/gpu_proof.py "${args[@]}"
