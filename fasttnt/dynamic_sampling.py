"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2; verl's ``filter_groups``): a group whose K rewards are
all equal has a zero advantage and teaches nothing, so a step draws more batches of prompts until it has
``prompts_per_step`` groups whose rewards differ (``rollout.dynamic_sampling``, capped by ``rollout.max_draws``).

A ``Draw`` is one batch of prompts after rollout, verification and reward; the trainer makes them, this module
joins them and picks the groups a step trains on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fasttnt_kernels import TntRewards

from .engines.batch import RolloutBatch


@dataclass
class Draw:
    """One batch of prompts on this rank, through rollout, verify and reward. S responses, G = S / K groups."""

    batch: RolloutBatch
    correct: torch.Tensor  # (S,) bool
    rewards: TntRewards  # rewards, non_thinking, solution_len (S,); limit (G,)
    hacked: torch.Tensor  # (S,) bool
    timeouts: int = 0
    crashes: int = 0
    levels: torch.Tensor | None = None  # (S,) int: each response's problem level, -1 where it has none


def varied_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(G,) bool: the groups whose K rewards are not all equal (the ones with a nonzero advantage)."""
    r = rewards.view(-1, group_size)  # (G, K)
    return r.amax(dim=1) != r.amin(dim=1)


def choose_groups(varied: list[bool], quota: int) -> tuple[list[int], int]:
    """The groups a step trains on, ascending (draw order): the first ``quota`` varied ones; when there are fewer
    (the draw cap was reached), filled up with equal-reward groups, first drawn first, so the step keeps its batch
    shape (its mini-batches and ranks divide it as configured). Returns them and how many were fills. A fill has a
    zero advantage: no policy-gradient term (an entropy bonus or KL term still acts on it), and its tokens count in
    a token-mean loss's normaliser, as they would without dynamic sampling."""
    kept = [g for g, v in enumerate(varied) if v][:quota]
    fills = [g for g, v in enumerate(varied) if not v][: quota - len(kept)]
    return sorted(kept + fills), len(fills)


def concat_draws(draws: list[Draw]) -> Draw:
    """The draws as one, in order (the groups of draw 0 first)."""
    if len(draws) == 1:
        return draws[0]
    rewards = TntRewards(*(torch.cat([getattr(d.rewards, f) for d in draws]) for f in TntRewards._fields))
    return Draw(
        RolloutBatch.concat([d.batch for d in draws]),
        torch.cat([d.correct for d in draws]),
        rewards,
        torch.cat([d.hacked for d in draws]),
        sum(d.timeouts for d in draws),
        sum(d.crashes for d in draws),
        torch.cat([d.levels for d in draws]) if all(d.levels is not None for d in draws) else None,
    )


def select_groups(draw: Draw, groups: list[int]) -> Draw:
    """Groups ``groups`` (ascending) of a draw, all K responses each, repacked from 0."""
    k = draw.batch.group_size
    seqs = [g * k + j for g in groups for j in range(k)]
    batch, _ = draw.batch.select(seqs)
    device = draw.correct.device
    s = torch.tensor(seqs, dtype=torch.long, device=device)
    g = torch.tensor(groups, dtype=torch.long, device=draw.rewards.limit.device)
    r = draw.rewards
    rewards = TntRewards(r.rewards[s], r.non_thinking[s], r.solution_len[s], r.limit[g])
    return Draw(batch, draw.correct[s], rewards, draw.hacked[s])
