"""The choice between the modes as a bandit, through the real rewards, advantages, fade and loss kernel.

One prompt position and two first tokens: ``</think>`` (a direct answer, right with probability ``acc_direct``) and
a thinking token (right with ``acc_think``); a group of K = 8 answers 4 rows with ``</think>`` pre-filled and
samples 4 freely at temperature T, as the real configs' recipe does (``tnt+mix+acc``: a direct answer earns the
thinking reward plus a margin, AdaptThink's 0.05, under which the shared advantage's sign error is largest). The
exact test enumerates a group's outcomes, so its numbers are the estimator's expectation, the same on every
machine; the sampled one trains per-level logits with SGD and checks where each level ends.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fasttnt.advantages import step_advantages
from fasttnt.config import load_config
from fasttnt.data import PromptMode
from fasttnt.engines.batch import FORCED_CODES, RolloutBatch
from fasttnt.modes import CHOICE_POWER, CHOICE_SCALE, EVIDENCE_FLOOR, EVIDENCE_SCALE, ModeMix
from fasttnt.policy import UpdateInputs
from fasttnt.rewards import compute_rewards
from fasttnt_kernels import PolicyLossConfig, _common, clipped_policy_loss

END, THINK = 0, 1  # token ids of the bandit: </think> and a thinking answer's first token

K, FORCED = 8, 4
RECIPE = ["rollout.forced_non_thinking=0.5", "reward.direct_margin=0.05", "rollout.group_size=8"]
DELTA = 0.05

# (acc_direct, acc_think): direct better; thinking better by a little where both are almost always right (the case
# where a margin divided by the group's std goes the wrong way); thinking better by a lot; a tie under the margin
CASES = {"direct": (0.9, 0.6), "near": (0.92, 1.0), "thinking": (0.1, 0.9), "tie": (0.95, 1.0)}


def _accuracies(case: str | tuple[float, float]) -> tuple[float, float]:
    """(acc_direct, acc_think) of a named case or of a pair given as it is."""
    return CASES[case] if isinstance(case, str) else case


def _gap(case: str | tuple[float, float]) -> float:
    acc_direct, acc_think = _accuracies(case)
    return acc_direct + DELTA - acc_think  # R_N - R_T under the accuracy-aware table


def _groups(p: float, acc_direct: float, acc_think: float):
    """Every distinct outcome of a group, by counts (the advantages depend on a group's rows only as a multiset):
    (probability, first tokens (K,), correct (K,))."""
    out = []
    for right in range(FORCED + 1):  # forced direct rows right
        p_forced = math.comb(FORCED, right) * acc_direct**right * (1 - acc_direct) ** (FORCED - right)
        # the free rows: direct right, direct wrong, thinking right, thinking wrong
        cells = (p * acc_direct, p * (1 - acc_direct), (1 - p) * acc_think, (1 - p) * (1 - acc_think))
        for counts in itertools.product(range(K - FORCED + 1), repeat=4):
            if sum(counts) != K - FORCED:
                continue
            ways = math.factorial(K - FORCED) / math.prod(math.factorial(c) for c in counts)
            prob = p_forced * ways * math.prod(c**n for c, n in zip(cells, counts, strict=True))
            tokens = [END] * FORCED + [END] * (counts[0] + counts[1]) + [THINK] * (counts[2] + counts[3])
            correct = [i < right for i in range(FORCED)] + [True] * counts[0] + [False] * counts[1]
            correct += [True] * counts[2] + [False] * counts[3]
            out.append((prob, tokens, correct))
    return out


# the saturating choice's recipe: of K = 8, 4 rows forced direct, 2 forced thinking, 2 free; its halves (even and
# odd positions) each hold 2 forced direct rows, 1 forced thinking row and 1 free one. The evidence choice splits
# the same recipe's groups
SATURATING = ["rollout.forced_thinking=0.25", "loss.mode_advantage=saturating"]
EVIDENCE = ["rollout.forced_thinking=0.25", "loss.mode_advantage=evidence"]
HALF_POSITIONS = ((0, 2, 4, 6), (1, 3, 5, 7))


def _codes(overrides: list[str]) -> list[int]:
    """One group's forced codes (K,): forced direct rows, then forced thinking ones, then free ones."""
    thinking = 2 if SATURATING[0] in overrides else 0
    return ([FORCED_CODES[PromptMode.NON_THINKING]] * FORCED + [FORCED_CODES[PromptMode.THINKING]] * thinking
            + [0] * (K - FORCED - thinking))  # fmt: skip


def _half_outcomes(p: float, acc_direct: float, acc_think: float):
    """Every outcome of one half of a saturating group (2 forced direct rows, 1 forced thinking, 1 free):
    (probability, first tokens (4,), correct (4,))."""
    free = {(END, True): p * acc_direct, (END, False): p * (1 - acc_direct),
            (THINK, True): (1 - p) * acc_think, (THINK, False): (1 - p) * (1 - acc_think)}  # fmt: skip
    out = []
    for right in range(3):
        p_direct = math.comb(2, right) * acc_direct**right * (1 - acc_direct) ** (2 - right)
        for think_right in (True, False):
            p_think = acc_think if think_right else 1 - acc_think
            for (token, ok), p_free in free.items():
                correct = [i < right for i in range(2)] + [think_right, ok]
                out.append((p_direct * p_think * p_free, [END, END, THINK, token], correct))
    return out


def _saturating_groups(p: float, acc_direct: float, acc_think: float):
    """Every outcome of a saturating group, as its two independent halves: (probability, tokens (K,), correct (K,))."""
    halves = _half_outcomes(p, acc_direct, acc_think)
    out = []
    for (p_a, tok_a, ok_a), (p_b, tok_b, ok_b) in itertools.product(halves, halves):
        tokens, correct = [0] * K, [False] * K
        for positions, toks, oks in zip(HALF_POSITIONS, (tok_a, tok_b), (ok_a, ok_b), strict=True):
            for pos, token, ok in zip(positions, toks, oks, strict=True):
                tokens[pos], correct[pos] = token, ok
        out.append((p_a * p_b, tokens, correct))
    return out


def _loss(mix: ModeMix, cfg, logits: torch.Tensor, tokens: torch.Tensor, correct: torch.Tensor, weight, floor, T,
          codes: list[int]):  # fmt: skip
    """The real rewards, mode terms and loss of one-token responses ``tokens`` (S,) under per-group ``logits``
    (G, 2) at temperature T; ``weight`` (S,) scales each row's loss (an outcome's probability); ``codes`` (K,) a
    group's forced codes."""
    s = tokens.numel()
    cu = torch.arange(s + 1)
    rewards = compute_rewards(RolloutBatch.of_packed(tokens, cu, K), correct, END, cfg.reward)
    forced = torch.tensor(codes * (s // K), dtype=torch.int8)
    batch = RolloutBatch([[0]] * s, tokens, cu, torch.zeros(s, dtype=torch.bool), K, forced=forced)
    logp_all = torch.log_softmax(logits / T, dim=-1)  # (G, 2)
    logp = logp_all.repeat_interleave(K, 0).gather(1, tokens[:, None]).squeeze(1)  # (S,)
    end_logp = logp_all[:, END].detach()  # (G,) log pi_old(</think> | x)
    inputs = UpdateInputs(batch, *step_advantages(rewards, cfg, mix, end_logp), old_logp=logp.detach())
    terms, _ = mix.mode_token_terms(inputs, rewards.non_thinking, end_logp, END, floor_logp=floor)
    weights = weight if terms.is_weights is None else weight * terms.is_weights.to(weight.dtype)
    loss, _ = clipped_policy_loss(logp, terms.old_logp.to(logp.dtype), terms.advantages, cu,
                                  config=PolicyLossConfig.of(cfg.loss), is_weights=weights,
                                  first_advantages=terms.first_advantages)  # fmt: skip
    return loss, rewards


def expected_step(overrides: list[str], p: float, case: str | tuple[float, float], T: float,
                  floor: float | None = None):  # fmt: skip
    """The expected SGD step -E[dL/dz] on the logits (z_end, z_think) of one group at pi_T(</think>) = p, each
    outcome's gradient weighted by its probability, in units of one group's rows (the token-mean's 1 / N undone),
    and the step it makes on the choice's log-odds log p - log(1 - p) at T."""
    cfg = load_config(None, [*RECIPE, f"rollout.temperature={T}", *overrides])
    mix = ModeMix.of(cfg)
    groups = (_saturating_groups if SATURATING[0] in overrides else _groups)(p, *_accuracies(case))
    z0 = torch.tensor([T * math.log(p), T * math.log1p(-p)], dtype=torch.float64)
    logits = z0.repeat(len(groups), 1).requires_grad_(True)
    tokens = torch.tensor([t for _, toks, _ in groups for t in toks])
    correct = torch.tensor([c for _, _, ok in groups for c in ok])
    weight = torch.tensor([g[0] for g in groups], dtype=torch.float64).repeat_interleave(K) * tokens.numel()
    loss, _ = _loss(mix, cfg, logits, tokens, correct, weight, floor, T, _codes(overrides))
    loss.backward()
    step = -logits.grad.sum(0)  # (2,)
    return step, (step[END] - step[THINK]) / T  # two tokens: d(log-odds) = (dz_end - dz_think) / T


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_the_expected_step_on_the_choice_has_the_gaps_sign_at_every_p(T):
    for case in CASES:
        gap = _gap(case)
        for p in (1e-9, 1e-4, 0.1, 0.5, 0.9, 0.999, 1 - 1e-9):
            step, on_odds = expected_step([], p, case, T)
            # the docstring's expectation (fasttnt.modes): per group, E[n_N 1{n_T > 0}] (R_N - R_T) (1 - p) / T on
            # the </think> logit, with n_N = 4 + B, B ~ Bin(4, p) free rows that chose </think>, and n_T = 4 - B:
            # E[(4 + B) 1{B < 4}] = 4 + 4p - 8 p^4; the step is zero-sum over the two logits
            want = (4 + 4 * p - 8 * p**4) * gap * (1 - p) / T
            scale = (4 + 4 * p - 8 * p**4) * (1 - p) / T  # the step of a gap of one reward unit
            # rounding: float32 rewards and gaps (relative 1e-7 of each group's gap, |gap| <= 1.05), summed over
            # outcomes of total probability 1: within 1e-6 of the scale
            assert abs(step[END].item() - want) <= 1e-6 * scale, (case, p)
            assert abs(step.sum().item()) <= 1e-6 * scale
            if case == "tie":
                assert abs(on_odds.item()) <= 1e-6 * scale / T, p  # no drift either way
            else:
                assert math.copysign(1, on_odds.item()) == math.copysign(1, gap), (case, p)
                assert abs(on_odds.item()) > 1e-3 * scale / T  # a real step, not rounding


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton kernels on CPU tensors need Triton's interpreter")
def test_the_triton_kernels_take_the_same_expected_step(monkeypatch):
    # the steps above run the kernels' PyTorch paths (the CPU default); the reward, advantage and loss kernels'
    # Triton paths, under the interpreter, give the same expected step (float32 kernels against float32/float64
    # references: within 1e-5 of the step a unit gap makes)
    for case, p in (("near", 1e-9), ("direct", 0.5)):
        monkeypatch.setenv(_common.BACKEND_ENV, "torch")  # whatever the suite's environment asks for
        torch_step, _ = expected_step([], p, case, 0.6)
        monkeypatch.setenv(_common.BACKEND_ENV, "triton")
        triton_step, _ = expected_step([], p, case, 0.6)
        scale = (4 + 4 * p - 8 * p**4) * (1 - p) / 0.6
        assert torch_step[END] != 0 and (triton_step - torch_step).abs().max() <= 1e-5 * scale, case


def test_one_advantage_per_response_goes_the_wrong_way_where_both_modes_are_almost_always_right():
    # the mechanism at T = 0.6 (docs/algorithms.md): GRPO's shared advantage, divided by the group's std, turns the
    # 0.05 margin of the groups in which every answer is right into a full unit, so its expected step sends the
    # "near" level, where thinking pays 0.03 more, towards direct answers; the decoupled gap goes the right way
    assert _gap("near") < 0
    for T in (0.6, 1.0):
        _, shared = expected_step(["loss.mode_advantage=shared"], 1e-9, "near", T)
        _, decoupled = expected_step([], 1e-9, "near", T)
        assert shared > 0 > decoupled


def test_below_the_floor_the_step_fades_and_keeps_its_sign():
    # the fade multiplies each group's mode token by min(1, p / floor)^4: at p one nat below the floor, e^-4
    floor = math.log(1e-8)
    for case in ("direct", "thinking"):
        _, at_floor = expected_step([], 1e-8, case, 0.6, floor=floor)
        _, below = expected_step([], 1e-8 / math.e, case, 0.6, floor=floor)
        _, unfaded = expected_step([], 1e-8 / math.e, case, 0.6)
        assert math.copysign(1, below.item()) == math.copysign(1, _gap(case)) == math.copysign(1, at_floor.item())
        assert below.item() == pytest.approx(math.exp(-4) * unfaded.item(), rel=1e-5)


def _half_gaps(p: float, acc_direct: float, acc_think: float):
    """Every outcome of one half as (probability, its gap d): its direct rows' mean reward (right + DELTA, wrong
    DELTA) minus its thinking rows' (each half holds both modes)."""
    for prob, tokens, correct in _half_outcomes(p, acc_direct, acc_think):
        direct = [ok + DELTA for t, ok in zip(tokens, correct, strict=True) if t == END]
        thinking = [float(ok) for t, ok in zip(tokens, correct, strict=True) if t != END]
        yield prob, sum(direct) / len(direct) - sum(thinking) / len(thinking)


def _half_finds_direct_better(p: float, acc_direct: float, acc_think: float) -> float:
    """P(a half's gap > 0)."""
    return sum(prob * (d > 0) for prob, d in _half_gaps(p, acc_direct, acc_think))


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_the_saturating_choice_steps_with_the_gaps_sign_and_saturates_at_each_mode(T):
    # E[C] = CHOICE_SCALE (R_N - R_T) q(p) per group (fasttnt.modes.saturating_choice), q = P(d > 0) (1 - p)^g +
    # P(d <= 0) p^g with d one half's gap, computed here from the reward table; the step on the </think> logit is
    # C / T whichever rows carry it (the direct rows' </think> below p = 1/2, the thinking rows' first tokens above)
    for case in CASES:
        gap = _gap(case)
        for p in (1e-9, 1e-4, 0.1, 0.49, 0.5, 0.9, 0.999, 1 - 1e-9):
            step, on_odds = expected_step(SATURATING, p, case, T)
            wins = _half_finds_direct_better(p, *CASES[case])
            q = wins * (1 - p) ** CHOICE_POWER + (1 - wins) * p**CHOICE_POWER
            want = CHOICE_SCALE * gap * q / T
            # rounding: float32 rewards and advantages (relative 1e-7 of terms of size <= CHOICE_SCALE * 1.05 / T
            # and of the thinking rows' zero-sum answer advantages, <= 3 each), summed over outcomes of total
            # probability 1: within 1e-5 / T
            tol = 1e-5 / T
            assert abs(step[END].item() - want) <= tol, (case, p, step[END].item(), want)
            assert abs(step.sum().item()) <= tol
            assert abs(step[END].item()) <= CHOICE_SCALE * abs(gap) / T + tol  # bounded by the gap, at every p
            if case == "tie":
                assert abs(on_odds.item()) <= 2 * tol / T
            else:  # the sign of the expected gap, the noisy "near" level included
                assert math.copysign(1, on_odds.item()) == math.copysign(1, gap), (case, p)
                assert abs(step[END].item()) > 100 * tol or q < 1e-3, (case, p)  # a real step where q is not tiny
    # at its preferred mode a level's push falls to the share of halves that find the other mode better (each
    # half's sign sizes the other's gap): small for levels whose modes differ clearly; a level that went direct
    # while thinking pays is pulled back at nearly the full step the gap allows
    for case, p, preferred in (("direct", 1 - 1e-9, True), ("thinking", 1e-9, True), ("thinking", 1 - 1e-9, False)):
        step, _ = expected_step(SATURATING, p, case, T)
        size = abs(step[END].item()) / (CHOICE_SCALE * abs(_gap(case)) / T)  # of the largest step the gap allows
        wins = _half_finds_direct_better(p, *CASES[case])
        disagree = 1 - wins if _gap(case) > 0 else wins
        if preferred:
            assert size == pytest.approx(disagree, abs=1e-4) and disagree < 0.2, (case, p, size)
        else:
            assert size > 0.8, (case, p, size)


def test_the_saturating_choice_by_hand():
    # K = 8 with 3 forced direct rows, 2 forced thinking, 3 free (direct, thinking, thinking): the halves alternate
    # within each block, A = rows 0, 2 | 3 | 5, 7 and B = rows 1 | 4 | 6
    from fasttnt.modes import saturating_choice

    rewards = torch.tensor([1.05, 0.05, 1.05, 1.0, 0.0, 0.05, 1.0, 1.0] * 2)
    direct = torch.tensor([True, True, True, False, False, True, False, False] * 2)
    d_a = (1.05 + 1.05 + 0.05) / 3 - (1.0 + 1.0) / 2  # A: direct rows 0, 2, 5; thinking rows 3, 7
    d_b = 0.05 - (0.0 + 1.0) / 2  # B: direct row 1; thinking rows 4, 6
    p = torch.tensor([0.25, 0.75], dtype=torch.float64)  # one group below 1/2, one above
    out = saturating_choice(rewards, direct, p.log(), 8, (3, 2)).double()
    for g, prob in enumerate(p.tolist()):
        size = prob**CHOICE_POWER  # both halves find thinking better: each sized by p^gamma
        step = CHOICE_SCALE * (d_b * size + d_a * size) / 2
        rows = out[8 * g : 8 * (g + 1)]
        if prob < 0.5:  # on the 4 direct rows' </think>, each moving the logit by 1 - p
            want = torch.where(direct[:8], step / (4 * (1 - prob)), 0.0)
        else:  # on the 4 thinking rows' first tokens, each moving it by -p
            want = torch.where(direct[:8], 0.0, -step / (4 * prob))
        assert step < 0 and (want != 0).sum() == 4
        torch.testing.assert_close(rows, want.double(), rtol=1e-6, atol=1e-7)
    # 2 forced direct rows and 6 free: A = rows 0 | 2, 4, 6 and B = rows 1 | 3, 5, 7. Thinking rows in A alone: B
    # has no gap, and the group no step; one in each half: a step
    only_a = torch.tensor([True, True, False, True, True, True, True, True])
    assert not saturating_choice(rewards[:8], only_a, p[:1].log(), 8, (2, 0)).any()
    both = torch.tensor([True, True, False, False, True, True, True, True])
    assert saturating_choice(rewards[:8], both, p[:1].log(), 8, (2, 0)).any()


def test_the_saturating_choice_needs_mode_mixed_rollouts_and_the_policy_rule():
    from fasttnt.config import ConfigError

    with pytest.raises(ConfigError, match=r"loss\.mode_advantage: saturating needs mode-mixed rollouts"):
        load_config(None, ["loss.mode_advantage=saturating"])
    with pytest.raises(ConfigError, match=r"loss\.mode_token_logp=policy"):
        load_config(None, [*RECIPE, *SATURATING, "loss.mode_token_logp=mixture"])
    # each forced mode on 0 or at least 2 rows, so both halves hold it; no fixed floor (no fade)
    with pytest.raises(ConfigError, match="force 0 or at least 2 rows of each"):
        load_config(None, [*RECIPE, *SATURATING, "rollout.forced_thinking=0.125"])
    with pytest.raises(ConfigError, match=r"loss\.mode_token_floor: must be auto or 0"):
        load_config(None, [*RECIPE, *SATURATING, "loss.mode_token_floor=1e-9"])
    # under auto, no settled-choice fade: the term is bounded by itself
    mix = ModeMix.of(load_config(None, [*RECIPE, *SATURATING]))
    assert mix.floor_logp(-20.0) is None and not mix.measures_floor(None)


def test_the_evidence_and_centered_choices_are_refused_where_they_cannot_work():
    from fasttnt.config import ConfigError

    for choice in ("evidence", "centered"):
        with pytest.raises(ConfigError, match=rf"loss\.mode_advantage: {choice} needs mode-mixed rollouts"):
            load_config(None, [f"loss.mode_advantage={choice}"])
    # the evidence choice splits each group in halves, as the saturating one; under auto it keeps the fade
    with pytest.raises(ConfigError, match="force 0 or at least 2 rows of each"):
        load_config(None, [*RECIPE, *EVIDENCE, "rollout.forced_thinking=0.125"])
    assert ModeMix.of(load_config(None, [*RECIPE, *EVIDENCE])).measures_floor(None)
    # the centered one has no settled-choice fade (it would break the zero mean): no fixed floor
    with pytest.raises(ConfigError, match=r"loss\.mode_token_floor: must be auto or 0"):
        load_config(None, [*RECIPE, "loss.mode_advantage=centered", "loss.mode_token_floor=1e-9"])


def _half_evidence(p: float, acc_direct: float, acc_think: float) -> float:
    """E[1 / max(|d|, EVIDENCE_FLOOR)] over one half's outcomes, d its gap."""
    return sum(prob / max(abs(d), EVIDENCE_FLOOR) for prob, d in _half_gaps(p, acc_direct, acc_think))


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_the_evidence_choice_steps_with_the_gaps_sign_and_sizes_a_clear_level_alike(T):
    # E[C] = EVIDENCE_SCALE (R_N - R_T) E[1 / max(|d|, floor)] per group (fasttnt.modes.evidence_choice), d one
    # half's gap, computed here from the reward table; the step on the </think> logit is C / T
    for case in CASES:
        gap = _gap(case)
        for p in (1e-9, 1e-4, 0.1, 0.49, 0.5, 0.9, 0.999, 1 - 1e-9):
            step, on_odds = expected_step(EVIDENCE, p, case, T)
            want = EVIDENCE_SCALE * gap * _half_evidence(p, *CASES[case]) / T
            # rounding: float32 rewards and advantages (relative 1e-7 of terms of size <= EVIDENCE_SCALE * 1.05 /
            # EVIDENCE_FLOOR / T = 21 / T and of the thinking rows' answer advantages, <= 3 each), summed over
            # outcomes of total probability 1: within 1e-5 / T
            tol = 1e-5 / T
            assert abs(step[END].item() - want) <= tol, (case, p, step[END].item(), want)
            assert abs(step.sum().item()) <= tol
            if case == "tie":
                assert abs(on_odds.item()) <= 2 * tol / T
            else:
                assert math.copysign(1, on_odds.item()) == math.copysign(1, gap), (case, p)
                assert abs(step[END].item()) > 100 * tol, (case, p)
    # the stand-in's levels 1 and 3: every answer right either way (gap +0.05) against direct answers right 10% of the
    # time (gap -0.85). The decoupled gap weighs them 17:1; the evidence choice about alike (1 against 1.24 at small p)
    easy, hard = (1.0, 1.0), (0.1, 1.0)
    decoupled = [EVIDENCE[0], "loss.mode_advantage=decoupled"]  # the same groups, the gap on each direct row
    for p in (1e-9, 0.1):

        def ratio(overrides, p=p):
            return abs(expected_step(overrides, p, hard, T)[0][END] / expected_step(overrides, p, easy, T)[0][END])

        assert ratio(decoupled).item() == pytest.approx(abs(_gap(hard) / _gap(easy)), rel=1e-5)
        assert 0.5 < ratio(EVIDENCE).item() < 2, p


def test_the_centered_choice_steps_by_each_groups_gap_against_the_batchs_mean():
    # a batch of two groups at p = 1e-9, each of its own level, every joint outcome in which no free row chose
    # </think> enumerated (the batch's mean couples the groups; the outcomes left out weigh 4e-9, and the kept ones
    # are renormalised): each group holds 4 direct and 4 thinking rows, so its decoupled step is s = 4 (its gap),
    # E[s] = 4 (R_N - R_T), and the centered one moves its </think> logit by (s_a - s_b) / 2 (1 - p) / T, in
    # expectation 2 (gap_a - gap_b) (1 - p) / T: zero-sum over the batch, against the batch's mean gap, not 0
    T, p = 0.6, 1e-9
    cfg = load_config(None, [*RECIPE, f"rollout.temperature={T}", "loss.mode_advantage=centered"])
    mix = ModeMix.of(cfg)
    assert mix.floor_logp(-20.0) is None, "no settled-choice fade: it would break the zero mean"
    z0 = torch.tensor([T * math.log(p), T * math.log1p(-p)], dtype=torch.float64)
    for a, b in (("direct", "thinking"), ("near", "thinking"), ("tie", "tie")):
        kept = {}
        for case in (a, b):
            rows = [g for g in _groups(p, *CASES[case]) if g[1].count(END) == FORCED]
            total = sum(g[0] for g in rows)
            kept[case] = [(prob / total, tokens, correct) for prob, tokens, correct in rows]
        step = torch.zeros(2, 2, dtype=torch.float64)
        for (p_a, tok_a, ok_a), (p_b, tok_b, ok_b) in itertools.product(kept[a], kept[b]):
            logits = z0.repeat(2, 1).requires_grad_(True)
            weight = torch.full((2 * K,), p_a * p_b * 2 * K, dtype=torch.float64)  # the token-mean's 1 / N undone
            loss, _ = _loss(mix, cfg, logits, torch.tensor(tok_a + tok_b), torch.tensor(ok_a + ok_b), weight, None,
                            T, _codes([]))  # fmt: skip
            loss.backward()
            step -= logits.grad
        want = 2 * (_gap(a) - _gap(b)) * (1 - p) / T
        # rounding: float32 rewards (relative 1e-7 of steps of size <= 4 * 2.1 / T), summed over probability 1
        tol = 1e-5 / T
        assert abs(step[0, END].item() - want) <= tol, (a, b, step[0, END].item(), want)
        assert abs(step[1, END].item() + want) <= tol, (a, b)  # zero-sum over the batch's groups
        assert abs(step.sum().item()) <= 2 * tol
        if a != b:
            assert abs(want) > 1000 * tol
    # the price of centering: "near", where thinking pays 0.03 more, is pushed towards direct beside "thinking"
    assert _gap("near") < 0 < 2 * (_gap("near") - _gap("thinking"))


FILL = 2  # a token after the first, whose log-prob is fixed: it moves nothing, and stretches the sequence's ratio


def _adaptthink_expected(p: float, case: str, T: float, lengths: tuple[int, int]):
    """The expected step on the </think> logit of one group under ``tnt+adaptthink`` (GSPO's sequence ratio, the
    forced </think>'s old log-prob log 0.5, one advantage per response, no std scaling) with direct responses of
    ``lengths[0]`` tokens and thinking ones of ``lengths[1]``, from the real rewards, advantages and loss; and the same
    from the formula: a row's sequence ratio r = exp((log pi(y1) - old(y1)) / L) passes its advantage A where the
    clip does not hold it (A > 0: r < 1 + clip_high; A < 0: r > 1 - clip_low), moving the logit by A r d log pi(y1)."""
    from fasttnt.variants import variant_overrides

    cfg = load_config(None, [f"rollout.temperature={T}", "rollout.group_size=8"])
    cfg = load_config(None, [*variant_overrides("tnt+adaptthink", cfg), f"rollout.temperature={T}",
                             "rollout.group_size=8"])  # fmt: skip
    mix, loss_cfg = ModeMix.of(cfg), cfg.loss
    groups = _groups(p, *CASES[case])
    z = torch.tensor([T * math.log(p), T * math.log1p(-p)], dtype=torch.float64).repeat(len(groups), 1)
    z.requires_grad_(True)
    logp_first = torch.log_softmax(z / T, -1)  # (G, 2)
    ids, logps, counts = [], [], []
    for g, (_, tokens, _) in enumerate(groups):
        for token in tokens:
            n = lengths[0] if token == END else lengths[1]
            ids += [token] + [FILL] * (n - 1)
            logps += [logp_first[g, token]] + [torch.zeros((), dtype=torch.float64)] * (n - 1)
            counts.append(n)
    ids, logp = torch.tensor(ids), torch.stack(logps)  # (N,)
    cu = torch.tensor([0, *itertools.accumulate(counts)])
    correct = torch.tensor([c for _, _, ok in groups for c in ok])
    rewards = compute_rewards(RolloutBatch.of_packed(ids, cu, K), correct, END, cfg.reward)
    forced = torch.tensor(_codes([]) * len(groups), dtype=torch.int8)
    batch = RolloutBatch([[0]] * len(counts), ids, cu, torch.zeros(len(counts), dtype=torch.bool), K, forced=forced)
    end_logp = logp_first[:, END].detach()
    inputs = UpdateInputs(batch, *step_advantages(rewards, cfg, mix, end_logp), old_logp=logp.detach())
    terms, _ = mix.mode_token_terms(inputs, rewards.non_thinking, end_logp, END, floor_logp=mix.floor_logp(None))
    assert terms.is_weights is None and terms.first_advantages is None, "no fade, one advantage per response"
    probs = torch.tensor([g[0] for g in groups], dtype=torch.float64)
    weight = torch.repeat_interleave(probs.repeat_interleave(K), torch.tensor(counts)) * len(ids)  # (N,)
    loss, _ = clipped_policy_loss(logp, terms.old_logp.to(logp.dtype), terms.advantages, cu,
                                  config=PolicyLossConfig.of(loss_cfg), is_weights=weight)  # fmt: skip
    loss.backward()
    got = -z.grad[:, END].sum().item()
    want = 0.0
    starts, old = cu[:-1], terms.old_logp.detach()
    for row, (start, n) in enumerate(zip(starts.tolist(), counts, strict=True)):
        g, adv = row // K, terms.advantages[row].item()
        r = math.exp((logp[start].item() - old[start].item()) / n)
        passes = (adv > 0 and r < 1 + loss_cfg.clip_high) or (adv < 0 and r > 1 - loss_cfg.clip_low)
        d_logp = (1 - p) / T if ids[start] == END else -p / T
        want += probs[g].item() * adv * r * d_logp * passes
    return got, want


def test_adaptthinks_objective_ratchets_up_on_short_answers_and_follows_the_gap_on_long_ones():
    # tnt+adaptthink at p = 1e-9. The forced </think>'s ratio, exp((log p - log 0.5) / L), is 0.16 on the
    # stand-in's 11-token direct answers: below 1 - clip_low, where the clip holds every negative advantage and
    # passes every positive one, so the expected step on the choice is up at every level, where thinking pays too.
    # On answers of hundreds of tokens, as R1's, it is 0.90 at 200, inside the clip range: both signs
    # pass, and the step has the sign of the gap (no std scaling: the 0.05 margin stays 0.05)
    T, p = 0.6, 1e-9
    for lengths, follows_gap in (((11, 20), False), ((200, 400), True)):
        for case in CASES:
            got, want = _adaptthink_expected(p, case, T, lengths)
            # rounding: float32 rewards and advantages (relative 1e-7 of terms <= 2.1 / T), over probability 1
            assert abs(got - want) <= 1e-5 / T, (lengths, case, got, want)
            if case == "tie":
                continue
            if follows_gap:
                assert math.copysign(1, got) == math.copysign(1, _gap(case)), (lengths, case, got)
            else:
                assert got > 1e-3, (lengths, case, got)  # up, whatever the gap


@pytest.mark.parametrize("T", [0.6, 1.0])
def test_a_bandit_of_four_levels_ends_in_the_better_mode_at_each(T):
    # one logit pair per level, started thinking-only (the same raw gap of 12.4: p = 1e-9 at T = 0.6, 4e-6 at
    # T = 1.0, as the CPU stand-in's warm-up), 8 groups a level a step, SGD for 250 steps with the floor measured at
    # the first step (loss.mode_token_floor=auto: the start itself). Rewards are drawn: the step sizes below leave a
    # margin of many standard deviations (derived in the comments) at any seed.
    cfg = load_config(None, [*RECIPE, f"rollout.temperature={T}"])
    mix = ModeMix.of(cfg)
    levels = list(CASES)
    groups = 8
    logits = torch.tensor([[0.0, 12.4]] * len(levels), dtype=torch.float64, requires_grad=True)
    start = torch.log_softmax(logits.detach() / T, -1)
    odds0 = start[:, END] - start[:, THINK]  # (L,) the choice's log-odds at T
    opt = torch.optim.SGD([logits], lr=4.0)
    floor = None
    acc = torch.tensor([CASES[c] for c in levels], dtype=torch.float64)  # (L, 2) direct, thinking
    for _ in range(250):
        z = logits.repeat_interleave(groups, 0)  # (L * groups, 2)
        pi = torch.softmax(z.detach() / T, -1)[:, END]  # (G,)
        free = torch.rand(len(z), K - FORCED) < pi[:, None]  # (G, free rows) chose </think>
        tokens = torch.cat([torch.zeros(len(z), FORCED, dtype=torch.long), (~free).long()], 1).reshape(-1)
        level_acc = acc.repeat_interleave(groups, 0)  # (G, 2)
        p_right = torch.where(tokens.view(len(z), K) == END, level_acc[:, :1], level_acc[:, 1:])
        correct = (torch.rand(len(z), K, dtype=torch.float64) < p_right).reshape(-1)
        if floor is None:  # auto: the first step's smallest log pi_old(</think> | x)
            floor = torch.log_softmax(z.detach() / T, -1)[:, END].min().item()
        loss, _ = _loss(mix, cfg, z, tokens, correct, torch.ones(tokens.numel(), dtype=torch.float64), floor, T,
                        _codes([]))  # fmt: skip
        opt.zero_grad()
        loss.backward()
        opt.step()
    end = torch.log_softmax(logits.detach() / T, -1)
    odds = end[:, END] - end[:, THINK]
    moved = dict(zip(levels, (odds - odds0).tolist(), strict=True))
    # direct better (gap +0.35): each step moves the level's log-odds by about lr x its 32 rows of the batch's 256 x
    # 2 (both logits move) x gap x (1 - p) / T^2 = 4 x 0.125 x 2 x 0.35 / T^2 = 0.35 / T^2, so it passes p = 0.5
    # within 40 steps at either T; then it slows as the free rows stop thinking (no gap where a group holds one mode)
    assert odds[levels.index("direct")] > 0, moved
    # thinking better, by a little or a lot: never up, and pushed down only a few nats below the start, where the
    # fade (p / floor)^4 stops it (x nats below, the step is e^{-4x} of its size, so x grows as log(1 + 4 r t) / 4)
    for case in ("near", "thinking"):
        assert -4.0 / T < moved[case] <= 0.5, moved
    # the tie: no expected step, so only the groups' noise moves it. Per step, the gap of a group is the mean of 4
    # direct answers right 95% of the time (std 0.11), so the step on the log-odds has std 4 x 2 x 4 x sqrt(8) x
    # 0.11 / 256 / T^2 = 0.039 / T^2, a random walk of std 0.61 / T^2 over 250 steps (the fade below the start
    # shortens its downward half): the bound is 7 of those standard deviations, and the level stays thinking
    assert abs(moved["tie"]) < 4.3 / T**2, moved
    assert odds[levels.index("tie")] < 0, moved
