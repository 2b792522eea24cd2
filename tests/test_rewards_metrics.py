"""Reward schemes on hand-worked packed batches, and the metrics on hand-worked examples. A theme file over
fasttnt/rewards.py, scoring.py and metrics.py: the same hand-worked batches are scored, rewarded and measured."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fasttnt import scoring
from fasttnt.embedded.char_tokenizer import THINK_END, build_char_tokenizer
from fasttnt.embedded.synthetic import HACK_MARKERS, make_problem
from fasttnt.engines import RolloutBatch, pack_sequences
from fasttnt.metrics import (
    MATH_MARKERS,
    HackMarkers,
    choice_metrics,
    hack_flags,
    levels_present,
    mode_accuracies,
    rollout_metrics,
    to_floats,
    token_efficiency,
)
from fasttnt.rewards import REWARD_SCHEMES, RewardConfig, compute_rewards

TOK = build_char_tokenizer()
END_ID = TOK.convert_tokens_to_ids(THINK_END)


def _pack(texts, group_size):
    ids = [TOK(t, add_special_tokens=False)["input_ids"] for t in texts]
    cu = torch.tensor([0, *itertools.accumulate(len(x) for x in ids)])
    flat = torch.tensor([i for x in ids for i in x])
    return RolloutBatch.of_packed(flat, cu, group_size), [len(x) for x in ids]


def _query():
    # one query, K = 4, built from the synthetic task's own response forms:
    #   thinking right (solution "\boxed{132}" = 11 tokens), direct right (1 + 11 = 12 tokens),
    #   hacked right (steps after </think>: 1 + 22 + 11 = 34 tokens), direct wrong (12 tokens)
    p = make_problem(47, 85, 2)
    return [p.thinking, p.direct, p.hacked, "</think>\\boxed{133}"], [True, True, True, False]


def test_schemes_on_a_hand_worked_query():
    texts, correct = _query()
    batch, lengths = _pack(texts, 4)
    assert lengths == [34, 12, 34, 12]
    correct = torch.tensor(correct)
    expected = {
        # L = 2 * 11 = 22: the direct answer (12) is within, the hacked one (34) is over
        "tnt": ([1.0, 2.0, -2.0, -1.0], 22.0),
        "no-limit": ([1.0, 2.0, 2.0, -1.0], math.inf),  # the hack pays as much as an honest direct answer
        "uniform-limit": ([1.0, 2.0, 2.0, -1.0], 40.0),  # a cap of 40 tokens is too loose for this query
        "binary": ([1.0, 1.0, 1.0, 0.0], math.inf),
    }
    for scheme, (rewards, limit) in expected.items():
        out = compute_rewards(batch, correct, END_ID, RewardConfig(scheme=scheme, uniform_limit=40))
        assert out.rewards.tolist() == rewards, scheme
        assert out.limit.tolist() == [limit], scheme
        assert out.non_thinking.tolist() == [False, True, True, True]
    tight = compute_rewards(batch, correct, END_ID, RewardConfig(scheme="uniform-limit", uniform_limit=11))
    assert tight.rewards.tolist() == [1.0, -2.0, -2.0, -2.0]  # too tight: even the honest direct answer loses


def test_scoring_judges_truncated_responses_wrong_and_flags_the_hack():
    # the query's four responses through the real verifier; the first two were cut by the length budget
    texts, _ = _query()
    ids = [TOK(t, add_special_tokens=False)["input_ids"] for t in texts]
    batch = RolloutBatch([[]] * 4, *pack_sequences(ids), torch.tensor([True, True, False, False]), 4)
    scores = scoring.score(TOK, batch, ["132"] * 4, eos_ids={TOK.eos_token_id}, reward=RewardConfig(),
                           think_end_id=END_ID, markers=HACK_MARKERS)  # fmt: skip
    assert scores.judged.correct.tolist() == [False, False, True, False]  # right answers, but truncated
    assert scores.rewards.rewards.tolist() == [0.0, -1.0, -2.0, -1.0]  # the hack is over its limit of 22
    assert scores.hacked.tolist() == [False, False, True, False]
    assert scores.judged.texts == texts


def test_reward_values_and_fallback_come_from_the_config():
    texts = ["</think>\\boxed{1}", "</think>\\boxed{2}"]  # no thinking sample: the fallback limit applies
    batch, lengths = _pack(texts, 2)
    cfg = RewardConfig(fallback_limit=lengths[0], direct_correct=3.0, direct_wrong=-0.5, over_limit=-4.0)
    out = compute_rewards(batch, torch.tensor([True, False]), END_ID, cfg)
    assert out.limit.tolist() == [float(lengths[0])]
    assert out.rewards.tolist() == [3.0, -0.5]
    longer = compute_rewards(batch, torch.tensor([True, False]), END_ID, RewardConfig(fallback_limit=lengths[0] - 1))
    assert longer.rewards.tolist() == [-2.0, -2.0]


def test_unknown_scheme_lists_the_choices():
    batch, _ = _pack(["</think>1"], 1)
    with pytest.raises(ValueError, match="unknown reward scheme 'adaptive'; choose one of: tnt, no-limit"):
        compute_rewards(batch, torch.tensor([True]), END_ID, RewardConfig(scheme="adaptive"))
    with pytest.raises(ValueError, match="already registered"):
        REWARD_SCHEMES.add("tnt", lambda *a: None)


# -- metrics ----------------------------------------------------------------------------------------------------


def test_token_efficiency_matches_the_paper():
    # TNT paper, R1-Distill-Qwen-1.5B: 41.0% at 5,893 tokens -> TE 0.53; the base model's 37.0% at 12,736 -> 0.33
    assert round(token_efficiency(41.0, 5893), 2) == 0.53
    assert round(token_efficiency(37.0, 12736), 2) == 0.33
    assert token_efficiency(50.0, 0) == 0.0


def test_rollout_metrics_by_hand():
    correct = torch.tensor([True, False, True, True])
    non_thinking = torch.tensor([False, False, True, True])
    lengths = torch.tensor([100, 60, 10, 30])
    hacked = torch.tensor([False, False, False, True])
    limit = torch.tensor([20.0, math.inf])
    m = to_floats(
        rollout_metrics(
            correct=correct,
            non_thinking=non_thinking,
            lengths=lengths,
            hacked=hacked,
            truncated=torch.tensor([False, True, False, False]),
            limit=limit,
            rewards=torch.tensor([1.0, 0.0, 2.0, -2.0]),
        )
    )
    assert m["acc"] == 0.75
    assert m["len"] == 50.0 and m["len_thinking"] == 80.0 and m["len_non_thinking"] == 20.0
    assert m["non_thinking_ratio"] == 0.5 and m["hack_rate"] == 0.5
    assert m["truncated_ratio"] == 0.25 and m["reward"] == 0.25
    assert m["limit_mean"] == 20.0 and m["limit_min"] == 20.0 and m["limit_max"] == 20.0  # inf is no limit
    assert math.isclose(m["te"], token_efficiency(75.0, 50.0), rel_tol=1e-6)


def test_metrics_without_a_mode_are_zero_not_nan():
    m = to_floats(
        rollout_metrics(
            correct=torch.tensor([True, True]),
            non_thinking=torch.tensor([False, False]),
            lengths=torch.tensor([5, 7]),
            hacked=torch.tensor([False, False]),
            limit=torch.tensor([math.inf]),
        )
    )
    assert m["len_non_thinking"] == 0.0 and m["hack_rate"] == 0.0 and m["limit_mean"] == 0.0
    assert not any(math.isnan(v) for v in m.values())


MATH_CASES = [
    ("</think>The sum is 5. Wait, let me recompute: 6. \\boxed{6}", True, True),
    ("</think>Alternatively, we could factor. \\boxed{3}", True, True),
    ("</think>Hmm, so x = 2. \\boxed{2}", True, True),
    ("</think>We double-check: 2+2=4. \\boxed{4}", True, True),
    ("</think>Let me check the units. \\boxed{4}", True, True),
    ("</think>Factor and solve: x = 2. \\boxed{2}", True, False),
    ("</think>A waiting time of 5 minutes. \\boxed{5}", True, False),  # whole words only: "waiting" is not "Wait"
    ("</think>Hmmm. \\boxed{5}", True, False),
    ("Wait, this is a thinking response.</think>\\boxed{5}", False, False),  # thinking responses are never flagged
    ("</think>The Wait-Smith theorem gives \\boxed{5}", True, True),  # case-aware whole word: a known false positive
]


@pytest.mark.parametrize(("text", "non_thinking", "expected"), MATH_CASES)
def test_math_hack_markers(text, non_thinking, expected):
    assert hack_flags([text], [non_thinking], MATH_MARKERS) == [expected]


def test_synthetic_hack_markers():
    p = make_problem(47, 85, 2)
    assert hack_flags([p.hacked, p.direct, p.thinking], [True, True, False], HACK_MARKERS) == [True, False, False]
    with pytest.raises(ValueError, match="at least one"):
        HackMarkers()


def test_decoding_drops_the_final_eos_but_keeps_think_end():
    # with two EOS ids (a generation config's second, here <|user|>), a response ended by either reads the same
    from fasttnt.engines import decode_responses

    ids = TOK("</think>The answer is 5", add_special_tokens=False)["input_ids"]
    eos, second = TOK.eos_token_id, TOK.convert_tokens_to_ids("<|user|>")
    assert decode_responses(TOK, [[*ids, eos], [*ids, second]], {eos, second}) == ["</think>The answer is 5"] * 2
    # an id that is not one of the run's EOS ids is a token of the text
    assert decode_responses(TOK, [[*ids, second]], {eos}) == ["</think>The answer is 5<|user|>"]


def test_mode_accuracies_by_hand_with_a_problem_without_a_level():
    # rows: thinking right/wrong at level 1, a free direct right at level 2, a forced direct wrong with no level (-1)
    correct = torch.tensor([True, False, True, False])
    non_thinking = torch.tensor([False, False, True, True])
    free = torch.tensor([True, True, True, False])
    levels = torch.tensor([1, 1, 2, -1])
    assert levels_present(levels) == [1, 2]
    m = mode_accuracies(correct, non_thinking, free, forced_direct=~free, levels=levels, present=[1, 2])
    m = {k: v.item() for k, v in m.items()}
    assert m["acc_thinking"] == 0.5 and m["acc_free_direct"] == 1.0 and m["acc_forced_direct"] == 0.0
    assert m["acc_thinking_l1"] == 0.5 and m["acc_free_direct_l2"] == 1.0
    assert math.isnan(m["acc_thinking_l2"]) and math.isnan(m["acc_forced_direct_l1"])  # no response there
    assert not any(k.endswith("_l-1") for k in m)  # a missing level is no level of its own
    # level 0 is a level (a dataset may count from 0), only -1 is none
    assert levels_present(torch.tensor([0, -1, 2, 0])) == [0, 2]


def test_think_end_prob_is_the_arithmetic_mean_of_the_probabilities():
    # p(</think>) of three groups: 0.5, 0.1 and 0.0 (a model that never stops thinking): (0.5 + 0.1 + 0) / 3 = 0.2;
    # a geometric mean would give 0, a mean of the log-probs exponentiated exp(-inf) = 0, a constant 0.5. By level:
    # the first two groups are level 1 (0.3), the third level 2 (0)
    logp = torch.tensor([0.5, 0.1, 0.0]).log()
    rows = torch.tensor([1, 1, 1, 1, 2, 2])  # groups of 2 rows
    m = to_floats(choice_metrics(torch.zeros(6), torch.zeros(6, dtype=torch.bool), rows, [1, 2],
                                 think_end_logp=logp, group_levels=rows[::2]))  # fmt: skip
    assert math.isclose(m["think_end_prob"], 0.2, rel_tol=1e-6)
    assert math.isclose(m["think_end_prob_l1"], 0.3, rel_tol=1e-6) and m["think_end_prob_l2"] == 0.0


def test_the_floored_and_freely_chosen_shares_by_level():
    # groups of 2 rows: levels 1, 1, 2; the fade below the floor in the second and third groups; the free rows are
    # the second of each group, of which level 1's first chose </think> and its second did not, level 2's did
    rows = torch.tensor([1, 1, 1, 1, 2, 2])
    non_thinking = torch.tensor([True, True, True, False, True, True])
    free = torch.tensor([False, True] * 3)
    below = torch.tensor([False, True, True])
    m = to_floats(choice_metrics(torch.zeros(6), non_thinking, rows, [1, 2], think_end_logp=torch.zeros(3),
                                 group_levels=rows[::2], below_floor=below, free=free))  # fmt: skip
    assert m["mode_floored_l1"] == 0.5 and m["mode_floored_l2"] == 1.0
    assert m["free_non_thinking_ratio_l1"] == 0.5 and m["free_non_thinking_ratio_l2"] == 1.0
    # the overall shares are the update's mode_floored and rollout_metrics' free_non_thinking_ratio, not these
    assert "mode_floored" not in m and "free_non_thinking_ratio" not in m
    # a level without free rows: NaN (left out of the trainer's row)
    m = to_floats(
        choice_metrics(torch.zeros(6), non_thinking, rows, [1, 2], free=torch.tensor([True] * 4 + [False] * 2))
    )
    assert m["free_non_thinking_ratio_l1"] == 0.75 and math.isnan(m["free_non_thinking_ratio_l2"])


def test_the_choice_metrics_by_hand():
    # level 1: thinking 1, 0 (mean 0.5), direct 1.05 (forced or free alike); level 2: thinking 1, 1, direct 0.05,
    # 0.05; a row without a level (-1) counts overall only. Overall: thinking (1 + 0 + 1 + 1) / 4, direct
    # (1.05 + 0.05 + 0.05 + 2) / 4
    rewards = torch.tensor([1.0, 0.0, 1.05, 1.0, 1.0, 0.05, 0.05, 2.0])
    non_thinking = torch.tensor([False, False, True, False, False, True, True, True])
    levels = torch.tensor([1, 1, 1, 2, 2, 2, 2, -1])
    m = to_floats(choice_metrics(rewards, non_thinking, levels, levels_present(levels)))
    assert m["reward_thinking_l1"] == pytest.approx(0.5) and m["reward_direct_l1"] == pytest.approx(1.05)
    assert m["reward_thinking_l2"] == pytest.approx(1.0) and m["reward_direct_l2"] == pytest.approx(0.05)
    assert m["prefers_direct_l1"] == 1.0 and m["prefers_direct_l2"] == 0.0
    assert m["reward_thinking"] == pytest.approx(0.75) and m["reward_direct"] == pytest.approx(3.15 / 4)
    assert m["prefers_direct"] == 1.0
    assert not any(k.endswith("_l-1") for k in m) and "think_end_prob" not in m  # no probe given
    # a level with one mode only: no preference there (NaN, which the trainer leaves out of its row)
    m = to_floats(choice_metrics(rewards[:3], torch.tensor([False, False, False]), levels[:3], [1]))
    assert m["reward_thinking_l1"] == pytest.approx(2.05 / 3)
    assert math.isnan(m["reward_direct_l1"]) and math.isnan(m["prefers_direct_l1"])


def test_a_response_without_its_eos_is_truncated():
    # the budget ran out before EOS: no tokens at all (a zero budget) counts as cut too
    from fasttnt.engines.batch import truncated_without_eos

    eos, second = TOK.eos_token_id, TOK.convert_tokens_to_ids("<|user|>")
    assert truncated_without_eos([[], [5, eos], [5, 6], [eos], [5, second]], {eos}) == [True, False, True, False, True]
    # any of the run's EOS ids ends a response (a generation config's second)
    assert truncated_without_eos([[5, eos], [5, second], [second, 6]], {eos, second}) == [False, False, True]
