"""Mode-decoupled advantages: the choice of mode and the answer within a mode judged against different baselines.

A hybrid group holds responses of two modes, thinking and non-thinking (the first token ``</think>``). One GRPO
advantage per response gives the mode token and every answer token the same credit, so a right direct answer in a
group where thinking pays more pushes down the digits it got right. Here, per group g and mode m in {T, N}, with
n_m rows and mean reward mu_m:

    mode token   A_mode = mu_m - mu_m'  (m' the other mode)                       0 when g holds one mode
    other tokens A      = (r - mu_m) / (std_m + eps)                              0 when n_m == 1 or mode m is flat

The mode advantage is the gap between the modes' mean rewards, in reward units: given how many rows each mode
has, mu_N - mu_T is an unbiased estimate of the gap between the modes' expected rewards (the rows of a mode are
draws of that mode's reward, whichever way the mode was reached: forced or chosen), so a loss that puts it on
the mode token moves the choice, in expectation, with the sign of that gap. It is deliberately not divided by
the group's reward std: that std depends on the same rewards, and the quotient's expectation can take the other
sign. With the accuracy-aware table (a direct answer earns the thinking reward plus 0.05), a level whose direct
answers are right 92% of the time against thinking's 100% loses 0.03 per response by going direct, yet the
groups where every answer is right (72% of them, 4 + 4 rows) have a gap of 0.05 and a std of 0.027: divided,
+1.9 each, and the expected quotient is positive. (The trainer, ``fasttnt.modes``, puts A_mode on the
``</think>`` that opens a non-thinking response; a thinking response's first token is already part of its answer
there.) ``scale`` applies to the answer advantages only: ``"std"`` divides by the mode's reward std (+ eps),
``"none"`` (Dr. GRPO) only centres. Flat sets (a group's, or a mode's, rewards all equal) get exact zeros, never
NaN.

Neighbours: HGPO (Jiang et al. 2025, "Think Only When You Need with Large Hybrid-Reasoning Models", sec. 3)
samples both modes per query and gives the mode choice an inter-group advantage from comparing the modes' rewards
and the responses an intra-group one within their mode; as we read it, its inter-group reward is which mode won
(a margin deciding ties towards no-thinking), normalised over the group, so the size of the gap is lost: here it
is kept. Thinkless's DeGRPO (Fang et al. 2025, sec. 3.2) keeps one GRPO advantage per response and decouples how
the control token's and the response tokens' terms are normalised (the control token not diluted by the
response's length); the baseline is shared there, so a right answer of the losing mode is still pushed down.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import _common
from .group_advantages import Scale

_SCALES = ("std", "none")


class ModeAdvantages(NamedTuple):
    answer: torch.Tensor  # (G*K,) float32: every token after the mode token, against its own mode's rows
    mode: torch.Tensor  # (G*K,) float32: the mode token (the first), its mode's mean reward minus the other's


@triton.jit
def _mode_stats(r, in_mode, count, eps, SCALE_BY_STD: tl.constexpr):
    """Per group of a tile: the mode's mean (BLOCK_G,) and its rows' advantages within it (BLOCK_G, BLOCK_K)."""
    mean = tl.sum(tl.where(in_mode, r, 0.0), axis=1) / tl.maximum(count, 1.0)
    centred = tl.where(in_mode, r - mean[:, None], 0.0)
    r_max = tl.max(tl.where(in_mode, r, -float("inf")), axis=1)
    r_min = tl.min(tl.where(in_mode, r, float("inf")), axis=1)
    # one row, or rows all equal (an empty mode too: -inf <= inf): nothing to compare within the mode
    flat = (r_max <= r_min) | (count < 2.0)
    if SCALE_BY_STD:
        var = tl.sum(centred * centred, axis=1) / tl.maximum(count - 1.0, 1.0)
        denom = tl.where(flat, 1.0, tl.sqrt(var) + eps)
        adv = centred / denom[:, None]
    else:
        adv = centred
    return mean, tl.where(flat[:, None], 0.0, adv)


@triton.jit
def _mode_advantages_kernel(
    # pointers
    rewards_ptr,
    non_thinking_ptr,  # (G*K,) int8: 1 where the response's first token is </think>
    answer_ptr,
    mode_ptr,
    # sizes
    G,
    K,
    # scalars
    eps,
    # meta
    SCALE_BY_STD: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one tile holds BLOCK_G whole groups; reads G*K floats and flags once, writes two floats per row
    groups = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # (BLOCK_G,)
    k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    mask = (groups[:, None] < G) & (k[None, :] < K)
    offs = groups[:, None].to(tl.int64) * K + k[None, :]  # (BLOCK_G, BLOCK_K)
    r = tl.load(rewards_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    nt = tl.load(non_thinking_ptr + offs, mask=mask, other=0) != 0
    is_n = mask & nt
    is_t = mask & (nt == 0)
    count_n = tl.sum(is_n.to(tl.float32), axis=1)  # (BLOCK_G,)
    count_t = tl.sum(is_t.to(tl.float32), axis=1)
    mean_n, adv_n = _mode_stats(r, is_n, count_n, eps, SCALE_BY_STD)
    mean_t, adv_t = _mode_stats(r, is_t, count_t, eps, SCALE_BY_STD)
    answer = tl.where(is_n, adv_n, adv_t)

    both = (count_n > 0.0) & (count_t > 0.0)
    gap = tl.where(is_n, (mean_n - mean_t)[:, None], (mean_t - mean_n)[:, None])
    g_max = tl.max(tl.where(mask, r, -float("inf")), axis=1)
    g_min = tl.min(tl.where(mask, r, float("inf")), axis=1)
    # one mode present, or every reward equal (the modes' means then differ by rounding at most)
    no_gap = (both == 0) | (g_max <= g_min)
    mode = tl.where(no_gap[:, None], 0.0, gap)
    tl.store(answer_ptr + offs, answer, mask=mask)
    tl.store(mode_ptr + offs, mode, mask=mask)


def mode_advantages_reference(
    rewards: torch.Tensor, non_thinking: torch.Tensor, group_size: int, *, scale: Scale = "std", eps: float = 1e-6
) -> ModeAdvantages:
    """The semantics in plain PyTorch, group by group and mode by mode (float32, or float64 for float64 rewards)."""
    dtype = _common.compute_dtype(rewards.dtype)
    r = rewards.to(dtype).reshape(-1, group_size)  # (G, K)
    nt = non_thinking.bool().reshape(-1, group_size)  # (G, K)
    answer, mode = torch.zeros_like(r), torch.zeros_like(r)
    for g in range(r.shape[0]):
        means = {}
        for flag in (False, True):
            rows = nt[g] == flag
            if not rows.any():
                continue
            x = r[g, rows]
            means[flag] = x.mean()
            if len(x) < 2 or bool(x.max() == x.min()):
                continue  # one row, or all equal: zero
            centred = x - x.mean()
            answer[g, rows] = centred / (x.std(correction=1) + eps) if scale == "std" else centred
        if len(means) < 2 or bool(r[g].max() == r[g].min()):
            continue
        for flag, mean in means.items():
            mode[g, nt[g] == flag] = mean - means[not flag]
    return ModeAdvantages(answer.reshape(-1), mode.reshape(-1))


def mode_advantages(
    rewards: torch.Tensor, non_thinking: torch.Tensor, group_size: int, *, scale: Scale = "std", eps: float = 1e-6
) -> ModeAdvantages:
    """The answer and mode-token advantages (G*K,) float32 each, of rewards (G*K,) laid out group after group with
    ``non_thinking`` (G*K,) bool, each response's mode; in one launch. ``scale`` and ``eps`` as in
    ``group_advantages``, for the answer advantages (the mode gap stays in reward units: module docstring)."""
    _common.check_1d("rewards", rewards)
    _common.check_dtype("rewards", rewards, _common.FLOAT_DTYPES)
    _common.check_1d("non_thinking", non_thinking, rewards.shape[0])
    _common.check_same_device(rewards=rewards, non_thinking=non_thinking)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} elements, not a multiple of group_size={group_size}")
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not _common.use_triton(rewards, non_thinking):
        out = mode_advantages_reference(rewards, non_thinking, group_size, scale=scale, eps=eps)
        return ModeAdvantages(out.answer.float(), out.mode.float())

    n = rewards.numel()
    if group_size == 1:  # one row: neither a mode to compare with nor a row within its mode
        zeros = torch.zeros(n, dtype=torch.float32, device=rewards.device)
        return ModeAdvantages(zeros, zeros.clone())
    rewards = rewards.contiguous()
    flags = non_thinking.to(torch.int8).contiguous()
    G, K = n // group_size, group_size
    answer = _common.new_empty(n, dtype=torch.float32, device=rewards.device)  # (G*K,)
    mode = _common.new_empty(n, dtype=torch.float32, device=rewards.device)  # (G*K,)
    if G == 0:
        return ModeAdvantages(answer, mode)
    block_k = triton.next_power_of_2(K)
    block_g = max(1, min(triton.next_power_of_2(G), 4096 // block_k))
    _mode_advantages_kernel[(triton.cdiv(G, block_g),)](
        rewards, flags, answer, mode, G, K, eps, SCALE_BY_STD=scale == "std", BLOCK_G=block_g, BLOCK_K=block_k
    )
    return ModeAdvantages(answer, mode)
