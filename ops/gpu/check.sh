#!/usr/bin/env bash
# The GPU check in ONE device call (9 minutes on one H200), from a checkout prepared by
# ops/gpu/prepare.sh on the CPU machine (it fills the git-ignored .whl/ and .gpu/, which the call
# carries: carry [".whl", ".gpu"]):
#   ops/gpu/check.sh           # on the GPU machine: wheels installed, then ops/gpu/check.py
#   ops/gpu/check.sh --dry     # anywhere: the same stages on the CPU at tiny shapes (CI runs it)
# Prints what is missing first, runs every stage in a process of its own under a time limit, writes
# $OUT/check.json and $OUT/check.log, and ends with the table of targets (exit 1 on any FAIL).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-${TMPDIR:-/tmp}/tokenmill-gpu-check}
PYTHON=${PYTHON:-python3}
mkdir -p "$OUT"
DRY=0
for arg in "$@"; do [ "$arg" = --dry ] && DRY=1; done
# NOTE: the wheels are the GPU image's (Python 3.12); a dry run uses the Python it is given as it is.
if [ "$DRY" = 0 ] && compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/tokenmill-site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || echo "installing .whl/ failed: the check reports what is missing"
  export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
command -v nvidia-smi >/dev/null && nvidia-smi -L
exec "$PYTHON" ops/gpu/check.py --out "$OUT" "$@"
