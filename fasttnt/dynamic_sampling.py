"""DAPO's dynamic sampling (Yu et al. 2025, "DAPO", sec. 3.2; verl's ``filter_groups``): a group whose K rewards are
all equal has a zero advantage and teaches nothing, so a step draws more batches of prompts until it has
``prompts_per_step`` groups whose rewards differ (``rollout.dynamic_sampling``, capped by ``rollout.max_draws``).

A draw is one batch of prompts after rollout, verification and reward, a ``fasttnt.scoring.ScoredBatch``; the
trainer makes them, this module joins them and picks the groups a step trains on.
"""

from __future__ import annotations

import torch

from fasttnt_kernels import TntRewards

from .engines.batch import RolloutBatch
from .scoring import Judged, ScoredBatch


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


def concat_draws(draws: list[ScoredBatch]) -> ScoredBatch:
    """The draws as one, in order (the groups of draw 0 first)."""
    if len(draws) == 1:
        return draws[0]
    rewards = TntRewards(*(torch.cat([getattr(d.rewards, f) for d in draws]) for f in TntRewards._fields))
    judged = [d.judged for d in draws]
    return ScoredBatch(
        RolloutBatch.concat([d.batch for d in draws]),
        Judged(
            [t for j in judged for t in j.texts],
            torch.cat([j.correct for j in judged]),
            timeouts=sum(j.timeouts for j in judged),
            crashes=sum(j.crashes for j in judged),
        ),
        rewards,
        hacked=_cat_optional([d.hacked for d in draws]),
        levels=_cat_optional([d.levels for d in draws]),
    )


def select_groups(draw: ScoredBatch, groups: list[int]) -> ScoredBatch:
    """Groups ``groups`` (ascending) of a draw, all K responses each, repacked from 0. The verifier's counts
    (``timeouts``, ``crashes``) are of whole draws and stay with them: the selection's are 0."""
    k = draw.batch.group_size
    seqs = [g * k + j for g in groups for j in range(k)]
    batch, _ = draw.batch.select(seqs)
    device = draw.judged.correct.device
    s = torch.tensor(seqs, dtype=torch.long, device=device)
    g = torch.tensor(groups, dtype=torch.long, device=draw.rewards.limit.device)
    r = draw.rewards
    rewards = TntRewards(r.rewards[s], r.non_thinking[s], r.solution_len[s], r.limit[g])
    return ScoredBatch(
        batch,
        Judged([draw.judged.texts[i] for i in seqs], draw.judged.correct[s]),
        rewards,
        hacked=None if draw.hacked is None else draw.hacked[s],
        levels=None if draw.levels is None else draw.levels[s],
    )


def _cat_optional(parts: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The parts joined, or None where any draw has none."""
    return torch.cat(parts) if all(p is not None for p in parts) else None
