#!/usr/bin/env bash
# Sequoia tree vs fixed shapes: at temperature 0.7 on SmolLM2 with its default draft, the Sequoia tree chosen
# from calibrated acceptance and the measured profile vs a fixed chain and a fixed wide tree with
# the same number of candidate rows; each run records predicted (Sequoia) and measured time per
# committed token. Writes results/show_sequoia/<arm>/record.json, then a report.
set -euo pipefail
cd "$(dirname "$0")/.."
H=.venv/bin/harness
OUT=${OUT:-results/show_sequoia}
COMMON=(model=smollm2 proposer=draft_model proposer.sampling=without_replacement verifier=sequoia
        generation.temperature=0.7 workload=humaneval workload.limit=${LIMIT:-4}
        generation.max_new_tokens=${NEW:-48} threads=2)
$H run "${COMMON[@]}" topology=sequoia output_dir=$OUT/sequoia
ROWS=$(.venv/bin/python -c "import json; print(json.load(open('$OUT/sequoia/record.json'))['metrics']['sequoia_tree_candidate_rows'])")
$H run "${COMMON[@]}" topology=sequence topology.max_nodes=$ROWS topology.max_depth=$ROWS output_dir=$OUT/chain
$H run "${COMMON[@]}" topology=set topology.max_nodes=$ROWS output_dir=$OUT/wide
$H report $OUT out=$OUT/report
