"""The hf engine's sampler (fasttnt.engines.sampler): exact draws from softmax(logits / T) after the top-p cut, the
log-probs it returns, and a pure function of (row seed, position)."""

from __future__ import annotations

import math

import pytest
import torch

from fasttnt.engines.sampler import inverse_cdf, row_seeds, row_uniforms, seeded_sample

V = 40
ROWS = 20_000  # draws per distribution: expected counts >= 5 for every token the checks below count


def _chi2_threshold(df: int) -> float:
    """The chi-square statistic that df degrees of freedom exceed with probability ~1e-7 (Wilson-Hilferty, z = 5.2).
    The draws are a pure function of fixed seeds: the check is deterministic, the threshold only says how far from
    the distribution a correct sampler's counts can land."""
    z = 5.2
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _draws(logits: torch.Tensor, *, temperature: float, top_p: float, position: int = 3):
    seeds = row_seeds(11, 0, ROWS)
    return seeded_sample(logits.expand(ROWS, -1), seeds, position, temperature=temperature, top_p=top_p)


def _truth(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """(V,) float64: softmax(logits / T) restricted to the smallest descending set reaching top_p, renormalised
    (the logits here have no ties, so the sampler's tie rule does not enter)."""
    p = torch.softmax(logits.double() / temperature, -1)
    sorted_p, order = p.sort(descending=True)
    keep_sorted = sorted_p.cumsum(-1) - sorted_p < top_p
    keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, keep_sorted)
    p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.6, 1.0), (1.0, 0.9)])
def test_the_counts_fit_the_distribution_and_the_log_probs_are_its_own(temperature, top_p):
    # a distribution with a heavy head, a long tail and a forbidden token (-inf): every kind of interval
    logits = torch.linspace(3.0, -3.0, V) + 0.3 * torch.sin(torch.arange(V, dtype=torch.float32))
    logits[5] = -float("inf")
    truth = _truth(logits, temperature, top_p)
    if top_p < 1:  # keep top_p away from a cumulative boundary, where a rounding would move the cut by a token
        cum = truth.sort(descending=True).values.cumsum(-1)
        assert (cum - top_p).abs().min() > 1e-4
    tokens, logp = _draws(logits, temperature=temperature, top_p=top_p)
    assert not torch.isnan(logp).any()
    counts = torch.bincount(tokens, minlength=V).double()
    assert counts[truth == 0].sum() == 0, "a token outside the kept set (the forbidden one, or past top-p) was drawn"
    expected = truth * ROWS
    counted = expected >= 5  # the chi-square approximation's condition; the rest are pooled into one cell
    assert counted.sum() >= 10  # precondition: a real test of the shape
    observed = torch.cat([counts[counted], counts[~counted & (truth > 0)].sum().view(1)])
    wanted = torch.cat([expected[counted], expected[~counted & (truth > 0)].sum().view(1)])
    stat = float(((observed - wanted) ** 2 / wanted.clamp(min=1e-12)).sum())
    assert stat < _chi2_threshold(len(observed) - 1), f"chi2 {stat:.1f} over {len(observed) - 1} df"
    # the returned log-prob is the drawn token's under the distribution it was drawn from (float32 softmax)
    torch.testing.assert_close(logp.double(), truth.log()[tokens], atol=1e-5, rtol=0)


def test_a_row_draws_the_same_whatever_batch_it_is_in():
    logits = torch.randn(6, 1000) * 2
    seeds = row_seeds(5, 0, 6)
    tokens, logp = seeded_sample(logits, seeds, 7, temperature=0.7, top_p=1.0)
    for i in range(6):
        alone, alone_logp = seeded_sample(logits[i : i + 1], seeds[i : i + 1], 7, temperature=0.7, top_p=1.0)
        assert alone.item() == tokens[i].item() and alone_logp.item() == logp[i].item()
    # another position or another seed is another draw
    u = row_uniforms(seeds, 7)
    assert not torch.equal(u, row_uniforms(seeds, 8)) and not torch.equal(u, row_uniforms(row_seeds(6, 0, 6), 7))
    assert ((u > 0) & (u < 1)).all()


def test_the_inverse_cdf_never_draws_a_zero_weight_even_at_the_top_of_the_range():
    weights = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0]] * 4)
    # the edges: below the first weight, the middle, the largest uniform drawn, and 1 itself (u * total = total:
    # the clamp below the total keeps the draw on the last weighted token)
    u = torch.tensor([1e-300, 0.5, 1 - 2**-53, 1.0], dtype=torch.float64)
    index, total = inverse_cdf(weights, u)
    assert index.tolist() == [1, 3, 3, 3] and total.tolist() == [3.0] * 4


def test_under_top_p_a_row_draws_the_same_whatever_batch_it_is_in():
    # bf16-rounded logits tie often; a flat row in the batch widens the top-k search for every row, which orders
    # ties differently: the kept set and the draw must not change
    logits = (torch.randn(16, 5000) * 3).bfloat16().float()
    seeds = row_seeds(3, 0, 17)
    alone, alone_logp = seeded_sample(logits, seeds[:16], 2, temperature=1.0, top_p=0.95)
    with_flat = torch.cat([logits, torch.zeros(1, 5000)])
    tokens, logp = seeded_sample(with_flat, seeds, 2, temperature=1.0, top_p=0.95)
    assert torch.equal(tokens[:16], alone) and torch.equal(logp[:16], alone_logp)


def test_top_p_over_a_flat_distribution_widens_its_search():
    # 5000 nearly equal tokens (no ties): the top 1024 hold ~23% of the mass, so the candidates must grow past them
    logits = -1e-4 * torch.arange(5000, dtype=torch.float32).expand(4, -1)
    truth = _truth(logits[0], 1.0, 0.9)
    assert 1024 < int((truth > 0).sum()) < 5000  # precondition: the cut lies past the first candidates
    cum = torch.softmax(logits[0].double(), -1).cumsum(-1)
    assert (cum - 0.9).abs().min() > 1e-6  # and away from a boundary
    tokens, logp = seeded_sample(logits, row_seeds(1, 0, 4), 0, temperature=1.0, top_p=0.9)
    assert (truth[tokens] > 0).all()
    torch.testing.assert_close(logp.double(), truth.log()[tokens], atol=1e-4, rtol=0)
