"""Token log-probabilities through the lm_head without materialising the N x V logits.

    linear_token_logprobs(hidden, weight, ids) == token_logprobs(hidden @ weight.T, ids)

Rows are processed in chunks: each chunk's logits (chunk x V, in the matmul's dtype, exactly what the lm_head
would produce) live only while that chunk is processed. The backward recomputes a chunk's logits, turns them
into their gradient in place, and feeds two matmuls; so peak extra memory is one chunk of logits, and the cost
is one extra matmul of N x H x V. The weight's gradient accumulates over chunks in the weight's own dtype (no
V x H temporary): exact for float32 weights (autocast's usual master copy); for 16-bit weights it is rounded
once per chunk, as Liger-Kernel's fused linear cross-entropy does.

Under ``torch.autocast`` the matmuls run in the autocast dtype, in the forward and in the recomputation alike,
so the backward sees the very logits the forward normalised.
"""

from __future__ import annotations

import torch

from . import _common
from .token_logprobs import (
    check_logprob_inputs,
    token_logprobs_backward,
    token_logprobs_backward_reference,
    token_logprobs_forward,
    token_logprobs_forward_reference,
    token_logprobs_reference,
)

DEFAULT_CHUNK_BYTES = 512 * 2**20
"""Logits bytes per chunk: 512 MiB is ~1,700 rows of a bf16 152K vocabulary, enough rows to keep the matmul
efficient while the logits stay a small fraction of a GPU's memory."""


def linear_token_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The semantics: materialise ``hidden @ weight.T`` (in the input dtype) and take token log-probs."""
    return token_logprobs_reference(hidden @ weight.T, ids, temperature=temperature, with_entropy=with_entropy)


def chunk_rows_for(n_rows: int, vocab: int, itemsize: int, chunk_bytes: int) -> int:
    """Rows per chunk so that one chunk of logits fits ``chunk_bytes``; a multiple of 128 rows once above 128 (the
    matmul's tile height on tensor cores, so no chunk but the last runs a ragged tile)."""
    rows = max(1, chunk_bytes // max(1, vocab * itemsize))
    if rows >= 128:
        rows -= rows % 128
    return min(rows, max(1, n_rows))


def check_lm_head_inputs(hidden, weight, ids, temperature: float, chunk_bytes: int) -> int:
    """Check the inputs of an op over ``hidden @ weight.T``; returns the rows per chunk for ``chunk_bytes``."""
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"hidden must be (N, H) and weight (V, H) with one H; got {tuple(hidden.shape)} and {tuple(weight.shape)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden ({hidden.dtype}) and weight ({weight.dtype}) must share a dtype")
    check_logprob_inputs(hidden, ids, temperature, name="hidden")
    if chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
    itemsize = torch.empty((), dtype=_common.matmul_dtype(hidden)).element_size()
    return chunk_rows_for(hidden.shape[0], weight.shape[0], itemsize, chunk_bytes)


class LinearTokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, with_entropy, chunk_rows, use_triton):
        N = hidden.shape[0]
        device = hidden.device
        forward_chunk = token_logprobs_forward if use_triton else token_logprobs_forward_reference
        logp = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        lse = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        entropy = _common.new_empty(N, dtype=torch.float32, device=device) if with_entropy else None
        dtype = _common.matmul_dtype(hidden)
        w = weight.to(dtype)  # (V, H): a copy only under autocast, as autocast's own matmul would make
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            logits = _common.mm(hidden[rows].to(dtype), w.T)  # (C, V): the only logits alive at any time
            forward_chunk(
                logits,
                ids[rows],
                inv_temperature=1.0 / temperature,
                logp=logp[rows],
                lse=lse[rows],
                entropy=entropy[rows] if entropy is not None else None,
            )
            del logits
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.matmul_dtype = dtype
        ctx.inv_temperature = 1.0 / temperature
        ctx.chunk_rows = chunk_rows
        ctx.use_triton = use_triton
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None, None, None
        backward_chunk = token_logprobs_backward if ctx.use_triton else token_logprobs_backward_reference
        N = hidden.shape[0]
        chunk_rows = ctx.chunk_rows
        dtype = ctx.matmul_dtype
        w = weight.to(dtype)  # (V, H)
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device) if need_weight else None
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            h = hidden[rows].to(dtype)  # (C, H)
            logits = _common.mm(h, w.T)  # (C, V) recomputed, bit-identical to the forward's
            backward_chunk(
                logits,
                ids[rows],
                inv_temperature=ctx.inv_temperature,
                lse=lse[rows],
                entropy=entropy[rows] if entropy is not None else None,
                grad_logp=grad_logp[rows].contiguous() if grad_logp is not None else None,
                grad_entropy=grad_entropy[rows].contiguous() if grad_entropy is not None else None,
                grad_logits=logits,  # in place: the chunk's logits become its gradient
            )
            if need_hidden and dtype == hidden.dtype:
                _common.mm(logits, w, out=grad_hidden[rows])  # (C, H)
            elif need_hidden:
                grad_hidden[rows] = _common.mm(logits, w)
            if need_weight:
                if dtype == weight.dtype:
                    grad_weight.addmm_(logits.T, h)  # (V, H), accumulated in place
                else:  # autocast over float32 weights: a 16-bit product added to the float32 gradient
                    grad_weight += _common.mm(logits.T, h)
            del logits
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs (and entropy) of ``hidden @ weight.T`` with the logits never materialised in full.

    hidden: (N, H), weight: (V, H) of one float dtype; ids: (N,) int32/int64. Returns float32 ``logp`` (N,) or
    ``(logp, entropy)``, differentiable w.r.t. ``hidden`` and ``weight``. At most ``chunk_bytes`` of logits
    exist at once. On CUDA (or ``FASTTNT_KERNELS=triton``) each chunk runs the Triton kernels; elsewhere it runs
    the reference, with the same chunking, so the memory bound holds on the CPU too.
    """
    _common.check_same_device(hidden=hidden, weight=weight, ids=ids)
    chunk_rows = check_lm_head_inputs(hidden, weight, ids, temperature, chunk_bytes)
    use_triton = _common.use_triton(hidden, weight, ids)
    return LinearTokenLogprobsFunction.apply(
        hidden, weight, ids.contiguous(), temperature, with_entropy, chunk_rows, use_triton
    )
