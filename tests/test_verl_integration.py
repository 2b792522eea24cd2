"""fasttnt's kernels inside verl (fasttnt.integrations.verl) against verl's own functions: the policy losses against
``compute_policy_loss_vanilla``, ``_gspo``, ``_sapo`` and ``_cispo`` for every ``loss_agg_mode`` (local and global
normalisers, rollout importance weights), the GRPO advantages against ``compute_grpo_outcome_advantage``, the
registrations, the TNT scores.

Needs verl, which is not in the test extra (it pins transformers<5.11 and pulls Ray): skipped without it. The
README's command runs it in an environment of its own: ``pip install -e ".[test,verl]"`` there, then
``python -m pytest tests/test_verl_integration.py``."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

pytest.importorskip("verl")

from omegaconf import OmegaConf  # a verl dependency
from verl.trainer.ppo import core_algos
from verl.workers.config import ActorConfig

from fasttnt.integrations import verl as fasttnt_verl
from fasttnt_kernels import tnt_rewards

MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


def _batch(seed: int, b: int = 6, t: int = 9):
    """verl's padded (B, T) tensors: responses of uneven lengths (one of a single token), log-probs that moved
    enough for both clip bounds and the dual clip to bind, GRPO-style advantages broadcast over each response."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 4, 1, 7, 9, 3])[:b]
    mask = torch.arange(t)[None, :] < lengths[:, None]  # (B, T) bool, as verl hands it over
    old = -torch.rand(b, t, generator=g) * 3
    new = old + 0.6 * torch.randn(b, t, generator=g)
    new[:, 0] = old[:, 0] + 1.5  # a ratio of 4.5 at every first token: past 1 + clip_high and past clip_ratio_c
    new.requires_grad_()
    signs = torch.tensor([1.0, -1.0] * (b // 2))  # both signs, so both the clip and the dual clip bind
    advantages = (torch.rand(b, generator=g) + 0.1) * signs * 2  # (B,)
    advantages = advantages[:, None] * mask  # (B, T)
    weights = torch.rand(b, t, generator=g) + 0.5
    return old, new, advantages, mask, weights


def _config(**global_batch_info) -> ActorConfig:
    # SAPO's temperatures off verl's defaults (1.0, 1.05), so that reading them is tested
    config = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=0.2,
                         clip_ratio_high=0.28, clip_ratio_c=2.0, tau_pos=1.3, tau_neg=2.0)  # fmt: skip
    config.global_batch_info.update(global_batch_info)
    return config


# fasttnt's registered loss of each of verl's loss modes, and verl's own function
LOSSES = {
    "vanilla": (fasttnt_verl.policy_loss, core_algos.compute_policy_loss_vanilla),
    "gspo": (fasttnt_verl.gspo_policy_loss, core_algos.compute_policy_loss_gspo),
    "sapo": (fasttnt_verl.sapo_policy_loss, core_algos.compute_policy_loss_sapo),
    "cispo": (fasttnt_verl.cispo_policy_loss, core_algos.compute_policy_loss_cispo),
    "gpg": (fasttnt_verl.gpg_policy_loss, core_algos.compute_policy_loss_gpg),
}


@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("global_counts", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("weighted", [False, True], ids=["", "is_weights"])
def test_the_policy_losses_equal_verls(loss, mode, global_counts, weighted):
    ours, theirs = LOSSES[loss]
    old, new, advantages, mask, weights = _batch(seed=MODES.index(mode))
    info = dict(dp_size=2, batch_num_tokens=80, global_batch_size=16, loss_scale_factor=12) if global_counts else {}
    kwargs = dict(old_log_prob=old, advantages=advantages, response_mask=mask, loss_agg_mode=mode,
                  rollout_is_weights=weights if weighted else None)  # fmt: skip
    want, want_metrics = theirs(log_prob=new, config=_config(**info), **kwargs)
    (want_grad,) = torch.autograd.grad(want, new)
    got, got_metrics = ours(log_prob=new, config=_config(**info), **kwargs)
    (got_grad,) = torch.autograd.grad(got, new)
    assert want_grad.abs().sum() > 0  # precondition
    if loss not in ("sapo", "gpg"):  # SAPO's gate and GPG have no clip; the others' binds, vanilla's dual clip too
        assert want_metrics["actor/pg_clipfrac"] > 0
        assert (want_metrics["actor/pg_clipfrac_lower"] > 0) == (loss == "vanilla")
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert got_metrics.keys() == want_metrics.keys()
    for name, value in want_metrics.items():
        assert got_metrics[name] == pytest.approx(float(value), rel=1e-5, abs=1e-6), name


def test_cispo_with_the_lower_clip_turned_off_as_verl_turns_it_off():
    # clip_ratio_low above 1: a lower bound of 1 - 1.5 < 0, which no ratio is under (the kernel's clip_low of 1)
    old, new, advantages, mask, _ = _batch(seed=7)
    config = ActorConfig(strategy="fsdp", rollout_n=2, ppo_micro_batch_size_per_gpu=1, clip_ratio_low=1.5,
                         clip_ratio_high=0.28)  # fmt: skip
    kwargs = dict(old_log_prob=old, advantages=advantages, response_mask=mask, loss_agg_mode="token-mean")
    want, want_metrics = core_algos.compute_policy_loss_cispo(log_prob=new, config=config, **kwargs)
    got, got_metrics = fasttnt_verl.cispo_policy_loss(log_prob=new, config=config, **kwargs)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-6)
    assert got_metrics["actor/pg_clipfrac"] == pytest.approx(want_metrics["actor/pg_clipfrac"], rel=1e-5, abs=1e-6)


def test_the_policy_loss_refuses_advantages_that_vary_within_a_response():
    old, new, advantages, mask, _ = _batch(seed=0)
    advantages = advantages + torch.linspace(0, 1, advantages.shape[1])  # GAE-like: per token
    with pytest.raises(ValueError, match="vary within a response"):
        fasttnt_verl.policy_loss(old, new, advantages, mask, "token-mean", _config())


@pytest.mark.parametrize("by_std", [True, False])
def test_grpo_advantages_equal_verls_grouped_by_uid(by_std):
    g = torch.Generator().manual_seed(3)
    uids = np.array(["b", "a", "c", "a", "b", "c", "c", "a", "b", "a", "b", "c"], dtype=object)  # 3 groups of 4
    mask = torch.arange(5)[None, :] < torch.randint(1, 6, (12,), generator=g)[:, None]
    rewards = torch.zeros(12, 5)
    rewards[torch.arange(12), mask.sum(1) - 1] = torch.randn(12, generator=g)  # the score at the last token
    config = OmegaConf.create({"norm_adv_by_std_in_grpo": by_std})
    want, _ = core_algos.compute_grpo_outcome_advantage(rewards, mask.float(), uids, norm_adv_by_std_in_grpo=by_std)
    got, returns = fasttnt_verl.grpo_advantages(rewards, mask.float(), index=uids, config=config)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert returns is got


def test_grpo_advantages_refuse_groups_of_unequal_size():
    with pytest.raises(ValueError, match="groups of one size"):
        fasttnt_verl.grpo_advantages(torch.ones(3, 2), torch.ones(3, 2), index=np.array(["a", "a", "b"]))


def test_the_registrations_are_verls():
    from importlib.metadata import entry_points

    if any(ep.name == "fasttnt" for ep in entry_points(group="verl.plugins")):  # fasttnt installed, not on a path
        # verl imported fasttnt's plugin through the entry point when it was imported
        assert core_algos.POLICY_LOSS_REGISTRY.get("fasttnt") is fasttnt_verl.policy_loss
    fasttnt_verl.register()  # and again: nothing changes
    fasttnt_verl.register()
    assert core_algos.get_policy_loss_fn("fasttnt") is fasttnt_verl.policy_loss
    for loss in ("gspo", "sapo", "cispo", "gpg"):
        assert core_algos.get_policy_loss_fn(f"fasttnt_{loss}") is LOSSES[loss][0]
    assert core_algos.get_adv_estimator_fn("fasttnt") is fasttnt_verl.grpo_advantages


def test_tnt_scores_group_by_uid_and_sit_at_the_last_token():
    think_end = 7
    # two groups of 3, interleaved: "x" = [thinking right, direct right, direct too long], "y" = [direct wrong,
    # thinking wrong, thinking right]
    rows = [
        ([1, 2, think_end, 3], "x", True), ([think_end, 5, 6], "y", False), ([think_end, 5], "x", True),
        ([1, think_end, 4, 4], "y", False), ([think_end, 5, 5, 5, 5, 5, 5], "x", True), ([9, think_end, 2], "y", True),
    ]  # fmt: skip
    t = 8
    responses = torch.zeros(6, t, dtype=torch.long)
    mask = torch.zeros(6, t, dtype=torch.long)
    for i, (ids, _, _) in enumerate(rows):
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    uids = np.array([uid for _, uid, _ in rows], dtype=object)
    correct = [c for _, _, c in rows]
    scores = fasttnt_verl.tnt_token_scores(responses, mask, uids, correct, think_end)
    # the truth: each group through the kernel on its own, adjacent
    expected = {}
    for uid in ("x", "y"):
        members = [i for i, (_, u, _) in enumerate(rows) if u == uid]
        ids = torch.tensor([tok for i in members for tok in rows[i][0]])
        cu = torch.tensor([0, *np.cumsum([len(rows[i][0]) for i in members])])
        out = tnt_rewards(ids, cu, torch.tensor([rows[i][2] for i in members]), 3, think_end)
        expected.update(zip(members, out.rewards.tolist(), strict=True))
    for i, (ids, _, _) in enumerate(rows):
        assert scores[i, len(ids) - 1].item() == expected[i]
        assert scores[i].count_nonzero() <= 1  # the reward sits at the last valid token alone
    assert [expected[i] for i in (0, 2, 4)] == [1.0, 2.0, -2.0]  # x: the 7-token direct answer is over the limit


def test_the_kernel_readme_verl_example_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "kernels" / "README.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if b.startswith("# needs: verl")]
    script = tmp_path / "verl_example.py"
    script.write_text(block)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "actor/pg_clipfrac" in result.stdout


def test_the_reward_manager_scores_a_dataproto_by_uid():
    from verl import DataProto
    from verl.workers.reward_manager import get_reward_manager_cls

    from fasttnt.embedded.char_tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    texts = [
        "<think>3+4=7</think> \\boxed{7}", "</think> \\boxed{7}", "</think> \\boxed{8}",
        "<think>6+1</think> \\boxed{7}", "</think> \\boxed{7}", "<think>3+4=",
    ]  # fmt: skip
    uids = np.array(["a", "b", "a", "b", "a", "b"], dtype=object)
    # each with EOS but the last, which was truncated
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] * (i < 5) for i, t in enumerate(texts)]
    t = max(len(r) for r in ids)
    responses = torch.full((6, t), tok.pad_token_id)
    response_mask = torch.zeros(6, t, dtype=torch.long)
    for i, r in enumerate(ids):
        responses[i, : len(r)] = torch.tensor(r)
        response_mask[i, : len(r)] = 1
    prompts = torch.ones(6, 3, dtype=torch.long)
    data = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses,
                 "attention_mask": torch.cat([torch.ones(6, 3, dtype=torch.long), response_mask], 1)},
        non_tensors={"uid": uids, "reward_model": np.array([{"ground_truth": "7"}] * 6, dtype=object),
                     "data_source": np.array(["synthetic"] * 6, dtype=object)},
    )  # fmt: skip
    fasttnt_verl.register()
    manager = get_reward_manager_cls("fasttnt")(tok, num_examine=0)
    out = manager(data, return_dict=True)
    correct = [True, True, False, True, True, False]  # 8 is wrong; the truncated one is wrong whatever it says
    assert out["reward_extra_info"]["correct"] == correct
    expected = fasttnt_verl.tnt_token_scores(
        responses, response_mask, uids, correct, tok.convert_tokens_to_ids("</think>")
    )
    torch.testing.assert_close(out["reward_tensor"], expected)
    rewards = [float(out["reward_tensor"][i, len(r) - 1]) for i, r in enumerate(ids)]
    assert rewards == [1.0, 2.0, -1.0, 1.0, 2.0, 0.0]


# -- the TNT reward inside verl's own trainer (fasttnt.integrations.verl_trainer) ---------------------------------


@pytest.fixture(scope="module")
def transfer_queue():
    """A real TransferQueue on a local Ray, as verl's V1 trainer uses it (its controller and two storage units
    each ask Ray for a CPU: 4 logical ones, whatever the machine has)."""
    tq = pytest.importorskip("transfer_queue")
    import ray

    ray.init(num_cpus=4, include_dashboard=False, object_store_memory=200 * 2**20, log_to_driver=False)
    tq.init()
    yield tq
    tq.close()
    ray.shutdown()


def test_the_trainer_is_registered_by_the_entry_point_and_stays_synchronous():
    # `import verl` loads fasttnt's verl.plugins entry points; the trainer's real __init__ from verl's own config
    import os

    import verl.trainer
    from hydra import compose, initialize_config_dir
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    from fasttnt.integrations.verl_trainer import TNTTrainer

    assert get_trainer_cls("fasttnt") is TNTTrainer
    with initialize_config_dir(config_dir=os.path.join(os.path.dirname(verl.trainer.__file__), "config"),
                               version_base=None):  # fmt: skip
        cfg = compose("ppo_trainer", overrides=["trainer.v1.trainer_mode=fasttnt", "algorithm.adv_estimator=grpo",
                                                "actor_rollout_ref.rollout.n=4", "data.train_batch_size=8",
                                                "actor_rollout_ref.model.path=/nonexistent"])  # fmt: skip
    trainer = TNTTrainer(config=cfg)
    # under its own name verl's base would pick the asynchronous replay buffer (it compares with "sync")
    assert trainer.trainer_mode == "sync" and type(trainer.replay_buffer) is ReplayBuffer


def test_the_trainer_rescores_a_step_by_uid_before_verls_advantages(transfer_queue):
    # a step's batch as the agent loop puts it into TransferQueue: 2 prompts x 3 samples with their per-response
    # scores, in the balancer's interleaved order; the trainer's _compute_advantage replaces them with TNT's
    from omegaconf import OmegaConf
    from transfer_queue import KVBatchMeta
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.integrations.verl_trainer import TNTTrainer

    tq = transfer_queue
    tok = build_char_tokenizer()
    texts = {
        ("a", 0): "<think>3+4=7</think> \\boxed{7}", ("a", 1): "</think> \\boxed{7}", ("a", 2): "</think> \\boxed{8}",
        ("b", 0): "<think>6+1</think> \\boxed{7}", ("b", 1): "</think> \\boxed{7}", ("b", 2): "<think>3+4=",
    }  # fmt: skip
    keys, fields, tags, ids = [], [], [], {}
    for (uid, s), text in texts.items():
        eos = [] if (uid, s) == ("b", 2) else [tok.eos_token_id]  # b_2 was cut by the length budget
        response = ids[(uid, s)] = tok(text, add_special_tokens=False)["input_ids"] + eos
        per_response = torch.zeros(len(response))
        per_response[-1] = float(text.endswith("{7}"))
        keys.append(f"{uid}_{s}_0")
        fields.append({"uid": uid, "prompts": torch.tensor([5, 6, 7][: 2 + s % 2]), "responses": torch.tensor(response),
                       "response_mask": torch.ones(len(response), dtype=torch.int64), "rm_scores": per_response,
                       "reward_model": {"ground_truth": "7", "style": "rule"}, "data_source": "synthetic"})  # fmt: skip
        tags.append({"status": "success"})
    tq.kv_batch_put(keys=keys, partition_id="train", fields=list_of_dict_to_tensordict(fields), tags=tags)
    order = [0, 3, 1, 4, 2, 5]
    batch = KVBatchMeta(partition_id="train", keys=[keys[i] for i in order], tags=[tags[i] for i in order])
    trainer = object.__new__(TNTTrainer)  # the step's hook alone: no workers, no Ray actors of verl's
    trainer.tokenizer = tok
    trainer.config = OmegaConf.create({
        "algorithm": {"use_kl_in_reward": False, "adv_estimator": "grpo", "gamma": 1.0, "lam": 1.0,
                      "norm_adv_by_std_in_grpo": True, "rollout_correction": None},
        "actor_rollout_ref": {"rollout": {"n": 3}}, "reward": {"fasttnt": {"omega": 2.0}},
    })  # fmt: skip
    metrics = {}
    trainer._compute_advantage(batch, metrics)
    out = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rm_scores", "advantages"])
    got = {k: r for k, r in zip(keys, out["rm_scores"].unbind(0), strict=True)}
    # the truth: fasttnt's kernel on the same responses, grouped by uid; b_2 is truncated, so wrong
    for uid in ("a", "b"):
        responses = [ids[(uid, s)] for s in range(3)]
        cu = torch.tensor([0, *np.cumsum([len(r) for r in responses])])
        correct = torch.tensor([texts[(uid, s)].endswith("{7}") and (uid, s) != ("b", 2) for s in range(3)])
        flat = torch.tensor([t for r in responses for t in r])
        want = tnt_rewards(flat, cu, correct, 3, tok.convert_tokens_to_ids("</think>"))
        for s in range(3):
            score = got[f"{uid}_{s}_0"]
            assert score.shape == (len(responses[s]),) and score.nonzero().numel() <= 1
            assert float(score[-1]) == pytest.approx(float(want.rewards[s]))
    assert [float(got[k][-1]) for k in keys] == [1.0, 2.0, -1.0, 1.0, 2.0, 0.0]  # a direct answer over no limit
    # verl's own GRPO advantages on the TNT scores, by uid
    scores = torch.stack([torch.nn.functional.pad(got[k], (0, 40 - len(got[k]))) for k in keys])  # (B, 40)
    advantages, _ = core_algos.compute_grpo_outcome_advantage(scores, torch.ones_like(scores),
                                                             np.array([k[0] for k in keys]))  # fmt: skip
    for k, a, adv in zip(keys, out["advantages"].unbind(0), advantages, strict=True):
        assert float(a[0]) == pytest.approx(float(adv[0]), abs=1e-5), k
    assert metrics["fasttnt/correct_mean"] == pytest.approx(4 / 6)


def test_the_trainers_overlong_shaping_counts_back_from_verls_response_budget():
    # TransferQueue's rows are jagged: padded to the longest response alone, the shaping would count back from that
    # length instead of data.max_response_length. Rows as the step's batch holds them, scored directly
    from verl.utils.tensordict_utils import list_of_dict_to_tensordict

    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.integrations.verl_trainer import tnt_rm_scores
    from fasttnt.rewards import RewardConfig, overlong_shaping

    tok = build_char_tokenizer()
    texts = ["<think>3+4=7</think> \\boxed{7}", "<think>3+4 is 7</think> \\boxed{7}", "</think> \\boxed{7}"]
    ids = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    data = list_of_dict_to_tensordict([
        {"uid": "a", "prompts": torch.tensor([5, 6]), "responses": torch.tensor(r),
         "reward_model": {"ground_truth": "7", "style": "rule"}} for r in ids
    ])  # fmt: skip
    config = RewardConfig(overlong_buffer=20, overlong_penalty=1.0)
    manager = fasttnt_verl.TNTRewardManager(tok, config=config)
    budget = 40  # the shorter responses fall inside the buffer (40 - 20) only when counted from it
    lengths = torch.tensor([len(r) for r in ids])
    assert max(lengths) < budget and (lengths > budget - 20).any(), "the construction: shaping only from 40"
    rows, _ = tnt_rm_scores(data, manager, tok.pad_token_id, response_budget=budget)
    cu = torch.tensor([0, *np.cumsum(lengths.tolist())])
    plain = tnt_rewards(torch.tensor([t for r in ids for t in r]), cu, torch.ones(3, dtype=torch.bool), 3,
                        tok.convert_tokens_to_ids("</think>")).rewards  # fmt: skip
    want = plain + overlong_shaping(lengths, budget, 20, 1.0)
    assert (want != plain).any()
    assert [float(r[-1]) for r in rows] == pytest.approx(want.tolist())
    with pytest.raises(ValueError, match=re.escape("set data.max_response_length")):
        tnt_rm_scores(data, manager, tok.pad_token_id)


def test_compute_score_is_the_verifiers_verdict():
    # verl's per-response loop decodes without special tokens: the answer is found with or without </think>
    score = fasttnt_verl.compute_score
    assert score("synthetic", "<think>3+4=7</think> \\boxed{7}", "7") == 1.0
    assert score("synthetic", "3+4=7 so \\boxed{7}", "7") == 1.0
    assert score("synthetic", "\\boxed{8}", "7") == 0.0
    assert score("synthetic", "no answer", "7") == 0.0
