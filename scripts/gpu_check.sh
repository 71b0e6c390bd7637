#!/usr/bin/env bash
# The prepared GPU check (< 5 minutes on one GPU): equivalence on a SmolLM2-shaped random model and
# a t(n) / round-loop timing sweep with CUDA events. Works with the torch/transformers already on
# the GPU machine (no network): it only needs this repository on PYTHONPATH.
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (figures go to OUT_DIR/gpu_check.json)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-results/gpu}}"
mkdir -p "$out"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && PY=.venv/bin/python
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m harness.gpu_check --out "$out/gpu_check.json" "${@:2}"
