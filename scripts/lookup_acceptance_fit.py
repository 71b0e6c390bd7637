"""Fit the prompt-lookup acceptance model's starting constants from recorded greedy outputs.

At every position of every recorded output, the default experiment's lookup candidates (the
matches :func:`harness.proposers.prompt_lookup.find_continuations` finds in the request and in the
outputs of the set's earlier records, as a run's history holds them, merged by
:func:`harness.proposers.prompt_lookup.candidate_tree`) are tried against the output: every row whose
parent is the output's token is an observation, accepted when it is the output's next token. A
logistic regression over :meth:`AcceptanceModel.raw_features`, standardised, with a small L2
penalty, is fitted to the observations of the fitting sets (the dev splits) by L-BFGS; the log-loss
on every set (the eval splits held out) is printed beside the current constants' log-loss, with the
constants to paste into :class:`harness.proposers.prompt_lookup.AcceptanceModel`.

    # the outputs, once (the target's greedy continuations)
    .venv/bin/python scripts/lookup_replay.py collect --workloads humaneval chat copy --splits dev eval \\
        --limit 24 --out results/replay/outputs.json
    .venv/bin/python scripts/lookup_acceptance_fit.py results/replay/outputs.json \\
        --fit humaneval/dev chat/dev copy/dev --out results/replay/acceptance_fit.json

The lookup settings (``--ngram``, ``--max-depth``, ``--max-matches``, ``--rows``) default to the
default experiment's (a tree of up to 4 x ``topology.max_nodes`` rows before the adaptive choice).
Bad input (a missing or malformed file, a set without records, no rows to fit) ends with one line
and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from harness.proposers.prompt_lookup import (
    SEPARATOR,
    AcceptanceModel,
    TokenCorpus,
    candidate_tree,
    find_continuations,
    tried_rows,
)


def observations(
    records: Sequence[dict], *, max_ngram: int = 2, max_depth: int = 10, max_matches: int = 8, limit: int = 64
) -> tuple[np.ndarray, np.ndarray]:
    """(raw features ``[N, F]``, accepted ``[N]``) of every tried row at every output position of
    ``records`` (``{"prompt": ids, "out": ids}``), the earlier records' outputs as history."""
    xs, ys, earlier, corpus = [], [], [], None
    for rec in records:
        prompt, out = list(rec["prompt"]), list(rec["out"])
        for pos in range(1, len(out)):
            matches = find_continuations(
                np.asarray(prompt + out[:pos], dtype=np.int64),
                max_ngram=max_ngram,
                min_ngram=1,
                max_depth=max_depth,
                max_matches=max_matches,
                corpus=corpus,
            )
            tree = candidate_tree(matches, limit=limit)
            rows, accepted = tried_rows(tree.prefixes, tuple(out[pos : pos + max_depth]))
            if len(rows):
                xs.append(AcceptanceModel.raw_features(tree)[rows])
                ys.append(accepted)
        earlier += [*out, SEPARATOR]
        corpus = TokenCorpus(np.asarray(earlier, dtype=np.int64))
    width = len(AcceptanceModel.FEATURES)
    if not xs:
        return np.empty((0, width)), np.empty(0, dtype=bool)
    return np.concatenate(xs), np.concatenate(ys)


def fit(x: np.ndarray, y: np.ndarray, *, l2: float = 1e-3) -> dict:
    """Logistic regression on standardised ``x``: ``{"mean", "scale", "weights", "bias"}``."""
    if len(x) == 0 or y.all() or not y.any():
        raise ValueError(f"need both accepted and rejected rows to fit; got {int(y.sum())} of {len(y)} accepted")
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)  # a constant feature keeps weight 0
    xt = torch.tensor((x - mean) / scale, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64)
    w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(xt @ w[:-1] + w[-1], yt) + l2 * (w[:-1] ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    w = w.detach().numpy()
    return {"mean": mean.tolist(), "scale": scale.tolist(), "weights": w[:-1].tolist(), "bias": float(w[-1])}


def log_loss(model: dict, x: np.ndarray, y: np.ndarray) -> float:
    z = ((x - np.asarray(model["mean"])) / np.asarray(model["scale"])) @ np.asarray(model["weights"]) + model["bias"]
    p = np.clip(1.0 / (1.0 + np.exp(-z)), 1e-9, 1 - 1e-9)
    return float(-np.mean(np.where(y, np.log(p), np.log(1 - p))))


def current_constants() -> dict:
    m = AcceptanceModel
    return {"mean": list(m.MEAN), "scale": list(m.SCALE), "weights": list(m.WEIGHTS), "bias": m.BIAS}


def as_python(model: dict) -> str:
    def row(values):
        return "(" + ", ".join(f"{v:.4f}" for v in values) + ")"

    return "\n".join(
        [
            f"    MEAN: ClassVar[tuple[float, ...]] = {row(model['mean'])}",
            f"    SCALE: ClassVar[tuple[float, ...]] = {row(model['scale'])}",
            f"    WEIGHTS: ClassVar[tuple[float, ...]] = {row(model['weights'])}",
            f"    BIAS: ClassVar[float] = {model['bias']:.4f}",
        ]
    )


def load_sets(paths: Sequence[str]) -> dict[str, list[dict]]:
    """``{set name: records}`` from ``lookup_replay.py collect`` files; ``ValueError`` (one line) for
    anything else, or for a set named in two files."""
    sets: dict[str, list[dict]] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot read recorded outputs ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("sets"), dict):
            raise ValueError(
                f"{path}: not a file of recorded outputs (no 'sets'; write one with lookup_replay.py collect)"
            )
        for name, records in data["sets"].items():
            if name in sets:
                raise ValueError(f"{path}: set {name!r} is also in an earlier file")
            if not isinstance(records, list) or not all(
                isinstance(r, dict) and isinstance(r.get("prompt"), list) and isinstance(r.get("out"), list)
                for r in records
            ):
                raise ValueError(f"{path}: set {name!r} is not a list of {{'prompt': ids, 'out': ids}} records")
            sets[name] = records
    return sets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outputs", nargs="+", help="JSON files written by scripts/lookup_replay.py collect")
    ap.add_argument("--fit", nargs="+", help="the sets to fit on (default: every set whose name ends in /dev)")
    ap.add_argument("--l2", type=float, default=1e-3, help="the L2 penalty on the standardised weights (>= 0)")
    ap.add_argument("--ngram", type=int, default=2, help="max_ngram of the matches")
    ap.add_argument("--max-depth", type=int, default=10)
    ap.add_argument("--max-matches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="the candidate tree's row limit")
    ap.add_argument("--out", help="write the constants and log-losses here (JSON)")
    args = ap.parse_args(argv)
    if not args.l2 >= 0 or min(args.ngram, args.max_depth, args.max_matches, args.rows) < 1:
        ap.error("--l2 must be >= 0, and --ngram, --max-depth, --max-matches and --rows >= 1")
    try:
        sets = load_sets(args.outputs)
        fit_names = args.fit or [name for name in sets if name.endswith("/dev")]
        if not fit_names:
            raise ValueError(f"no set name ends in /dev; pass --fit with some of {sorted(sets)}")
        missing = [name for name in fit_names if name not in sets]
        if missing:
            raise ValueError(f"no recorded set named {', '.join(missing)}; have {', '.join(sorted(sets))}")
        settings = {
            "max_ngram": args.ngram,
            "max_depth": args.max_depth,
            "max_matches": args.max_matches,
            "rows": args.rows,
        }
        data = {
            name: observations(
                records,
                max_ngram=args.ngram,
                max_depth=args.max_depth,
                max_matches=args.max_matches,
                limit=args.rows,
            )
            for name, records in sets.items()
        }
        model = fit(
            np.concatenate([data[n][0] for n in fit_names]), np.concatenate([data[n][1] for n in fit_names]), l2=args.l2
        )
    except ValueError as exc:
        print(f"lookup_acceptance_fit: {exc}", file=sys.stderr)
        return 2
    current = current_constants()
    table = {
        name: {
            "rows": len(y),
            "accepted": float(y.mean()) if len(y) else None,
            "log_loss_fitted": log_loss(model, x, y) if len(y) else None,
            "log_loss_current": log_loss(current, x, y) if len(y) else None,
            "fitted_on": name in fit_names,
        }
        for name, (x, y) in data.items()
    }
    for name, row in table.items():
        print(name, row)
    print(as_python(model))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        result = {
            "features": list(AcceptanceModel.FEATURES),
            "settings": settings,
            "l2": args.l2,
            "fit_sets": fit_names,
            "model": model,
            "sets": table,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
