"""Sampling that depends on nothing but a row's own seed: one counter-based uniform per row and position, drawn
through the inverse of the row's cumulative distribution, so a response is the same whichever batch, rank or decode
step it is drawn in (the hf engine's sampler; the vllm engine uses vLLM's own, with the same per-row seeds).

Why the inverse CDF and not Gumbel-max: Gumbel-max needs V uniforms per row and position, each an int64 hash and
two float64 logs; at a real vocabulary (V = 151,936) that was a third of a CPU decode step of a 2-layer 0.5B-shaped
model. The inverse CDF needs one hash per row, one exp and one float64 cumulative sum over V, and a binary search.
Both are exact draws from ``softmax(logits / T)`` (after the top-p cut); ``benchmarks/rollout_engines.py`` reports
the sampler's share of a decode step.
"""

from __future__ import annotations

import torch

_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64's odd constants, signed


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (arithmetic wraps, as hashes want), the one hash of this module: a row's seed
    (``row_seeds``) and its uniform at each position (``row_uniforms``) are this finaliser of their own input mix."""
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2]), (31, 1)):
        x = (x ^ _shift_right_logical(x, shift)) * mult
    return x


def _shift_right_logical(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x >> shift`` on int64 as unsigned (torch's ``>>`` is arithmetic: it copies the sign bit in)."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def row_uniforms(row_seeds: torch.Tensor, position: int) -> torch.Tensor:
    """(B,) float64 uniforms in (0, 1), a pure function of (row seed, position): counter-based, so a row's draw does
    not depend on which other rows share its batch (or its rank)."""
    pos = torch.full((), position + 1, dtype=torch.int64, device=row_seeds.device)
    x = _splitmix(row_seeds * _MIX[0] + pos * _MIX[1])
    # 52 random bits and a half: strictly inside (0, 1), since 2^52 - 0.5 is exact in float64
    return (_shift_right_logical(x, 12).double() + 0.5) / float(1 << 52)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B,) int64: for each row of ``weights`` (B, V) >= 0, unnormalised, the index i with cum[i-1] <= u * total <
    cum[i] (``u`` (B,) in (0, 1)): index i with probability weights[i] / total, never one of weight 0; and the
    totals (B,) float64."""
    cum = weights.double().cumsum(-1)  # (B, V): float64, so a weight of 1e-12 of the total keeps its interval
    if cum.is_cuda:  # a parallel scan can gain an ulp across a zero weight: hold the sum flat there
        cum = torch.where(weights > 0, cum, torch.zeros_like(cum)).cummax(-1).values
    total = cum[:, -1:]
    # strictly below the total: u * total may round up to it, and the search would run past the last index
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    # clamped: a row without finite weights (NaN logits) gets the last index and a NaN log-prob, which the NaN
    # checks downstream report, rather than an index past the vocabulary
    index = torch.searchsorted(cum, target, right=True)[:, 0].clamp(max=weights.shape[-1] - 1)
    return index, total[:, 0]


def top_p_cut(
    z: torch.Tensor, weights: torch.Tensor, top: torch.Tensor, top_p: float, first_k: int = 1024
) -> torch.Tensor:
    """(B, 1) per row of ``z`` (B, V) the lowest value kept by top-p: the smallest descending prefix whose
    probability reaches ``top_p``, every token tied with its last one included, so the kept set (z >= cut) is
    defined by values alone and a row's draw does not depend on how ``topk`` orders ties (which changes with k,
    which the whole batch shares). k grows by 4x from ``first_k`` until the top k of every row hold top_p of its
    mass: the prefix is then inside them, and a full sort over V is only needed for a flat distribution.
    ``weights`` (B, V): exp(z - top), ``top`` (B, 1) the rows' maxima."""
    total = weights.double().sum(-1, keepdim=True)  # (B, 1) the whole mass
    k = min(first_k, z.shape[-1])
    while True:
        values, _ = z.topk(k, dim=-1)  # (B, k) descending
        p = (values - top).exp().double()
        cum = p.cumsum(-1)
        if k == z.shape[-1] or bool((cum[:, -1:] >= top_p * total).all()):  # sync: the search's stop
            break
        k = min(4 * k, z.shape[-1])
    # (B, 1) the prefix's length, >= 1 (at least 1 for a NaN row too, whose comparisons are all False: its cut is
    # then NaN, and its draw a NaN log-prob that the checks downstream report)
    kept = (cum - p < top_p * total).sum(-1, keepdim=True).clamp_(min=1)
    return values.gather(-1, kept - 1)


def seeded_sample(
    scores: torch.Tensor, row_seeds: torch.Tensor, position: int, *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (B,), and its log-prob (B,) under the distribution it was drawn from (after temperature
    and top-p), which the rollout correction compares with. ``position``: the tokens the rows generated before.
    ``scores`` (B, V); -inf marks a token that may not be drawn."""
    z = scores.float() / temperature  # (B, V)
    u = row_uniforms(row_seeds.to(z.device), position)  # (B,)
    top = z.amax(-1, keepdim=True)  # (B, 1)
    weights = (z - top).exp()  # (B, V) unnormalised probabilities, in token-id order
    if top_p < 1.0:  # the smallest set of tokens whose probability reaches top_p
        weights = weights.masked_fill(z < top_p_cut(z, weights, top, top_p), 0.0)
    chosen, mass = inverse_cdf(weights, u)
    # log p(chosen) = z_chosen - max - log(the kept mass)
    logp = z.gather(-1, chosen[:, None])[:, 0] - top[:, 0] - mass.log().float()
    return chosen, logp


SEED_STRIDE = 1_000_003
"""How far apart the call seeds of runs with consecutive seeds start (``step_seed``): more calls than a run makes."""


def step_seed(run_seed: int, step: int) -> int:
    """The seed of one ``generate`` call of a run seeded ``run_seed``, ``step`` telling its calls apart (a training
    step's number, an evaluation batch's first problem): runs with different seeds never share a call's seed while
    ``step`` stays below ``SEED_STRIDE``. Each call's rows get their own seeds from it (``row_seeds``)."""
    return run_seed * SEED_STRIDE + step


def row_seeds(seed: int, first_row: int, rows: int) -> torch.Tensor:
    """Seeds of rows ``first_row .. first_row + rows - 1`` of a step whose seed is ``seed``: a hash of both, so
    no two (seed, row) pairs share a stream (a linear mix would, once a step had as many rows as its factor)."""
    x = torch.arange(first_row, first_row + rows, dtype=torch.int64)
    return _splitmix(x ^ (torch.tensor(seed, dtype=torch.int64) * _MIX[0]))
