"""`harness tree`: Sequoia's tree DP and hardware-aware (n, d) choice, printed as JSON.

    harness tree acceptance=[0.82,0.0864,0.022464] max_nodes=8 max_depth=4 \\
        verify_cost=[1.0,1.0,1.03,1.08,1.16,1.28,1.43,1.62] draft_cost=0.09

Keys (Hydra-style ``key=value``; values parsed by OmegaConf's YAML grammar, never ``eval``):

  acceptance=[p_1,...,p_B]  selected-child probabilities (sum <= 1), or instead
  h=[h_1,...,h_B]           conditional sibling rates, converted with p_j = h_j prod_{i<j}(1-h_i)
  max_nodes=N               nodes n, ROOT INCLUDED (n = candidate rows + 1, the verify length)
  max_depth=D               depth in edges
  verify_cost=[t(1..N)]     verify time per node count, normalised so t(1) = 1   } hand-entered:
  draft_cost=c              draft time per depth step below the first, same unit } synthetic
  draft_base_cost=c0        proposer's pass on the pending token, which drafts   }
                            the first level (default c: Sequoia's d*c)
  profile=PATH              a stored hardware profile JSON with those three keys (measured only where
                            it says ``"synthetic": false``, as harness calibrate writes it; a file
                            without the key is read as synthetic); excludes the three keys above.
                            Its draft_feed_cost (the draft's pass over k committed tokens) and
                            draft_level_cost (a masked step of r rows), where given, price each
                            tree by its shape and acceptance
  min_nodes=2               smallest n searched with costs (1 admits plain AR: G=1, time t(1); at most max_nodes)

The JSON's ``run_options`` are the same bounds for a run (``topology.max_nodes`` counts candidate
rows, the root excluded; ``topology.calibration.branches`` the acceptance vector's length). Without
costs the tree reported is the max-G tree at (N, D) (the largest feasible n <= N if N nodes do not
fit depth D); with costs it is the tree minimising (t(n) + draft time) / G, the draft time
(c0 + (d-1)*c) priced by the tree's shape where the profile gives the draft's forwards by size; the
JSON's ``chosen.searched`` says over which trees the choice is the best (every tree, or a family
that holds every chain and the best tree of each size, depth and branching pattern).
Bad input: a message on stderr and exit code 2.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from omegaconf import OmegaConf

from harness.files import print_traceback_if_asked
from harness.topology.sequoia import (
    TreeResult,
    optimize_tree,
    select_hardware_aware,
    selected_child_probabilities,
    tree_to_budget_parents,
)

KEYS = (
    "acceptance",
    "h",
    "max_nodes",
    "max_depth",
    "verify_cost",
    "draft_cost",
    "draft_base_cost",
    "profile",
    "min_nodes",
)
PROFILE_KEYS = ("verify_cost", "draft_cost", "draft_base_cost")


class UsageError(ValueError):
    """Bad `harness tree` input (exit code 2)."""


def parse_args(argv: list[str]) -> dict:
    """``key=value`` strings -> a plain dict; unknown, repeated or malformed keys are refused."""

    seen: set[str] = set()
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise UsageError(f"arguments are key=value; got {arg!r}")
        if key not in KEYS:
            raise UsageError(f"unknown key {key!r}; known keys: {list(KEYS)}")
        if key in seen:
            raise UsageError(f"key {key!r} given twice")
        if value == "":
            raise UsageError(f"key {key!r} has an empty value")
        seen.add(key)
    try:
        cfg = OmegaConf.from_dotlist(list(argv))
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception as exc:  # omegaconf/yaml grammar errors: report them as usage errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UsageError(f"cannot parse arguments {argv}: {first}") from exc


def _int(args: dict, key: str, *, default: int | None = None) -> int:
    if key not in args:
        if default is None:
            raise UsageError(f"{key}=<int> is required")
        return default
    v = args[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise UsageError(f"{key} must be an integer; got {v!r}")
    return v


def _number(value, *, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise UsageError(f"{name} must be a number; got {value!r}")
    return float(value)


def _numbers(value, *, name: str) -> list[float]:
    if not isinstance(value, list):
        raise UsageError(f"{name} must be a list like [0.8,0.1]; got {value!r}")
    return [_number(v, name=f"{name}[{i}]") for i, v in enumerate(value)]


def _costs(args: dict) -> tuple[dict | None, str | None]:
    """Return ({verify_cost, draft_cost, draft_base_cost, synthetic}, source) or (None, None)."""
    given = [k for k in PROFILE_KEYS if k in args]
    if "profile" in args:
        if given:
            raise UsageError(f"profile= already gives the costs; drop {given}")
        path = Path(str(args["profile"]))
        if not path.is_file():
            what = "is a folder" if path.is_dir() else "does not exist"
            raise UsageError(f"profile={path}: {what}; give a hardware profile JSON (harness calibrate writes one)")
        try:
            profile = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"profile={path}: not a hardware profile JSON ({exc})") from exc
        if not isinstance(profile, dict):
            raise UsageError(f"hardware profile {str(path)!r} must be a JSON object")
        missing = [k for k in ("verify_cost", "draft_cost") if k not in profile]
        if missing:
            raise UsageError(f"hardware profile {str(path)!r} lacks {missing}")
        synthetic = profile.get("synthetic", True)  # calibrate writes false; a hand-written file says nothing
        if not isinstance(synthetic, bool):
            raise UsageError(f"hardware profile 'synthetic' must be true or false; got {synthetic!r}")
        source, values = str(path), profile
    elif given:
        if "verify_cost" not in args or "draft_cost" not in args:
            raise UsageError(f"costs need both verify_cost=[t(1..N)] and draft_cost=c; got only {given}")
        source, values, synthetic = "command line", args, True
    else:
        return None, None
    c = _number(values["draft_cost"], name="draft_cost")
    c0 = values.get("draft_base_cost")  # unset: the first level costs a step too (Sequoia's d*c)
    vectors = {  # a measured profile's draft forwards by size (harness calibrate writes them)
        key: _numbers(values[key], name=key)
        for key in ("draft_feed_cost", "draft_level_cost")
        if source != "command line" and values.get(key) is not None
    }
    return {
        "verify_cost": _numbers(values["verify_cost"], name="verify_cost"),
        "draft_cost": c,
        "draft_base_cost": c if c0 is None else _number(c0, name="draft_base_cost"),
        **vectors,
        "synthetic": synthetic,
    }, source


def _tree_fields(tree: TreeResult) -> dict:
    return {
        "expected_tokens": tree.expected_tokens,
        "nodes": tree.nodes,
        "candidate_rows": tree.candidate_rows,
        "depth": tree.depth,
        "parents": list(tree.parents),
        "ranks": list(tree.ranks),
        "budget_parents": list(tree_to_budget_parents(tree.parents)),
    }


def cost_notes(verify_cost: list[float], *, max_nodes: int) -> list[str]:
    """What a verify-cost list says that the choice then takes as given: a larger forward priced
    below a smaller one (noise in a measured profile, or a typo), entries past the largest tree."""
    notes = [
        f"verify_cost decreases from t({i + 1})={a:g} to t({i + 2})={b:g}: a larger tree is priced below a "
        "smaller one, and the choice takes the list as given"
        for i, (a, b) in enumerate(zip(verify_cost, verify_cost[1:]))
        if b < a
    ]
    if len(verify_cost) > max_nodes:  # t(n) prices a tree of n nodes, the root included
        notes.append(
            f"verify_cost gives t(1..{len(verify_cost)}); trees of max_nodes={max_nodes} use t(1..{max_nodes})"
        )
    return notes


def run_tree(args: dict) -> dict:
    """Parsed arguments -> the JSON-ready result (raises UsageError / ValueError on bad input)."""
    if ("acceptance" in args) == ("h" in args):
        raise UsageError("give exactly one of acceptance=[p_1,...] (selected-child probabilities) or h=[h_1,...]")
    h = None
    if "h" in args:
        h = _numbers(args["h"], name="h")
        acceptance = selected_child_probabilities(h)
    else:
        acceptance = _numbers(args["acceptance"], name="acceptance")
    max_nodes = _int(args, "max_nodes")
    max_depth = _int(args, "max_depth")
    if max_depth < 1:  # a run refuses topology.max_depth=0 too
        raise UsageError(
            f"max_depth must be an integer >= 1 (a tree of the root alone proposes nothing); got {max_depth}"
        )
    table = optimize_tree(acceptance=acceptance, max_nodes=max_nodes, max_depth=max_depth)

    out: dict = {"acceptance": list(table.acceptance)}
    if h is not None:
        out["h"] = h
    out.update(
        max_nodes=max_nodes,
        max_depth=max_depth,
        node_convention="nodes include the root: nodes = candidate_rows + 1; depth in edges",
    )
    if max_nodes >= 2:  # a run's topology.max_nodes counts candidate rows, the root excluded: the same bounds
        out["run_options"] = (
            f"topology=sequoia topology.max_nodes={max_nodes - 1} topology.max_depth={max_depth}"
            # the run calibrates as many siblings per parent as the acceptance vector gives, so its DP
            # searches trees of the same widths
            f" topology.calibration.branches={len(table.acceptance)}"
            + (f" topology.min_nodes={_int(args, 'min_nodes')}" if "min_nodes" in args else "")
        )

    costs, source = _costs(args)
    if costs is None:
        if "min_nodes" in args:
            raise UsageError("min_nodes= applies only with costs (verify_cost/draft_cost or profile)")
        tree = table.widest(max_depth)
        out["objective"] = "max_expected_tokens"
        out.update(_tree_fields(tree))
    else:
        shaped = []  # a profile measured for smaller bounds prices the draft by its one-row forwards
        for key, need, bound in (
            ("draft_feed_cost", table.max_depth + 1, f"max_depth <= {len(costs.get('draft_feed_cost') or []) - 1}"),
            ("draft_level_cost", max(1, (max_nodes - 1) // 2), "fewer nodes"),
        ):
            if key in costs and len(costs[key]) < need:
                shaped.append(f"{key} gives {len(costs.pop(key))} entries, {need} needed (measured for {bound})")
        choice = select_hardware_aware(
            table,
            verify_cost=costs["verify_cost"],
            draft_cost=costs["draft_cost"],
            draft_base_cost=costs["draft_base_cost"],
            feed_cost=costs.get("draft_feed_cost"),
            level_cost=costs.get("draft_level_cost"),
            min_nodes=_int(args, "min_nodes", default=min(2, max_nodes)),  # max_nodes=1: plain AR only
        )
        tree = choice.tree
        out["objective"] = "min_time_per_token"
        out.update(_tree_fields(tree))
        out["chosen"] = {
            "n": choice.n,
            "d": choice.d,
            "candidate_rows": choice.candidate_rows,
            "expected_tokens": choice.expected_tokens,
            "time_per_token": choice.time_per_token,
            "time_unit": "one autoregressive target step t(1)",
            "verify_time": costs["verify_cost"][choice.n - 1],
            "draft_time": choice.draft_time,
            "searched": choice.searched,
        }
        out["synthetic"] = costs["synthetic"]
        out["cost_source"] = source
        notes = cost_notes(costs["verify_cost"], max_nodes=max_nodes)
        notes += [f"the profile's {why}: the draft is priced by its one-row forwards (c0, c)" for why in shaped]
        if notes:
            out["notes"] = notes
        out.update({k: costs[k] for k in (*PROFILE_KEYS, "draft_feed_cost", "draft_level_cost") if k in costs})
    out["expected_tokens_table"] = table.expected_tokens_table()
    return out


def main(argv: list[str]) -> int:
    if any(a in {"-h", "--help"} for a in argv):
        print(__doc__)
        return 0
    try:
        out = run_tree(parse_args(argv))
    except ValueError as exc:  # UsageError and the algorithm's boundary checks
        print_traceback_if_asked(exc)
        print(f"harness tree: refused: {exc}", file=sys.stderr)
        return 2
    assert all(g is None or math.isfinite(g) for _, _, g in out["expected_tokens_table"])
    for note in out.get("notes", []):
        print(f"harness tree: note: {note}", file=sys.stderr)
    print(json.dumps(out, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
