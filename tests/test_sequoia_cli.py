"""`harness tree`: the toy command and its refusals."""

from __future__ import annotations

import json
import re

import pytest

from harness import cli
from harness.topology.sequoia_cli import main

TOY_ARGS = [
    "acceptance=[0.82,0.0864,0.022464]",
    "max_nodes=8",
    "max_depth=4",
    "verify_cost=[1.0,1.0,1.03,1.08,1.16,1.28,1.43,1.62]",
    "draft_cost=0.09",
]
CHAIN5_G = 1 + 0.82 + 0.82**2 + 0.82**3 + 0.82**4


def _run(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def test_toy_command_picks_five_node_chain(capsys):
    rc = cli.main(["tree", *TOY_ARGS])  # through the dispatcher, as `harness tree ...`
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out["objective"] == "min_time_per_token"
    assert (out["nodes"], out["candidate_rows"], out["depth"]) == (5, 4, 4)
    assert out["expected_tokens"] == pytest.approx(3.49588976, abs=1e-8)
    assert out["parents"] == [-1, 0, 1, 2, 3]
    assert out["budget_parents"] == [-1, 0, 1, 2]
    chosen = out["chosen"]
    assert (chosen["n"], chosen["d"], chosen["candidate_rows"]) == (5, 4, 4)
    assert chosen["time_per_token"] == pytest.approx(0.4348, abs=1e-4)
    assert chosen["expected_tokens"] == pytest.approx(3.49588976, abs=1e-8)
    assert out["synthetic"] is True and out["cost_source"] == "command line"
    # the same bounds for a run, whose topology.max_nodes counts candidate rows (the root excluded)
    from harness.config import compose

    assert out["run_options"] == (
        "topology=sequoia topology.max_nodes=7 topology.max_depth=4 topology.calibration.branches=3"
    )
    topology = compose(out["run_options"].split()).topology
    assert (topology.max_nodes + 1, topology.max_depth) == (out["max_nodes"], out["max_depth"])
    assert topology.calibration.branches == len(out["acceptance"])  # the run's DP searches the same widths
    table = out["expected_tokens_table"]
    assert len(table) == 8 * 5 and table[0] == [1, 0, 1.0]
    by_nd = {(n, d): g for n, d, g in table}
    assert by_nd[(5, 4)] == pytest.approx(3.49588976, abs=1e-8)
    assert by_nd[(2, 0)] is None and by_nd[(5, 1)] is None  # infeasible -> null
    for (n, d), g in by_nd.items():
        assert g is None or 1.0 <= g <= min(n, d + 1)


def test_a_one_node_budget_with_costs_searches_plain_decoding_without_naming_a_default(capsys):
    """min_nodes' default of 2 was refused against max_nodes=1 as if the user had given it."""
    args = ["acceptance=[0.82,0.0864]", "max_nodes=1", "max_depth=1", "verify_cost=[1.0]", "draft_cost=0.09"]
    rc, out, err = _run(capsys, args)
    assert rc == 0, err
    assert (out["nodes"], out["candidate_rows"], out["chosen"]["n"]) == (1, 0, 1)
    rc, _, err = _run(capsys, [*args, "min_nodes=2"])
    assert rc == 2 and "min_nodes must be an integer in [1, 1]; got 2" in err


def test_passing_h_as_acceptance_is_refused(capsys):
    rc, _, err = _run(capsys, ["acceptance=[0.82,0.48,0.24]", "max_nodes=8", "max_depth=4"])
    assert rc == 2
    assert "1.54" in err and "conditional sibling rates h_j" in err and "h=[...]" in err


def test_h_key_converts_and_reports_both(capsys):
    rc, out, _ = _run(capsys, ["h=[0.82,0.48,0.24]", *TOY_ARGS[1:]])
    assert rc == 0
    assert out["h"] == [0.82, 0.48, 0.24]
    assert out["acceptance"] == pytest.approx([0.82, 0.0864, 0.022464], abs=1e-15)
    assert out["chosen"]["n"] == 5 and out["chosen"]["time_per_token"] == pytest.approx(0.4348, abs=1e-4)


def test_without_costs_reports_max_g_tree(capsys):
    rc, out, _ = _run(capsys, TOY_ARGS[:3])
    assert rc == 0
    assert out["objective"] == "max_expected_tokens" and "chosen" not in out and "synthetic" not in out
    assert (out["nodes"], out["candidate_rows"]) == (8, 7)
    # chain of 5, a rank-2 child of node 1, and a rank-2 root child with its own child
    assert out["expected_tokens"] == pytest.approx(CHAIN5_G + 0.82 * 0.0864 + 0.0864 * (1 + 0.82), abs=1e-12)
    assert out["expected_tokens"] == max(g for n, d, g in out["expected_tokens_table"] if g is not None)


def test_without_costs_falls_back_to_largest_feasible_n(capsys):
    rc, out, _ = _run(capsys, ["acceptance=[0.5]", "max_nodes=8", "max_depth=2"])
    assert rc == 0
    assert out["nodes"] == 3 and out["parents"] == [-1, 0, 1]
    assert out["expected_tokens"] == pytest.approx(1.75)


def test_stored_profile_is_not_synthetic(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "verify_cost": [1.0, 1.0, 1.03, 1.08, 1.16, 1.28, 1.43, 1.62],
                "draft_cost": 0.09,
                "draft_base_cost": 0.09,
                "device": "cpu",
                "synthetic": False,  # as harness calibrate writes it
            }
        )
    )
    rc, out, _ = _run(capsys, [*TOY_ARGS[:3], f"profile={path}"])
    assert rc == 0
    assert out["synthetic"] is False and out["cost_source"] == str(path)
    assert out["chosen"]["n"] == 5 and out["chosen"]["time_per_token"] == pytest.approx(0.4348, abs=1e-4)
    # a hand-written file that does not say: synthetic, as the same numbers typed on the command line are
    hand = tmp_path / "hand.json"
    hand.write_text(json.dumps({"verify_cost": [1.0] * 8, "draft_cost": 0.1}))
    rc, out, _ = _run(capsys, [*TOY_ARGS[:3], f"profile={hand}"])
    assert rc == 0 and out["synthetic"] is True and out["cost_source"] == str(hand)


def test_a_profiles_draft_forwards_by_size_price_the_tree_and_short_ones_fall_back(tmp_path, capsys):
    """A measured profile's draft passes (over k committed tokens) and masked levels price each tree by its
    shape; one measured for a shallower search than asked was refused (the vector too short): its draft is
    priced by the one-row forwards then, and the output says so."""
    base = {"verify_cost": [1.0, 1.0, 1.03, 1.08, 1.16, 1.28, 1.43, 1.62], "draft_cost": 0.09, "synthetic": False}
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                **base,
                "draft_base_cost": 0.09,
                "draft_feed_cost": [0.09, 0.2, 0.3, 0.4, 0.5],
                "draft_level_cost": [0.3, 0.3, 0.3],
            }
        )
    )
    rc, out, _ = _run(capsys, [*TOY_ARGS[:3], f"profile={path}"])  # max_depth=4: feeds 1..5 measured
    assert rc == 0 and out["draft_feed_cost"] == [0.09, 0.2, 0.3, 0.4, 0.5] and "notes" not in out
    scalar = out["chosen"]["draft_time"]
    short = tmp_path / "short.json"
    short.write_text(
        json.dumps(
            {**base, "draft_base_cost": 0.09, "draft_feed_cost": [0.09, 0.2], "draft_level_cost": [0.3, 0.3, 0.3]}
        )
    )
    rc, out, _ = _run(capsys, [*TOY_ARGS[:3], f"profile={short}"])
    assert rc == 0 and "draft_feed_cost" not in out
    assert out["notes"] == [
        "the profile's draft_feed_cost gives 2 entries, 5 needed (measured for max_depth <= 1): the draft is priced "
        "by its one-row forwards (c0, c)"
    ]
    assert scalar != out["chosen"]["draft_time"]


def test_the_tree_reported_is_the_choice_even_where_it_is_no_max_g_tree(tmp_path, capsys):
    """Priced by shape, the cheapest tree per token can be a chain with fewer expected tokens than the
    size's max-G tree: the command read the max-G tree of the chosen size back and stopped on an
    AssertionError (exit 1). It reports the chosen tree and over which trees it is the best."""
    from harness.topology.sequoia import SEARCHED_FAMILY

    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {
                "verify_cost": [1.0, 1.004, 1.146, 1.238, 1.487],
                "draft_cost": 0.115,
                "draft_base_cost": 0.4245,
                "draft_feed_cost": [0.1187, 0.7492, 1.1759, 1.4849],
                "draft_level_cost": [0.0025, 0.7862],
                "synthetic": False,
            }
        )
    )
    rc, out, _ = _run(capsys, ["acceptance=[0.4617,0.2641]", "max_nodes=5", "max_depth=3", f"profile={path}"])
    assert rc == 0 and out["parents"] == [-1, 0, 1]  # the three-node chain
    assert (out["chosen"]["n"], out["chosen"]["d"]) == (3, 2) and out["chosen"]["searched"] == SEARCHED_FAMILY


def test_profile_marked_synthetic_stays_synthetic(tmp_path, capsys):
    path = tmp_path / "profile.json"
    path.write_text(
        json.dumps(
            {"verify_cost": [1.0, 1.0, 1.03, 1.08, 1.16, 1.28, 1.43, 1.62], "draft_cost": 0.09, "synthetic": True}
        )
    )
    rc, out, _ = _run(capsys, [*TOY_ARGS[:3], f"profile={path}"])
    assert rc == 0 and out["synthetic"] is True


def test_draft_base_cost_changes_the_time(capsys):
    rc, out, _ = _run(capsys, [*TOY_ARGS, "draft_base_cost=0.2"])
    assert rc == 0
    chosen = out["chosen"]
    g = chosen["expected_tokens"]
    t = [1.0, 1.0, 1.03, 1.08, 1.16, 1.28, 1.43, 1.62][chosen["n"] - 1]
    assert chosen["time_per_token"] == pytest.approx((t + 0.2 + (chosen["d"] - 1) * 0.09) / g)
    assert chosen["time_per_token"] > 0.4348
    assert chosen["draft_time"] == pytest.approx(0.2 + (chosen["d"] - 1) * 0.09)


@pytest.mark.parametrize(
    "argv, reason",
    [
        (TOY_ARGS[:3] + ["verify_cost=[1.0,1.0]"], "both verify_cost"),
        (TOY_ARGS[:3] + ["draft_cost=0.09"], "both verify_cost"),
        (TOY_ARGS + ["profile=/nonexistent/profile.json"], "already gives the costs"),
        (TOY_ARGS[:3] + ["profile=/nonexistent/profile.json"], "profile=/nonexistent/profile.json: does not exist"),
        (TOY_ARGS[:3] + ["profile=/tmp"], "profile=/tmp: is a folder"),
        (["acceptance=[0.5,0.2]", "max_nodes=20000", "max_depth=20"], "the Sequoia DP would hold 17.9 GiB"),
        (TOY_ARGS + ["colour=blue"], "unknown key"),
        (TOY_ARGS + ["max_nodes=9"], "twice"),
        (["acceptance=[0.82", "max_nodes=8", "max_depth=4"], "cannot parse"),
        (["acceptance=0.82", "max_nodes=8", "max_depth=4"], "must be a list"),
        (["acceptance=[0.82,abc]", "max_nodes=8", "max_depth=4"], "must be a number"),
        (["acceptance=[0.82]", "max_nodes=8.5", "max_depth=4"], "max_nodes must be an integer"),
        (["acceptance=[0.82]", "max_depth=4"], "max_nodes=<int> is required"),
        (["acceptance=[0.82]", "h=[0.82]", "max_nodes=8", "max_depth=4"], "exactly one"),
        (["max_nodes=8", "max_depth=4"], "exactly one"),
        (["acceptance=[0.82]", "max_nodes", "max_depth=4"], "key=value"),
        (["acceptance=[0.82]", "max_nodes=0", "max_depth=4"], "max_nodes must be an integer >= 1"),
        # its run_options said topology.max_depth=0, which a run refuses
        (["acceptance=[0.5]", "max_nodes=4", "max_depth=0"], "max_depth must be an integer >= 1 \\(a tree of the root"),
        (
            ["acceptance=[0.82]", "max_nodes=8", "max_depth=4", "verify_cost=[2.0,1,1,1,1,1,1,1]", "draft_cost=0.1"],
            "t\\(1\\) = 1",
        ),
        (["acceptance=[0.82]", "max_nodes=8", "max_depth=4", "verify_cost=[1.0,1.0]", "draft_cost=0.1"], "t\\(1..8\\)"),
        (["acceptance=[0.82]", "max_nodes=8", "max_depth=4", "min_nodes=1"], "only with costs"),
    ],
)
def test_bad_input_exits_2_with_reason(capsys, argv, reason):
    rc, _, err = _run(capsys, argv)
    assert rc == 2
    assert err.startswith("harness tree: refused:")
    assert re.search(reason, err), err


def test_bad_profile_contents(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"draft_cost": 0.09}))
    rc, _, err = _run(capsys, [*TOY_ARGS[:3], f"profile={path}"])
    assert rc == 2 and "lacks ['verify_cost']" in err
    path.write_text("[1, 2]")
    rc, _, err = _run(capsys, [*TOY_ARGS[:3], f"profile={path}"])
    assert rc == 2 and "JSON object" in err


def test_help(capsys):
    assert main(["--help"]) == 0
    assert "max_nodes=N" in capsys.readouterr().out


def test_a_verify_cost_list_that_decreases_or_runs_past_the_tree_is_noted_not_silently_taken(capsys):
    args = ["acceptance=[0.8,0.1]", "max_nodes=3", "max_depth=2", "draft_cost=0.1"]
    rc, out, err = _run(capsys, [*args, "verify_cost=[1.0,1.2,1.3]"])
    assert rc == 0 and "notes" not in out and err == ""
    rc, out, err = _run(capsys, [*args, "verify_cost=[1.0,1.2,1.1,1.3]"])
    assert rc == 0 and out["notes"] == [
        "verify_cost decreases from t(2)=1.2 to t(3)=1.1: a larger tree is priced below a smaller one, and the "
        "choice takes the list as given",
        "verify_cost gives t(1..4); trees of max_nodes=3 use t(1..3)",
    ]
    assert err.splitlines() == [f"harness tree: note: {n}" for n in out["notes"]]


def test_run_options_carry_min_nodes_and_are_left_out_where_no_run_has_such_bounds(capsys):
    rc, out, _ = _run(capsys, [*TOY_ARGS, "min_nodes=3"])
    assert rc == 0 and out["run_options"].endswith(" topology.min_nodes=3")
    rc, out, _ = _run(capsys, ["acceptance=[0.8]", "max_nodes=1", "max_depth=1"])  # no candidate row
    assert rc == 0 and "run_options" not in out
