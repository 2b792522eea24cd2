"""Group-relative advantages: each sample's reward against the other samples of its query.

    scale="std":  A = (r - mean_g) / (std_g + eps)    std with Bessel's correction, as verl and TRL use
    scale="none": A = r - mean_g                        Dr. GRPO

Rewards are laid out group after group: samples k of query g sit at g * K + k. A group whose rewards are all
equal (nothing to learn from) gets exactly 0, never NaN, and so does every group of size 1.
"""

from __future__ import annotations

from typing import Literal

import torch
import triton
import triton.language as tl

from . import _common

Scale = Literal["std", "none"]
_SCALES = ("std", "none")


@triton.jit
def _group_advantages_kernel(
    # pointers
    rewards_ptr,
    adv_ptr,
    # sizes
    G,
    K,
    # scalars
    eps,
    # meta
    SCALE_BY_STD: tl.constexpr,  # the only formulation switch: Dr. GRPO drops the division
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one tile holds BLOCK_G whole groups; reads and writes G*K floats once
    groups = tl.program_id(0) * BLOCK_G + tl.arange(0, BLOCK_G)  # (BLOCK_G,)
    k = tl.arange(0, BLOCK_K)  # (BLOCK_K,)
    mask = (groups[:, None] < G) & (k[None, :] < K)
    offs = groups[:, None].to(tl.int64) * K + k[None, :]  # (BLOCK_G, BLOCK_K)
    r = tl.load(rewards_ptr + offs, mask=mask, other=0.0).to(tl.float32)

    mean = tl.sum(r, axis=1) / K  # (BLOCK_G,)
    centred = tl.where(mask, r - mean[:, None], 0.0)
    # all-equal groups (and K == 1): the mean of identical values can round off them by an ulp, which eps would
    # blow up; compare the extremes instead and write exact zeros
    r_max = tl.max(tl.where(mask, r, -float("inf")), axis=1)
    r_min = tl.min(tl.where(mask, r, float("inf")), axis=1)
    flat = r_max <= r_min  # also true for the tile's rows past the last group (-inf <= inf)
    if SCALE_BY_STD:
        var = tl.sum(centred * centred, axis=1) / (K - 1)  # K >= 2: the caller handles K == 1
        # a flat group's denominator is replaced too, so eps = 0 computes no 0 / 0 even in the discarded branch
        denom = tl.where(flat, 1.0, tl.sqrt(var) + eps)
        adv = centred / denom[:, None]
    else:
        adv = centred
    adv = tl.where(flat[:, None], 0.0, adv)
    tl.store(adv_ptr + offs, adv, mask=mask)


def group_advantages_reference(
    rewards: torch.Tensor, group_size: int, *, scale: Scale = "std", eps: float = 1e-6
) -> torch.Tensor:
    """The semantics in plain PyTorch (float32, or float64 for float64 rewards)."""
    r = rewards.to(_common.compute_dtype(rewards.dtype)).reshape(-1, group_size)  # (G, K)
    centred = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        std = r.std(dim=1, keepdim=True, correction=1) if group_size > 1 else torch.zeros_like(r[:, :1])
        adv = centred / (std + eps)
    else:
        adv = centred
    flat = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv).reshape(-1)


def group_advantages(
    rewards: torch.Tensor, group_size: int, *, scale: Scale = "std", eps: float = 1e-6
) -> torch.Tensor:
    """Advantages (G*K,) float32 of rewards (G*K,) laid out group after group, in one launch.

    ``scale="std"`` divides by the group's unbiased std plus ``eps``; ``scale="none"`` only centres (Dr. GRPO).
    Groups whose rewards are all equal, and every group when ``group_size == 1``, get 0.
    """
    _common.check_1d("rewards", rewards)
    _common.check_dtype("rewards", rewards, _common.FLOAT_DTYPES)
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} elements, not a multiple of group_size={group_size}")
    if scale not in _SCALES:
        raise ValueError(f"scale must be one of {_SCALES}, got {scale!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if not _common.use_triton(rewards):
        return group_advantages_reference(rewards, group_size, scale=scale, eps=eps).float()

    if group_size == 1:
        # no group to compare with; also keeps K == 1 (which Triton specialises to a constant) out of the kernel
        return torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)
    rewards = rewards.contiguous()
    G, K = rewards.numel() // group_size, group_size
    adv = _common.new_empty(G * K, dtype=torch.float32, device=rewards.device)  # (G*K,)
    if G == 0:
        return adv
    block_k = triton.next_power_of_2(K)
    # ~4K elements a tile: a whole 128-prompt x 16-sample batch is a handful of programs
    block_g = max(1, min(triton.next_power_of_2(G), 4096 // block_k))
    _group_advantages_kernel[(triton.cdiv(G, block_g),)](
        rewards, adv, G, K, eps, SCALE_BY_STD=scale == "std", BLOCK_G=block_g, BLOCK_K=block_k
    )
    return adv
