"""rollout_correction_weights: importance weights for samples of another engine, against hand-worked cases."""

from __future__ import annotations

import math

import pytest
import torch

from fasttnt_kernels import rollout_correction_weights, rollout_correction_weights_reference


def test_rollout_correction_modes_by_hand():
    # two sequences: [log diffs 0.5, -0.2] and [2.0, 0.3, -1.0]; cap 2
    old = torch.tensor([0.5, -0.2, 2.0, 0.3, -1.0], dtype=torch.float64) - 3.0
    rollout = torch.full((5,), -3.0, dtype=torch.float64)
    cu = torch.tensor([0, 2, 5])
    rho_tok = torch.tensor([0.5, -0.2, 2.0, 0.3, -1.0], dtype=torch.float64).exp()
    rho_seq = torch.tensor([0.3, 0.3, 1.3, 1.3, 1.3], dtype=torch.float64).exp()
    expected = {
        "token-truncate": (rho_tok.clamp(max=2.0), 1 / 5),
        "token-mask": (torch.where(rho_tok > 2, 0.0, rho_tok), 1 / 5),
        "sequence-truncate": (rho_seq.clamp(max=2.0), 3 / 5),  # e^1.3 = 3.7 > 2: the second sequence's 3 tokens
        "sequence-mask": (torch.where(rho_seq > 2, 0.0, rho_seq), 3 / 5),
    }
    for mode, (weights, frac) in expected.items():
        got, stats = rollout_correction_weights(old, rollout, cu, mode=mode, cap=2.0)
        assert got.dtype == torch.float32, mode
        torch.testing.assert_close(got.double(), weights, rtol=1e-6, atol=1e-7, msg=mode)
        assert math.isclose(stats["rollout_is_clipped_frac"].item(), frac, rel_tol=1e-6), mode
        assert math.isclose(stats["rollout_is_mean"].item(), weights.mean().item(), rel_tol=1e-6), mode
        assert math.isclose(stats["rollout_logp_diff"].item(), 4.0 / 5, rel_tol=1e-6), mode
    none, stats = rollout_correction_weights(old, rollout, cu, mode="none", cap=2.0)
    assert none is None and stats["rollout_is_clipped_frac"].item() == 0.0
    assert math.isclose(stats["rollout_is_mean"].item(), rho_tok.mean().item(), rel_tol=1e-6)
    # a difference of 1000 (a token the engine nearly never samples) gives a finite weight
    huge, _ = rollout_correction_weights(old + 1000, rollout, cu, mode="sequence-truncate", cap=2.0)
    assert torch.isfinite(huge).all() and huge.max().item() == 2.0
    with pytest.raises(ValueError, match="mode must be one of"):
        rollout_correction_weights(old, rollout, cu, mode="tokens", cap=2.0)
    with pytest.raises(ValueError, match="cap must be >= 1"):
        rollout_correction_weights(old, rollout, cu, mode="token-mask", cap=0.5)


def test_the_public_function_is_its_reference_behind_the_checks():
    old, rollout = -torch.rand(7), -torch.rand(7)
    cu = torch.tensor([0, 3, 3, 7])
    for mode in ("none", "token-truncate", "sequence-mask"):
        got, stats = rollout_correction_weights(old, rollout, cu, mode=mode, cap=1.5)
        want, want_stats = rollout_correction_weights_reference(old, rollout, cu, mode=mode, cap=1.5)
        assert (got is None and want is None) or torch.equal(got, want), mode
        assert all(torch.equal(stats[k], want_stats[k]) for k in want_stats), mode
    with pytest.raises(ValueError, match="rollout_logp must have 7 elements"):
        rollout_correction_weights(old, rollout[:-1], cu, mode="none", cap=1.5)
