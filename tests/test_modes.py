"""Mode-mixed rollouts (fasttnt.modes): the behaviour log-probs of the first token by hand under each rule, the
loss's gradient on the mode token ("mixture" as a weight outside the clip, "half" inside the ratio), a group that
holds both modes in a real run, forced responses scored as free ones, a share of 0 that changes nothing, and
AutoThink's batch balance and ellipsis prompt."""

from __future__ import annotations

import copy
import math
import re

import pytest
import torch
from safetensors.torch import load_file
from support import varied
from support.small import TINY, deterministic, metric_rows, run_overrides

import fasttnt.trainer as trainer_module
from fasttnt.actor import Actor
from fasttnt.advantages import step_advantages
from fasttnt.checkpoint import list_checkpoints, read_trainer_state
from fasttnt.config import ConfigError, load_config
from fasttnt.data import PromptMode, build_prompt, think_end_token_id
from fasttnt.embedded.char_tokenizer import build_char_tokenizer
from fasttnt.embedded.synthetic import held_out
from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model
from fasttnt.engines import EngineSettings, RolloutBatch, pack_sequences
from fasttnt.engines.hf import HFEngine
from fasttnt.modes import ModeMix
from fasttnt.policy import UpdateInputs
from fasttnt.step_metrics import PhaseClock
from fasttnt.trainer import Trainer
from fasttnt_kernels import clipped_policy_loss, tnt_rewards

TOK = build_char_tokenizer()
END = think_end_token_id(TOK)
A, B = 20, 21  # two other first tokens


def _batch(first_tokens: list[int], forced: list[int], k: int) -> RolloutBatch:
    ids, cu = pack_sequences([[t, 5, 6] for t in first_tokens])  # each response: its first token, then two more
    return RolloutBatch([[1]] * len(first_tokens), ids, cu, torch.zeros(len(first_tokens), dtype=torch.bool), k,
                        forced=torch.tensor(forced, dtype=torch.int8))  # fmt: skip


def test_the_first_tokens_behaviour_log_probs_by_hand():
    # K = 4: one row forced to answer directly, one forced to think, two free (one of which chose </think>).
    # s_N = s_T = 1/4, s_F = 1/2; the old policy's p = pi_old(</think> | x) = 0.2, pi_old(A) = 0.3, pi_old(B) = 0.1:
    #   mu(</think>) = 1/4 + 1/2 * 0.2                 = 0.35
    #   mu(A)        = 0.3 * (1/4 / (1 - 0.2) + 1/2)     = 0.3 * 0.8125 = 0.24375
    #   mu(B)        = 0.1 * 0.8125                      = 0.08125
    batch = _batch([END, A, END, B], [1, 2, 0, 0], 4)
    old_first = torch.tensor([0.2, 0.3, 0.2, 0.1]).log()  # pi_old of each row's first token
    end_logp = torch.tensor([0.2]).log()  # (G,)
    # (forced_non_thinking_rows, forced_thinking_rows, group_size, mode_token_logp, mode_advantage)
    mixture = ModeMix(1, 1, 4, "mixture", "shared")
    got = mixture.behaviour_logp(batch, old_first, end_logp, END)
    want = torch.tensor([0.35, 0.24375, 0.35, 0.08125]).log()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    # AdaptThink's rule: log 0.5 for the forced first tokens, the free ones keep their own
    half = ModeMix(1, 1, 4, "half", "shared")
    got = half.behaviour_logp(batch, old_first, end_logp, END)
    torch.testing.assert_close(got, torch.tensor([0.5, 0.5, 0.2, 0.1]).log(), rtol=1e-6, atol=1e-7)
    # no importance weight: every first token keeps the old policy's own log-prob
    policy = ModeMix(1, 1, 4, "policy", "shared")
    torch.testing.assert_close(policy.behaviour_logp(batch, old_first, end_logp, END), old_first)
    # no forced thinking: mu(A) = pi_old(A) * s_F; all free: mu is pi_old itself
    only_direct = ModeMix(2, 0, 4, "mixture", "shared")
    first = torch.tensor([0.2, 0.2, 0.3, 0.1]).log()
    got = only_direct.behaviour_logp(_batch([END, END, A, B], [1, 1, 0, 0], 4), first, end_logp, END)
    torch.testing.assert_close(got, torch.tensor([0.6, 0.6, 0.15, 0.05]).log(), rtol=1e-6, atol=1e-7)
    free = ModeMix(0, 0, 4, "mixture", "shared")
    got = free.behaviour_logp(_batch([END, A, END, B], [0] * 4, 4), old_first, end_logp, END)
    torch.testing.assert_close(got, old_first, rtol=1e-6, atol=1e-7)


def test_a_stale_batch_weighs_its_mode_tokens_against_the_weights_that_sampled_it():
    # k >= 1: the batch was sampled with older weights (pi_b), the ratio is around the trainer's (pi_old). The
    # group of test_the_first_tokens_behaviour_log_probs_by_hand, where pi_b(</think> | x) = 0.4, pi_b(A) = 0.25,
    # pi_b(B) = 0.05 and pi_old as there:
    #   mu(</think>) = 1/4 + 1/2 * 0.4                = 0.45
    #   mu(A)        = 0.25 * (1/4 / (1 - 0.4) + 1/2)  = 0.25 * 11/12
    #   mu(B)        = 0.05 * 11/12
    # and the mixture's weight w = pi_old(y1) / mu(y1): 0.2 / 0.45, 0.3 / (0.25 * 11/12), 0.2 / 0.45, ...
    batch = _batch([END, A, END, B], [1, 2, 0, 0], 4)
    batch.behaviour_first_logp = torch.tensor([0.4, 0.25, 0.4, 0.05]).log()
    batch.behaviour_think_end_logp = torch.full((4,), math.log(0.4))
    old_first = torch.tensor([0.2, 0.3, 0.2, 0.1], dtype=torch.float64).log()
    end_logp = torch.tensor([0.2]).log()  # the trainer's: not the mixture's at k >= 1
    mixture = ModeMix(1, 1, 4, "mixture", "shared")
    mu = torch.tensor([0.45, 0.25 * 11 / 12, 0.45, 0.05 * 11 / 12], dtype=torch.float64)
    got = mixture.behaviour_logp(batch, old_first.float(), end_logp, END)
    torch.testing.assert_close(got.double(), mu.log(), rtol=0, atol=4 * torch.finfo(torch.float32).eps)
    old_logp = torch.full((batch.response_ids.numel(),), -0.5)
    first = batch.cu_seqlens[:-1]
    old_logp[first] = old_first.float()
    inputs = UpdateInputs(batch, torch.zeros(4), torch.zeros(4), old_logp=old_logp)
    terms, _ = mixture.mode_token_terms(inputs, torch.tensor([True, False, True, False]), end_logp, END)
    want = old_first.exp() / mu
    torch.testing.assert_close(terms.is_weights[first].double(), want, rtol=1e-6, atol=0)
    assert terms.old_logp is old_logp or torch.equal(terms.old_logp, old_logp), "the ratio stays around pi_old"
    # the fade reads the sampling weights' choice: at a floor of 0.8, (0.4 / 0.8) ** 4 on the direct rows' </think>,
    # not the trainer's (0.2 / 0.8) ** 4
    policy = ModeMix(1, 1, 4, "policy", "shared")
    faded, below = policy.mode_token_terms(inputs, torch.tensor([True, False, True, False]), end_logp, END,
                                           floor_logp=math.log(0.8))  # fmt: skip
    torch.testing.assert_close(faded.is_weights[first], torch.tensor([0.5**4, 1.0, 0.5**4, 1.0]), rtol=1e-6, atol=0)
    assert below.tolist() == [True]


def test_the_loss_gradient_on_the_mode_token_by_hand():
    # "mixture": the forced non-thinking row's mode token has pi_old(</think>) = 0.2 and mu = 0.35, so its importance
    # weight w = 0.2 / 0.35 = 4/7 multiplies the clipped term from outside, whose ratio starts at 1: no clip binds
    # and dpg/dlogp = -w A / N for either sign of A (token-mean over the row's 3 tokens, the other two unweighted)
    logp = torch.tensor([math.log(0.2), -1.0, -2.0])
    cu = torch.tensor([0, 3])
    w = torch.tensor([4 / 7, 1.0, 1.0])
    for advantage in (1.0, -1.0):
        x = logp.clone().requires_grad_()
        loss, stats = clipped_policy_loss(x, logp, torch.tensor([advantage]), cu, clip_low=0.2, clip_high=0.28,
                                          is_weights=w)  # fmt: skip
        loss.backward()
        assert x.grad[0].item() == pytest.approx(-(4 / 7) * advantage / 3, abs=1e-7), advantage
        assert x.grad[1].item() == pytest.approx(-advantage / 3, abs=1e-7)  # ratio 1, weight 1: -A / N
        assert stats["ratio_mean"].item() == pytest.approx(1.0, abs=1e-7)
    # "half": log mu = log 0.5 as the old log-prob, inside the ratio: r = 0.2 / 0.5 = 0.4 < 1 - clip_low, so with
    # A = +1 the unclipped branch is the smaller loss (dpg/dlogp = -r / N) and with A = -1 the low clip binds
    old = torch.cat([torch.tensor([math.log(0.5)]), logp[1:]])
    for advantage, grad0 in ((1.0, -0.4 / 3), (-1.0, 0.0)):
        x = logp.clone().requires_grad_()
        loss, stats = clipped_policy_loss(x, old, torch.tensor([advantage]), cu, clip_low=0.2, clip_high=0.28)
        loss.backward()
        assert x.grad[0].item() == pytest.approx(grad0, abs=1e-7), advantage
        assert stats["ratio_mean"].item() == pytest.approx((0.4 + 2) / 3, rel=1e-6)


def test_requests_of_all_free_rows_are_the_plain_ones_bit_for_bit():
    # modes of FREE for every row make the same prefill and the same samples as no modes
    model = build_tiny_model(TOK, TinyModelConfig(**TINY), seed=0)
    engine = HFEngine(model, TOK, EngineSettings(max_new_tokens=12))
    prompts = [build_prompt(TOK, p.problem) for p in held_out(2)]
    plain = engine.generate(prompts, 3, seed=5)
    rows = [p.in_mode(PromptMode.FREE) for p in prompts for _ in range(3)]
    free = engine.generate(prompts, 3, seed=5, rows=rows)
    assert plain.responses == free.responses and free.forced is None
    assert torch.equal(plain.rollout_logp, free.rollout_logp)
    assert ModeMix(0, 0, 3, "policy", "shared").rollout(engine, prompts, seed=5).responses == plain.responses
    mixed = ModeMix(1, 1, 3, "mixture", "shared").rollout(engine, prompts, seed=5)
    assert mixed.forced.tolist() == [1, 2, 0] * len(prompts)
    assert all(r[0] == END for r in mixed.responses[::3]) and all(r[0] != END for r in mixed.responses[1::3])
    assert mixed.responses[2::3] == plain.responses[2::3]  # a free row samples as it would in a free group


@pytest.mark.parametrize("rule", ["mixture", "half", "policy"])
def test_a_mode_mixed_run_trains_both_modes_against_their_behaviour(tmp_path, monkeypatch, rule):
    seen = []
    real = Actor.update

    def update(self, inputs, **kw):
        assert inputs.first_advantages is None  # loss.mode_advantage=shared
        seen.append((inputs.batch, inputs.old_logp.clone(), inputs.is_weights))
        return real(self, inputs, **kw)

    monkeypatch.setattr(Actor, "update", update)
    # rows of K = 4: forced direct, two forced thinking, one free ("half" refuses forced thinking rows: there the
    # two are free), with one advantage per response (shared). The settled-choice fade only with "policy", there
    # at a floor of 0.999, above any p a barely warmed-up model gives </think>: every direct row's first token is
    # faded by (p / 0.999)^4
    floor = 0.999 if rule == "policy" else 0.0
    thinking = 0.0 if rule == "half" else 0.5
    codes = [1, 0, 0, 0] if rule == "half" else [1, 2, 2, 0]
    extra = ("rollout.forced_non_thinking=0.25", f"rollout.forced_thinking={thinking}", f"loss.mode_token_logp={rule}",
             f"loss.mode_token_floor={floor}", "loss.mode_advantage=shared")  # fmt: skip
    trainer = Trainer(load_config(None, run_overrides(tmp_path, varied.OVERRIDE, *extra, steps=2)), tmp_path / "run")
    rows = trainer.run()
    assert all(r["grad_norm"] > 0 for r in rows)
    for row in rows:  # logged: what the model chooses unforced, and its own probability of answering directly
        assert 0 <= row["free_non_thinking_ratio"] <= 1 and 0 < row["think_end_prob"] < 1
        assert row["non_thinking_ratio"] >= 0.25  # the forced quarter at least
        assert ("mode_floored" in row) == (rule == "policy")
    assert len(seen) == 2
    for row, (batch, old, weights) in zip(rows, seen, strict=True):
        k = batch.group_size
        assert batch.forced.tolist() == codes * (len(batch.responses) // k)
        first = [r[0] for r in batch.responses]
        assert all(t == END for t in first[::k])  # both modes in every group
        if rule != "half":
            assert all(t != END for t in first[1::k]) and all(t != END for t in first[2::k])
        # the engine's log-probs of the first tokens were replaced by the old ones the loss uses: the rollout
        # correction and the stale-weight guard do not see them
        starts = batch.cu_seqlens[:-1]
        assert torch.equal(batch.rollout_logp[starts], old[starts])
        # each group's p = pi_old(</think> | x): its forced direct row's first token is </think>
        p = old[starts[::k]].double().exp().repeat_interleave(k)  # (S,)
        if rule == "policy":  # the old policy's own log-probs; the fade (p / floor)^4 on each direct row's </think>
            direct = torch.tensor([t == END for t in first])
            fade = torch.where(direct, (p / floor).clamp(max=1) ** 4, torch.ones_like(p))  # (S,)
            assert (fade < 1).any(), "the construction: a direct row faded"
            rest = torch.ones(len(old), dtype=torch.bool)
            rest[starts] = False
            assert (weights[rest] == 1).all()
            torch.testing.assert_close(weights[starts].double(), fade, rtol=1e-4, atol=0.0)
            assert row["mode_floored"] == pytest.approx((p[::k] < floor).double().mean().item())
            continue
        if rule == "half":  # the forced first tokens' old log-prob is log 0.5; no weights
            assert weights is None
            forced = (batch.forced != 0).nonzero().squeeze(1)
            assert len(forced) == len(batch.responses) // k
            assert torch.allclose(old[starts[forced]], torch.tensor(math.log(0.5)))
            continue
        # "mixture": the old log-probs are the policy's own; the weights pi_old / mu sit on the first tokens only,
        # with s_N = s_F = 1/4, s_T = 1/2, forced or free alike: a first </think> gets p / (s_N + s_F p), any other
        # first token y1 pi_old(y1) / mu(y1) = 1 / (s_T / (1 - p) + s_F)
        rest = torch.ones(len(old), dtype=torch.bool)
        rest[starts] = False
        assert weights is not None and (weights[rest] == 1).all()
        ends = torch.tensor([t == END for t in first])
        want = torch.where(ends, p / (0.25 + 0.25 * p), 1 / (0.5 / (1 - p) + 0.25))  # (S,)
        assert (batch.forced == 0).any(), "the construction: free rows"
        torch.testing.assert_close(weights[starts].double(), want, rtol=1e-5, atol=1e-7)


def test_forced_responses_are_scored_as_free_ones(tmp_path):
    # the TNT reward of a mode-mixed draw is the kernel's on the same responses: no special case for forced rows
    cfg = run_overrides(tmp_path, varied.OVERRIDE, "rollout.forced_non_thinking=0.5", "reward.scheme=tnt", steps=2)
    trainer = Trainer(load_config(None, cfg), tmp_path / "run")
    draw = trainer.rollouts.draw(1, 0, PhaseClock())
    want = tnt_rewards(draw.batch.response_ids, draw.batch.cu_seqlens, draw.judged.correct, 4, END)
    assert draw.batch.forced is not None and (draw.rewards.non_thinking[::4]).all()
    assert torch.equal(draw.rewards.rewards, want.rewards) and torch.equal(draw.rewards.limit, want.limit)
    trainer.verifier.close()


def test_a_share_of_zero_is_todays_run(tmp_path):
    def run(name, *extra):
        Trainer(load_config(None, run_overrides(tmp_path, varied.OVERRIDE, *extra, steps=2)), tmp_path / name).run()
        return metric_rows(tmp_path / name), load_file(tmp_path / name / "final" / "model.safetensors")

    plain, w_plain = run("plain")
    assert all(r["grad_norm"] > 0 for r in plain), "a step without a gradient"
    zero, w_zero = run("zero", "rollout.forced_non_thinking=0.0", "rollout.forced_thinking=0.0",
                       "loss.mode_token_logp=half")  # fmt: skip
    assert "free_non_thinking_ratio" not in zero[0]  # nothing forced
    assert [deterministic(r) for r in zero] == [deterministic(r) for r in plain]
    assert all(torch.equal(w_plain[k], w_zero[k]) for k in w_plain)


def test_a_group_without_free_rows_logs_no_free_choice(tmp_path):
    # half forced direct, half forced thinking: no row chooses, so there is no free share to log (not a 0)
    cfg = load_config(None, run_overrides(tmp_path, varied.OVERRIDE, "steps=1", "rollout.forced_non_thinking=0.5",
                                          "rollout.forced_thinking=0.5", steps=2))  # fmt: skip
    row = Trainer(cfg, tmp_path / "run").run()[0]
    assert row["non_thinking_ratio"] == 0.5 and 0 < row["think_end_prob"] < 1
    assert "free_non_thinking_ratio" not in row


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("rollout.forced_non_thinking=1.5", "rollout.forced_non_thinking: must be a share of the group in [0, 1]"),
        (
            "rollout.forced_thinking=0.625",  # 2.5 rows round up to 3: 2 + 3 > 4
            "rollout.forced_non_thinking + rollout.forced_thinking: force 2 + 3 rows (each rounded to the nearest row,"
            " halves up), more than rollout.group_size=4",
        ),
        ("rollout.forced_thinking=0.1", "rollout.forced_thinking: 0.1 of rollout.group_size=4 rounds to no row"),
        ("loss.mode_token_logp=exact", "loss.mode_token_logp: 'exact' is not one of"),
        ("rollout.top_p=0.9", "loss.mode_token_logp: mixture assumes free samples drawn from the whole distribution"),
        (
            "rollout.forced_thinking=0.25",
            "loss.mode_token_logp: half with rollout.forced_thinking > 0: log 0.5 as the old log-prob of a sampled",
        ),
        ("loss.mode_advantage=split", "loss.mode_advantage: 'split' is not one of"),
        ("loss.mode_token_floor=1.5", "loss.mode_token_floor: must be auto or a probability in [0, 1)"),
        ("loss.mode_token_floor=always", "loss.mode_token_floor: expected a number, got 'always' and 'always' is not"),
    ],
)
def test_bad_mode_options_name_the_key(override, message):
    rule = ["loss.mode_token_logp=mixture"] if "top_p" in override else []
    rule = ["loss.mode_token_logp=half"] if "forced_thinking=0.25" in override else rule
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(None, ["rollout.group_size=4", "rollout.forced_non_thinking=0.5", *rule, override])


def test_forced_rows_round_to_the_nearest_row_halves_up():
    cfg = load_config(None, ["rollout.group_size=5", "rollout.forced_non_thinking=0.5", "rollout.forced_thinking=0.3"])
    assert cfg.rollout.forced_rows() == (3, 2)  # 2.5 -> 3 (Python's round: 2), 1.5 -> 2
    assert ModeMix.of(cfg).free_rows == 0


# -- AutoThink's batch balance and ellipsis prompt ------------------------------------------------------------


def test_the_batch_balance_by_hand():
    # 6 thinking and 2 non-thinking responses: z = 0.75 > gamma = 0.5, so each thinking reward loses
    # clip(2 (0.75 - 0.5), 0, 1) = 0.5; the non-thinking share 0.25 is under gamma: unchanged
    from fasttnt.rewards import RewardConfig, mode_balance

    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 2.0, -1.0])
    nt = torch.tensor([False] * 6 + [True] * 2)
    got = mode_balance(rewards, nt, RewardConfig(mode_balance=True), torch.tensor([6.0, 2.0]))
    assert got.tolist() == [0.5, -0.5, 0.5, 0.5, -0.5, 0.5, 2.0, -1.0]
    # all of one mode: the whole penalty of 1 (clip at 1)
    got = mode_balance(rewards[:2], nt[:2], RewardConfig(mode_balance=True), torch.tensor([2.0, 0.0]))
    assert got.tolist() == [0.0, -1.0]
    # forced rows neither count nor lose: rows 0-1 forced to think, 2-5 free thinking, 6-7 free non-thinking, so
    # z = 4/6 of the free ones: each free thinking reward loses clip(2 (2/3 - 0.5), 0, 1) = 1/3, the forced none
    free = torch.tensor([False] * 2 + [True] * 6)
    got = mode_balance(rewards, nt, RewardConfig(mode_balance=True), torch.tensor([4.0, 2.0]), free)
    torch.testing.assert_close(got, torch.tensor([1.0, 0.0, 2 / 3, 2 / 3, -1 / 3, 2 / 3, 2.0, -1.0]))


@pytest.mark.parametrize("forced", [(0.0, 0.0), (0.25, 0.5)])
def test_the_batch_balance_in_a_run(tmp_path, forced):
    # the first step samples the same responses with and without the balance (the same weights): its logged mean
    # reward moves by exactly the penalty the thinking and non-thinking shares give. With one row of each group of 4
    # forced to answer directly and two to think, only the free row counts and loses: a forced row that paid, or
    # shares counted over every row, would move the mean by at least 0.006 at any free share (a quarter's
    # multiple). gamma 0.4: the larger free mode (>= half) always pays
    direct, think = forced
    mix = [f"rollout.forced_non_thinking={direct}", f"rollout.forced_thinking={think}"] if direct else []
    rows = {}
    for name, extra in (("plain", ()), ("balanced", ("reward.mode_balance=true",))):
        cfg = load_config(None, [*run_overrides(tmp_path, varied.OVERRIDE, "steps=1", *mix, *extra, steps=2),
                                 "reward.scheme=tnt", "reward.balance_gamma=0.4"])  # fmt: skip
        rows[name] = Trainer(cfg, tmp_path / name).run()[0]
    key = "free_non_thinking_ratio" if direct else "non_thinking_ratio"
    nt = rows["plain"][key]
    assert rows["balanced"][key] == nt and rows["balanced"]["len"] == rows["plain"]["len"]
    f_think, f_direct = (min(max(2 * (share - 0.4), 0.0), 1.0) for share in (1 - nt, nt))
    assert max(f_think, f_direct) > 0, "the construction: a mode above gamma pays"
    penalty = (1 - direct - think) * (f_think * (1 - nt) + f_direct * nt)
    assert rows["balanced"]["reward"] == pytest.approx(rows["plain"]["reward"] - penalty, abs=1e-6)


def test_the_ellipsis_prompt_in_training_and_evaluation(tmp_path, monkeypatch):
    plain, ellipsis = (build_prompt(TOK, "1+2", style=s).text for s in ("plain", "ellipsis"))
    assert ellipsis == plain.rstrip() + "\n...\n" and plain.rstrip().endswith("<think>")
    # an R1-style template opens the think block with a newline: the ellipsis follows "<think>" with one newline
    r1 = copy.deepcopy(TOK)
    r1.chat_template = TOK.chat_template.replace("<think>{% endif %}", "<think>\n{% endif %}")
    r1_plain, r1_ellipsis = (build_prompt(r1, "1+2", style=s).text for s in ("plain", "ellipsis"))
    assert r1_plain.endswith("<think>\n"), "the construction: a template whose prompt ends in whitespace"
    assert r1_ellipsis == plain.rstrip() + "\n...\n" and not r1_ellipsis.endswith("<think>\n\n...\n")
    trainer = Trainer(
        load_config(None, run_overrides(tmp_path, varied.OVERRIDE, "data.prompt_style=ellipsis", steps=2)),
        tmp_path / "run",
    )
    prompt = trainer.parts.prompt(held_out(1)[0])
    assert prompt.text.endswith("<think>\n...\n")
    trainer.verifier.close()
    import fasttnt.evaluate as evaluate

    styles = []
    real = evaluate.build_prompt
    monkeypatch.setattr(evaluate, "build_prompt", lambda *a, **kw: styles.append(kw["style"]) or real(*a, **kw))
    model = tmp_path / "model"
    shape = TinyModelConfig(**TINY)
    build_tiny_model(TOK, shape).save_pretrained(model)
    TOK.save_pretrained(model)
    from fasttnt.cli import main as cli_main

    args = ["eval", "--model", str(model), "--benchmarks", "synthetic", "--synthetic-per-level", "1", "--samples", "1",
            "--max-new-tokens", "4", "--prompt-style", "ellipsis", "--output-dir", str(tmp_path / "eval")]  # fmt: skip
    assert cli_main(args) == 0
    assert styles and set(styles) == {"ellipsis"}


def test_a_warm_up_whose_direct_examples_do_not_teach_the_choice():
    # the stand-in for a thinking-only distilled model: its direct examples carry </think> in the prompt (pre-filled),
    # so the loss teaches answering after it, never writing it first; the default recipe keeps it a response token
    import itertools

    from fasttnt.embedded.tiny import WarmupConfig, _examples

    for choose in (True, False):
        cfg = WarmupConfig(direct_share=0.5, choose_direct=choose)
        examples = list(itertools.islice(_examples(TOK, cfg), 40))
        direct = [(p, r) for p, r in examples if p[-1] == END or r[0] == END]
        assert 5 < len(direct) < 35, "the construction: both kinds of example"
        if choose:
            assert all(r[0] == END and p[-1] != END for p, r in direct)
        else:
            assert all(p[-1] == END and r[0] != END for p, r in direct)
    # the same examples otherwise: the prompt plus response, token for token
    both = [list(itertools.islice(_examples(TOK, WarmupConfig(choose_direct=c)), 40)) for c in (True, False)]
    assert [p + r for p, r in both[0]] == [p + r for p, r in both[1]]
    # warmup.double_check: the thinking examples check the sum before </think>, the direct ones are as they were
    checked = list(itertools.islice(_examples(TOK, WarmupConfig(double_check=True)), 40))
    check = TOK("check ", add_special_tokens=False)["input_ids"]

    def has_check(ids: list[int]) -> bool:
        return any(ids[i : i + len(check)] == check for i in range(len(ids)))

    pairs = list(zip(both[0], checked, strict=True))
    thinking = [(plain, ours) for plain, ours in pairs if plain[1][0] != END]
    assert 5 < len(thinking) < 35
    assert all(has_check(r) and not has_check(p) for _, (p, r) in thinking)
    assert all(len(ours[1]) > len(plain[1]) for plain, ours in thinking)
    assert all(plain == ours for plain, ours in pairs if plain[1][0] == END)


def test_select_keeps_the_forced_codes_of_the_rows_it_keeps():
    # four rows of modes free, direct, thinking, direct: keeping rows 1 and 2 keeps their codes, in that order
    forced = torch.tensor([0, 1, 2, 1], dtype=torch.int8)
    batch = RolloutBatch.of_responses([[1]] * 4, [[5, 6], [7], [8, 9, 10], [11]], [False] * 4, 2,
                                      rollout_logp=[-0.1] * 7, forced=forced)  # fmt: skip
    kept, index = batch.select([1, 2])
    assert kept.forced.tolist() == [1, 2]
    assert kept.responses == [[7], [8, 9, 10]] and index.tolist() == [2, 3, 4, 5]


def test_a_mode_mixed_run_gives_the_mode_token_the_modes_reward_gap(tmp_path, monkeypatch):
    seen = []
    real_advantages, real_update = trainer_module.step_advantages, Actor.update

    def step_advantages(rewards, *args):
        seen.append(rewards.rewards.clone())
        return real_advantages(rewards, *args)

    def update(self, inputs, **kw):
        seen[-1] = (inputs, seen[-1])
        return real_update(self, inputs, **kw)

    monkeypatch.setattr(trainer_module, "step_advantages", step_advantages)
    monkeypatch.setattr(Actor, "update", update)
    # a forced thinking row in every group: both modes in each, and acc_thinking logged at every step; the default
    # loss.mode_advantage (auto) is decoupled for a mode-mixed run
    extra = ("rollout.forced_non_thinking=0.5", "rollout.forced_thinking=0.25")
    cfg = load_config(None, run_overrides(tmp_path, varied.OVERRIDE, *extra, steps=2))
    assert cfg.loss.mode_advantage == "auto" and ModeMix.of(cfg).mode_advantage == "decoupled"
    rows = Trainer(cfg, tmp_path / "run").run()
    assert all(r["grad_norm"] > 0 for r in rows)
    for row in rows:  # the accuracies by mode, and by level on the synthetic task
        assert 0 <= row["acc_forced_direct"] <= 1 and 0 <= row["acc_thinking"] <= 1
        assert any(name.startswith("acc_thinking_l") for name in row)
    for terms, rewards in seen:
        batch = terms.batch
        k = batch.group_size
        nt = torch.tensor([r[0] == END for r in batch.responses]).view(-1, k)
        r = rewards.view(-1, k).double()
        a, m = terms.advantages.view(-1, k).double(), terms.first_advantages.view(-1, k).double()
        both = nt.any(1) & (~nt).any(1)
        assert both.all(), "the construction: forced rows of both modes in every group"
        for g in range(len(nt)):
            for rows_of in (nt[g], ~nt[g]):  # answers centred within their mode
                assert abs(a[g, rows_of].sum()) < 1e-5
            # </think> first, the choice: the gap between the modes' mean rewards, in reward units; a thinking row's
            # first token is its answer's
            gap = r[g, nt[g]].mean() - r[g, ~nt[g]].mean()
            torch.testing.assert_close(m[g, nt[g]], gap.expand(int(nt[g].sum())), rtol=1e-5, atol=1e-6)
            assert torch.equal(m[g, ~nt[g]], a[g, ~nt[g]])
        assert (m[nt] != 0).any(), "a group whose modes' rewards differ"


def test_the_auto_floor_is_the_first_steps_smallest_choice_and_survives_a_resume(tmp_path, monkeypatch):
    floors = []
    real = ModeMix.mode_token_terms

    def mode_token_terms(self, inputs, non_thinking, think_end_logp, think_end_id, floor_logp=None):
        floors.append((think_end_logp.min().item(), floor_logp))
        return real(self, inputs, non_thinking, think_end_logp, think_end_id, floor_logp)

    monkeypatch.setattr(ModeMix, "mode_token_terms", mode_token_terms)
    overrides = run_overrides(tmp_path, varied.OVERRIDE, "rollout.forced_non_thinking=0.5", steps=2)
    Trainer(load_config(None, [*overrides, "save_every=1"]), tmp_path / "run").run()
    (first_min, first_floor), (_, second_floor) = floors
    assert first_floor == first_min and second_floor == first_floor  # measured once, at step 1
    state = read_trainer_state(list_checkpoints(tmp_path / "run" / "checkpoints")[0])
    assert state.step == 1 and state.mode_token_floor_logp == first_floor
    # a resumed run reads the floor back instead of measuring its own step's
    floors.clear()
    Trainer(load_config(None, [*overrides, "steps=3"]), tmp_path / "run", resume=True).run()
    assert floors and floors[0][1] == first_floor and floors[0][0] != first_floor
    # fixed, and off
    fixed = ModeMix.of(load_config(None, ["rollout.forced_non_thinking=0.5", "loss.mode_token_floor=0.01"]))
    assert fixed.floor_logp(None) == pytest.approx(math.log(0.01))
    assert ModeMix.of(load_config(None, ["rollout.forced_non_thinking=0.5", "loss.mode_token_floor=0"])).floor_logp(
        -3.0) is None  # fmt: skip
    assert ModeMix.of(load_config(None, [])) is None  # unmixed: no mode mix, no choice to fade
    # a fixed floor above every group's start holds the choice: said, with the largest scale the fade leaves
    warning = fixed.floor_above_start(math.log(1e-9))
    assert warning is not None and "loss.mode_token_floor=0.01" in warning and "1.0e-09" in warning
    assert f"{(1e-9 / 0.01) ** 4:.1e}" in warning
    assert fixed.floor_above_start(math.log(0.02)) is None  # some group starts above it
    assert ModeMix.of(load_config(None, ["rollout.forced_non_thinking=0.5"])).floor_above_start(-30.0) is None  # auto


def test_the_fade_by_hand():
    # two groups of K = 4 (rows: forced direct, free that chose </think>, free thinking, forced thinking), floor
    # 0.01: group 0 at p = 0.01 (on the floor: 1), group 1 one nat below it (e^-4 = 0.0183). The fade multiplies
    # the </think> of every direct row, forced or chosen; thinking rows' first tokens and later tokens keep 1
    batch = _batch([END, END, A, B] * 2, [1, 0, 0, 2] * 2, 4)
    rewards = type("R", (), {"rewards": torch.tensor([1.0, 1.0, 0.0, 0.0] * 2),
                             "non_thinking": torch.tensor([True, True, False, False] * 2)})  # fmt: skip
    end_logp = torch.tensor([math.log(0.01), math.log(0.01) - 1.0])  # (G,)
    cfg = load_config(None, ["rollout.group_size=4", "rollout.forced_non_thinking=0.25",
                             "rollout.forced_thinking=0.25", "loss.mode_token_floor=0.01"])  # fmt: skip
    mix = ModeMix.of(cfg)
    assert mix.mode_advantage == "decoupled" and mix.mode_token_logp == "policy"  # the defaults of a mixed run
    old_logp = torch.full((batch.response_ids.numel(),), -0.5)
    inputs = UpdateInputs(batch, *step_advantages(rewards, cfg, mix, end_logp), old_logp=old_logp)
    terms, below_floor = mix.mode_token_terms(inputs, rewards.non_thinking, end_logp, END, mix.floor_logp(None))
    first = batch.cu_seqlens[:-1]
    want = torch.tensor([1.0, 1.0, 1.0, 1.0, math.exp(-4.0), math.exp(-4.0), 1.0, 1.0])
    torch.testing.assert_close(terms.is_weights[first], want, rtol=1e-5, atol=0.0)
    rest = torch.ones(len(old_logp), dtype=torch.bool)
    rest[first] = False
    assert (terms.is_weights[rest] == 1).all()
    assert below_floor.tolist() == [False, True]  # the second group below the floor
    # the fade is a step size, on the weight: the mode token's advantage is the gap itself, direct 1 against
    # thinking 0 in both groups
    assert terms.first_advantages[[0, 1, 4, 5]].tolist() == [1.0] * 4
    without, below_floor = mix.mode_token_terms(inputs, rewards.non_thinking, end_logp, END, floor_logp=None)
    assert without.is_weights is None and below_floor is None


def test_log1mexp_is_finite_where_p_rounds_to_one():
    # the mixture's log(1 - p) at p = 1 exactly (log p = 0) is a very small number, not -inf, which would make a
    # thinking row's behaviour log-prob +inf; elsewhere it is log(1 - p) to float64's rounding
    from fasttnt.modes import _log1mexp

    logp = torch.tensor([0.0, -1e-300, math.log(0.5), -20.0, -math.inf], dtype=torch.float64)
    got = _log1mexp(logp)
    assert torch.isfinite(got).all(), got
    assert got[0] == got[1] == pytest.approx(math.log(1e-30), rel=1e-15)  # p = 1, and p within 1e-300 of it
    # 1 - p rounds once (half an ulp of 1) before the log: that is the error's bound
    eps = torch.finfo(torch.float64).eps
    assert got[2] == pytest.approx(math.log(0.5), abs=eps) and got[3] == pytest.approx(-math.exp(-20.0), abs=eps)
    assert got[4] == 0.0  # p = 0
