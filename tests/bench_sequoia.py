"""Micro-benchmarks for the Sequoia DP and hardware-aware choice (skipped by default).

Not collected by the default `pytest` run (the file name is not test_*); run explicitly with

    .venv/bin/python -m pytest tests/bench_sequoia.py -o addopts="" --benchmark-enable
"""

from __future__ import annotations

import pytest

from harness.topology.sequoia import optimize_tree, select_hardware_aware, selected_child_probabilities

ACCEPTANCE = selected_child_probabilities([0.8, 0.5, 0.35, 0.25, 0.2, 0.15, 0.1, 0.1])  # B = 8


@pytest.mark.parametrize("max_nodes, max_depth", [(8, 4), (64, 8), (128, 12)])
def test_bench_optimize_tree(benchmark, max_nodes, max_depth):
    table = benchmark(optimize_tree, acceptance=ACCEPTANCE, max_nodes=max_nodes, max_depth=max_depth)
    g = table.g(max_nodes, max_depth)
    assert g is not None and 1.0 <= g <= min(max_nodes, max_depth + 1)


def test_bench_select_hardware_aware(benchmark):
    table = optimize_tree(acceptance=ACCEPTANCE, max_nodes=128, max_depth=12)
    verify_cost = [1.0 + 0.004 * n for n in range(128)]
    choice = benchmark(select_hardware_aware, table, verify_cost=verify_cost, draft_cost=0.05)
    assert 2 <= choice.n <= 128 and choice.time_per_token < 1.0
