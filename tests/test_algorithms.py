"""DAPO's dynamic sampling and overlong reward shaping, Dr. GRPO, and the named variants that combine them with a
reward scheme: the pieces against their definitions, and real training steps of a very small model. A theme file,
named after the algorithms: each one's pieces live in several modules (dynamic_sampling, rewards, variants, the verl
scorer) and are tested together, no one module dominating."""

from __future__ import annotations

import pytest
import torch
from support import varied
from support.small import deterministic, metric_rows, run_overrides

from fasttnt.actor import Actor
from fasttnt.cli import main as cli_main
from fasttnt.config import ConfigError, load_config
from fasttnt.dynamic_sampling import choose_groups, concat_draws, select_groups, varied_groups
from fasttnt.engines import RolloutBatch, pack_sequences
from fasttnt.rewards import RewardConfig, compute_rewards, overlong_shaping
from fasttnt.rollouts import Rollouts
from fasttnt.scoring import Judged, ScoredBatch
from fasttnt.trainer import Trainer
from fasttnt.variants import VariantError, check_variant, read_variants_file, split_variants, variant_overrides
from fasttnt_kernels import TntRewards

# -- overlong reward shaping --------------------------------------------------------------------------------------


def _dapo_overlong_reference(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO's soft overlong punishment, eq. 13 of the paper, piecewise in float64."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return ((max_len - buffer) - length) / buffer * factor
    return -factor


@pytest.mark.parametrize("trial", range(3))
def test_overlong_shaping_is_dapos_piecewise_penalty(trial):
    g = torch.Generator().manual_seed(100 + trial)
    max_len = int(torch.randint(8, 200, (1,), generator=g))
    buffer = int(torch.randint(1, max_len + 1, (1,), generator=g))
    factor = float(torch.rand((), generator=g) * 2)
    lengths = torch.randint(0, max_len + 1, (64,), generator=g)
    lengths[:3] = torch.tensor([max_len, max_len - buffer, max_len - buffer + 1])  # the corners
    got = overlong_shaping(lengths, max_len, buffer, factor)
    expected = torch.tensor(
        [_dapo_overlong_reference(int(n), max_len, buffer, factor) for n in lengths], dtype=torch.float64
    )
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    assert got[0] == pytest.approx(-factor) and got[1] == 0


def test_compute_rewards_adds_the_shaping_to_any_scheme():
    ids, cu = pack_sequences([[5, 6, 7, 2], [5] * 12, [5] * 15 + [2], [9, 2]])  # lengths 4, 12, 16, 2
    batch = RolloutBatch.of_packed(ids, cu, group_size=2)
    correct = torch.tensor([True, True, False, True])
    for scheme in ("tnt", "binary"):
        plain = compute_rewards(batch, correct, think_end_id=3, cfg=RewardConfig(scheme=scheme))
        cfg = RewardConfig(scheme=scheme, overlong_buffer=8, overlong_penalty=0.5)
        shaped = compute_rewards(batch, correct, think_end_id=3, cfg=cfg, max_new_tokens=16)
        # lengths 12 and 16 are past 16 - 8: -0.5 * 4/8 and -0.5
        torch.testing.assert_close(shaped.rewards - plain.rewards, torch.tensor([0.0, -0.25, -0.5, 0.0]))
        torch.testing.assert_close(shaped.limit, plain.limit)
        with pytest.raises(ValueError, match="needs max_new_tokens"):
            compute_rewards(batch, correct, think_end_id=3, cfg=cfg)


def test_compute_rewards_composes_the_scheme_the_shaping_and_the_balance():
    # one call, in that order: the balance takes the shaped rewards (-0.25 and -0.5 on rows 1 and 2, as above).
    # Rows: non-thinking (</think> = 3 first), thinking, thinking, thinking
    ids, cu = pack_sequences([[3, 7, 2], [5] * 12, [5] * 15 + [2], [9, 2]])  # lengths 3, 12, 16, 2
    batch = RolloutBatch.of_packed(ids, cu, group_size=2)
    correct = torch.tensor([True, True, False, True])
    plain = compute_rewards(batch, correct, think_end_id=3, cfg=RewardConfig())
    assert plain.non_thinking.tolist() == [True, False, False, False], "precondition: one direct row"
    cfg = RewardConfig(overlong_buffer=8, overlong_penalty=0.5, mode_balance=True)
    # every row free (no codes): z = 3/4, each thinking row loses 0.5, the direct one none
    everyone = compute_rewards(batch, correct, think_end_id=3, cfg=cfg, max_new_tokens=16)
    torch.testing.assert_close(everyone.rewards - plain.rewards, torch.tensor([0.0, -0.75, -1.0, -0.5]))
    # row 0 forced to answer directly (FORCED_CODES): it neither counts nor loses. Of the free rows all 3 think: z =
    # 1, so each loses clip(2 (1 - 0.5), 0, 1) = 1
    batch.forced = torch.tensor([1, 0, 0, 0], dtype=torch.int8)
    got = compute_rewards(batch, correct, think_end_id=3, cfg=cfg, max_new_tokens=16)
    torch.testing.assert_close(got.rewards - plain.rewards, torch.tensor([0.0, -1.25, -1.5, -1.0]))


@pytest.mark.parametrize(
    "override, message",
    [
        ("reward.overlong_buffer=97", "reward.overlong_buffer: must be in [0, rollout.max_new_tokens=96]"),
        ("reward.overlong_penalty=-1", "reward.overlong_penalty: must be >= 0"),
        ("rollout.max_draws=0", "rollout.max_draws: must be >= 1"),
        ("rollout.dynamic_sampling=sometimes", "rollout.dynamic_sampling: expected true or false"),
        ("reward.direct_margin=0.05 reward.direct_correct=1.5", "reward.direct_margin: replaces reward.direct_correct"),
        ("reward.direct_margin=0.05 reward.scheme=binary", "reward.direct_margin: has no effect under reward.scheme"),
        ("reward.direct_margin=inf", "reward.direct_margin: must be a finite number"),
    ],
)
def test_bad_algorithm_options_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, override.split())  # one or more overrides, space-separated


# -- dynamic sampling, its pieces ------------------------------------------------------------------------------


def _draw(lengths: list[int], rewards: list[float], k: int, first_token: int = 10) -> ScoredBatch:
    seqs = [[first_token + i] * n for i, n in enumerate(lengths)]
    ids, cu = pack_sequences(seqs)
    s = len(lengths)
    batch = RolloutBatch([[1, 2]] * s, ids, cu, torch.zeros(s, dtype=torch.bool), k,
                         rollout_logp=torch.arange(ids.numel(), dtype=torch.float32))  # fmt: skip
    r = torch.tensor(rewards)
    out = TntRewards(r, r > 1, torch.full((s,), -1, dtype=torch.int32), torch.arange(s // k, dtype=torch.float32))
    texts = [f"response {first_token + i}" for i in range(s)]
    levels = torch.arange(s) // k + first_token  # (S,) a level per group, apart between draws
    judged = Judged(texts, r > 0, timeouts=1, crashes=first_token)
    return ScoredBatch(batch, judged, out, hacked=torch.zeros(s, dtype=torch.bool), levels=levels)


def test_varied_groups_and_the_choice_of_groups():
    assert varied_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0]), 2).tolist() == [False, True, False]
    assert choose_groups([False, True, True, False, True], quota=2) == ([1, 2], 0)
    # short of the quota (the draw cap): filled with equal-reward groups, first drawn first, in draw order
    assert choose_groups([False, True, False, False], quota=3) == ([0, 1, 2], 2)
    assert choose_groups([True, True], quota=2) == ([0, 1], 0)


def test_every_per_row_field_of_a_batch_and_of_the_updates_inputs_is_carried():
    # a RolloutBatch field that is neither per sequence nor per token would keep its full length through a cut; one
    # declared is cut by select and group_slice and joined by concat. Each field here holds its row's (or token's)
    # index, so a cut that took the wrong rows shows too
    from dataclasses import fields, replace

    from fasttnt.data import PromptMode
    from fasttnt.engines.batch import FORCED_CODES
    from fasttnt.policy import SEQUENCE_INPUTS, TOKEN_INPUTS, UpdateInputs

    declared = {f.name: f.metadata.get("per") for f in fields(RolloutBatch)}
    assert {n for n, per in declared.items() if per is None} == {"cu_seqlens", "group_size"}
    rows = [[5, 6], [7], [8, 9, 10], [11]]  # 4 rows, 7 tokens, K = 2
    batch = RolloutBatch.of_responses([[i] for i in range(4)], rows, [False, True, False, True], 2,
                                      rollout_logp=[float(t) for t in range(7)],
                                      forced=torch.arange(4, dtype=torch.int8))  # fmt: skip
    batch.behaviour_first_logp, batch.behaviour_think_end_logp = torch.arange(4.0) + 100, torch.arange(4.0) + 200
    seq = torch.arange(4, dtype=torch.float32)
    tok = torch.arange(7, dtype=torch.float32)
    inputs = UpdateInputs(batch, seq, seq + 10, tok, tok + 10, tok + 20)
    assert set(SEQUENCE_INPUTS) | set(TOKEN_INPUTS) == {f.name for f in fields(UpdateInputs)} - {"batch"}

    def rows_and_tokens(part):
        return part.batch.prompt_ids, part.advantages.tolist(), part.batch.rollout_logp.tolist()

    kept = inputs.select([1, 2])
    assert rows_and_tokens(kept) == ([[1], [2]], [1.0, 2.0], [2.0, 3.0, 4.0, 5.0])
    assert kept.batch.forced.tolist() == [1, 2] and kept.batch.truncated.tolist() == [True, False]
    assert kept.batch.behaviour_first_logp.tolist() == [101, 102] and kept.batch.behaviour_think_end_logp[0] == 201
    assert kept.first_advantages.tolist() == [11.0, 12.0] and kept.is_weights.tolist() == [22.0, 23.0, 24.0, 25.0]
    assert kept.old_logp.tolist() == [2.0, 3.0, 4.0, 5.0] and kept.ref_logp.tolist() == [12.0, 13.0, 14.0, 15.0]
    second = inputs.group_slice(1, 2)
    assert rows_and_tokens(second) == ([[2], [3]], [2.0, 3.0], [3.0, 4.0, 5.0, 6.0])
    assert second.batch.forced.tolist() == [2, 3] and second.ref_logp.tolist() == [13.0, 14.0, 15.0, 16.0]
    joined = RolloutBatch.concat([second.batch, inputs.group_slice(0, 1).batch])
    assert joined.prompt_ids == [[2], [3], [0], [1]] and joined.forced.tolist() == [2, 3, 0, 1]
    assert joined.rollout_logp.tolist() == [3.0, 4.0, 5.0, 6.0, 0.0, 1.0, 2.0]
    assert joined.truncated.tolist() == [False, True, False, True]
    assert joined.behaviour_first_logp.tolist() == [102, 103, 100, 101]
    assert joined.behaviour_think_end_logp.tolist() == [202, 203, 200, 201]
    # a batch whose rows were all free (no forced codes) joined with one that has them: its rows get the free code;
    # behaviour log-probs, which no code stands for, are None when a part lacks them
    free = replace(inputs.group_slice(0, 1).batch, forced=None, behaviour_first_logp=None)
    assert (
        free.filled("forced").tolist() == [FORCED_CODES[PromptMode.FREE]] * 2
        and free.filled("rollout_logp") is not None
    )
    mixed = RolloutBatch.concat([second.batch, free])
    assert mixed.forced.tolist() == [2, 3, FORCED_CODES[PromptMode.FREE], FORCED_CODES[PromptMode.FREE]]
    assert mixed.behaviour_first_logp is None and free.filled("behaviour_first_logp") is None
    # the micro-batch of row 1 alone: the kernel's inputs, each cut to it
    from fasttnt.policy import plan_micro_batches

    mb = plan_micro_batches(inputs.batch, budget=4)[1]
    assert (mb.first, mb.last) == (1, 2), "precondition: row 1 alone (row 2 does not fit beside it)"
    micro = inputs.micro_batch(mb, total_tokens=7.0, total_seqs=4.0)
    assert micro.advantages.tolist() == [1.0] and micro.first_advantages.tolist() == [11.0]
    assert (
        micro.old_logp.tolist() == [2.0] and micro.is_weights.tolist() == [22.0] and micro.cu_seqlens.tolist() == [0, 1]
    )


def test_concat_and_select_keep_each_groups_responses_together():
    k = 2
    a = _draw([3, 1, 2, 2], [0.0, 1.0, 1.0, 1.0], k, first_token=10)
    b = _draw([1, 4, 2, 3], [2.0, 0.0, -1.0, -1.0], k, first_token=20)
    both = concat_draws([a, b])
    assert both.batch.lengths.numel() == 8 and both.judged.timeouts == 2 and both.judged.crashes == 10 + 20
    assert both.levels.tolist() == [10, 10, 11, 11, 20, 20, 21, 21]
    assert both.batch.bounds == both.batch.cu_seqlens.tolist() == [0, 3, 4, 6, 8, 9, 13, 15, 18]
    assert both.batch.responses == a.batch.responses + b.batch.responses
    torch.testing.assert_close(both.batch.rollout_logp, torch.cat([a.batch.rollout_logp, b.batch.rollout_logp]))
    assert varied_groups(both.rewards.rewards, k).tolist() == [True, False, True, False]
    picked = select_groups(both, [0, 2])  # group 0 of a, group 0 of b
    assert picked.batch.responses == a.batch.responses[:2] + b.batch.responses[:2]
    assert picked.batch.bounds == picked.batch.cu_seqlens.tolist() == [0, 3, 4, 5, 9]
    assert picked.batch.response_ids.tolist() == [t for r in picked.batch.responses for t in r]
    expected_logp = torch.cat([a.batch.rollout_logp[:4], b.batch.rollout_logp[:5]])
    torch.testing.assert_close(picked.batch.rollout_logp, expected_logp)
    assert picked.rewards.rewards.tolist() == [0.0, 1.0, 2.0, 0.0]
    assert picked.rewards.limit.tolist() == [0.0, 0.0]  # each draw's own group 0
    assert picked.judged.correct.tolist() == [False, True, True, False]
    assert picked.judged.texts == a.judged.texts[:2] + b.judged.texts[:2]
    assert picked.judged.timeouts == 0 and picked.judged.crashes == 0  # a draw's counts stay with it
    assert picked.levels.tolist() == [10, 10, 20, 20]


# -- dynamic sampling in the trainer ----------------------------------------------------------------------------


@pytest.mark.parametrize("max_draws", [4, 1])
def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(tmp_path, monkeypatch, max_draws):
    # support/varied.py: in every draw of 4 prompts, groups 0 and 2 have rewards that differ and 1 and 3 do not, by
    # construction. With 4 draws allowed each step takes exactly 2 draws and trains on their 4 varied groups; with
    # 1, the step reaches the cap and fills its batch with the 2 equal-reward groups (zero advantage)
    extra = ("rollout.dynamic_sampling=true", f"rollout.max_draws={max_draws}", "steps=3", varied.OVERRIDE)
    cfg = load_config(None, run_overrides(tmp_path, *extra, steps=2))
    trainer = Trainer(cfg, tmp_path / "run")
    seen = []
    real_update, real_draw = Actor.update, Rollouts.draw
    draws = []

    def update(self, inputs, **kw):
        seen.append((inputs.batch, inputs.advantages.clone()))
        return real_update(self, inputs, **kw)

    def draw(self, step, index, lap):
        out = real_draw(self, step, index, lap)
        draws.append((step, index, out))
        return out

    monkeypatch.setattr(Actor, "update", update)
    monkeypatch.setattr(Rollouts, "draw", draw)
    rows = trainer.run()
    k, p = cfg.rollout.group_size, cfg.rollout.prompts_per_step
    assert all(r["grad_norm"] > 0 for r in rows), "a step without a gradient"
    expected_draws, expected_fills = (2, 0) if max_draws == 4 else (1, 2)
    assert [(r["draws"], r["filled_groups"]) for r in rows] == [(expected_draws, expected_fills)] * 3
    positions = 0
    for row, (batch, advantages) in zip(rows, seen, strict=True):
        mine = [(i, d) for step, i, d in draws if step == row["step"]]
        assert [i for i, _ in mine] == list(range(row["draws"]))
        varied_flags = torch.cat([varied_groups(d.rewards.rewards, k) for _, d in mine])
        assert row["varied_group_frac"] == pytest.approx(float(varied_flags.float().mean())) == 0.5
        assert batch.lengths.numel() == p * k  # the step keeps its batch shape
        flat = advantages.view(-1, k)
        zero_groups = int((flat == 0).all(dim=1).sum())
        assert zero_groups == row["filled_groups"]  # only fills have no advantage
        # the trained groups, in draw order: the even groups of both draws, or the one draw's every group
        drawn = [d.batch.responses[g * k : (g + 1) * k] for _, d in mine for g in range(p)]
        chosen = [0, 2, 4, 6] if max_draws == 4 else [0, 1, 2, 3]
        assert [batch.responses[g * k : (g + 1) * k] for g in range(p)] == [drawn[g] for g in chosen]
        positions += row["draws"] * p
    assert trainer.state.data_position == positions  # every draw took its prompts from the stream


def test_dynamic_sampling_with_one_draw_changes_nothing(tmp_path):
    # one draw and no more: the varied groups and the fills are the whole draw, in order, so the run is the plain
    # run's to the bit (weights and every deterministic metric)
    def run(name, *extra):
        cfg = load_config(None, run_overrides(tmp_path, varied.OVERRIDE, *extra, steps=2))
        rows = Trainer(cfg, tmp_path / name).run()
        from safetensors.torch import load_file

        return rows, load_file(tmp_path / name / "final" / "model.safetensors")

    plain, w_plain = run("plain")
    assert all(r["grad_norm"] > 0 for r in plain), "a step without a gradient"
    dynamic, w_dynamic = run("dynamic", "rollout.dynamic_sampling=true", "rollout.max_draws=1")
    for a, b in zip(plain, dynamic, strict=True):
        for key, value in deterministic(a).items():
            assert b[key] == value, key
        assert b["draws"] == 1
    assert all(torch.equal(w_plain[k], w_dynamic[k]) for k in w_plain)


def test_resume_reproduces_a_dynamically_sampled_run(tmp_path):
    # 2 draws a step by construction (support/varied.py): the resumed stream must continue after every draw's prompts
    extra = ("rollout.dynamic_sampling=true", "rollout.max_draws=3", "steps=4", varied.OVERRIDE)

    def run(name, *more, resume=False):
        Trainer(
            load_config(None, run_overrides(tmp_path, *extra, *more, steps=2)), tmp_path / name, resume=resume
        ).run()
        return [deterministic(r) for r in metric_rows(tmp_path / name)]

    straight = run("straight")
    assert all(r["grad_norm"] > 0 and r["draws"] == 2 for r in straight)
    run("resumed", "steps=2")
    assert run("resumed", resume=True) == straight


def test_overlong_shaping_in_a_run(tmp_path):
    # the shaping is added to the scheme's reward in the trainer: with a buffer as long as the budget every token
    # costs penalty / budget, so the logged reward is the scheme's mean minus penalty * mean length / budget
    shaping = ("reward.overlong_buffer=16", "reward.overlong_penalty=0.5")
    rows = [
        Trainer(load_config(None, run_overrides(tmp_path, "steps=1", *extra, steps=2)), tmp_path / name).run()
        for name, extra in (("plain", ()), ("shaped", shaping))
    ]
    for plain, shaped in zip(*rows, strict=True):
        assert shaped["len"] == plain["len"]  # the same samples: the reward does not change the rollout
        assert shaped["reward"] == pytest.approx(plain["reward"] - 0.5 * plain["len"] / 16, abs=1e-5)


# -- variants ----------------------------------------------------------------------------------------------------


def test_variant_names_resolve_to_overrides():
    base = load_config(None, ["rollout.max_new_tokens=80"])
    assert variant_overrides("binary", base) == ["reward.scheme=binary"]
    dapo = variant_overrides("tnt+dapo", base)
    assert dapo[0] == "reward.scheme=tnt"
    assert {"rollout.dynamic_sampling=true", "loss.clip_high=0.28", "reward.overlong_buffer=16"} <= set(dapo)
    dr = load_config(None, ["rollout.max_new_tokens=80", *variant_overrides("tnt+drgrpo", base)])
    assert (dr.loss.adv_scale, dr.loss.agg, dr.loss.norm_length) == ("none", "seq-mean-token-sum-norm", 80.0)
    cfg = load_config(None, variant_overrides("uniform-limit:cap=64,direct_correct=1.5", base))
    assert (cfg.reward.scheme, cfg.reward.uniform_limit, cfg.reward.direct_correct) == ("uniform-limit", 64.0, 1.5)
    cfg = load_config(None, variant_overrides("no-limit+dapo:rollout.max_draws=3,omega=1", base))
    assert (cfg.rollout.max_draws, cfg.reward.omega, cfg.rollout.dynamic_sampling) == (3, 1.0, True)


@pytest.mark.parametrize(
    "name, message",
    [
        ("adaptive", "unknown scheme or variant 'adaptive'"),
        ("tnt+ppo", "^tnt\\+ppo: unknown algorithm 'ppo'"),
        ("tnt:omga=1", "'omga' is no reward parameter"),
        ("tnt:omega", "parameters are key=value"),
        ("tnt:omega=0", "tnt:omega=0: reward.omega: must be > 0"),
        ("tnt:loss.agg=sum", "loss.agg: 'sum' is not one of"),
    ],
)
def test_bad_variants_are_named(name, message):
    with pytest.raises(VariantError, match=message):
        check_variant(name, [])


def test_variants_from_a_yaml_file(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("short-tnt:\n  reward.scheme: tnt\n  reward.omega: 1.5\n")
    mine = read_variants_file(path)
    cfg = load_config(None, variant_overrides("short-tnt+drgrpo:fallback_limit=50", load_config(), mine))
    assert (cfg.reward.omega, cfg.reward.fallback_limit, cfg.loss.adv_scale) == (1.5, 50.0, "none")
    path.write_text("bad name:\n  reward.omega: 1\n")
    with pytest.raises(VariantError, match="a name may not contain"):
        read_variants_file(path)
    path.write_text("x: [1, 2]\n")
    with pytest.raises(VariantError, match="x: expected a mapping"):
        read_variants_file(path)
    path.write_text("x:\n  reward.omega: [1\n")
    with pytest.raises(VariantError, match=r"mine\.yaml:3:1: not valid YAML"):
        read_variants_file(path)
    with pytest.raises(VariantError, match="does not exist"):
        read_variants_file(tmp_path / "none.yaml")


def test_train_takes_a_variant_and_the_overrides_win(tmp_path, capsys):
    out = tmp_path / "run"
    args = [
        "train",
        "--variant",
        "tnt+dapo",
        "--output-dir",
        str(out),
        *run_overrides(tmp_path, "rollout.max_draws=2", steps=2),
    ]
    assert cli_main(args) == 0
    assert "dynamic sampling: " in capsys.readouterr().out  # the end-of-run summary says how many draws it took
    cfg = load_config(out / "config.yaml")
    assert cfg.rollout.dynamic_sampling and cfg.rollout.max_draws == 2 and cfg.reward.overlong_buffer == 3
    assert all(1 <= r["draws"] <= 2 for r in metric_rows(out))
    assert cli_main(["train", "--variant", "tnt+ppo", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--variant tnt+ppo: unknown algorithm 'ppo'" in capsys.readouterr().err


def test_variant_lists_and_an_algorithm_on_the_variants_own_config():
    assert split_variants("tnt, uniform-limit:cap=64,direct_correct=1.5,tnt+dapo:omega=1") == [
        "tnt", "uniform-limit:cap=64,direct_correct=1.5", "tnt+dapo:omega=1",
    ]  # fmt: skip
    # DAPO's buffer and Dr. GRPO's normaliser follow the variant's own length budget, not the base config's
    base = load_config()
    dapo = load_config(None, variant_overrides("tnt+dapo:rollout.max_new_tokens=40", base))
    assert (dapo.rollout.max_new_tokens, dapo.reward.overlong_buffer) == (40, 8)
    dr = load_config(None, variant_overrides("tnt+drgrpo:rollout.max_new_tokens=40", base))
    assert dr.loss.norm_length == 40.0
    with pytest.raises(VariantError, match="tnt:seed=3: seed is set for every run by the command"):
        check_variant("tnt:seed=3", [], reserved=("steps", "seed"))


def test_verls_tnt_scores_shape_back_from_the_padded_width():
    from fasttnt.integrations.verl import tnt_token_scores

    lengths = [3, 10, 12, 5]  # two groups of two, padded to T = 12
    responses = torch.full((4, 12), 7)
    mask = torch.arange(12)[None] < torch.tensor(lengths)[:, None]  # (B, T)
    correct, uids = [True, False, True, True], ["a", "a", "b", "b"]
    plain = tnt_token_scores(responses, mask, uids, correct, think_end_id=3)
    shaped = tnt_token_scores(responses, mask, uids, correct, 3, config=RewardConfig(overlong_buffer=4))
    with pytest.raises(ValueError, match=r"tnt_token_scores: reward.mode_balance=True is the fasttnt trainer's"):
        tnt_token_scores(responses, mask, uids, correct, 3, config=RewardConfig(mode_balance=True))
    rows = torch.arange(4)
    last = torch.tensor(lengths) - 1
    torch.testing.assert_close(shaped[rows, last] - plain[rows, last], torch.tensor([0.0, -0.5, -1.0, 0.0]))
    assert (shaped.sum(1) == shaped[rows, last]).all()  # the score sits at each response's last token only


def test_verls_scores_come_from_the_configured_scheme_registered_or_not():
    # a scheme registered in REWARD_SCHEMES (support/varied.py's) reaches verl's reward: two groups of 4, their rows
    # interleaved as verl may hand them over, against compute_rewards on the same rows laid out group by group
    from fasttnt.integrations.verl import tnt_token_scores

    varied.register()
    think_end = 3
    rows = [[think_end, 5], [1, think_end, 4, 4], [think_end, 6, 6], [2, 2, think_end, 5], [think_end, 5, 5],
            [1, think_end, 7], [think_end, 8, 8, 8], [4, think_end]]  # fmt: skip
    uids = ["x", "y"] * 4
    correct = [True, False, True, True, False, True, True, False]
    t = max(map(len, rows)) + 2  # padded past the longest, as verl pads to its budget
    responses = torch.zeros(len(rows), t, dtype=torch.long)
    mask = torch.zeros(len(rows), t, dtype=torch.long)
    for i, ids in enumerate(rows):
        responses[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
    cfg = RewardConfig(scheme=varied.NAME)
    scores = tnt_token_scores(responses, mask, uids, correct, think_end, config=cfg)
    order = [i for uid in ("x", "y") for i in range(len(rows)) if uids[i] == uid]  # uid x first: seen first
    packed = RolloutBatch.of_packed(*pack_sequences([rows[i] for i in order]), 4)
    truth = compute_rewards(packed, torch.tensor(correct)[order], think_end, cfg, max_new_tokens=t).rewards
    got = [float(scores[i, len(rows[i]) - 1]) for i in order]
    assert got == truth.tolist()
    assert got[4:] == [0.0] * 4 and got[1] - got[0] >= varied.BONUS - 4  # varied's, not tnt's: group y all 0
