"""fasttnt's kernels inside verl (read and tested against verl 0.9.1): a policy loss and a GRPO advantage estimator
for verl's registries, and the TNT reward over a verl batch.

    import fasttnt.integrations.verl as fasttnt_verl
    fasttnt_verl.register()  # or, in every Ray worker: VERL_USE_EXTERNAL_MODULES=fasttnt.integrations.verl_plugin

    actor_rollout_ref.actor.policy_loss.loss_mode=fasttnt    # policy_loss below (fasttnt_gspo, _sapo, _cispo, _gpg)
    algorithm.adv_estimator=fasttnt                          # grpo_advantages below

With fasttnt installed, verl also loads ``fasttnt.integrations.verl_plugin`` itself through its ``verl.plugins``
entry point. ``policy_loss`` computes verl's ``compute_policy_loss_vanilla`` (clip_ratio_low/high, the dual clip
clip_ratio_c on negative advantages, the log-ratio clamped to +-20, rollout importance weights) and its ``agg_loss``
for every ``loss_agg_mode`` and global normaliser, with ``clipped_policy_loss`` on the packed valid tokens; it
returns verl's metrics. ``gspo_policy_loss``, ``sapo_policy_loss`` and ``cispo_policy_loss`` (registered as
``fasttnt_gspo``, ``fasttnt_sapo``, ``fasttnt_cispo``) compute verl's ``compute_policy_loss_gspo``, ``_sapo`` and
``_cispo`` the same way, with their settings (SAPO's ``tau_pos``/``tau_neg``) and metrics, and ``gpg_policy_loss``
(``fasttnt_gpg``) its ``_gpg``. verl's advantages arrive per token; the loss takes one per sequence, so per-token
advantages that vary within a response (GAE) are refused. ``grpo_advantages`` is verl's GRPO outcome advantage
(unbiased std, epsilon, ``norm_adv_by_std_in_grpo``) from ``group_advantages``, grouping by verl's ``uid``; every
group must have the same size, and a group of one gets 0 (verl's gives the score itself: no baseline exists).
``TNTRewardManager`` (registered as ``fasttnt`` among verl's reward managers) scores a whole batch, each response
against the thinking responses sharing its ``uid``; ``tnt_token_scores`` is its core on plain tensors, the
configured reward scheme's (``fasttnt.rewards.compute_rewards``: a scheme registered in ``REWARD_SCHEMES`` reaches
verl too). ``compute_score`` is verl's per-response reward function, each answer verified under the trainer's
timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence

import numpy as np
import torch

from fasttnt_kernels import clipped_policy_loss, group_advantages

from .. import scoring
from ..data import think_end_token_id
from ..engines.batch import RolloutBatch, cu_seqlens_of, eos_ids_of
from ..rewards import RewardConfig, compute_rewards, refuse_mode_balance
from ..verify import VerifierPool, verify_batch
from ..verify.answers import DEFAULT_TIMEOUT

NAME = "fasttnt"


def register(name: str = NAME) -> None:
    """Register ``policy_loss`` and ``grpo_advantages`` with verl under ``name`` (both registries), the GSPO, SAPO,
    CISPO and GPG losses as ``<name>_gspo``, ``<name>_sapo``, ``<name>_cispo`` and ``<name>_gpg``
    (``POLICY_LOSSES``), and ``TNTRewardManager`` in verl's reward-manager registry (the batch-level one). Imports
    verl."""
    from verl.trainer.ppo import core_algos
    from verl.workers import reward_manager

    for loss_mode, function in POLICY_LOSSES.items():
        core_algos.register_policy_loss(loss_mode.replace(NAME, name, 1))(function)
    if core_algos.ADV_ESTIMATOR_REGISTRY.get(name) is not grpo_advantages:  # verl refuses a second function
        core_algos.register_adv_est(name)(grpo_advantages)
    reward_manager.register(name)(TNTRewardManager)  # the same class again is accepted


def _packed(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's (B, T) mask as packed sequences: the valid tokens row by row (a mask need not be a prefix: every valid
    token is its sequence's), and cu_seqlens (B+1,)."""
    mask = response_mask.bool()
    return mask, cu_seqlens_of(mask.sum(1))


def _sequence_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per sequence (B,) from verl's per-token (B, T), refusing ones that vary within a sequence."""
    first = torch.where(mask.any(1), mask.int().argmax(1), 0)  # (B,) the first valid token
    per_sequence = advantages.gather(1, first[:, None])[:, 0]  # (B,)
    if not torch.equal(torch.where(mask, advantages, 0), torch.where(mask, per_sequence[:, None], 0)):
        raise ValueError(
            "fasttnt's policy loss takes one advantage per response; these vary within a response (GAE?): use an "
            "outcome estimator (grpo, fasttnt) or verl's vanilla loss"
        )
    return per_sequence


def _normalisers(loss_agg_mode: str, mask: torch.Tensor, info: dict) -> dict:
    """verl's agg_loss (mode and global_batch_info) as clipped_policy_loss's aggregation and normalisers: the loss's
    sum over tokens (per sequence: mean or sum) divided by the global count over dp_size ranks."""
    dp_size = info.get("dp_size", 1)
    tokens = info.get("batch_num_tokens")
    sequences = info.get("global_batch_size")
    if dp_size > 1 and ((loss_agg_mode == "token-mean" and tokens is None) or
                        (loss_agg_mode.startswith("seq-") and sequences is None)):  # fmt: skip
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} with dp_size={dp_size} needs verl's global batch counts")
    tokens = float(mask.sum()) if tokens is None else float(tokens)
    sequences = float(mask.any(1).sum()) if sequences is None else float(sequences)
    if loss_agg_mode == "token-mean":
        return {"agg": "token-mean", "total_tokens": tokens / dp_size}
    if loss_agg_mode == "token-sum":
        return {"agg": "token-mean", "total_tokens": 1.0 / dp_size}
    if loss_agg_mode == "seq-mean-token-mean":
        return {"agg": "seq-mean-token-mean", "total_seqs": sequences / dp_size}
    if loss_agg_mode == "seq-mean-token-sum":
        return {"agg": "seq-mean-token-sum-norm", "norm_length": 1.0, "total_seqs": sequences / dp_size}
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = info.get("loss_scale_factor") or mask.shape[-1]  # verl's default: the padded response length
        return {"agg": "seq-mean-token-sum-norm", "norm_length": float(scale), "total_seqs": sequences / dp_size}
    raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")


def _option(config, name: str, default=None):
    value = config.get(name, default) if hasattr(config, "get") else getattr(config, name, default)
    return default if value is None else value


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config=None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's policy-loss interface (all (B, T), padded): ``(loss, metrics)`` as ``compute_policy_loss_vanilla``
    returns them, computed by ``clipped_policy_loss`` on the valid tokens."""
    return _policy_loss("vanilla", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights)  # fmt: skip


def gspo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                     config=None, rollout_is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """``compute_policy_loss_gspo`` (GSPO-token: each sequence's mean log-ratio, each token's own gradient; no dual
    clip) through the kernel; registered as ``fasttnt_gspo``."""
    return _policy_loss("gspo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights)  # fmt: skip


def sapo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                     config=None, rollout_is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """``compute_policy_loss_sapo`` (the soft gate at verl's ``tau_pos``/``tau_neg``) through the kernel; like
    verl's, it aggregates by seq-mean-token-mean whatever ``loss_agg_mode`` says. Registered as ``fasttnt_sapo``."""
    return _policy_loss("sapo", old_log_prob, log_prob, advantages, response_mask, "seq-mean-token-mean", config,
                        rollout_is_weights)  # fmt: skip


def cispo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                      rollout_is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """``compute_policy_loss_cispo`` (the importance weight clipped to [1 - clip_ratio_low, 1 + clip_ratio_high],
    detached, times A and log pi) through the kernel; registered as ``fasttnt_cispo``."""
    return _policy_loss("cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                        rollout_is_weights)  # fmt: skip


def gpg_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                    rollout_is_weights=None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
    """``compute_policy_loss_gpg`` (-A log pi, no ratio: CISPO's loss with its weights clipped to the band [1, 1])
    through the kernel, with verl's metrics for it (none); registered as ``fasttnt_gpg``."""
    loss, _ = _policy_loss("cispo", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                           rollout_is_weights, band=(0.0, 0.0))  # fmt: skip
    return loss, {}


# verl's loss_mode name of each policy loss registered here (``register``): one name per loss, as verl's own. Left
# out of verl's set: geo_mean (GMPO: the exp of a sequence's mean clipped log-ratio, its loss a plain mean over the
# micro-batch's sequences whatever loss_agg_mode says), clip_cov and kl_cov (which tokens train is chosen over the
# whole batch by the covariance of log-prob and advantage, clip_cov at random), dppo_tv, dppo_kl and dro
POLICY_LOSSES = {NAME: policy_loss, f"{NAME}_gspo": gspo_policy_loss, f"{NAME}_sapo": sapo_policy_loss,
                 f"{NAME}_cispo": cispo_policy_loss, f"{NAME}_gpg": gpg_policy_loss}  # fmt: skip


def _settings_read(mode: str, config, clip: float, band: tuple[float, float] | None) -> dict:
    """The kernel's settings that verl's ``mode`` reads from its config, and only those (a value another loss would
    refuse, which verl accepts because this loss ignores it, stays unread): SAPO's temperatures, the others' clip
    ratios; CISPO's lower ratio above 1 (verl's way to turn the lower clip off) as 1, the same bound of 0."""
    if mode == "sapo":
        return {"sapo_tau_pos": _option(config, "tau_pos", 1.0), "sapo_tau_neg": _option(config, "tau_neg", 1.05)}
    low, high = band or (_option(config, "clip_ratio_low", clip), _option(config, "clip_ratio_high", clip))
    return {"clip_low": min(low, 1.0) if mode == "cispo" else low, "clip_high": high}


def _policy_loss(
    mode: str,
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str,
    config,
    rollout_is_weights: torch.Tensor | None,
    band: tuple[float, float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_policy_loss_<mode>`` for mode vanilla, gspo, sapo or cispo, and its metrics; ``band``: the
    clip ratios (low, high) in place of the config's."""
    if config is None:
        raise ValueError("fasttnt's verl policy loss needs verl's actor config (clip ratios, global_batch_info)")
    clip = _option(config, "clip_ratio", 0.2)
    dual = None  # verl's gspo, sapo and cispo have no dual clip
    if mode == "vanilla":
        dual = _option(config, "clip_ratio_c", 3.0)
        if dual <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1.0, got {dual}")
    mask, cu_seqlens = _packed(response_mask)
    info = dict(_option(config, "global_batch_info", {}) or {})
    loss, stats = clipped_policy_loss(
        log_prob[mask],
        old_log_prob[mask],
        _sequence_advantages(advantages, mask),
        cu_seqlens,
        policy_loss=mode,
        dual_clip=dual,
        **_settings_read(mode, config, clip, band),
        is_weights=None if rollout_is_weights is None else rollout_is_weights[mask],
        **_normalisers(loss_agg_mode, mask, info),
    )
    # verl's metrics: masked means (its + 1e-8 in the denominator), the KL as the mean of old - new log-probs (its
    # gspo's unclamped, the others' clamped to +-20); the clip fractions each loss reports, 0 where it has none
    n = mask.sum() + 1e-8
    log_ratio = log_prob.detach() - old_log_prob
    if mode != "gspo":
        log_ratio = torch.clamp(log_ratio, -20.0, 20.0)
    tokens = float(mask.sum())
    clipped = 0.0 if mode == "sapo" else float((stats["clip_frac_low"] + stats["clip_frac_high"]) * tokens / n)
    metrics = {
        "actor/pg_clipfrac": clipped,
        "actor/ppo_kl": float(torch.where(mask, -log_ratio, 0).sum() / n),
        "actor/pg_clipfrac_lower": float(stats["dual_clip_frac"] * tokens / n),
    }
    return loss, metrics


def grpo_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence | np.ndarray | None = None,
    config=None,
    **_,
) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's advantage-estimator interface: ``(advantages, returns)``, each (B, T), from each response's total
    reward, group-relative among the responses sharing a ``uid`` (``index``)."""
    if index is None:
        raise ValueError("fasttnt's GRPO advantages group responses by verl's uid; the batch has none")
    epsilon = _option(config, "epsilon", 1e-6)  # a missing config (None) reads as the defaults
    by_std = _option(config, "norm_adv_by_std_in_grpo", True)
    scores = token_level_rewards.sum(-1)  # (B,)
    order, group_size = _group_order(index)
    advantages = torch.empty_like(scores)
    advantages[order] = group_advantages(scores[order], group_size, scale="std" if by_std else "none", eps=epsilon)
    out = advantages[:, None] * response_mask  # (B, T)
    return out, out


def _group_order(index: Sequence) -> tuple[torch.Tensor, int]:
    """A permutation that puts the responses of each uid together (first-seen order, stable), and the group size;
    groups of unequal size are refused (the kernels take groups of one size)."""
    groups: dict = {}
    for i, uid in enumerate(index):
        groups.setdefault(uid, []).append(i)
    sizes = {len(members) for members in groups.values()}
    if len(sizes) != 1:
        raise ValueError(f"fasttnt's GRPO advantages take groups of one size; the uids' groups have sizes {sizes}")
    order = torch.tensor([i for members in groups.values() for i in members], dtype=torch.int64)
    return order, sizes.pop()


def tnt_token_scores(
    responses: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence,
    correct: Sequence[bool] | torch.Tensor,
    think_end_id: int,
    *,
    config: RewardConfig | None = None,
) -> torch.Tensor:
    """The configured reward over a verl batch, as verl's reward managers lay a score out: (B, T), each response's
    reward at its last valid token. ``responses`` (B, T) token ids, ``response_mask`` (B, T), ``index`` the uids
    (the group of a response: all sharing its uid, groups of one size), ``correct`` (B,) the verifier's verdicts (a
    truncated response must be marked wrong by the caller). ``config``: the scheme (tnt, a baseline or one
    registered in ``fasttnt.rewards.REWARD_SCHEMES``) and values, through ``compute_rewards`` as in the trainer; its
    overlong shaping counts back from T, verl's response length budget (its batches are padded to it).
    """
    cfg = config or RewardConfig()
    refuse_mode_balance(cfg, "tnt_token_scores")
    order, group_size = _group_order(index)
    order = order.to(responses.device)
    mask, cu_seqlens = _packed(response_mask[order])  # the rows in group order, so that each group is adjacent
    correct = torch.as_tensor(correct, dtype=torch.bool, device=responses.device)
    packed = RolloutBatch.of_packed(responses[order][mask], cu_seqlens, group_size)
    out = compute_rewards(packed, correct[order], think_end_id, cfg, max_new_tokens=responses.shape[1])
    rewards = torch.empty(len(order), dtype=torch.float32, device=responses.device)
    rewards[order] = out.rewards
    valid = response_mask.bool()
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)  # (B,) each response's last valid token
    scores = torch.zeros(valid.shape, dtype=torch.float32, device=responses.device)
    scores[torch.arange(len(last), device=responses.device), last] = torch.where(valid.any(1), rewards, 0.0)
    return scores


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info=None, **_) -> float:
    """verl's custom reward function interface (``reward.custom_reward_function``): 1.0 when the response's final
    answer is the gold answer, else 0.0, by fasttnt's verifier. For verl's per-response reward loop (validation
    reports it) next to the ``fasttnt`` trainer's TNT reward. verl decodes without special tokens, which may drop
    ``</think>``: the answer is searched after it when it is there, in the whole text otherwise.

    Strings and numbers are decided here; a symbolic comparison runs in a verifier worker under the trainer's
    default timeout (``verify_timeout``, 5 s), as the trainer's do, and one that passes it, or kills its worker,
    is wrong: one pathological answer (a power tower) cannot hang verl's loop."""
    del data_source, extra_info
    return float(verify_batch([solution_str], [str(ground_truth)], pool=_score_pool())[0])


_score_pools = threading.local()


def _score_pool() -> VerifierPool:
    """This thread's verifier pool for ``compute_score``, made at its first call and reused: verl calls the function
    once per response, from its reward loop's executor threads (``run_in_executor``), and a pool serves one caller
    at a time. One worker, started at the first answer that needs it."""
    pool = getattr(_score_pools, "pool", None)
    if pool is None:
        pool = _score_pools.pool = VerifierPool(workers=1, timeout=DEFAULT_TIMEOUT)
    return pool


class TNTRewardManager:
    """The TNT reward as a verl reward manager of the batch kind (verl's ``BatchRewardManager`` interface: called on
    a whole ``DataProto``, returns the (B, T) reward tensor, or with ``return_dict`` also per-response extras).
    It needs the whole batch: a response's limit comes from the thinking responses sharing its ``uid``. Reads
    ``prompts``, ``responses`` and ``attention_mask`` (the tensors), ``uid`` and ``reward_model["ground_truth"]``
    (the non-tensors); a response is correct when ``verify(texts, golds)`` says so (default: fasttnt's verifier,
    the final answer after ``</think>``) and it ended with an EOS id within its length: ``eos_token_ids`` when given
    (a ``reward_kwargs`` entry), else the tokenizer's plus the generation config's of the local folder it was loaded
    from, as ``fasttnt.integrations.trl.TNTReward`` takes them.

    verl 0.9.1's trainer scores through its reward loop, one response at a time, which cannot give a group-level
    reward: the ``fasttnt`` trainer (``fasttnt.integrations.verl_trainer``) calls this manager on each step's whole
    batch. It is also registered among verl's batch reward managers, as ``fasttnt``."""

    def __init__(
        self,
        tokenizer,
        num_examine: int = 0,
        compute_score=None,
        reward_fn_key: str = "data_source",
        *,
        config: RewardConfig | None = None,
        verify: scoring.Verify | None = None,
        eos_token_ids: Collection[int] | None = None,
        **_,
    ) -> None:
        del num_examine, compute_score, reward_fn_key  # verl's manager arguments this manager has no use for
        self.tokenizer, self.config, self.verify = tokenizer, config or RewardConfig(), verify
        refuse_mode_balance(self.config, "TNTRewardManager")
        self.think_end_id = think_end_token_id(tokenizer)
        self.eos_ids = frozenset(eos_token_ids) if eos_token_ids is not None else eos_ids_of(tokenizer)

    def __call__(self, data, return_dict: bool = False):
        responses = data.batch["responses"]  # (B, T)
        prompt_length = data.batch["prompts"].shape[-1]
        mask = data.batch["attention_mask"][:, prompt_length:].bool()  # (B, T)
        lengths = mask.sum(1).tolist()
        ids = [row[:n].tolist() for row, n in zip(responses, lengths, strict=True)]
        golds = [str(item["ground_truth"]) for item in data.non_tensor_batch["reward_model"]]
        batch = scoring.batch_of(ids, group_size=1, eos_ids=self.eos_ids)  # groups: by uid, below
        correct = scoring.judge(self.tokenizer, batch, golds, eos_ids=self.eos_ids, verify=self.verify).correct.tolist()
        scores = tnt_token_scores(
            responses, mask, data.non_tensor_batch["uid"], correct, self.think_end_id, config=self.config
        )
        if not return_dict:
            return scores
        return {"reward_tensor": scores, "reward_extra_info": {"correct": correct}}
