"""The numbers a step logs, by name: the update's sums (token sums and counts, one all-reduce per optimizer step),
the step's counts, and the record written to metrics.jsonl (docs/metrics.md says what each means)."""

from __future__ import annotations

from collections.abc import Callable

import torch

ROLLOUT_METRICS = ("rollout_logp_diff", "rollout_is_mean", "rollout_is_clipped_frac")
"""The rollout correction's diagnostics: the engine's log-probs against the trainer's."""
TOKEN_METRICS = ("entropy", "clip_frac", "kl", "kl_ref", *ROLLOUT_METRICS)
"""Metrics that are means over the tokens the update ran on: absent from a step whose every sequence was skipped."""

Reduce = Callable[[torch.Tensor], torch.Tensor]


def reduce_named(values: dict[str, torch.Tensor], reduce: Reduce) -> dict[str, torch.Tensor]:
    """Each named scalar summed over the ranks in one collective: stacked by name and unstacked by the same names,
    so no caller depends on an order."""
    names = list(values)
    total = reduce(torch.stack([values[name].reshape(()) for name in names]))
    return dict(zip(names, total.unbind(0), strict=True))


def add_into(total: dict[str, torch.Tensor], part: dict[str, torch.Tensor]) -> None:
    for name, value in part.items():
        total[name] = total[name] + value if name in total else value
