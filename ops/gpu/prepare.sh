#!/usr/bin/env bash
# Run on the CPU machine before the one device call of ops/gpu/check.sh: downloads the Python 3.12
# wheels the GPU image lacks into .whl/, copies SmolLM2's config and tokenizer into .gpu/smollm2
# (both git-ignored), and prints what the call will carry (64 MiB at most). See ops/gpu/prepare.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
exec "${PYTHON:-.venv/bin/python}" ops/gpu/prepare.py "$@"
