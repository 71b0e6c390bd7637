"""Helpers shared by tests (importable because pytest puts this folder on sys.path)."""

import copy


def round_of_one(kw: dict) -> dict:
    """An ``on_round`` call of a batch of one as {tree, selection, emitted, state} (the state copied
    as it was after the round's commit: a finished request leaves the batch right after)."""
    return {
        "tree": kw["trees"][0],
        "selection": kw["selections"][0],
        "emitted": kw["emitted"][0],
        "state": copy.deepcopy(kw["state"]),
    }


# --------------------------------------------------------------------------------------------
# W&B offline runs read back with W&B's own reader (`wandb leet inspect` parses the run's .wandb
# transaction log through wandb-core; no server)


def inspect_run(path) -> tuple[dict, list[dict]]:
    """(state/summary/config, every record of the transaction log) of the one W&B run under ``path``."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    (run_file,) = list(Path(path).glob("wandb/*run-*/run-*.wandb"))
    cli = Path(sys.executable).parent / "wandb"

    def call(*flags: str) -> str:
        args = [str(cli), "leet", "inspect", *flags, "--json", str(run_file)]
        return subprocess.run(args, capture_output=True, text=True, timeout=120, check=True).stdout

    summary = json.loads(call("--summary"))
    records = [json.loads(line) for line in call().splitlines() if line.strip()]
    return summary, records


def run_info(records: list[dict]) -> dict:
    """The last run record of a transaction log (name, group, job type, tags as they were at the end)."""
    return [r["run"] for r in records if r.get("type") == "run"][-1]


def history(records: list[dict]) -> list[dict]:
    """The history steps of a transaction log, in order."""
    return [r["history"]["item"] for r in records if r.get("type") == "history"]
