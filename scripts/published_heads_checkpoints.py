"""Write the checkpoints the checkpoint show runs on (scripts/show_checkpoints.sh): an HF-format copy
of the embedded SmolLM2 (a checkpoint given by path) and SmolLM2-sized Medusa and Hydra head
checkpoints in their published layouts with random weights (mechanics only: they predict nothing),
and ``tree63.json``, a sparse 63-node static tree built here (``topology.choices_file``).

    .venv/bin/python scripts/published_heads_checkpoints.py OUT_DIR

The head writers are the tests' own (tests/checkpoint_fixtures.py), built from the published key
names and shapes; nothing is copied from a published file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from checkpoint_fixtures import (  # noqa: E402
    best_first_choices,
    hydra_config,
    hydra_state,
    medusa_config,
    medusa_state,
    write_choices,
    write_hydra,
    write_medusa,
)


def main(out: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from harness.target.loading import smollm2_converted_dir

    src = smollm2_converted_dir()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    copy = out / "smollm2-hf"
    model.save_pretrained(copy)
    write_choices(out / "tree63.json", best_first_choices(63))
    AutoTokenizer.from_pretrained(src).save_pretrained(copy)
    # Medusa-1 layout as FasterDecoding publishes it (5 heads, one residual block, own projections)
    write_medusa(
        out / "medusa-random", medusa_state(heads=5, layers=1, hidden=hidden, vocab=vocab), config=medusa_config(5, 1)
    )
    # Hydra's mlp layout, grounded heads (4 heads, one block), the base embedding saved alongside
    embed = model.get_input_embeddings().weight.detach()
    write_hydra(
        out / "hydra-random",
        hydra_state(heads=4, layers=1, hidden=hidden, vocab=vocab, embed=embed),
        config=hydra_config(4, 1),
    )
    print(f"wrote {copy}, {out / 'medusa-random'}, {out / 'hydra-random'}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # --help is no folder to write 1.7 GB into
        print("usage: .venv/bin/python scripts/published_heads_checkpoints.py OUT_DIR", file=sys.stderr)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    main(Path(sys.argv[1]))
