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


def test_a_groups_workload_runs_its_prompt_once_and_its_trained_responses():
    from fasttnt.balance import group_workload

    sizes = {"hidden_size": 8, "intermediate_size": 8}  # 4 H + 3 I = 56
    assert group_workload(10, [], **sizes) == 0.0  # no response trains: the forward does not run the group
    assert group_workload(10, [5], **sizes) == pytest.approx(workload(15, **sizes))
    # two responses of one prompt packed: 10 + 5 + 7 tokens; attention 10^2 + (15^2 - 10^2) + (17^2 - 10^2) over 56
    assert group_workload(10, [5, 7], **sizes) == pytest.approx(22 + (100 + 125 + 189) / 56)


def test_the_workload_counts_attention_against_the_projections_and_mlp():
    # R1-Distill-Qwen-1.5B: 4 H + 3 I = 4 * 1536 + 3 * 8960 = 33,024; a sequence of that length costs twice its tokens
    assert workload(33_024, 1536, 8960) == pytest.approx(2 * 33_024)
    assert workload(100, 1536, 8960) == pytest.approx(100 * (1 + 100 / 33_024))


def test_no_part_is_empty_while_there_are_items_for_each():
    # equal sums everywhere (zero weights included): an empty subset sorts as the lightest, so it is filled first
    for weights in ([0.0] * 5, [1.0] * 4, [0.0, 0.0, 5.0, 0.0], [3.0, 3.0, 3.0]):
        assignment = karmarkar_karp(weights, 3)
        assert all(assignment), (weights, assignment)
    rng = random.Random(1)
    for _ in range(200):
        parts = rng.randint(2, 8)
        weights = [rng.choice([0.0, 1.0, rng.lognormvariate(0, 2)]) for _ in range(rng.randint(parts, 3 * parts))]
        assert all(karmarkar_karp(weights, parts)), weights


def _dealt(mode: str) -> list[dict]:
    """Both ranks' JSON lines of ``support/deal_ranks.py`` over a real 2-rank gloo group."""
    import json
    import os

    from support import small, varied

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": varied.PYTHONPATH}
    ranks = small.run_ranks("deal_ranks", mode, env=env, timeout=300)
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-3000:]
    return sorted((json.loads(r.stdout.strip().splitlines()[-1]) for r in ranks), key=lambda r: r["rank"])


def _tokens(rows: list[dict], trained: list[bool]) -> int:
    """The tokens the update's forward runs on: each group's prompt once and its trained responses."""
    from support.deal_ranks import K

    total = 0
    for g in range(0, len(rows), K):
        responses = [len(r["response"]) for r, t in zip(rows[g : g + K], trained[g : g + K], strict=True) if t]
        total += len(rows[g]["prompt"]) + sum(responses) if responses else 0
    return total


def _drawn(rank: int) -> list[dict]:
    from support.deal_ranks import drawn_inputs, rows_of

    return rows_of(drawn_inputs(rank))


def test_the_dealt_rows_are_the_drawn_ones_each_mini_batch_on_near_equal_work():
    from support.deal_ranks import GROUPS, MINI_BATCHES, SIZES, K, trained_rows

    from fasttnt.data import PromptMode
    from fasttnt.engines.batch import FORCED_CODES

    results = _dealt("balance")
    drawn = {row["advantage"]: (rank, i, row) for rank in (0, 1) for i, row in enumerate(_drawn(rank))}
    per_mb = GROUPS // MINI_BATCHES

    def c(n: int) -> float:
        return workload(n, **SIZES)

    def group_cost(rows: list[dict]) -> float:  # the prompt once, each trained response over prompt and itself
        trained = [r for r in rows if trained_of[r["advantage"]]]
        p = len(rows[0]["prompt"])
        return c(p) + sum(c(p + len(r["response"])) - c(p) for r in trained) if trained else 0.0

    trained_of = {row["advantage"]: bool(trained_rows(rank)[i]) for rank, i, row in drawn.values()}
    assert not all(trained_of.values()), "precondition: some rows do not train"

    seen, moved = [], 0
    for result in results:
        rank, rows, counts = result["rank"], result["rows"], result["mini_batch_groups"]
        assert len(counts) == MINI_BATCHES and sum(counts) * K == len(rows) and all(counts)
        start = 0
        for mb, n in enumerate(counts):
            block = rows[start * K : (start + n) * K]
            start += n
            for j in range(0, len(block), K):  # each group whole, its rows adjacent and in order
                sources = [drawn[row["advantage"]] for row in block[j : j + K]]
                source_rank, first, _ = sources[0]
                assert first % K == 0 and [s[:2] for s in sources] == [(source_rank, first + i) for i in range(K)]
                assert first // K // per_mb == mb  # the group is of this mini-batch on the rank that drew it
                moved += source_rank != rank
            for row in block:
                original = drawn[row["advantage"]][2]
                if original["forced"] is None:  # rank 1's rows were all free: filled with the free code
                    original = {**original, "forced": FORCED_CODES[PromptMode.FREE]}
                assert row == original  # every field of the row, exactly
                seen.append(row["advantage"])
        assert result["tokens"][rank] == _tokens(rows, [trained_of[r["advantage"]] for r in rows])
    assert sorted(seen) == sorted(drawn)  # every drawn row dealt once
    assert moved == results[0]["moved"] == results[1]["moved"] > 0  # precondition: rows travelled
    # per mini-batch, the ranks' work against the drawn split's (rank 0 drew every long response) and against the
    # best split of its 4 groups, which the differencing method reaches within 7/6 for 2 parts
    for mb in range(MINI_BATCHES):
        groups = {}  # (rank drawn on, group there) -> workload, of this mini-batch's groups
        for rank in (0, 1):
            rows = _drawn(rank)
            for g in range(mb * per_mb, (mb + 1) * per_mb):
                groups[rank, g] = group_cost(rows[g * K : (g + 1) * K])
        before = [sum(w for (rank, _), w in groups.items() if rank == r) for r in (0, 1)]
        after = []
        for result in results:
            counts, rows = result["mini_batch_groups"], result["rows"]
            block = rows[sum(counts[:mb]) * K : sum(counts[: mb + 1]) * K]
            after.append(sum(group_cost(block[g : g + K]) for g in range(0, len(block), K)))
        assert sum(after) == pytest.approx(sum(before))
        assert max(before) > 1.2 * sum(before) / 2  # precondition: the drawn split is off
        assert max(after) <= 7 / 6 * _optimum(list(groups.values()), 2) * (1 + 1e-12) < max(before)
    logged = results[0]["logged"]
    assert logged == results[1]["logged"]
    assert logged["rank_tokens_max_over_mean"] < logged["rank_tokens_max_over_mean_drawn"]
    assert [logged["rank_tokens_0"], logged["rank_tokens_1"]] == results[0]["tokens"]


def test_without_balance_each_rank_keeps_its_rows_and_counts_its_tokens():
    from support.deal_ranks import GROUPS, MINI_BATCHES, trained_rows

    for result in _dealt("keep"):
        rows, drawn = result["rows"], _drawn(result["rank"])
        assert result["moved"] == 0 and result["mini_batch_groups"] == [GROUPS // MINI_BATCHES] * MINI_BATCHES
        assert rows == drawn  # the inputs themselves (rank 1's forced stays None: nothing was gathered)
        assert result["tokens"] == result["tokens_before"]
        assert result["tokens"][result["rank"]] == _tokens(rows, trained_rows(result["rank"]).tolist())


def test_the_curves_of_a_run_over_ranks_gain_the_ranks_row(tmp_path):
    from matplotlib.image import imread

    from fasttnt.plots import plot_curves, rank_count

    one = [{"step": s, "reward": 0.1 * s, "acc": 0.5, "len": 10.0, "non_thinking_ratio": 0.0} for s in (1, 2, 3)]
    for ranks in (2, 12):  # a line per rank, then the fewest, mean and most
        over = [{**row, **{f"rank_tokens_{r}": 100.0 + r * row["step"] for r in range(ranks)},
                 "rank_tokens_max_over_mean": 1.02, "rank_tokens_max_over_mean_drawn": 1.3, "moved_groups": 3.0,
                 "time_rank_wait": 0.01, "time_update": 0.5} for row in one]  # fmt: skip
        assert rank_count(over) == ranks and rank_count(one) == 0
        plot_curves(one, tmp_path / "one.png")
        plot_curves(over, tmp_path / "over.png")
        two_rows, three_rows = (imread(tmp_path / f"{name}.png").shape[0] for name in ("one", "over"))
        assert three_rows == pytest.approx(two_rows * 3 / 2, rel=0.01), "a third row of 3.5 inches"
