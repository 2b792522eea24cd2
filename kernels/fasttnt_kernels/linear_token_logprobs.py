"""Token log-probabilities through the lm_head without materialising the N x V logits.

    linear_token_logprobs(hidden, weight, ids) == token_logprobs(hidden @ weight.T, ids)

Rows are processed in chunks: each chunk's logits (chunk x V, in the matmul's dtype, exactly what the lm_head
would produce) live only while that chunk is processed. The backward recomputes a chunk's logits, turns them
into their gradient in place, and feeds two matmuls; so peak extra memory is one chunk of logits, and the cost
is one extra matmul of N x H x V. The weight's gradient accumulates over the chunks in float32 and is rounded to
the weight's dtype once, as ``linear_policy_loss``'s (``_lm_head.LmHeadGrads``, which says why): exact chunk sums
for float32 weights, one rounding for 16-bit ones, at the cost of a float32 V x H buffer for those.

Under ``torch.autocast`` the matmuls run in the autocast dtype, in the forward and in the recomputation alike,
so the backward sees the very logits the forward normalised.
"""

from __future__ import annotations

import torch

from . import _common
from ._lm_head import LmHeadGrads, LmHeadPlan, check_lm_head_inputs, chunks, matmul_dtype
from .token_logprobs import token_logprobs_reference


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


class LinearTokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, plan: LmHeadPlan, with_entropy: bool):
        N = hidden.shape[0]
        device = hidden.device
        logp = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        lse = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        entropy = _common.new_empty(N, dtype=torch.float32, device=device) if with_entropy else None
        w = weight.to(matmul_dtype(hidden))  # (V, H): a copy only under autocast, as autocast's own matmul would make
        for rows, _h, logits in chunks(hidden, w, plan.chunk_rows):
            plan.logprobs_forward(
                logits,
                ids[rows],
                inv_temperature=1.0 / plan.temperature,
                logp=logp[rows],
                lse=lse[rows],
                entropy=entropy[rows] if entropy is not None else None,
            )
            del logits
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.matmul_dtype = w.dtype
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return (logp, entropy) if with_entropy else logp

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy=None):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (grad_logp is None and grad_entropy is None) or not (need_hidden or need_weight):
            return None, None, None, None, None
        plan = ctx.plan
        w = weight.to(ctx.matmul_dtype)  # (V, H)
        grads = LmHeadGrads(hidden, weight, need_hidden=need_hidden, need_weight=need_weight)
        for rows, h, logits in chunks(hidden, w, plan.chunk_rows):  # recomputed, bit-identical to the forward's
            plan.logprobs_backward(
                logits,
                ids[rows],
                inv_temperature=1.0 / plan.temperature,
                lse=lse[rows],
                entropy=entropy[rows] if entropy is not None else None,
                grad_logp=grad_logp[rows].contiguous() if grad_logp is not None else None,
                grad_entropy=grad_entropy[rows].contiguous() if grad_entropy is not None else None,
                grad_logits=logits,  # in place: the chunk's logits become its gradient
            )
            grads.add(rows, logits, h, w)
            del logits
        return *grads.result(), None, None, None


def linear_token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk_bytes: int | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token log-probs (and entropy) of ``hidden @ weight.T`` with the logits never materialised in full.

    hidden: (N, H), weight: (V, H) of one float dtype; ids: (N,) int32/int64. Returns float32 ``logp`` (N,) or
    ``(logp, entropy)``, differentiable w.r.t. ``hidden`` and ``weight``. At most ``chunk_bytes`` of logits
    exist at once (None: 512 MiB on CUDA, 256 MiB elsewhere). On CUDA (or ``FASTTNT_KERNELS=triton``) each chunk
    runs the Triton kernels; elsewhere ``token_logprobs``' PyTorch path, with the same chunking, so the memory bound
    holds on the CPU too.
    """
    _common.check_same_device(hidden=hidden, weight=weight, ids=ids)
    chunk_rows = check_lm_head_inputs(hidden, weight, ids, temperature, chunk_bytes)
    plan = LmHeadPlan(chunk_rows, _common.use_triton(hidden, weight, ids), temperature)
    return LinearTokenLogprobsFunction.apply(hidden, weight, ids.contiguous(), plan, with_entropy)
