#!/usr/bin/env bash
# Checkpoints users bring, on SmolLM2 (docs/measurements.md, "Checkpoints, published heads and
# choice trees"):
#   1. draft = target: SmolLM2 drafting for itself through its HF-format copy given by path;
#      acceptance per depth at T = 0 (greedy) and T = 0.7 (rejection, SpecInfer); expected >= 0.99.
#   2. published layouts: SmolLM2-sized Medusa and Hydra heads with random weights, loaded key for
#      key and run (mechanics; acceptance near zero by construction).
#   3. one head bank, two trees: the CPU-budget Medusa heads (4 heads, trained here first) on a
#      sparse 63-node choice tree (of the kind Medusa publishes, built here) vs a Cartesian tree.
# Writes results/show_checkpoints/<arm>/record.json, then a table of acceptance by depth.
set -euo pipefail
cd "$(dirname "$0")/.."
H=.venv/bin/harness
PY=.venv/bin/python
OUT=${OUT:-results/show_checkpoints}
CK=$OUT/checkpoints
COMMON=(workload=humaneval workload.limit=${LIMIT:-4} generation.max_new_tokens=${NEW:-48} threads=2)
[ -f "$CK/tree63.json" ] || $PY scripts/published_heads_checkpoints.py "$CK"

DRAFT=(model=smollm2 proposer=draft_model proposer.model.name=hf proposer.model.name_or_path=$CK/smollm2-hf
       topology.max_depth=4)
$H run "${COMMON[@]}" "${DRAFT[@]}" topology=sequence topology.max_nodes=4 verifier=greedy \
   output_dir=$OUT/draft_eq_target_T0
$H run "${COMMON[@]}" "${DRAFT[@]}" topology=sequence topology.max_nodes=4 verifier=rejection \
   generation.temperature=0.7 output_dir=$OUT/draft_eq_target_T07_rejection
$H run "${COMMON[@]}" "${DRAFT[@]}" topology=expansion 'topology.widths=[2,1,1,1]' topology.max_nodes=8 \
   verifier=specinfer generation.temperature=0.7 output_dir=$OUT/draft_eq_target_T07_specinfer

$H run "${COMMON[@]}" model=smollm2 proposer=medusa proposer.artifact=$CK/medusa-random \
   topology=choices topology.choices_file=$CK/tree63.json output_dir=$OUT/medusa_random_choices
$H run "${COMMON[@]}" model=smollm2 proposer=hydra proposer.artifact=$CK/hydra-random \
   topology=cartesian 'topology.widths=[3,2,2]' output_dir=$OUT/hydra_random_cartesian

$H train model=smollm2 proposer=medusa proposer.num_heads=4
$H run "${COMMON[@]}" model=smollm2 proposer=medusa proposer.num_heads=4 \
   topology=choices topology.choices_file=$CK/tree63.json output_dir=$OUT/medusa4_choices_tree63
$H run "${COMMON[@]}" model=smollm2 proposer=medusa proposer.num_heads=4 \
   topology=cartesian 'topology.widths=[3,2,2]' output_dir=$OUT/medusa4_cartesian_3x2x2

$PY - "$OUT" <<'PYEOF'
import json, sys
from pathlib import Path
for rec in sorted(Path(sys.argv[1]).glob("*/record.json")):
    r = json.loads(rec.read_text()); m = r["metrics"]
    acc = ", ".join("-" if a is None else f"{a:.3f}" for a in m["acceptance_by_depth"])
    print(f"{rec.parent.name:40s} acceptance by depth [{acc}]  committed/round {m['mean_committed_per_round']:.2f}"
          f"  rows/round {m['mean_candidate_rows']:.1f}  speedup {m['speedup']:.2f}"
          f"  greedy_identical {m['greedy_identical']}  cpu_budget_artifact {m['cpu_budget_artifact']}")
PYEOF
