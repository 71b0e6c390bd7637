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
