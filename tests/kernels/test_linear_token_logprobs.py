"""linear_token_logprobs: chunked lm_head + log-probs against the materialised reference in float64."""

from __future__ import annotations

import pytest
import torch

from fasttnt_kernels import linear_token_logprobs, linear_token_logprobs_reference
from fasttnt_kernels._lm_head import chunk_rows_for

from checks import DEVICE, assert_close, assert_within, bf16_logit_bounds


def _inputs(n, h, v, dtype):
    hidden = torch.randn(n, h, device=DEVICE).to(dtype)
    weight = (torch.randn(v, h, device=DEVICE) / h**0.5 * 3).to(dtype)
    ids = torch.randint(0, v, (n,), device=DEVICE)
    return hidden, weight, ids


def _grads(fn, hidden, weight, ids, g_logp, g_ent, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, entropy = fn(h, w, ids, with_entropy=True, **kw)
    ((logp * g_logp.to(logp.dtype)).sum() + (entropy * g_ent.to(entropy.dtype)).sum()).backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


def _bytes_for_rows(rows, v, dtype):
    return rows * v * torch.empty((), dtype=dtype).element_size()


# (N, H, V, rows per chunk): several chunks with a ragged last one; one chunk holding every row; one row per
# chunk; the Qwen2 vocabulary with a hidden width that is not a power of two.
CASES = [(50, 32, 1000, 16), (7, 24, 3000, 64), (5, 16, 777, 1), (6, 48, 151936, 4)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_float32_matches_float64_reference(monkeypatch, case, path):
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    n, h, v, rows = case
    hidden, weight, ids = _inputs(n, h, v, torch.float32)
    g_logp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    chunk = _bytes_for_rows(rows, v, torch.float32)
    got = _grads(linear_token_logprobs, hidden, weight, ids, g_logp, g_ent, temperature=0.7, chunk_bytes=chunk)
    truth = _grads(
        linear_token_logprobs_reference, hidden.double(), weight.double(), ids, g_logp, g_ent, temperature=0.7
    )
    # every output inherits the float32 matmul's rounding of the logits (amplified in the entropy by |log p + H|)
    for name, a, t in zip(("logp", "entropy", "grad hidden", "grad weight"), got, truth, strict=True):
        assert_close(a, t, tol="fp32-matmul", name=name)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_bfloat16_within_what_the_logits_rounding_allows(monkeypatch, path):
    # the logits are bf16 (what the lm_head itself would give), so no path can beat that rounding: the chunked one
    # is within its first-order bound (checks.bf16_logit_bounds), and never NaN
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    n, h, v = 64, 64, 5000
    hidden, weight, ids = _inputs(n, h, v, torch.bfloat16)
    g_logp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    chunk = _bytes_for_rows(16, v, torch.bfloat16)
    got = _grads(linear_token_logprobs, hidden, weight, ids, g_logp, g_ent, chunk_bytes=chunk)
    truth = _grads(linear_token_logprobs_reference, hidden.double(), weight.double(), ids, g_logp, g_ent)
    bounds = bf16_logit_bounds(hidden, weight, ids, a=g_logp, c=g_ent)  # the loss: sum(g_logp logp + g_ent H)
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    for name, a, t in zip(("logp", "entropy", "grad hidden", "grad weight"), got, truth, strict=True):
        assert_within(a, t, bounds[name], name=name)


def test_same_values_as_token_logprobs_of_the_product(triton_path):
    # the definition: identical to token_logprobs(hidden @ weight.T) on the same dtype, to float32 rounding
    from fasttnt_kernels import token_logprobs

    hidden, weight, ids = _inputs(33, 40, 2500, torch.bfloat16)
    chunk = _bytes_for_rows(8, 2500, torch.bfloat16)  # five chunks, the last one ragged
    logp, entropy = linear_token_logprobs(hidden, weight, ids, with_entropy=True, temperature=1.2, chunk_bytes=chunk)
    e_logp, e_entropy = token_logprobs(hidden @ weight.T, ids, with_entropy=True, temperature=1.2)
    torch.testing.assert_close(logp, e_logp, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(entropy, e_entropy, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_autocast_recomputes_the_logits_the_forward_used(monkeypatch, path):
    # float32 parameters under bf16 autocast (the usual mixed-precision set-up): the forward's logits are bf16,
    # and the backward must recompute those same bf16 logits, not float32 ones, or p no longer sums to 1
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    n, h, v = 48, 32, 3000
    hidden, weight, ids = _inputs(n, h, v, torch.float32)
    g_logp, g_ent = torch.randn(n, device=DEVICE), torch.randn(n, device=DEVICE)
    chunk = _bytes_for_rows(16, v, torch.bfloat16)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = _grads(linear_token_logprobs, hidden, weight, ids, g_logp, g_ent, chunk_bytes=chunk)
    h16, w16 = hidden.bfloat16(), weight.bfloat16()  # what autocast computes from
    truth = _grads(linear_token_logprobs_reference, h16.double(), w16.double(), ids, g_logp, g_ent)
    bounds = bf16_logit_bounds(h16, w16, ids, a=g_logp, c=g_ent, float32_inputs=True)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    for name, a, t in zip(("logp", "entropy", "grad hidden", "grad weight"), got, truth, strict=True):
        assert_within(a, t, bounds[name], name=name)


def test_weight_without_grad_and_no_grad(triton_path):
    hidden, weight, ids = _inputs(20, 16, 900, torch.float32)
    h = hidden.clone().requires_grad_()
    logp = linear_token_logprobs(h, weight, ids, chunk_bytes=_bytes_for_rows(8, 900, torch.float32))
    g = torch.randn(20, device=DEVICE)
    (logp * g).sum().backward()
    hr = hidden.double().requires_grad_()
    (linear_token_logprobs_reference(hr, weight.double(), ids) * g.double()).sum().backward()
    assert_close(h.grad, hr.grad, tol="fp32-matmul", name="grad hidden")
    with torch.no_grad():
        assert_close(linear_token_logprobs(hidden, weight, ids), logp.detach().double(), name="no_grad logp")
    assert_close(
        logp.detach(),
        linear_token_logprobs_reference(hidden.double(), weight.double(), ids),
        tol="fp32-matmul",
        name="logp",
    )


def test_chunk_rows_follow_the_memory_budget():
    # 512 MiB of bf16 logits at the Qwen2 vocabulary is 1766 rows, rounded down to a multiple of 128
    assert chunk_rows_for(65536, 151936, 2, 512 * 2**20) == 1664
    assert chunk_rows_for(100, 151936, 2, 512 * 2**20) == 100  # never more than N
    assert chunk_rows_for(10, 1000, 4, 1) == 1  # a budget under one row still makes progress
    assert chunk_rows_for(1000, 1000, 4, 100 * 1000 * 4) == 100  # under 128 rows: no rounding


def test_peak_memory_is_one_chunk_not_n_by_v(monkeypatch):
    # On the CPU, torch's profiler counts allocator bytes. Materialising N x V float32 logits of a 32K vocabulary
    # for 256 rows is 32 MiB (and autograd keeps more); the chunked op at 1 MiB chunks must stay far below that.
    monkeypatch.setenv("FASTTNT_KERNELS", "torch")
    n, h, v = 256, 16, 32768
    hidden, weight, ids = (t.cpu() for t in _inputs(n, h, v, torch.float32))  # CPU tensors, whatever DEVICE is
    hidden.requires_grad_()
    weight.requires_grad_()
    n_by_v = n * v * 4

    def peak(fn):
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            logp = fn()
            logp.sum().backward()
        # the largest single live block proxies the peak: N x V logits would be one n_by_v allocation
        return max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)

    chunked = peak(lambda: linear_token_logprobs(hidden, weight, ids, chunk_bytes=2**20))
    hidden.grad = weight.grad = None
    materialised = peak(lambda: linear_token_logprobs_reference(hidden, weight, ids))
    assert materialised >= n_by_v
    assert chunked <= n_by_v // 8, f"largest allocation {chunked} bytes vs {n_by_v} for the full logits"


def test_bad_shapes_are_named():
    with pytest.raises(ValueError, match="hidden must be"):
        linear_token_logprobs(torch.randn(4, 8), torch.randn(10, 9), torch.zeros(4, dtype=torch.long))
    with pytest.raises(TypeError, match="share a dtype"):
        linear_token_logprobs(torch.randn(4, 8), torch.randn(10, 8).double(), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_bytes"):
        linear_token_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long), chunk_bytes=0)
