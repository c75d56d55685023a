"""Pareto fronts: dominance in both directions, ties, missing values and bad arguments."""

from __future__ import annotations

import math

import pytest

from mcp2026.bench.pareto import pareto_front


def test_throughput_up_latency_down():
    points = [
        {"tput": 100, "lat": 50},  # front: fastest
        {"tput": 200, "lat": 80},  # front
        {"tput": 150, "lat": 90},  # dominated by 200@80
        {"tput": 300, "lat": 200},  # front: most throughput
        {"tput": 90, "lat": 60},  # dominated by 100@50
    ]
    assert pareto_front(points, minimize=["lat"], maximize=["tput"]) == [0, 1, 3]


def test_two_minimized_keys_and_ties():
    points = [
        {"ppl": 5.0, "lat": 10.0},
        {"ppl": 5.0, "lat": 10.0},
        {"ppl": 5.0, "lat": 11.0},
        {"ppl": 4.0, "lat": 30},
    ]
    # Equal points do not dominate each other; 5.0@11 is beaten by 5.0@10 (equal PPL, lower latency).
    assert pareto_front(points, minimize=["ppl", "lat"]) == [0, 1, 3]


def test_single_objective_keeps_only_the_best():
    assert pareto_front([{"x": 3}, {"x": 1}, {"x": 2}, {"x": 1}], minimize=["x"]) == [1, 3]


def test_points_missing_an_objective_take_no_part():
    points = [
        {"ppl": None, "lat": 1.0},
        {"ppl": 5.0, "lat": 2.0},
        {"ppl": math.nan, "lat": 0.5},
        {"lat": 0.1},
    ]
    assert pareto_front(points, minimize=["ppl", "lat"]) == [1]
    assert pareto_front([], minimize=["lat"]) == []


def test_bad_arguments():
    with pytest.raises(ValueError, match="at least one key"):
        pareto_front([{"a": 1}])
    with pytest.raises(ValueError, match="both minimized and maximized"):
        pareto_front([{"a": 1}], minimize=["a"], maximize=["a"])
