"""Fit the prompt-lookup acceptance model's starting constants from recorded greedy outputs.

With ``--t-from`` (a benchmark JSON's measured t(n)), the observations are the rounds a run sees:
the default experiment's proposer (history of earlier records) with rejected tails on is
replayed over each set, and every round's candidate tree before the adaptive choice is tried
against the output (:func:`round_observations`). Without it, at every position of every recorded
output, the default experiment's lookup candidates (the
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
        --fit humaneval/dev chat/dev copy/dev --t-from results/pld_float32_humaneval.json \\
        --out results/replay/acceptance_fit.json

``--only FEATURE ...`` fits those features' weights alone, unstandardised, every other constant
held at :class:`~harness.proposers.prompt_lookup.AcceptanceModel`'s: how the rejected-tail terms
were added (``--t-from ... --only tail log_tail_run``) without moving the probability of any other
row.

The lookup settings (``--ngram``, ``--max-depth``, ``--max-matches``, ``--rows``) default to the
default experiment's (a tree of up to 4 x ``topology.max_nodes`` rows before the adaptive choice;
the committed constants were fitted with ``--max-depth 10``, the default experiment's depth then).
Bad input (a missing or malformed file, a set without records, no rows to fit, a ``--t-from``
without a usable ``t_of_n_ms``) ends with one line and exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
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
    records: Sequence[dict], *, max_ngram: int = 2, max_depth: int = 16, max_matches: int = 8, limit: int = 64
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


@functools.cache
def _lookup_replay():
    spec = importlib.util.spec_from_file_location("lookup_replay", Path(__file__).with_name("lookup_replay.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def round_observations(
    records: Sequence[dict],
    t_ms: Sequence[float],
    *,
    max_ngram: int = 2,
    max_depth: int = 16,
    max_matches: int = 8,
    nodes: int = 16,
    rejected_tails: bool = True,
    datastore: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(raw features ``[N, F]``, accepted ``[N]``) of every tried row of every round of the default
    experiment's proposer (with ``rejected_tails``, the history of earlier records, and the
    ``datastore`` directory's continuations where given) replayed
    over ``records`` with verify costs ``t_ms``: each round's candidate tree before the adaptive
    choice, tried against the output's next ``max_depth`` tokens. Only the rounds a run sees are
    observed, and the tails, which exist only after a round, with them."""
    lookup_replay = _lookup_replay()
    xs, ys = [], []
    proposer = lookup_replay.adaptive_proposer(
        t_ms,
        nodes=nodes,
        depth=max_depth,
        matches=max_matches,
        ngram=max_ngram,
        history_tokens=65536,
        rejected_tails=rejected_tails,
        datastore=datastore,
    )

    def on_round(committed, truth, _nodes, _accepted):
        tree = proposer.last_candidates
        rows, accepted = tried_rows(tree.prefixes, tuple(truth[:max_depth]))
        if len(rows):
            xs.append(AcceptanceModel.raw_features(tree)[rows])
            ys.append(accepted)

    lookup_replay.replay(records, t_ms, proposer=proposer, on_round=on_round)
    width = len(AcceptanceModel.FEATURES)
    if not xs:
        return np.empty((0, width)), np.empty(0, dtype=bool)
    return np.concatenate(xs), np.concatenate(ys)


def fit(
    x: np.ndarray,
    y: np.ndarray,
    *,
    l2: float = 1e-3,
    only: Sequence[int] | None = None,
    held: dict | None = None,
) -> dict:
    """Logistic regression on standardised ``x``: ``{"mean", "scale", "weights", "bias"}``.

    only: fit the weights of these feature columns alone, unstandardised (mean 0, scale 1), with
    every other constant and the bias held at ``held``'s: rows on which those features are zero
    keep the probabilities ``held`` gives them without its terms for those columns (all of them,
    where those terms are zero, as for features ``held`` never weighed), so a new kind of row gets
    its own terms without moving the rest."""
    if only is not None and held is None:
        raise ValueError("fitting some features alone needs the held constants of the others")
    if len(x) == 0 or y.all() or not y.any():
        raise ValueError(f"need both accepted and rejected rows to fit; got {int(y.sum())} of {len(y)} accepted")
    yt = torch.tensor(y, dtype=torch.float64)
    if only is not None:
        cols = list(only)
        rest = [i for i in range(x.shape[1]) if i not in cols]
        mean, scale, weights = (np.asarray(held[k], dtype=np.float64).copy() for k in ("mean", "scale", "weights"))
        offset = ((x[:, rest] - mean[rest]) / scale[rest]) @ weights[rest] + held["bias"]
        xt, base = torch.tensor(x[:, cols], dtype=torch.float64), torch.tensor(offset, dtype=torch.float64)
        w = torch.zeros(len(cols), dtype=torch.float64, requires_grad=True)

        def logits():
            return base + xt @ w

        def penalty():
            return l2 * (w**2).sum()
    else:
        mean, scale = x.mean(axis=0), x.std(axis=0)
        scale = np.where(scale > 0, scale, 1.0)  # a constant feature keeps weight 0
        xt = torch.tensor((x - mean) / scale, dtype=torch.float64)
        w = torch.zeros(x.shape[1] + 1, dtype=torch.float64, requires_grad=True)

        def logits():
            return xt @ w[:-1] + w[-1]

        def penalty():
            return l2 * (w[:-1] ** 2).sum()

    opt = torch.optim.LBFGS([w], max_iter=500, tolerance_grad=1e-10, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits(), yt) + penalty()
        loss.backward()
        return loss

    opt.step(closure)
    w = w.detach().numpy()
    if only is not None:
        mean[cols], scale[cols], weights[cols] = 0.0, 1.0, w
        return {
            "mean": mean.tolist(),
            "scale": scale.tolist(),
            "weights": weights.tolist(),
            "bias": float(held["bias"]),
        }
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


def load_t_of_n(path: str, *, rows: int) -> list[float]:
    """A benchmark JSON's ``t_of_n_ms`` (at least ``rows`` positive times); ``ValueError`` otherwise."""
    try:
        t_ms = json.loads(Path(path).read_text()).get("t_of_n_ms")
    except (OSError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: cannot read a benchmark's t_of_n_ms ({exc})") from None
    if (
        not isinstance(t_ms, list)
        or len(t_ms) < rows
        or not all(isinstance(t, (int, float)) and t > 0 and np.isfinite(t) for t in t_ms)
    ):
        raise ValueError(f"{path}: t_of_n_ms must list at least {rows} positive times (ms for 1, 2, ... rows)")
    return [float(t) for t in t_ms]


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
    ap.add_argument("--max-depth", type=int, default=16)
    ap.add_argument("--max-matches", type=int, default=8)
    ap.add_argument("--rows", type=int, default=64, help="the candidate tree's row limit")
    ap.add_argument(
        "--t-from",
        help="a benchmark JSON whose t_of_n_ms prices the replayed rounds: observe the proposer's rounds "
        "(tails included) instead of every position",
    )
    ap.add_argument(
        "--only",
        nargs="+",
        choices=AcceptanceModel.FEATURES,
        help="fit these features' weights alone (unstandardised), every other constant held at the current ones",
    )
    ap.add_argument(
        "--datastores",
        nargs="+",
        default=[],
        metavar="WORKLOAD=DIR",
        help="with --t-from: the sets of this workload replay the proposer with this datastore directory "
        "(proposer.datastore), e.g. chat=~/.cache/harness/datastores/sharegpt-smollm2",
    )
    ap.add_argument("--out", help="write the constants and log-losses here (JSON)")
    args = ap.parse_args(argv)
    datastores = {}
    for item in args.datastores:
        name, _, path = item.partition("=")
        if not name or not path or not (Path(path).expanduser() / "manifest.json").is_file():
            ap.error(f"--datastores {item!r}: give WORKLOAD=DIR, DIR a datastore directory (with manifest.json)")
        datastores[name] = path
    if datastores and not args.t_from:
        ap.error("--datastores needs --t-from: the datastore's rows are observed in the proposer's rounds")
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
        lookup = {"max_ngram": args.ngram, "max_depth": args.max_depth, "max_matches": args.max_matches}
        if args.t_from:
            nodes = max(args.rows // 4, 1)
            t_ms = load_t_of_n(args.t_from, rows=nodes + 1)
            settings["t_from"] = args.t_from
            settings["datastores"] = datastores
            data = {
                name: round_observations(
                    records, t_ms, nodes=nodes, datastore=datastores.get(name.split("/")[0]), **lookup
                )
                for name, records in sets.items()
            }
        else:
            data = {name: observations(records, limit=args.rows, **lookup) for name, records in sets.items()}
        model = fit(
            np.concatenate([data[n][0] for n in fit_names]),
            np.concatenate([data[n][1] for n in fit_names]),
            l2=args.l2,
            only=[AcceptanceModel.FEATURES.index(f) for f in dict.fromkeys(args.only)] if args.only else None,
            held=current_constants(),
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
            "only": args.only,
            "model": model,
            "sets": table,
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
