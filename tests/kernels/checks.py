"""Assertions shared by the kernel tests: the tolerance table and comparisons against the float64 truth."""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tolerances against the float64 truth, by what limits precision.
TOLERANCES = {
    # float32 accumulation (inputs upcast from 16-bit are exact in float32): errors ~1e-7 relative per op, so
    # 1e-5 is far under the 1e-3 the kernels promise and still catches a wrong formula
    "fp32": {"rtol": 1e-5, "atol": 1e-5},
    # a float32 matmul reducing over K terms errs by ~sqrt(K) 2^-24 of the terms' magnitude: ~1e-4 relative at
    # K = 151936 (the gradient of the hidden states sums over the vocabulary); still 10x under 1e-3
    "fp32-matmul": {"rtol": 1e-4, "atol": 1e-4},
    # a 16-bit *output* (the gradient of a 16-bit input) carries its own rounding: half an ulp when rounded to
    # nearest, a whole ulp under the interpreter, which truncates when it converts float32 to bfloat16
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-5},
    torch.float16: {"rtol": 2**-10, "atol": 1e-5},
}


def assert_close(actual: torch.Tensor, truth: torch.Tensor, *, tol: str | torch.dtype = "fp32", name: str = "") -> None:
    """``actual`` within the tolerance of ``truth`` (float64); NaN anywhere fails, infinities must match."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in the result"
    assert not torch.isnan(truth).any(), f"{name}: NaN in the truth (bad test input)"
    torch.testing.assert_close(actual.double(), truth.double(), **TOLERANCES[tol], msg=lambda m: f"{name}: {m}")


def assert_no_worse_than(actual, lowp_ref, truth, *, slack: float = 2.0, atol: float = 1e-5, name: str = "") -> None:
    """For results whose precision is set by a 16-bit step both paths share (a bf16 matmul, a bf16 output):
    the kernel's worst error against the truth is at most ``slack`` times the reference's, plus ``atol``."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in the result"
    finite = torch.isfinite(truth)
    assert torch.equal(torch.isfinite(actual), finite), f"{name}: infinities differ"
    err = (actual.double() - truth)[finite].abs().max().item() if finite.any() else 0.0
    ref_err = (lowp_ref.double() - truth)[finite].abs().max().item() if finite.any() else 0.0
    assert err <= slack * ref_err + atol, f"{name}: max error {err:.3g} vs the reference's {ref_err:.3g}"


def assert_bool_written(t: torch.Tensor, name: str) -> None:
    raw = t.view(torch.uint8)
    assert bool((raw <= 1).all()), f"{name}: bytes other than 0/1 (an element was never written)"
