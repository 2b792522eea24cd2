"""A step's advantages, from its rewards (``loss.mode_advantage``, resolved by ``fasttnt.modes.mode_advantage_of``):

* ``shared``: GRPO's, one advantage per response, its reward against its group's (``group_advantages``);
* ``decoupled``: every token but the first judged within its own mode, and the ``</think>`` that opens each
  non-thinking response given the gap between the group's mean rewards over its non-thinking and thinking rows
  (``mode_advantages``; why: ``fasttnt.modes``);
* ``saturating``: the answers judged as ``decoupled`` does, the choice's term sized by the group's own evidence
  (``fasttnt.modes.saturating_choice``, which needs each group's pi_old(``</think>`` | x) of a mode-mixed run);
* ``evidence``: the answers so too, the choice's term one half's gap over the other half's size
  (``fasttnt.modes.evidence_choice``);
* ``centered``: the answers so too, each group's decoupled choice step minus the batch's mean one
  (``fasttnt.modes.centered_choice``).

``loss.adv_scale`` and ``loss.adv_eps`` scale each group's (or each mode's) advantages.
"""

from __future__ import annotations

import torch

from fasttnt_kernels import TntRewards, group_advantages, mode_advantages

from .config import TrainConfig
from .modes import HALF_SPLIT, ModeMix, centered_choice, evidence_choice, mode_advantage_of, saturating_choice


def step_advantages(
    rewards: TntRewards, cfg: TrainConfig, mode_mix: ModeMix | None = None, think_end_logp: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(advantages, first_advantages)``: the advantages (S,) of ``rewards`` (its rewards and non_thinking (S,),
    laid out group after group), every token's but the first's where ``first_advantages`` (S,) is given (the first
    tokens' own; None for ``shared``). ``mode_mix`` and ``think_end_logp`` (G,),
    each group's log pi_old(</think> | x): a mode-mixed run's, which the half-split choices need."""
    loss, k = cfg.loss, cfg.rollout.group_size
    mode_advantage = mode_advantage_of(cfg)
    if mode_advantage == "shared":
        return group_advantages(rewards.rewards, k, scale=loss.adv_scale, eps=loss.adv_eps), None
    out = mode_advantages(rewards.rewards, rewards.non_thinking, k, scale=loss.adv_scale, eps=loss.adv_eps)
    if mode_advantage == "decoupled":
        choice = out.mode
    elif mode_advantage == "centered":
        choice = centered_choice(out.mode, rewards.non_thinking, k)
    else:  # the half-split choices: the direct rows' </think> carries their term alone, added below
        choice = torch.zeros_like(out.mode)
    first_advantages = torch.where(rewards.non_thinking.bool(), choice, out.answer)
    if mode_advantage in HALF_SPLIT and mode_mix is not None:
        forced = (mode_mix.forced_non_thinking_rows, mode_mix.forced_thinking_rows)
        rule = saturating_choice if mode_advantage == "saturating" else evidence_choice
        term = rule(rewards.rewards, rewards.non_thinking, think_end_logp, k, forced)  # (S,)
        first_advantages = first_advantages + term.to(first_advantages.dtype)
    return out.answer, first_advantages
