"""token_logprobs: both paths (the Triton kernels, and the PyTorch path the CPU and the lm_head ops take there)
against the reference in float64, forward and backward."""

from __future__ import annotations

import sys

import pytest
import torch

from fasttnt_kernels import token_logprobs, token_logprobs_reference

from checks import DEVICE, assert_close

# (N, V): V=1 and N=1 the degenerate ends; 37 x 1000 small and unaligned; 5 x 4097 one past the 4096-column
# block, so the last block holds a single live column; 3 x 151936 the Qwen2 vocabulary (37 blocks, the last
# partial); 2 x 262144 the largest vocabulary the op promises (Gemma 3's).
SHAPES = [(1, 1), (1, 151936), (37, 1000), (5, 4097), (3, 151936), (2, 262144)]


@pytest.fixture(params=["triton", "torch"])
def path(request, monkeypatch):
    """Each test on both paths: the Triton kernels (under the interpreter here) and the PyTorch path."""
    monkeypatch.setenv("FASTTNT_KERNELS", request.param)
    return request.param


def _inputs(n, v, dtype, *, scale=4.0, ids_dtype=torch.int64):
    logits = (torch.randn(n, v, device=DEVICE) * scale).to(dtype)
    ids = torch.randint(0, v, (n,), device=DEVICE, dtype=ids_dtype)
    return logits, ids


def _run(logits, ids, *, temperature, with_entropy, grad_logp, grad_entropy, inplace=False):
    """Forward and backward through the public op; returns (logp, entropy or None, grad wrt logits)."""
    x = logits.detach().clone().requires_grad_()
    out = token_logprobs(x, ids, temperature=temperature, with_entropy=with_entropy, inplace_backward=inplace)
    logp, entropy = out if with_entropy else (out, None)
    loss = (logp * grad_logp).sum()
    if entropy is not None:
        loss = loss + (entropy * grad_entropy).sum()
    loss.backward()
    return logp.detach(), None if entropy is None else entropy.detach(), x.grad


def _truth(logits, ids, *, temperature, with_entropy, grad_logp, grad_entropy):
    """The reference evaluated in float64 on the (upcast) inputs: forward values and the gradient."""
    x = logits.detach().double().requires_grad_()
    out = token_logprobs_reference(x, ids, temperature=temperature, with_entropy=with_entropy)
    logp, entropy = out if with_entropy else (out, None)
    loss = (logp * grad_logp.double()).sum()
    if entropy is not None:
        loss = loss + (entropy * grad_entropy.double()).sum()
    loss.backward()
    return logp.detach(), None if entropy is None else entropy.detach(), x.grad


def _check(logits, ids, *, temperature=1.0, with_entropy=True, inplace=False):
    n = logits.shape[0]
    grad_logp = torch.randn(n, device=DEVICE)
    grad_entropy = torch.randn(n, device=DEVICE)
    kw = dict(temperature=temperature, with_entropy=with_entropy, grad_logp=grad_logp, grad_entropy=grad_entropy)
    logp, entropy, grad = _run(logits, ids, inplace=inplace, **kw)
    t_logp, t_entropy, t_grad = _truth(logits, ids, **kw)

    assert logp.dtype == torch.float32 and logp.shape == (n,)
    # forward values come from float32 arithmetic on exactly-upcast inputs: float32 tolerance for every dtype
    assert_close(logp, t_logp, name="logp")
    if with_entropy:
        assert entropy.dtype == torch.float32
        assert_close(entropy, t_entropy, name="entropy")
    assert grad.dtype == logits.dtype
    # the gradient of a 16-bit input is itself 16-bit: within its own rounding of the truth
    assert_close(grad, t_grad, tol="fp32" if logits.dtype == torch.float32 else logits.dtype, name="grad")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(path, shape, dtype):
    logits, ids = _inputs(*shape, dtype)
    _check(logits, ids, temperature=1.0)


def test_pytorch_path_over_many_blocks(monkeypatch):
    # blocks of 3 rows (the last of 37 holds one): each block's rows and ids are its own, none skipped or repeated
    monkeypatch.setenv("FASTTNT_KERNELS", "torch")
    module = sys.modules["fasttnt_kernels.token_logprobs"]  # the package exports a function of the same name
    monkeypatch.setattr(module, "_TORCH_BLOCK_BYTES", 3 * 1000 * 4)
    assert module._torch_block_rows(1000, torch.float32) == 3
    _check(*_inputs(37, 1000, torch.float32), temperature=0.7)
    # a row wider than the block's bytes still makes a block of one row (not zero: a loop that never advances)
    monkeypatch.setattr(module, "_TORCH_BLOCK_BYTES", 999 * 4)
    assert module._torch_block_rows(1000, torch.float32) == 1
    _check(*_inputs(5, 1000, torch.float32), temperature=0.7)


@pytest.mark.parametrize("temperature", [0.6, 1.7])
@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_temperature_and_id_dtypes(path, temperature, ids_dtype):
    logits, ids = _inputs(11, 5003, torch.float32, ids_dtype=ids_dtype)
    _check(logits, ids, temperature=temperature)


def test_float16(path):
    logits, ids = _inputs(9, 3001, torch.float16)
    _check(logits, ids, temperature=0.8)


def test_without_entropy(path):
    logits, ids = _inputs(7, 6000, torch.float32)
    _check(logits, ids, with_entropy=False)
    out = token_logprobs(logits, ids)
    assert isinstance(out, torch.Tensor) and out.shape == (7,)


def test_any_row_stride(path):
    # logits as a view into a wider buffer (rows 1000 + 24 apart), as a slice of a (B, T, V_padded) output is
    wide = torch.randn(13, 1024, device=DEVICE) * 3
    logits = wide[:, :1000]
    assert logits.stride(0) == 1024 and not logits.is_contiguous()
    ids = torch.randint(0, 1000, (13,), device=DEVICE)
    _check(logits, ids, temperature=0.9)


def test_negative_infinity_logits(path):
    # masked vocabularies put -inf in the logits: whole blocks of them, scattered ones, and the chosen id itself
    logits, ids = _inputs(6, 9000, torch.float32)
    logits[0, :4096] = -float("inf")  # a whole first block: the running max starts at -inf
    logits[1, ::3] = -float("inf")
    logits[2, 100:] = -float("inf")  # only 100 live columns
    ids[2] = 50
    logits[3, ids[3]] = -float("inf")  # the chosen id is impossible: logp = -inf, gradients stay finite
    logits[4, :-1] = -float("inf")  # a single live column, the last one: logp 0 and entropy 0 there
    ids[4] = 8999
    grad_logp = torch.randn(6, device=DEVICE)
    grad_entropy = torch.randn(6, device=DEVICE)
    kw = dict(temperature=0.7, with_entropy=True, grad_logp=grad_logp, grad_entropy=grad_entropy)
    logp, entropy, grad = _run(logits, ids, **kw)
    t_logp, t_entropy, t_grad = _truth(logits, ids, **kw)
    assert logp[3] == -float("inf")
    # one live column: logp 0 and entropy 0, to float32 rounding (a GPU's fused multiply-add leaves ~1e-7)
    assert abs(logp[4].item()) < 1e-6 and 0.0 <= entropy[4].item() < 1e-6
    assert_close(logp, t_logp, name="logp")
    assert_close(entropy, t_entropy, name="entropy")
    assert_close(grad, t_grad, name="grad")


@pytest.mark.parametrize("which", ["logp", "entropy"])
def test_backward_through_one_output(path, which):
    logits, ids = _inputs(8, 4500, torch.float32)
    g = torch.randn(8, device=DEVICE)
    x = logits.clone().requires_grad_()
    logp, entropy = token_logprobs(x, ids, temperature=1.3, with_entropy=True)
    ((logp if which == "logp" else entropy) * g).sum().backward()
    xr = logits.double().requires_grad_()
    r_logp, r_entropy = token_logprobs_reference(xr, ids, temperature=1.3, with_entropy=True)
    ((r_logp if which == "logp" else r_entropy) * g.double()).sum().backward()
    assert_close(x.grad, xr.grad, name=f"grad through {which} only")


def test_inplace_backward_reuses_the_logits_buffer(path):
    logits, ids = _inputs(10, 5000, torch.bfloat16)
    g = torch.randn(10, device=DEVICE)
    _, _, expected = _run(logits, ids, temperature=1.0, with_entropy=False, grad_logp=g, grad_entropy=g)

    base = logits.clone().requires_grad_()
    x = base * 1  # a non-leaf, as the lm_head output is
    seen = []
    x.register_hook(lambda grad: seen.append(grad.data_ptr()))
    (token_logprobs(x, ids, inplace_backward=True) * g).sum().backward()
    assert seen == [x.data_ptr()], "the gradient was not written into the logits buffer"
    assert torch.equal(base.grad, expected)
    _check(logits, ids, with_entropy=True, inplace=True)


def test_no_grad_forward(path):
    logits, ids = _inputs(4, 3000, torch.float32)
    with torch.no_grad():
        logp = token_logprobs(logits, ids, temperature=0.6)
    assert_close(logp, token_logprobs_reference(logits.double(), ids, temperature=0.6), name="logp")


def test_empty_batch(path):
    logits = torch.randn(0, 100, device=DEVICE, requires_grad=True)
    logp, entropy = token_logprobs(logits, torch.zeros(0, dtype=torch.long, device=DEVICE), with_entropy=True)
    assert logp.shape == (0,) and entropy.shape == (0,)
    (logp.sum() + entropy.sum()).backward()
    assert logits.grad.shape == (0, 100)


def test_out_of_range_id_is_nan_not_a_stray_read(triton_path):
    logits, _ = _inputs(3, 500, torch.float32)
    ids = torch.tensor([0, 500, -1], device=DEVICE)
    logp = token_logprobs(logits, ids)
    assert torch.isfinite(logp[0]) and torch.isnan(logp[1:]).all()


def test_out_of_range_id_is_an_error_on_the_pytorch_path(monkeypatch):
    # on the CPU: a CUDA gather checks its ids in a device-side assert, which breaks the CUDA context
    monkeypatch.setenv("FASTTNT_KERNELS", "torch")
    logits, _ = _inputs(3, 500, torch.float32)
    with pytest.raises(RuntimeError, match="out of bounds"):
        token_logprobs(logits.cpu(), torch.tensor([0, 500, 1]))


@pytest.mark.parametrize(
    ("logits", "ids", "temperature", "match"),
    [
        (torch.randn(2, 3, 4), torch.zeros(2, dtype=torch.long), 1.0, "2-D"),
        (torch.randn(2, 4), torch.zeros(3, dtype=torch.long), 1.0, "ids must have 2"),
        (torch.randn(2, 4), torch.zeros(2), 1.0, "ids has dtype float32"),
        (torch.randint(0, 5, (2, 4)), torch.zeros(2, dtype=torch.long), 1.0, "logits has dtype int64"),
        (torch.randn(2, 4), torch.zeros(2, dtype=torch.long), 0.0, "temperature"),
    ],
)
def test_bad_input_names_the_problem(logits, ids, temperature, match):
    with pytest.raises((ValueError, TypeError), match=match):
        token_logprobs(logits, ids, temperature=temperature)


def test_pytorch_path_works_a_few_rows_at_a_time():
    # The lm_head ops' CPU path: no temporary the size of the whole (N, V) logits, forward or backward (the
    # gradient written over the logits, as the lm_head ops ask). torch's profiler counts allocator bytes on the
    # CPU; the largest single allocation inside the launchers proxies their peak.
    from torch.profiler import ProfilerActivity, profile

    from fasttnt_kernels.token_logprobs import (
        _torch_block_rows,
        token_logprobs_backward_torch,
        token_logprobs_forward_torch,
    )

    v = 32768
    block = _torch_block_rows(v, torch.float32)
    n = 8 * block
    logits, ids = (t.cpu() for t in _inputs(n, v, torch.float32))  # CPU tensors, whatever DEVICE is
    logp, lse, entropy = (torch.full((n,), float("nan")) for _ in range(3))
    g_logp, g_entropy = torch.randn(n), torch.randn(n)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        token_logprobs_forward_torch(logits, ids, inv_temperature=1.1, logp=logp, lse=lse, entropy=entropy)
        token_logprobs_backward_torch(logits, ids, inv_temperature=1.1, lse=lse, entropy=entropy, grad_logp=g_logp,
                                      grad_entropy=g_entropy, grad_logits=logits)  # fmt: skip
    largest = max((e.cpu_memory_usage for e in prof.events() if e.cpu_memory_usage > 0), default=0)
    assert torch.isfinite(logits).all() and logits.abs().sum() > 0 and not entropy.isnan().any()
    assert largest >= block * v * 4, "the profiler saw no row block: the measurement is broken"
    assert largest <= n * v * 4 // 4, f"largest allocation {largest} bytes against {n * v * 4} for the logits"
