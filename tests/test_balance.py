"""fasttnt.balance: the largest differencing partition against brute force, and the workload's arithmetic."""

from __future__ import annotations

import itertools
import random

import pytest

from fasttnt.balance import karmarkar_karp, slowest_over_mean, workload


def _largest(weights, assignment) -> float:
    return max(sum(weights[i] for i in part) for part in assignment)


def _optimum(weights, parts: int) -> float:
    """The smallest possible largest part, by trying every assignment (small inputs only)."""
    best = float("inf")
    for labels in itertools.product(range(parts), repeat=len(weights)):
        sums = [0.0] * parts
        for w, label in zip(weights, labels, strict=True):
            sums[label] += w
        best = min(best, max(sums))
    return best


@pytest.mark.parametrize("parts", [2, 3])
def test_each_item_lands_once_and_the_largest_part_is_near_the_optimum(parts):
    # 40 random instances of 7-9 items: every index in exactly one part, and the largest part within 7/6 of the
    # optimum for 2 parts (the differencing method's proven ratio, Fischetti and Martello 1987) and 4/3 for 3
    # (Michiels et al. 2003's bound for k-way differencing, 4/3 - 1/(3k))
    rng = random.Random(0)
    bound = 7 / 6 if parts == 2 else 4 / 3 - 1 / (3 * parts)
    for _ in range(40):
        weights = [rng.lognormvariate(0, 1) for _ in range(rng.randint(7, 9))]
        assignment = karmarkar_karp(weights, parts)
        assert len(assignment) == parts
        assert sorted(i for part in assignment for i in part) == list(range(len(weights)))
        assert _largest(weights, assignment) <= bound * _optimum(weights, parts) * (1 + 1e-12)


def test_hand_worked_partitions():
    # [8, 7, 6, 5, 4] in 2, the method's textbook miss: 8 - 7 = 1, 6 - 5 = 1, 4 - 1 = 3, 3 - 1 = 2, so parts of 16
    # and 14 ({7, 5, 4} against {8, 6}), where {8, 7} and {6, 5, 4} are 15 each
    weights = [8, 7, 6, 5, 4]
    assignment = karmarkar_karp(weights, 2)
    assert sorted(sum(weights[i] for i in part) for part in assignment) == [14, 16]
    assert _optimum(weights, 2) == 15
    assert karmarkar_karp([], 3) == [[], [], []]
    assert karmarkar_karp([5.0], 3) == [[0], [], []]
    assert slowest_over_mean([1.0, 1.0, 1.0, 1.0], [[0, 1], [2, 3]]) == 1.0
    assert slowest_over_mean([3.0, 1.0], [[0], [1]]) == 1.5


def test_the_partition_is_deterministic_and_refuses_bad_input():
    weights = [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]  # ties everywhere
    assert karmarkar_karp(weights, 3) == karmarkar_karp(list(weights), 3)
    with pytest.raises(ValueError, match="parts must be >= 1"):
        karmarkar_karp(weights, 0)
    with pytest.raises(ValueError, match="at index 2"):
        karmarkar_karp([1.0, 2.0, float("nan")], 2)


def test_the_workload_counts_attention_against_the_projections_and_mlp():
    # R1-Distill-Qwen-1.5B: 4 H + 3 I = 4 * 1536 + 3 * 8960 = 33,024; a sequence of that length costs twice its tokens
    assert workload(33_024, 1536, 8960) == pytest.approx(2 * 33_024)
    assert workload(100, 1536, 8960) == pytest.approx(100 * (1 + 100 / 33_024))
