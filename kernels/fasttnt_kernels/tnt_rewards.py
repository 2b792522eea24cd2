"""Rewards of hybrid (think / no-think) responses from their token ids: TNT and its baselines.

Responses are packed: response s owns response_ids[cu_seqlens[s]:cu_seqlens[s+1]]; the K samples of query g are
responses g*K .. g*K+K-1. With `</think>` the id ``think_end_id``:

* non-thinking   <=> the response's first token is `</think>` (an empty response is thinking, and wrong);
* solution_len   = tokens after the response's first `</think>`; -1 when it has none (a thinking response
  that never closed its think block has no solution part);
* limit L_g      = omega * mean(solution_len over g's thinking responses that closed), or fallback_limit when
  there is none (TNT), computed in float32 as omega * sum / count; one constant for every query
  (uniform-limit); +inf (no-limit, binary);
* reward         = thinking: think_correct / think_wrong; non-thinking with |y| <= L_g: direct_correct /
  direct_wrong; non-thinking with |y| > L_g: over_limit. |y| counts every token of the response.

Schemes (``scheme=``): "tnt" (query-specific limit), "no-limit" (AutoThink's rewards, no length check: the
hackable one), "uniform-limit" (one cap, AdaptThink-style), "binary" (plain GRPO: 1/0 for every response).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import triton
import triton.language as tl

from . import _common
from ._common import SettingError

Scheme = Literal["tnt", "no-limit", "uniform-limit", "binary"]
SCHEMES = ("tnt", "no-limit", "uniform-limit", "binary")
# tokens of one response scanned per step when looking for `</think>`
_BLOCK_T = 1024


@dataclass(frozen=True)
class RewardValues:
    """The reward table; defaults are the paper's."""

    think_correct: float = 1.0
    think_wrong: float = 0.0
    direct_correct: float = 2.0
    direct_wrong: float = -1.0
    over_limit: float = -2.0


class TntRewards(NamedTuple):
    rewards: torch.Tensor  # (S,) float32
    non_thinking: torch.Tensor  # (S,) bool
    solution_len: torch.Tensor  # (S,) int32, -1 where the response has no `</think>`
    limit: torch.Tensor  # (G,) float32, +inf where the scheme sets no limit


@dataclass(frozen=True)
class _Rule:
    """A scheme reduced to what the kernel needs: where the limit comes from, and the reward table."""

    query_limit: bool
    const_limit: float  # the limit of every query when not query_limit
    values: RewardValues


def check_reward_limits(scheme: str, *, omega: float, fallback_limit: float, uniform_limit: float | None) -> None:
    """The limit's settings for ``scheme``; a ``SettingError`` names the one at fault. The one check of these
    settings: ``tnt_rewards`` runs it, and so does a trainer validating its config (fasttnt's ``reward.*`` keys)."""
    if not (math.isfinite(omega) and omega > 0):
        raise SettingError("omega", f"must be > 0 and finite, got {omega}")
    if not fallback_limit >= 0:
        raise SettingError("fallback_limit", f"must be >= 0, got {fallback_limit}")
    if scheme == "uniform-limit" and not (uniform_limit is not None and uniform_limit >= 0):
        raise SettingError("uniform_limit", f"must be >= 0 under scheme='uniform-limit', got {uniform_limit}")


def _resolve_scheme(
    scheme: str, *, omega: float, fallback_limit: float, uniform_limit: float | None, values: RewardValues
) -> _Rule:
    if scheme not in SCHEMES:
        raise SettingError("scheme", f"must be one of {SCHEMES}, got {scheme!r}")
    check_reward_limits(scheme, omega=omega, fallback_limit=fallback_limit, uniform_limit=uniform_limit)
    if scheme == "tnt":
        return _Rule(True, math.inf, values)
    if scheme == "uniform-limit":
        return _Rule(False, float(uniform_limit), values)
    if scheme == "no-limit":
        return _Rule(False, math.inf, values)
    binary = RewardValues(
        values.think_correct, values.think_wrong, values.think_correct, values.think_wrong, values.think_wrong
    )
    return _Rule(False, math.inf, binary)


@triton.jit
def _tnt_rewards_kernel(
    # pointers
    ids_ptr,
    cu_seqlens_ptr,
    correct_ptr,  # (S,) uint8
    rewards_ptr,
    non_thinking_ptr,  # (S,) uint8, viewed as bool by the caller
    solution_len_ptr,
    limit_ptr,
    # sizes
    K,
    # scalars
    think_end_id,
    query_limit,
    const_limit,
    omega,
    fallback_limit,
    think_correct,
    think_wrong,
    direct_correct,
    direct_wrong,
    over_limit,
    # meta
    BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # one program per query: scans its K responses once (reads every token id once), writes 3 values a response
    g = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    in_group = k < K
    seq = g * K + k  # (BLOCK_K,)
    start = tl.load(cu_seqlens_ptr + seq, mask=in_group, other=0)
    length = tl.load(cu_seqlens_ptr + seq + 1, mask=in_group, other=0) - start

    first_end = length  # position of the first `</think>` within each response; length = none
    for j in range(0, K):
        s_start = tl.load(cu_seqlens_ptr + g * K + j)
        s_end = tl.load(cu_seqlens_ptr + g * K + j + 1)
        pos = s_end - s_start
        for off in range(s_start, s_end, BLOCK_T):
            t = off + tl.arange(0, BLOCK_T)
            tok = tl.load(ids_ptr + t, mask=t < s_end, other=-1)
            hit = (tok == think_end_id) & (t < s_end)
            pos = tl.minimum(pos, tl.min(tl.where(hit, t - s_start, s_end - s_start), axis=0))
        first_end = tl.where(k == j, pos, first_end)

    closed = first_end < length
    non_thinking = in_group & (length > 0) & (first_end == 0)
    solution_len = tl.where(closed, length - first_end - 1, -1)

    # the query's limit from its thinking responses that have a solution part
    counted = in_group & closed & (first_end > 0)
    n_counted = tl.sum(counted.to(tl.int32), axis=0)
    h_sum = tl.sum(tl.where(counted, solution_len, 0), axis=0)
    # float32, in this order, correctly rounded, exactly as the reference: the <= below must agree to the last
    # bit (a plain `/` compiles to the approximate div.full.f32 on NVIDIA GPUs)
    tnt_limit = tl.div_rn(omega * h_sum.to(tl.float32), tl.maximum(n_counted, 1).to(tl.float32))
    tnt_limit = tl.where(n_counted > 0, tnt_limit, fallback_limit)
    limit = tl.where(query_limit != 0, tnt_limit, const_limit)

    correct = (tl.load(correct_ptr + seq, mask=in_group, other=0) != 0) & (length > 0)
    think_reward = tl.where(correct, think_correct, think_wrong)
    direct_reward = tl.where(correct, direct_correct, direct_wrong)
    direct_reward = tl.where(length.to(tl.float32) <= limit, direct_reward, over_limit)
    reward = tl.where(non_thinking, direct_reward, think_reward)

    tl.store(rewards_ptr + seq, reward, mask=in_group)
    tl.store(non_thinking_ptr + seq, non_thinking.to(tl.uint8), mask=in_group)
    tl.store(solution_len_ptr + seq, solution_len.to(tl.int32), mask=in_group)
    tl.store(limit_ptr + g, limit)


def tnt_rewards_reference(
    response_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    correct: torch.Tensor,
    group_size: int,
    think_end_id: int,
    *,
    omega: float = 2.0,
    fallback_limit: float = 1000.0,
    scheme: Scheme = "tnt",
    uniform_limit: float | None = None,
    values: RewardValues = RewardValues(),
) -> TntRewards:
    """The semantics in plain PyTorch."""
    rule = _resolve_scheme(
        scheme, omega=omega, fallback_limit=fallback_limit, uniform_limit=uniform_limit, values=values
    )
    N, S = response_ids.shape[0], correct.shape[0]
    device = response_ids.device
    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()
    lengths = ends - starts  # (S,)
    seq_of_token = torch.repeat_interleave(torch.arange(S, device=device), lengths, output_size=N)  # (N,)
    pos_in_seq = torch.arange(N, device=device) - starts[seq_of_token]  # (N,)
    candidates = torch.where(response_ids == think_end_id, pos_in_seq, lengths[seq_of_token])
    first_end = lengths.clone().scatter_reduce_(0, seq_of_token, candidates, reduce="amin")  # (S,)

    closed = first_end < lengths
    non_thinking = (lengths > 0) & (first_end == 0)
    solution_len = torch.where(closed, lengths - first_end - 1, -1)

    counted = (closed & ~non_thinking).reshape(-1, group_size)  # (G, K)
    n_counted = counted.sum(dim=1)
    h_sum = torch.where(counted, solution_len.reshape(-1, group_size), 0).sum(dim=1)
    f32 = dict(dtype=torch.float32, device=device)
    if rule.query_limit:
        # L in float32 as omega * sum / count: the kernel does the same IEEE operations in the same order, so
        # the discrete test |y| <= L agrees to the last bit
        limit = torch.tensor(omega, **f32) * h_sum.float() / n_counted.clamp(min=1).float()
        limit = torch.where(n_counted > 0, limit, torch.tensor(fallback_limit, **f32))
    else:
        limit = torch.full((S // group_size,), rule.const_limit, **f32)  # (G,)

    v = rule.values
    right = correct.bool() & (lengths > 0)
    think_reward = torch.where(right, v.think_correct, v.think_wrong)
    direct_reward = torch.where(right, v.direct_correct, v.direct_wrong)
    within = lengths.float() <= limit.repeat_interleave(group_size)
    direct_reward = torch.where(within, direct_reward, v.over_limit)
    rewards = torch.where(non_thinking, direct_reward, think_reward)
    return TntRewards(rewards.float(), non_thinking, solution_len.int(), limit)


def tnt_rewards(
    response_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    correct: torch.Tensor,
    group_size: int,
    think_end_id: int,
    *,
    omega: float = 2.0,
    fallback_limit: float = 1000.0,
    scheme: Scheme = "tnt",
    uniform_limit: float | None = None,
    values: RewardValues = RewardValues(),
) -> TntRewards:
    """Rewards, modes, solution lengths and per-query limits of packed responses, on device in one launch.

    response_ids: (N,) int32/int64; cu_seqlens: (S+1,) int32/int64 from 0 to N; correct: (S,) bool (the
    verifier's verdict; an empty response is never counted correct). S must be a multiple of ``group_size``.
    No host synchronisation: every output stays on the inputs' device.
    """
    rule = _resolve_scheme(
        scheme, omega=omega, fallback_limit=fallback_limit, uniform_limit=uniform_limit, values=values
    )
    _common.check_1d("response_ids", response_ids)
    _common.check_dtype("response_ids", response_ids, _common.INDEX_DTYPES)
    _common.check_1d("correct", correct)
    S = correct.shape[0]
    _common.check_1d("cu_seqlens", cu_seqlens, S + 1)
    _common.check_dtype("cu_seqlens", cu_seqlens, _common.INDEX_DTYPES)
    if correct.dtype != torch.bool:
        raise TypeError(f"correct must be a bool tensor, got {correct.dtype}")
    if not isinstance(group_size, int) or group_size < 1 or S % group_size:
        raise ValueError(f"group_size={group_size!r} must be a positive int dividing the {S} responses")
    _common.check_same_device(response_ids=response_ids, cu_seqlens=cu_seqlens, correct=correct)
    if not _common.use_triton(response_ids, cu_seqlens, correct):
        return tnt_rewards_reference(
            response_ids,
            cu_seqlens,
            correct,
            group_size,
            think_end_id,
            omega=omega,
            fallback_limit=fallback_limit,
            scheme=scheme,
            uniform_limit=uniform_limit,
            values=values,
        )

    device = response_ids.device
    G = S // group_size
    rewards = _common.new_empty(S, dtype=torch.float32, device=device)
    non_thinking = _common.new_empty(S, dtype=torch.uint8, device=device)
    solution_len = _common.new_empty(S, dtype=torch.int32, device=device)
    limit = _common.new_empty(G, dtype=torch.float32, device=device)
    if G > 0:
        v = rule.values
        _tnt_rewards_kernel[(G,)](
            response_ids.contiguous(),
            cu_seqlens.contiguous(),
            correct.contiguous().view(torch.uint8),
            rewards,
            non_thinking,
            solution_len,
            limit,
            group_size,
            think_end_id,
            int(rule.query_limit),
            float(rule.const_limit),
            float(omega),
            float(fallback_limit),
            float(v.think_correct),
            float(v.think_wrong),
            float(v.direct_correct),
            float(v.direct_wrong),
            float(v.over_limit),
            BLOCK_K=triton.next_power_of_2(group_size),
            BLOCK_T=_BLOCK_T,
        )
    return TntRewards(rewards, non_thinking.view(torch.bool), solution_len, limit)
