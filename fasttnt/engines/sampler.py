"""Sampling that depends on nothing but a row's own seed: counter-based Gumbel noise, so a response is the same
whichever batch, rank or decode step it is drawn in (the hf engine's sampler; the vllm engine uses vLLM's own, with
the same per-row seeds)."""

from __future__ import annotations

import torch

_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64's odd constants, signed


def _hash_uniform(row_seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """(B, V) uniforms in (0, 1), a pure function of (row seed, position, token id): counter-based, so a row's
    draws do not depend on which other rows share its batch (or its rank). int64 arithmetic wraps, as hashes want."""
    v = torch.arange(vocab, device=row_seeds.device, dtype=torch.int64)
    pos = torch.full((), position + 1, dtype=torch.int64, device=row_seeds.device)
    x = row_seeds[:, None] * _MIX[0] + pos * _MIX[1] + v[None, :] * _MIX[2]
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    # 52 random bits and a half: strictly inside (0, 1), since 2^52 - 0.5 is exact in float64 (with 53 bits the
    # top value rounds to 1.0, and -log(-log(1)) is +inf)
    return (((x >> 12) & ((1 << 52) - 1)).double() + 0.5) / float(1 << 52)


def seeded_sample(
    scores: torch.Tensor, row_seeds: torch.Tensor, position: int, *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (B,), and its log-prob (B,) under the distribution it was drawn from (after temperature
    and top-p), which the rollout correction compares with. ``position``: the tokens the rows generated before.

    Sampling by the Gumbel-max trick with per-row counter-based noise: ``argmax(logits / T + Gumbel)`` is a draw
    from ``softmax(logits / T)`` (after the top-p cut). Drawing the noise from each row's own seed makes a response
    depend only on its prompt, its seed and the model, not on the batch: a prompt's samples are the same whether
    one process generates the step's batch or N ranks generate a share each, and whichever rows are still decoding.
    """
    z = scores.float() / temperature  # (B, V)
    if top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_z.softmax(-1) >= top_p
        z = z.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -float("inf"))
    u = _hash_uniform(row_seeds.to(z.device), position, z.shape[-1])  # (B, V) float64
    chosen = (z + (-torch.log(-torch.log(u))).to(z.dtype)).argmax(-1, keepdim=True)  # (B, 1)
    return chosen[:, 0], torch.log_softmax(z, -1).gather(-1, chosen)[:, 0]


def row_seeds(seed: int, first_row: int, rows: int) -> torch.Tensor:
    """Seeds of rows ``first_row .. first_row + rows - 1`` of a step whose seed is ``seed``: a hash of both, so
    no two (seed, row) pairs share a stream (a linear mix would, once a step had as many rows as its factor)."""
    x = torch.arange(first_row, first_row + rows, dtype=torch.int64)
    x = x ^ (torch.tensor(seed, dtype=torch.int64) * _MIX[0])
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    return x
