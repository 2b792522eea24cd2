"""Per-token log-probabilities (and softmax entropy) of chosen ids, straight from a logits matrix.

    logp[i]    = log_softmax(logits[i] / T)[ids[i]]
    entropy[i] = -sum_v p[i, v] log p[i, v],   p[i] = softmax(logits[i] / T)

The forward kernel reads each row once with an online log-sum-exp; the backward kernel re-reads it and writes
the gradient, optionally over the logits buffer itself, so no second N x V tensor is ever allocated.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from . import _common

# One row of the vocabulary is streamed in blocks of this many columns: 16 KiB of fp32 registers per program,
# small enough to keep occupancy at the 152K-262K vocabularies the trainer sees, large enough to amortise the loop.
_BLOCK_V = 4096


@triton.jit
def _token_logprobs_fwd_kernel(
    # pointers
    logits_ptr,
    ids_ptr,
    logp_ptr,
    entropy_ptr,
    lse_ptr,
    # sizes and strides
    V,
    stride_row,
    # scalars
    inv_temperature,
    # meta
    WITH_ENTROPY: tl.constexpr,  # skips the p*z accumulation and its store when entropy is not asked for
    BLOCK_V: tl.constexpr,
):
    # reads N*V logits once, writes 2-3 floats per row
    row = tl.program_id(0).to(tl.int64)  # row * stride_row passes 2**31 past 14K rows of a 152K vocabulary
    row_ptr = logits_ptr + row * stride_row

    m = -float("inf")  # running max of z
    s = 0.0  # sum exp(z - m)
    t = 0.0  # sum exp(z - m) * (z - m): kept relative to m so the entropy needs no cancelling subtraction
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + cols, mask=cols < V, other=-float("inf")).to(tl.float32) * inv_temperature
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # while every z seen so far is -inf, shift by 0 instead of -inf so exp() gives 0 rather than NaN
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - shift)
        e = tl.exp(z - shift)
        if WITH_ENTROPY:
            # rebase the old t from m to shift: sum e*(z - shift) = alpha * (t + s * (m - shift))
            delta = tl.where(m == -float("inf"), 0.0, m - shift)
            # e = 0 (a -inf logit) contributes 0: zero its offset first, since 0 * -inf is NaN
            t = alpha * (t + s * delta) + tl.sum(e * tl.where(e > 0.0, z - shift, 0.0), axis=0)
        s = s * alpha + tl.sum(e, axis=0)
        m = m_new

    lse = m + tl.log(s)
    token = tl.load(ids_ptr + row).to(tl.int64)
    valid = (token >= 0) & (token < V)
    # an id outside [0, V) gives NaN instead of reading outside the row
    z_token = tl.load(row_ptr + token, mask=valid, other=float("nan")).to(tl.float32) * inv_temperature
    tl.store(logp_ptr + row, z_token - lse)
    tl.store(lse_ptr + row, lse)
    if WITH_ENTROPY:
        # H = lse - E[z] = log(s) - t / s, both terms non-negative; clamped because a fused multiply-add in
        # z - shift can leave a one-hot row at -1e-7
        tl.store(entropy_ptr + row, tl.maximum(tl.log(s) - t / s, 0.0))


@triton.jit
def _token_logprobs_bwd_kernel(
    # pointers
    logits_ptr,
    grad_logits_ptr,  # may alias logits_ptr: each element is read before it is overwritten
    ids_ptr,
    lse_ptr,
    entropy_ptr,
    grad_logp_ptr,
    grad_entropy_ptr,
    # sizes and strides
    V,
    stride_row,
    stride_grad_row,
    # scalars
    inv_temperature,
    # meta
    HAS_GRAD_LOGP: tl.constexpr,  # either upstream gradient may be absent; each skips its loads and its terms
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # reads N*V logits, writes N*V gradients: the floor for a gradient that is a full N x V tensor
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    grad_row_ptr = grad_logits_ptr + row * stride_grad_row
    lse = tl.load(lse_ptr + row)
    token = tl.load(ids_ptr + row).to(tl.int64)
    g_logp = 0.0
    if HAS_GRAD_LOGP:
        g_logp = tl.load(grad_logp_ptr + row).to(tl.float32)
    g_ent = 0.0
    entropy = 0.0
    if HAS_GRAD_ENTROPY:
        g_ent = tl.load(grad_entropy_ptr + row).to(tl.float32)
        entropy = tl.load(entropy_ptr + row)

    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < V
        z = tl.load(row_ptr + cols, mask=mask, other=-float("inf")).to(tl.float32) * inv_temperature
        log_p = z - lse
        p = tl.exp(log_p)
        # d logp / dz = onehot - p
        grad_z = g_logp * (tl.where(cols == token, 1.0, 0.0) - p)
        if HAS_GRAD_ENTROPY:
            # dH / dz = -p (log p + H); p = 0 (a -inf logit) contributes 0, not 0 * -inf
            grad_z -= g_ent * p * tl.where(p > 0.0, log_p + entropy, 0.0)
        grad_x = grad_z * inv_temperature
        tl.store(grad_row_ptr + cols, grad_x.to(grad_logits_ptr.dtype.element_ty), mask=mask)


def token_logprobs_reference(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The semantics, in plain differentiable PyTorch.

    Computes in float32, or in float64 when given float64 (the tests' truth); out-of-range ids raise.
    """
    log_p = torch.log_softmax(logits.to(_common.compute_dtype(logits.dtype)) / temperature, dim=-1)  # (N, V)
    logp = log_p.gather(-1, ids.long().unsqueeze(-1)).squeeze(-1)  # (N,)
    if not with_entropy:
        return logp
    p = log_p.exp()
    # a -inf logit has p = 0 and contributes 0: fill its log p before the product so neither value nor gradient
    # sees 0 * -inf
    entropy = -(p * log_p.masked_fill(p == 0, 0.0)).sum(-1)  # (N,)
    return logp, entropy


def _launch_config(V: int) -> tuple[int, int]:
    block = min(_BLOCK_V, triton.next_power_of_2(V))
    num_warps = 8 if block >= 2048 else 4
    return block, num_warps


def token_logprobs_forward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    inv_temperature: float,
    logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
) -> None:
    """Launch the forward kernel into given (N,) float32 buffers; ``logits`` must have unit column stride."""
    N, V = logits.shape
    if N == 0:
        return
    block, num_warps = _launch_config(V)
    _token_logprobs_fwd_kernel[(N,)](
        logits,
        ids,
        logp,
        entropy if entropy is not None else logp,  # never written when WITH_ENTROPY is off
        lse,
        V,
        logits.stride(0),
        inv_temperature,
        WITH_ENTROPY=entropy is not None,
        BLOCK_V=block,
        num_warps=num_warps,
    )


def token_logprobs_backward(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    inv_temperature: float,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logp: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    grad_logits: torch.Tensor,
) -> None:
    """Launch the backward kernel; ``grad_logits`` may be ``logits`` itself (the in-place backward)."""
    N, V = logits.shape
    if N == 0:
        return
    block, num_warps = _launch_config(V)
    _token_logprobs_bwd_kernel[(N,)](
        logits,
        grad_logits,
        ids,
        lse,
        entropy if entropy is not None else lse,
        grad_logp if grad_logp is not None else lse,
        grad_entropy if grad_entropy is not None else lse,
        V,
        logits.stride(0),
        grad_logits.stride(0),
        inv_temperature,
        HAS_GRAD_LOGP=grad_logp is not None,
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        BLOCK_V=block,
        num_warps=num_warps,
    )


_TORCH_BLOCK_BYTES = 20 * 2**20
"""The PyTorch path works through a chunk of logits a block of rows at a time, each (rows, V) temporary at most this
many bytes in the compute dtype, so they stay a few tens of MiB whatever the chunk: 34 rows of a float32 152K
vocabulary. Bytes, not rows: at a small vocabulary a fixed row count makes the Python loop the cost. The forward and
backward of ``linear_policy_loss`` over 30,000 tokens at the embedded default's shape (H = 128, V = 103) took 1.16 s
in blocks of 32 rows and 0.49 s in blocks of bytes (``benchmarks/cpu_lm_head.py --tokens 30000 --hidden 128 --vocab
103``, one thread, benchmarks/RESULTS.md)."""


def _torch_block_rows(vocab: int, dtype: torch.dtype) -> int:
    """Rows per block of the PyTorch path: as many as fit ``_TORCH_BLOCK_BYTES`` in ``dtype``, at least one."""
    return max(1, _TORCH_BLOCK_BYTES // (vocab * dtype.itemsize))


def token_logprobs_forward_torch(logits, ids, *, inv_temperature, logp, lse, entropy):
    """Same contract as ``token_logprobs_forward``, in PyTorch ops: the path without Triton (the CPU's) of the
    lm_head ops. The kernels' closed forms, a block of rows at a time (``_TORCH_BLOCK_BYTES``) and no autograd
    graph: going through ``token_logprobs_reference``'s autograd held about seven temporaries the size of the whole
    chunk and took as long as the chunk's three matmuls at a 152K vocabulary."""
    dtype = _common.compute_dtype(logits.dtype)
    block = _torch_block_rows(logits.shape[1], dtype)
    for start in range(0, logits.shape[0], block):
        rows = slice(start, start + block)
        log_p = logits[rows].to(dtype) * inv_temperature  # (B, V), a new tensor
        row_lse = torch.logsumexp(log_p, dim=-1, keepdim=True)  # (B, 1)
        log_p -= row_lse  # log p
        lse[rows] = row_lse.squeeze(1)
        logp[rows] = log_p.gather(1, ids[rows].long().unsqueeze(1)).squeeze(1)
        if entropy is not None:
            _clamp_log_p(log_p)
            entropy[rows] = _neg_sum_p_log_p(log_p.exp(), log_p).clamp_(min=0.0)


def token_logprobs_backward_torch(logits, ids, *, inv_temperature, lse, entropy, grad_logp, grad_entropy, grad_logits):
    """Same contract as ``token_logprobs_backward`` (``grad_logits`` may be ``logits`` itself), in PyTorch ops,
    a block of rows at a time: ``inv_temperature * (g_logp * (onehot - p) - g_ent * p * (log p + H))``."""
    dtype = _common.compute_dtype(logits.dtype)
    block = _torch_block_rows(logits.shape[1], dtype)
    for start in range(0, logits.shape[0], block):
        rows = slice(start, start + block)
        out = grad_logits[rows]
        in_place = out.dtype == dtype and out.data_ptr() == logits[rows].data_ptr()
        d = out if in_place else logits[rows].to(dtype, copy=True)  # (B, V)
        d *= inv_temperature
        # float64 (the tests' truth) recomputes its log-sum-exp and entropy rather than use the float32 ones the
        # forward stored
        row_lse = torch.logsumexp(d, -1, keepdim=True) if dtype == torch.float64 else lse[rows, None].to(dtype)
        d -= row_lse  # log p
        _clamp_log_p(d)
        p = d.exp()  # (B, V)
        # d <- g_ent * (p log p + p H) + g_logp * p, then negated; every product has p as a factor, so a -inf logit
        # (p = 0, log p clamped finite) contributes 0 rather than 0 * -inf
        if grad_entropy is not None:
            row_h = _neg_sum_p_log_p(p, d)[:, None] if dtype == torch.float64 else entropy[rows, None].to(dtype)
            d *= p
            d.addcmul_(p, row_h)
            d *= grad_entropy[rows, None].to(dtype)
        else:
            d.zero_()
        if grad_logp is not None:
            g = grad_logp[rows, None].to(dtype)  # (B, 1)
            d.addcmul_(p, g)
            d.neg_()
            d.scatter_add_(1, ids[rows].long().unsqueeze(1), g)  # + g_logp at the chosen id: the one-hot term
        else:
            d.neg_()
        d *= inv_temperature
        if not in_place:
            out.copy_(d)


def _clamp_log_p(log_p: torch.Tensor) -> None:
    """A -inf logit's log p to the dtype's lowest finite value, in place: p = exp(it) is still exactly 0, and
    0 times it is 0 where 0 * -inf would be NaN (the kernels' ``tl.where(p > 0, ...)``)."""
    log_p.clamp_(min=torch.finfo(log_p.dtype).min)


def _neg_sum_p_log_p(p: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """-sum_v p log p per row (B,): ``sum``'s cascade summation, whose error does not grow with V as a running
    dot product's does (one (B, V) temporary, a block's)."""
    return (p * log_p).sum(-1).neg_()


def launchers(use_triton: bool) -> tuple[Callable[..., None], Callable[..., None]]:
    """The (forward, backward) pair of one path: the Triton kernels' launchers, or the PyTorch path's."""
    if use_triton:
        return token_logprobs_forward, token_logprobs_backward
    return token_logprobs_forward_torch, token_logprobs_backward_torch


class TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, with_entropy, inplace_backward, use_triton):
        N = logits.shape[0]
        device = logits.device
        logp = _common.new_empty(N, dtype=torch.float32, device=device)
        lse = _common.new_empty(N, dtype=torch.float32, device=device)
        entropy = _common.new_empty(N, dtype=torch.float32, device=device) if with_entropy else None
        forward, ctx.launch_backward = launchers(use_triton)
        forward(logits, ids, inv_temperature=1.0 / temperature, logp=logp, lse=lse, entropy=entropy)
        ctx.save_for_backward(logits, ids, lse, entropy)
        ctx.inv_temperature = 1.0 / temperature
        ctx.inplace_backward = inplace_backward
        ctx.set_materialize_grads(False)  # an output nobody used arrives as None and its work is skipped
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        logits, ids, lse, entropy = ctx.saved_tensors
        if grad_logp is None and grad_entropy is None:
            return None, None, None, None, None, None
        grad_logits = logits if ctx.inplace_backward else torch.empty_like(logits)
        ctx.launch_backward(
            logits,
            ids,
            inv_temperature=ctx.inv_temperature,
            lse=lse,
            entropy=entropy,
            grad_logp=grad_logp.contiguous() if grad_logp is not None else None,
            grad_entropy=grad_entropy.contiguous() if grad_entropy is not None else None,
            grad_logits=grad_logits,
        )
        return grad_logits, None, None, None, None, None


def check_logprob_inputs(logits: torch.Tensor, ids: torch.Tensor, temperature: float, name: str = "logits") -> None:
    if logits.dim() != 2:
        raise ValueError(f"{name} must be 2-D (N, V), got shape {tuple(logits.shape)}")
    _common.check_dtype(name, logits, _common.FLOAT_DTYPES)
    _common.check_1d("ids", ids, logits.shape[0])
    _common.check_dtype("ids", ids, _common.INDEX_DTYPES)
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature}")


def token_logprobs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    inplace_backward: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / temperature)[ids]`` per row, and the softmax entropy when ``with_entropy``.

    logits: (N, V) float16/bfloat16/float32/float64, any row stride; ids: (N,) int32/int64 in [0, V) (an id
    outside gives NaN on the Triton path, an error on the PyTorch path). Returns float32 ``logp`` (N,), or
    ``(logp, entropy)``. Differentiable w.r.t. ``logits`` through both. ``inplace_backward=True`` writes the
    gradient over ``logits``: use it when nothing else needs the logits after this op's backward, which then also
    cannot run twice (no ``retain_graph``).
    """
    check_logprob_inputs(logits, ids, temperature)
    _common.check_same_device(logits=logits, ids=ids)
    use_triton = _common.use_triton(logits, ids)
    if use_triton and logits.stride(-1) != 1:
        logits = logits.contiguous()
    return TokenLogprobsFunction.apply(
        logits, ids.contiguous(), temperature, with_entropy, inplace_backward, use_triton
    )
