"""tnt_rewards: hand-worked packed batches for every scheme, edge cases, and random batches vs the reference."""

from __future__ import annotations

import pytest
import torch

from fasttnt_kernels import SCHEMES, RewardValues, TntRewards, tnt_rewards, tnt_rewards_reference

from checks import DEVICE, assert_bool_written

END = 7  # the `</think>` id of these tests


def _pack(responses, ids_dtype=torch.int64):
    ids = torch.tensor([t for r in responses for t in r], dtype=ids_dtype, device=DEVICE)
    cu = torch.zeros(len(responses) + 1, dtype=torch.int64, device=DEVICE)
    cu[1:] = torch.tensor([len(r) for r in responses], device=DEVICE).cumsum(0)
    return ids, cu


def _both(responses, correct, group_size, **kw) -> TntRewards:
    """The Triton result, after checking that it equals the reference's exactly and wrote every element."""
    ids, cu = _pack(responses)
    correct = torch.tensor(correct, dtype=torch.bool, device=DEVICE)
    got = tnt_rewards(ids, cu, correct, group_size, END, **kw)
    want = tnt_rewards_reference(ids, cu, correct, group_size, END, **kw)
    _assert_equal(got, want)
    return got


def _assert_equal(got: TntRewards, want: TntRewards) -> None:
    assert_bool_written(got.non_thinking, "non_thinking")
    assert got.rewards.dtype == torch.float32 and got.limit.dtype == torch.float32
    assert got.non_thinking.dtype == torch.bool and got.solution_len.dtype == torch.int32
    for name, a, b in zip(TntRewards._fields, got, want, strict=True):
        assert torch.equal(a, b), f"{name}: {a} vs {b}"


def _values(t):
    return t.cpu().tolist()


def test_hand_worked_tnt_batch(triton_path):
    # query 0 (K=4): thinking, solution 2 tokens | thinking, solution 4 | non-thinking, 6 tokens | non-thinking, 7
    #   L = 2 * mean(2, 4) = 6: the 6-token answer is within (|y| <= L), the 7-token one is one over
    # query 1 (K=4): no thinking sample at all, so L = fallback_limit = 5
    responses = [
        [1, 2, END, 3, 4],
        [1, END, 3, 4, 5, 6],
        [END, 1, 2, 3, 4, 5],
        [END, 1, 2, 3, 4, 5, 6],
        [END, 1],
        [END, 1, 2, 3, 4],
        [END, 1, 2, 3, 4, 5],
        [END, 9],
    ]
    correct = [True, False, True, True, True, False, True, False]
    out = _both(responses, correct, 4, omega=2.0, fallback_limit=5)
    assert _values(out.limit) == [6.0, 5.0]
    assert _values(out.solution_len) == [2, 4, 5, 6, 1, 4, 5, 1]
    assert _values(out.non_thinking) == [False, False, True, True, True, True, True, True]
    #          think ok, think wrong, direct ok within, direct ok over | ok, wrong, ok but 6 > 5, wrong
    assert _values(out.rewards) == [1.0, 0.0, 2.0, -2.0, 2.0, -1.0, -2.0, -1.0]


def test_schemes_differ_only_in_the_reward(triton_path):
    responses = [[1, END, 2], [END, 1, 2, 3, 4, 5, 6, 7, 8], [END, 1], [3, 4, 5]]
    correct = [True, True, False, True]
    tnt = _both(responses, correct, 4, scheme="tnt")  # L = 2 * 1 = 2
    no_limit = _both(responses, correct, 4, scheme="no-limit")
    uniform = _both(responses, correct, 4, scheme="uniform-limit", uniform_limit=8)
    binary = _both(responses, correct, 4, scheme="binary")
    assert _values(tnt.limit) == [2.0]
    assert _values(tnt.rewards) == [1.0, -2.0, -1.0, 1.0]  # 9-token direct answer is over 2
    assert _values(no_limit.limit) == [float("inf")]
    assert _values(no_limit.rewards) == [1.0, 2.0, -1.0, 1.0]  # the hack pays
    assert _values(uniform.limit) == [8.0]
    assert _values(uniform.rewards) == [1.0, -2.0, -1.0, 1.0]  # 9 > 8
    assert _values(binary.rewards) == [1.0, 1.0, 0.0, 1.0]
    for out in (no_limit, uniform, binary):
        assert torch.equal(out.non_thinking, tnt.non_thinking)
        assert torch.equal(out.solution_len, tnt.solution_len)


def test_edge_cases(triton_path):
    responses = [
        [],  # empty: thinking (no first token), no solution, and wrong even if the verifier said right
        [1, 2, 3],  # thinking that never closes: left out of the mean
        [END, END, 2, END],  # several `</think>`: the first one counts, so solution 3 tokens
        [4, END, END, 5],  # thinking, first `</think>` at 1: solution 2 tokens
    ]
    out = _both(responses, [True, True, True, True], 4)
    assert _values(out.solution_len) == [-1, -1, 3, 2]
    assert _values(out.non_thinking) == [False, False, True, False]
    assert _values(out.limit) == [4.0]  # 2 * mean(2): only the closed thinking response counts
    assert _values(out.rewards) == [0.0, 1.0, 2.0, 1.0]


def test_thinking_that_never_closes_falls_back(triton_path):
    # the only thinking responses have no solution part: no mean to take, so the fallback limit applies
    out = _both([[1, 2, 3], [END, 1, 2], [END, 1, 2, 3, 4]], [False, True, True], 3, fallback_limit=4)
    assert _values(out.limit) == [4.0]
    assert _values(out.rewards) == [0.0, 2.0, -2.0]


def test_long_responses_cross_blocks(triton_path):
    # `</think>` past the first 1024-token block, and a non-thinking answer thousands of tokens long
    long_think = [1] * 1500 + [END] + [2] * 600
    long_direct = [END] + [3] * 2500
    out = _both([long_think, long_direct, [1] * 3000, [END, 1]], [True, True, True, True], 4, omega=2.0)
    assert _values(out.solution_len) == [600, 2500, -1, 1]
    assert _values(out.limit) == [1200.0]
    assert _values(out.rewards) == [1.0, -2.0, 1.0, 2.0]


def test_custom_values_and_group_size_one(triton_path):
    values = RewardValues(think_correct=0.5, think_wrong=-0.5, direct_correct=1.5, direct_wrong=-1.5, over_limit=-3)
    out = _both([[END, 1], [1, END, 2], [END] + [1] * 20], [True, False, True], 1, values=values, fallback_limit=10)
    # group size 1: each query's limit comes from itself alone
    assert _values(out.limit) == [10.0, 2.0, 10.0]
    assert _values(out.rewards) == [1.5, -0.5, -3.0]


@pytest.mark.parametrize("scheme", SCHEMES)
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_random_batches_match_reference(triton_path, scheme, ids_dtype):
    # 24 queries x 8 samples; lengths 0-300, `</think>` at random places (often none, often first, often twice)
    responses = []
    for _ in range(24 * 8):
        n = int(torch.randint(0, 300, ()))
        r = torch.randint(0, 6, (n,))
        kind = int(torch.randint(0, 4, ()))
        if n and kind == 0:
            r[0] = END
        if n and kind in (1, 2):
            r[torch.randint(0, n, (1 + kind,))] = END
        responses.append(r.tolist())
    ids, cu = _pack(responses, ids_dtype)
    cu = cu.to(ids_dtype)
    correct = torch.rand(len(responses), device=DEVICE) < 0.5
    kw = dict(scheme=scheme, omega=1.7, fallback_limit=120.0, uniform_limit=90.0)
    got = tnt_rewards(ids, cu, correct, 8, END, **kw)
    _assert_equal(got, tnt_rewards_reference(ids, cu, correct, 8, END, **kw))
    assert got.non_thinking.any() and (~got.non_thinking).any()


def test_limits_that_need_a_correctly_rounded_division(triton_path):
    # 3 and 7 thinking samples (not powers of two) whose limit is a whole number of tokens, met exactly by a
    # direct answer: an approximate division (GPU `/` compiles to div.full.f32) could put L an ulp below |y|
    for solution_lens, omega, limit in (
        ([1, 1, 1], 2.0, 2.0),
        ([1, 2, 3, 4, 5, 6, 0], 2.0, 6.0),
        ([5, 2, 4], 3.0, 11.0),
    ):
        thinking = [[1] + [END] + [2] * n for n in solution_lens]
        at_limit = [END] + [3] * (int(limit) - 1)
        over = [END] + [3] * int(limit)
        k = len(thinking) + 2
        out = _both([*thinking, at_limit, over], [True] * k, k, omega=omega)
        assert _values(out.limit) == [limit]
        assert _values(out.rewards)[-2:] == [2.0, -2.0]


def test_no_host_sync(triton_path):
    ids, cu = _pack([[END, 1], [1, END]])
    correct = torch.tensor([True, False], device=DEVICE)
    if DEVICE.type == "cuda":  # a synchronising call raises in this mode
        torch.cuda.set_sync_debug_mode("error")
    try:
        out = tnt_rewards(ids, cu, correct, 2, END)
    finally:
        if DEVICE.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    assert all(t.device == ids.device for t in out)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"scheme": "adaptive"}, ValueError, "scheme must be one of"),
        ({"scheme": "uniform-limit"}, ValueError, "uniform_limit must be >= 0 under scheme='uniform-limit'"),
        ({"omega": 0.0}, ValueError, "omega"),
        ({"group_size": 3}, ValueError, "dividing the 4 responses"),
        ({"correct": torch.ones(4)}, TypeError, "bool"),
        ({"correct": torch.ones(3, dtype=torch.bool)}, ValueError, "cu_seqlens must have 4 elements"),
    ],
)
def test_bad_input_names_the_problem(kwargs, error, match):
    ids, cu = _pack([[END], [1], [2], [3]])
    args = dict(
        response_ids=ids, cu_seqlens=cu, correct=torch.ones(4, dtype=torch.bool), group_size=2, think_end_id=END
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        tnt_rewards(**args)
