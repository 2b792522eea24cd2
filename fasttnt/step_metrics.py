"""The numbers a step logs, by name: which metrics are token means, and how named sums add up (the update's token
sums and counts are summed over the ranks by name, ``distributed.sum_named_over_ranks``; docs/metrics.md says what
each logged number means). Apart from ``metrics`` (the numbers of a rollout's responses and of an evaluation, which
read the verifier's and the task's markers): the actor imports these names alone."""

from __future__ import annotations

import time

import torch

ROLLOUT_METRICS = ("rollout_logp_diff", "rollout_is_mean", "rollout_is_clipped_frac")
"""The rollout correction's diagnostics: the engine's log-probs against the trainer's."""
TOKEN_METRICS = ("entropy", "clip_frac", "kl", "kl_ref", *ROLLOUT_METRICS)
"""Metrics that are means over the tokens the update ran on: absent from a step whose every sequence was skipped."""
RANK_METRICS = ("rank_tokens_max_over_mean", "rank_tokens_max_over_mean_drawn", "moved_groups", "time_rank_wait")
"""Metrics logged only over several ranks (``fasttnt.balance.Deal.logged``, ``Actor.update``), with each rank's
tokens, ``rank_tokens_<rank>``."""


def add_into(total: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> None:
    for name, value in part.items():
        total[name] = total[name] + value if name in total else value


class PhaseClock:
    """Seconds per phase (``time_<phase>``); a phase that runs once per draw adds up over the draws."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.times[f"time_{phase}"] = self.times.get(f"time_{phase}", 0.0) + now - self._last
        self._last = now
