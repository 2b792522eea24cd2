"""The numbers a researcher reads, one implementation for training logs and evaluation.

    acc                  share of responses judged correct
    len                  mean response tokens; len_thinking / len_non_thinking by mode (0 when a mode is absent)
    non_thinking_ratio   share of responses whose first token is </think>
    limit_mean/min/max   the per-query limits L_x (finite ones; 0 when a scheme has none)
    limit_thinking_mean  TNT: the mean L_x of the queries that had a thinking response to set it (no fallback)
    limit_fallback_frac  TNT: the share of queries without one, whose limit is the fallback
    free_non_thinking_ratio  mode-mixed rollouts with free rows: the non-thinking share of the free responses (also
                         per level, free_non_thinking_ratio_l2, ...)
    think_end_prob       mode-mixed rollouts: the policy's mean probability of </think> as its first token
    mode_floored         mode-mixed rollouts: the share of groups below loss.mode_token_floor, whose </think> is faded
                         (the trainer's update; the others here come from the rollout); per level mode_floored_l2, ...
    acc_thinking         accuracy of the thinking responses; acc_free_direct of the freely chosen non-thinking ones;
                         acc_forced_direct of those answered with </think> pre-filled; each also per level
                         (acc_thinking_l2, ...) where the problems have one; absent where no response is counted
    reward_thinking      the mean reward of each mode's drawn responses, forced and free alike (the table the
    reward_direct        kernel pays); prefers_direct 1 where direct earns more, 0 where thinking does: the mode the
    prefers_direct       table pays more for; think_end_prob also per level (think_end_prob_l2, ...), as these three
    te                   token efficiency A / sqrt(L), A = accuracy in percent, L = mean tokens
    hack_rate            share of non-thinking responses whose solution part contains thinking markers
    truncated_ratio      share of responses cut by the length budget

Metrics are built as tensors on the rollout's device and read back once (``to_floats``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .verify import THINK_END


@dataclass(frozen=True)
class HackMarkers:
    """What counts as thinking inside a non-thinking response: whole words or phrases (case as written) and
    regular expressions, searched in the text after the first ``</think>``."""

    words: tuple[str, ...] = ()
    patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.words and not self.patterns:
            raise ValueError("HackMarkers needs at least one word or pattern")
        parts = [rf"(?<!\w){re.escape(w)}(?!\w)" for w in self.words] + list(self.patterns)
        object.__setattr__(self, "_regex", re.compile("|".join(f"(?:{p})" for p in parts)))

    def found_in(self, response: str) -> bool:
        solution = response.split(THINK_END, 1)[1] if THINK_END in response else response
        return self._regex.search(solution) is not None


# The reflection vocabulary of long chains of thought, as counted in the TNT paper's hack analysis: capitalised
# at the start of a sentence, where a model changes its mind, and the lower-case phrases that only verify.
MATH_MARKERS = HackMarkers(
    words=(
        "Wait",
        "But wait",
        "Alternatively",
        "Hmm",
        "Let me check",
        "let me check",
        "Let me verify",
        "let me verify",
        "double-check",
        "Double-check",
        "Let me think",
        "let me think",
        "re-examine",
        "Let me re-",
        "On second thought",
    )
)


def hack_flags(responses: list[str], non_thinking: list[bool], markers: HackMarkers) -> list[bool]:
    """Per response: a non-thinking response that thinks anyway. Thinking responses are never flagged."""
    return [bool(nt) and markers.found_in(text) for text, nt in zip(responses, non_thinking, strict=True)]


def token_efficiency(accuracy_percent: float, mean_tokens: float) -> float:
    """TE = A / sqrt(L); the TNT paper's 41.0% at 5,893 tokens is 0.53."""
    return accuracy_percent / math.sqrt(mean_tokens) if mean_tokens > 0 else 0.0


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    count = mask.sum()
    return torch.where(count > 0, (values * mask).sum() / count.clamp(min=1), torch.zeros_like(values.sum()))


def rollout_metrics(
    *,
    correct: torch.Tensor,
    non_thinking: torch.Tensor,
    lengths: torch.Tensor,
    hacked: torch.Tensor,
    truncated: torch.Tensor | None = None,
    limit: torch.Tensor | None = None,
    rewards: torch.Tensor | None = None,
    own_limit: torch.Tensor | None = None,
    free: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Scalar metric tensors, on the inputs' device, from per-response tensors (S,) and per-query limits (G,);
    ``own_limit`` (G,) marks the queries whose limit came from their own thinking responses (TNT); mode-mixed
    rollouts add ``free`` (S,), the responses sampled without a forced mode."""
    correct, non_thinking, hacked = correct.bool(), non_thinking.bool(), hacked.bool()
    lengths = lengths.float()
    thinking = ~non_thinking
    acc = correct.float().mean() if correct.numel() else torch.zeros((), device=correct.device)
    mean_len = lengths.mean() if lengths.numel() else torch.zeros((), device=lengths.device)
    out = {
        "acc": acc,
        "len": mean_len,
        "len_thinking": _masked_mean(lengths, thinking),
        "len_non_thinking": _masked_mean(lengths, non_thinking),
        "non_thinking_ratio": non_thinking.float().mean() if non_thinking.numel() else acc * 0,
        "hack_rate": _masked_mean(hacked.float(), non_thinking),
        "te": torch.where(mean_len > 0, acc * 100 / mean_len.clamp(min=1e-12).sqrt(), torch.zeros_like(acc)),
    }
    if truncated is not None:
        out["truncated_ratio"] = truncated.float().mean() if truncated.numel() else acc * 0
    if limit is not None and limit.numel():
        finite = torch.isfinite(limit)
        big, small = torch.finfo(torch.float32).max, -torch.finfo(torch.float32).max
        out["limit_mean"] = _masked_mean(torch.where(finite, limit, 0.0), finite)
        out["limit_min"] = torch.where(finite.any(), torch.where(finite, limit, big).min(), 0.0)
        out["limit_max"] = torch.where(finite.any(), torch.where(finite, limit, small).max(), 0.0)
    if rewards is not None:
        out["reward"] = rewards.float().mean() if rewards.numel() else acc * 0
    if limit is not None and own_limit is not None and own_limit.numel():
        own = own_limit.bool()
        out["limit_thinking_mean"] = _masked_mean(limit.float(), own)
        out["limit_fallback_frac"] = (~own).float().mean()
    if free is not None:
        out["free_non_thinking_ratio"] = _masked_mean(non_thinking.float(), free.bool())
    return out


def levels_present(levels: torch.Tensor | None) -> list[int]:
    """The levels (S,) int that occur, -1 (no level) left out. sync: one read."""
    return [] if levels is None else [lv for lv in levels.unique().tolist() if lv >= 0]


def _by_level(values: torch.Tensor, rows: torch.Tensor, levels, present: list[int], name: str) -> dict:
    """``name``: the mean of ``values`` over ``rows`` (NaN where none), and ``name_l<level>`` per present level."""
    nan = torch.full((), float("nan"), device=values.device)
    out = {name: torch.where(rows.any(), _masked_mean(values, rows), nan)}
    for level in present:
        at = rows & (levels == level)
        out[f"{name}_l{level}"] = torch.where(at.any(), _masked_mean(values, at), nan)
    return out


def mode_accuracies(
    correct, non_thinking, free=None, forced_direct=None, levels=None, present: list[int] = ()
) -> dict[str, torch.Tensor]:
    """``acc_thinking``, ``acc_free_direct`` and, with forced rows, ``acc_forced_direct`` (NaN where a mode has no
    response: the caller leaves those out), and each per level (``acc_thinking_l2``, ...) given ``levels`` (S,)
    int (-1: no level) and the levels ``present`` (``levels_present``); ``correct``, ``non_thinking`` (S,) bool,
    ``free`` (S,) the rows sampled without a forced mode (None: all), ``forced_direct`` (S,) those answered with
    ``</think>`` pre-filled."""
    non_thinking = non_thinking.bool()
    right = correct.float()
    free = torch.ones_like(non_thinking) if free is None else free.bool()
    groups = {"acc_thinking": ~non_thinking, "acc_free_direct": free & non_thinking}
    if forced_direct is not None:
        groups["acc_forced_direct"] = forced_direct.bool()
    out = {}
    for name, rows in groups.items():
        out.update(_by_level(right, rows, levels, present, name))
    return out


def choice_metrics(
    rewards: torch.Tensor, non_thinking: torch.Tensor, levels=None, present: list[int] = (),
    think_end_logp: torch.Tensor | None = None, group_levels: torch.Tensor | None = None,
    below_floor: torch.Tensor | None = None, free: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """What the hybrid's choice is learning from, overall and per level (``_l2``, ...; ``levels`` (S,) int, -1 for
    none, and the levels ``present``): each mode's mean reward over its rows, forced and free alike
    (``reward_thinking``, ``reward_direct``, from the drawn rows' ``rewards`` (S,), pooled over the groups), the
    mode the table pays more for (``prefers_direct``: 1 where direct earns more, 0 where thinking does; NaN where a
    mode has no row, as the rewards), and mode-mixed, the policy's mean probability of ``</think>`` first
    (``think_end_prob``, from ``think_end_logp`` (G,) of groups at ``group_levels`` (G,)); per level only, the
    share of those groups the settled-choice fade scales down (``mode_floored_l2``, ..., from ``below_floor`` (G,)
    bool) and the non-thinking share of the ``free`` (S,) rows (``free_non_thinking_ratio_l2``, ...)."""
    non_thinking = non_thinking.bool()
    values = rewards.float()
    out = {
        **_by_level(values, ~non_thinking, levels, present, "reward_thinking"),
        **_by_level(values, non_thinking, levels, present, "reward_direct"),
    }
    for suffix in ["", *(f"_l{lv}" for lv in present)]:
        direct, thinking = out[f"reward_direct{suffix}"], out[f"reward_thinking{suffix}"]
        # NaN + x is NaN: no preference where a mode has no row
        out[f"prefers_direct{suffix}"] = torch.where(direct.isnan() | thinking.isnan(), direct + thinking,
                                                     (direct > thinking).float())  # fmt: skip
    if think_end_logp is not None and think_end_logp.numel():
        prob = think_end_logp.float().exp()  # (G,)
        every = torch.ones_like(prob, dtype=torch.bool)
        group_present = present if group_levels is not None else []
        out.update(_by_level(prob, every, group_levels, group_present, "think_end_prob"))
        if below_floor is not None:  # per level only: the overall share is the update's mode_floored
            floored = _by_level(below_floor.float(), every, group_levels, group_present, "mode_floored")
            out.update({k: v for k, v in floored.items() if k != "mode_floored"})
    if free is not None:  # per level only: the overall share is rollout_metrics' free_non_thinking_ratio
        chosen = _by_level(non_thinking.float(), free.bool(), levels, present, "free_non_thinking_ratio")
        out.update({k: v for k, v in chosen.items() if k != "free_non_thinking_ratio"})
    return out


CHOICE_PREFIXES = (
    "acc_", "reward_thinking", "reward_direct", "prefers_direct", "think_end_prob", "mode_floored_l",
    "free_non_thinking_ratio_l",
)  # fmt: skip
"""The metrics of a mode (or level) that a step may have no response of: NaN there, and left out of its row."""


def own_limits(non_thinking: torch.Tensor, solution_len: torch.Tensor, group_size: int) -> torch.Tensor:
    """(G,) bool: the queries with a thinking response that closed its think block, whose solution lengths set
    TNT's limit (the others get the fallback limit)."""
    return (~non_thinking.bool() & (solution_len >= 0)).view(-1, group_size).any(dim=1)


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """All metric tensors to Python floats with one device-to-host copy."""
    if not metrics:
        return {}
    stacked = torch.stack([v.float().reshape(()) for v in metrics.values()]).tolist()  # sync: one per call
    return dict(zip(metrics, stacked, strict=True))
