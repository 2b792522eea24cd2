"""Reward schemes for hybrid responses, selected by name in the config; all computed on device by the
``tnt_rewards`` kernel from token ids.

    tnt            thinking 1/0; non-thinking 2/-1 within the query's limit omega * mean(solution length of its
                   thinking responses) (fallback_limit when it has none), -2 beyond it (the TNT paper)
    no-limit       thinking 1/0; non-thinking 2/-1 whatever its length (AutoThink's rewards; hackable)
    uniform-limit  as tnt with one limit, uniform_limit, for every query (AdaptThink-style)
    binary         1/0 for every response (plain GRPO)

``correct`` is the judged verdict (``fasttnt.scoring.judge``: a response truncated by the length budget is wrong,
whatever its text says). DAPO's overlong reward shaping (``overlong_buffer`` > 0) is added to any scheme's reward
afterwards, and AutoThink's mode balance (``mode_balance``) applied last: ``compute_rewards`` composes the three.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from fasttnt_kernels import RewardValues, SettingError, TntRewards, check_reward_limits, tnt_rewards

from . import distributed
from .engines.batch import RolloutBatch
from .modes import forced_rows
from .registry import Registry
from .typed_yaml import requirement


@dataclass(frozen=True)
class RewardConfig:
    """Reward hyper-parameters; the defaults are the TNT paper's (omega = 2, L_empty = 1000, 1/0, 2/-1, -2)."""

    scheme: str = "tnt"
    omega: float = 2.0
    fallback_limit: float = 1000.0
    uniform_limit: float | None = None
    # the reward table, flat under reward.* as users write it: the kernel's RewardValues by name, with its defaults
    # (one place for the paper's numbers); `values` makes the kernel's table of them, and the kernel's limit checks
    # (check_reward_limits) validate omega, fallback_limit and uniform_limit for the config
    think_correct: float = RewardValues.think_correct
    think_wrong: float = RewardValues.think_wrong
    direct_correct: float = RewardValues.direct_correct
    direct_wrong: float = RewardValues.direct_wrong
    over_limit: float = RewardValues.over_limit
    # the accuracy-aware table (AdaptThink's constraint, Zhang et al. 2025, sec. 3, with its delta 0.05: reward =
    # correct - R_ref(x) + delta 1{direct}): a direct answer earns the thinking reward plus direct_margin, right or
    # wrong, in place of direct_correct / direct_wrong. Within the limit, direct then pays more on average exactly
    # when its accuracy is above thinking's minus direct_margin; R_ref(x), the same for every row of a query,
    # cancels in the group's advantage, so the group's own rows make the comparison online. The over-limit reward
    # stays over_limit (-2, below every honest answer): the hack still costs more than any answer. None: off
    direct_margin: float | None = None
    # DAPO's overlong reward shaping (Yu et al. 2025, sec. 3.4; verl's DAPO reward manager): a response longer than
    # max_new_tokens - overlong_buffer loses overlong_penalty * (its excess / overlong_buffer), the whole penalty at
    # the length budget. 0: off
    overlong_buffer: int = 0
    overlong_penalty: float = 1.0
    # AutoThink's stage-1 batch balance (Tu et al. 2025, sec. 3.1; their verl main_ppo.py): with z the thinking share
    # of a draw's freely sampled responses (the step's without dynamic sampling; forced rows did not choose their
    # mode, so they neither count nor lose), a mode above balance_gamma of them loses f = clip(balance_lambda (share
    # - gamma), 0, 1) from each of its rewards, so neither mode dies out. Off by default; AutoThink's gamma 0.5,
    # lambda 2
    mode_balance: bool = False
    balance_gamma: float = 0.5
    balance_lambda: float = 2.0

    def validate(self) -> None:
        """This section's own fields (``config.validate`` checks them against the others)."""
        need = requirement("reward")
        need(self.scheme in REWARD_SCHEMES, "scheme", f"unknown; choose one of {REWARD_SCHEMES.names()}")
        need(self.overlong_penalty >= 0, "overlong_penalty", "must be >= 0")
        margin = self.direct_margin
        need(margin is None or math.isfinite(margin), "direct_margin", "must be a finite number (or null: off)")
        need(margin is None or (self.direct_correct, self.direct_wrong) == (RewardValues.direct_correct,
                                                                           RewardValues.direct_wrong),
             "direct_margin", "replaces reward.direct_correct and reward.direct_wrong (thinking's reward + the "
             "margin); leave those unset, or set reward.direct_margin=null to use them")  # fmt: skip
        need(margin is None or self.scheme != "binary", "direct_margin",
             "has no effect under reward.scheme=binary (1/0 for every response, no table); set "
             "reward.direct_margin=null")  # fmt: skip
        need(0 <= self.balance_gamma <= 1, "balance_gamma", "must be a share in [0, 1]")
        need(self.balance_lambda > 0, "balance_lambda", "must be > 0")
        try:  # the kernel's own checks of omega, fallback_limit and uniform_limit
            check_reward_limits(self.scheme, omega=self.omega, fallback_limit=self.fallback_limit,
                                uniform_limit=self.uniform_limit)  # fmt: skip
        except SettingError as err:
            need(False, err.key, err.why)

    @property
    def values(self) -> RewardValues:
        """The table the kernel pays (``tnt_rewards``' ``values``): these keys, with ``direct_margin``'s direct
        rewards in place of ``direct_correct`` / ``direct_wrong`` when it is set."""
        table = RewardValues(**{f.name: getattr(self, f.name) for f in fields(RewardValues)})
        if self.direct_margin is None:
            return table
        margin = self.direct_margin
        return replace(table, direct_correct=self.think_correct + margin, direct_wrong=self.think_wrong + margin)


RewardFn = Callable[[RolloutBatch, torch.Tensor, int, RewardConfig], TntRewards]
"""A reward scheme: ``(batch, correct, think_end_id, cfg)`` -> ``TntRewards``; it reads the batch's packed
``response_ids``, ``cu_seqlens`` and ``group_size``."""
REWARD_SCHEMES: Registry[RewardFn] = Registry("reward scheme")


def _kernel_scheme(name: str) -> RewardFn:
    def reward(batch: RolloutBatch, correct: torch.Tensor, think_end_id: int, cfg: RewardConfig) -> TntRewards:
        return tnt_rewards(
            batch.response_ids,
            batch.cu_seqlens,
            correct.bool(),
            batch.group_size,
            think_end_id,
            omega=cfg.omega,
            fallback_limit=cfg.fallback_limit,
            scheme=name,
            uniform_limit=cfg.uniform_limit,
            values=cfg.values,
        )

    return reward


for _name in ("tnt", "no-limit", "uniform-limit", "binary"):
    REWARD_SCHEMES.add(_name, _kernel_scheme(_name))


def overlong_shaping(lengths: torch.Tensor, max_new_tokens: int, buffer: int, penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (S,) float32, <= 0: 0 up to ``max_new_tokens - buffer`` tokens, then falling
    linearly to ``-penalty`` at ``max_new_tokens``. On the lengths' device, no host sync."""
    if buffer <= 0:
        raise ValueError(f"overlong buffer must be > 0 tokens, got {buffer}")
    excess = (lengths.float() - (max_new_tokens - buffer)).clamp(min=0)
    return -penalty * excess.clamp(max=buffer) / buffer


def mode_balance(
    rewards: torch.Tensor,
    non_thinking: torch.Tensor,
    cfg: RewardConfig,
    shares: torch.Tensor,
    free: torch.Tensor | None = None,
) -> torch.Tensor:
    """AutoThink's batch balance (``RewardConfig.mode_balance``): ``shares`` = (thinking, non-thinking) freely sampled
    responses of the draw (counts, summed over ranks); each free response (``free`` (S,), None: all) of a mode
    holding more than ``balance_gamma`` of them loses clip(lambda (share - gamma), 0, 1). (AutoThink moves a reward
    towards one lower, r (1 - f) + (r - 1) f: the same.) On the rewards' device, no host sync."""
    share = shares.float() / shares.sum().clamp(min=1)  # (2,) thinking, non-thinking
    f = (cfg.balance_lambda * (share - cfg.balance_gamma)).clamp(0.0, 1.0)  # (2,)
    penalty = f[non_thinking.long()]  # (S,)
    return rewards - (penalty if free is None else torch.where(free, penalty, torch.zeros_like(penalty)))


def refuse_mode_balance(cfg: RewardConfig, where: str) -> None:
    """Stop a reward of another framework's batches (TRL's, verl's) from taking ``mode_balance``: AutoThink's balance
    counts a draw's freely sampled rows over the fasttnt trainer's ranks, which such a call does not see."""
    if cfg.mode_balance:
        raise ValueError(
            f"{where}: reward.mode_balance=True is the fasttnt trainer's (it counts a draw's free rows over all "
            "ranks); a reward of one batch of another framework's cannot apply it. Leave it False here"
        )


def compute_rewards(
    batch: RolloutBatch,
    correct: torch.Tensor,
    think_end_id: int,
    cfg: RewardConfig,
    *,
    max_new_tokens: int | None = None,
    dist=None,
) -> TntRewards:
    """Rewards, modes, solution lengths and limits of a batch: ``cfg.scheme``'s, then the overlong shaping added when
    ``cfg.overlong_buffer`` > 0 (it needs the length budget, ``max_new_tokens``), then AutoThink's mode balance when
    ``cfg.mode_balance`` (``mode_balance``: over the batch's freely sampled rows, counted over the ranks of ``dist``,
    a ``fasttnt.distributed`` context; None: this process's)."""
    out = REWARD_SCHEMES.get(cfg.scheme)(batch, correct, think_end_id, cfg)
    if cfg.overlong_buffer > 0:
        if max_new_tokens is None:
            raise ValueError("reward.overlong_buffer > 0 needs max_new_tokens, the length budget it counts back from")
        shaping = overlong_shaping(batch.lengths, max_new_tokens, cfg.overlong_buffer, cfg.overlong_penalty)
        out = out._replace(rewards=out.rewards + shaping)
    if cfg.mode_balance:  # the modes' shares of the free responses, over all ranks
        nt, free = out.non_thinking, ~forced_rows(batch)  # (S,) each
        shares = torch.stack([(free & ~nt).sum(), (free & nt).sum()]).float()  # (2,) thinking, non-thinking
        out = out._replace(rewards=mode_balance(out.rewards, nt, cfg, distributed.sum_over_ranks(dist, shares), free))
    return out
