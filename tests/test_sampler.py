"""The hf engine's sampler (fasttnt.engines.sampler): exact draws from softmax(logits / T) after the top-p cut, the
log-probs it returns, and a pure function of (row seed, position)."""

from __future__ import annotations

import math

import pytest
import torch

from fasttnt.engines.sampler import inverse_cdf, row_seeds, row_uniforms, seeded_sample, step_seed

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
    with_flat = torch.cat([logits, -1e-4 * torch.arange(5000.0)[None]])  # nearly flat, no ties
    tokens, logp = seeded_sample(with_flat, seeds, 2, temperature=1.0, top_p=0.95)
    assert torch.equal(tokens[:16], alone) and torch.equal(logp[:16], alone_logp)
    # and the flat row, whose cut lies past the candidates that suffice for the others, as it draws alone
    flat, flat_logp = seeded_sample(with_flat[16:], seeds[16:], 2, temperature=1.0, top_p=0.95)
    assert torch.equal(tokens[16:], flat) and torch.equal(logp[16:], flat_logp)
    kept = int((_truth(with_flat[16], 1.0, 0.95) > 0).sum())
    assert kept > 1024, "precondition: the flat row's cut lies past the first candidates"


def test_a_row_of_nan_logits_draws_an_index_in_the_vocabulary_with_a_nan_log_prob():
    # the NaN checks downstream report it; an index past the vocabulary would fail in the gather first, or worse
    logits = torch.randn(3, 10)
    logits[1] = float("nan")
    for top_p in (1.0, 0.9):
        tokens, logp = seeded_sample(logits, row_seeds(0, 0, 3), 0, temperature=1.0, top_p=top_p)
        assert ((tokens >= 0) & (tokens < 10)).all() and logp[1].isnan()
        assert not logp[[0, 2]].isnan().any()


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


# The hashes' outputs on fixed inputs, computed by the sampler at commit 3862bd8 (before its logical shift became a
# function of its own): a rollout's tokens are a function of these bits, so a rewrite of the hash must keep every one
ROW_SEEDS = {  # (seed, first_row, rows): row_seeds
    (0, 0, 4): [0, 6238072747940578789, -2606959012126976886, 2185194620014831856],
    (123, 5, 3): [8812989653604322081, -7098010466717826931, -5139218791112526049],
    (-7, 1000, 2): [193461947034471386, -8652195769311243285],
    (2**62 + 12345, 0, 3): [-6072166925145794771, 7687263229063824990, 5269336624103793396],
    (1_000_003 * 7 + 3, 40, 2): [-4061305083115092242, 910097207585545346],
}
UNIFORMS = {  # position: row_uniforms(row_seeds(123, 0, 4), position), as float.hex
    0: ["0x1.5749bf14c5ec2p-2", "0x1.4c931118ea775p-1", "0x1.5cd8c415a7375p-1", "0x1.d634a15c96f24p-3"],
    1: ["0x1.91c2fbd96e615p-1", "0x1.2464d75d58c87p-1", "0x1.9d77955e7df05p-1", "0x1.b84b09215aebfp-1"],
    95: ["0x1.cf3cc4e89e573p-1", "0x1.512d462be55b4p-3", "0x1.219bc3199aafap-2", "0x1.5233ad307d01ap-2"],
}
# the extremes of int64 as row seeds, at position 7
EXTREME_UNIFORMS = ["0x1.513006e9ff501p-1", "0x1.8f89317992a6bp-1", "0x1.e994b1aa75246p-2", "0x1.9af004c8bf233p-1"]
# seeded_sample's tokens over fixed logits (4 rows x 50, sin-shaped), rows seeded row_seeds(99, 8, 4), T = 0.7
TOKENS = {(0, 1.0): [4, 20, 40, 9], (0, 0.8): [4, 7, 40, 9], (3, 1.0): [8, 5, 7, 40], (3, 0.8): [6, 5, 7, 40]}


def test_the_hashes_and_draws_are_bit_identical_to_the_recorded_ones():
    for (seed, first_row, rows), expected in ROW_SEEDS.items():
        assert row_seeds(seed, first_row, rows).tolist() == expected, (seed, first_row, rows)
    seeds = row_seeds(123, 0, 4)
    for position, expected in UNIFORMS.items():
        assert [u.hex() for u in row_uniforms(seeds, position).tolist()] == expected, position
    extremes = torch.tensor([0, -1, 2**63 - 1, -(2**63)])
    assert [u.hex() for u in row_uniforms(extremes, 7).tolist()] == EXTREME_UNIFORMS
    logits = torch.sin(torch.arange(4 * 50, dtype=torch.float32) * 0.37).view(4, 50) * 3
    for (position, top_p), expected in TOKENS.items():
        tokens, _ = seeded_sample(logits, row_seeds(99, 8, 4), position, temperature=0.7, top_p=top_p)
        assert tokens.tolist() == expected, (position, top_p)
    assert step_seed(7, 3) == 7 * 1_000_003 + 3  # the trainer's and evaluation's seed per call, as before
