"""The clipped policy loss straight from the last hidden states: lm_head, log-probs, loss and its gradient in one
chunked pass, in three matmuls per chunk.

    linear_policy_loss(hidden, weight, ids, old_logp, advantages, cu_seqlens, **kw)
        == clipped_policy_loss(logp, old_logp, advantages, cu_seqlens, **kw) - entropy_coef * sum(entropy) / T
    with logp, entropy = linear_token_logprobs(hidden, weight, ids, with_entropy=True)

where T is ``total_tokens`` (N by default): a token-mean entropy bonus over the same tokens as the loss's
normaliser. ``old_logp=None`` means on-policy (old = the current log-probs, detached).

Why the gradient is formed in the forward: every term of the loss is per token once the normalisers are known
(they are arguments), so dloss/dlogp_t and dloss/dentropy_t are known as soon as a chunk's logits are. Each chunk
then runs one matmul for its logits, turns them into their gradient in place, and two matmuls for the gradients
of the hidden states and of the weight. The composition above spends four: its backward recomputes the logits.
The same order as Liger-Kernel's fused linear losses (``liger_kernel/chunked_loss``); the weight gradient
accumulates in float32 when the matmuls run in 16 bits, as TRL 1.16's ``trl/kernels/chunked_logprob.py``
does (``torch.addmm(..., out_dtype=torch.float32)`` on CUDA): rounding each chunk's V x H product to bf16 before
summing drifts training (that file's comment reports entropy falling over a few dozen steps).

The gradients are kept from the forward and scaled in place by the upstream gradient in the backward, so the
backward holds no logits and reads no weight (under ZeRO-3 the weight need not be gathered again), and runs once
(no ``retain_graph``). The cost: the (N, H) hidden-state gradient and a float32 (V, H) weight gradient live from
the forward to the backward.
"""

from __future__ import annotations

import torch
from packaging.version import Version

from . import _common
from .clipped_policy_loss import (
    STAT_NAMES,
    Aggregation,
    PolicyLossConfig,
    check_policy_loss_inputs,
    clipped_policy_loss_reference,
    launch_token_terms,
    per_token_advantages,
    token_terms_reference,
)
from .linear_token_logprobs import DEFAULT_CHUNK_BYTES, check_lm_head_inputs, linear_token_logprobs_reference
from .token_logprobs import (
    token_logprobs_backward,
    token_logprobs_backward_reference,
    token_logprobs_forward,
    token_logprobs_forward_reference,
)

LINEAR_STAT_NAMES = (*STAT_NAMES, "entropy")
"""``clipped_policy_loss``'s statistics and the token-mean entropy (over the N tokens given)."""

_DEFAULT_CONFIG = PolicyLossConfig()

# torch.addmm(..., out_dtype=torch.float32) with 16-bit operands: CUDA only, from PyTorch 2.8
_MM_OUT_DTYPE = Version(torch.__version__.split("+")[0]) >= Version("2.8")


def linear_policy_loss_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy_coef: float = 0.0,
    config: PolicyLossConfig = _DEFAULT_CONFIG,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    first_advantages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The semantics: materialise the logits and compose the two references."""
    logp, entropy = linear_token_logprobs_reference(hidden, weight, ids, temperature=temperature, with_entropy=True)
    old = logp.detach() if old_logp is None else old_logp
    loss, stats = clipped_policy_loss_reference(
        logp,
        old,
        advantages,
        cu_seqlens,
        config=config,
        ref_logp=ref_logp,
        is_weights=is_weights,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        first_advantages=first_advantages,
    )
    n = hidden.shape[0]
    tokens = float(n if total_tokens is None else total_tokens)
    loss = loss - entropy_coef * entropy.sum() / max(tokens, 1e-30)
    stats["entropy"] = entropy.detach().sum() / max(n, 1)
    return loss, stats


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` float32 (or float64) and ``a``, ``b`` in the matmul dtype: no rounding of the
    product to 16 bits, and no (V, H) temporary where the device can write the float32 sum directly."""
    with torch.autocast(a.device.type, enabled=False):
        if a.dtype == acc.dtype:
            acc.addmm_(a, b)
        elif _MM_OUT_DTYPE and acc.is_cuda and acc.dtype == torch.float32:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        else:  # 16-bit operands elsewhere (the CPU has no out_dtype): upcast the (C, .) operands, not the product
            acc.addmm_(a.to(acc.dtype), b.to(acc.dtype))


def _chunk_terms_torch(logp, old, ref, is_w, a, seq_len, config, w_const, w_per_len, grad):
    """The chunk's policy-loss sums and dloss/dlogp through autograd of the reference (the CPU path)."""
    with torch.enable_grad():
        x = logp.detach().requires_grad_()
        loss_t, indicators = token_terms_reference(x, old, a, seq_len, config=config, ref_logp=ref, is_weights=is_w)
        weighted = (loss_t * (w_const + w_per_len / seq_len.to(loss_t.dtype))).sum()
        if grad is not None:
            (g,) = torch.autograd.grad(weighted, x)
            grad.copy_(g)
    sums = [weighted.detach()] + [indicators[name].sum() for name in STAT_NAMES]
    return torch.stack(sums).float()


class LinearPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden,
        weight,
        ids,
        old_logp,
        ref_logp,
        is_weights,
        advantages,
        cu_seqlens,
        config,
        temperature,
        entropy_coef,
        total_tokens,
        total_seqs,
        chunk_rows,
        use_triton,
        need_hidden,
        need_weight,
        first_advantages,
    ):
        N, S = hidden.shape[0], advantages.shape[0]
        device = hidden.device
        dtype = _common.matmul_dtype(hidden)
        w = weight.to(dtype)  # (V, H): a copy only under autocast, as autocast's own matmul would make
        w_const, w_per_len = _common.aggregation_weights(config.agg, config.norm_length, N, S, total_tokens, total_seqs)
        tokens = float(N if total_tokens is None else total_tokens)
        grad_entropy_value = -entropy_coef / tokens if tokens > 0 else 0.0  # d(loss)/d(entropy_t), every token
        if not use_triton:  # the reference's per-token view, made once for every chunk
            a_t, seq_len_t = per_token_advantages(advantages, cu_seqlens, N, first_advantages)  # (N,), (N,)
        compute_grad = need_hidden or need_weight
        grad_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if need_hidden else None  # (N, H)
        acc_dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
        grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=device) if need_weight else None  # (V, H)
        logp = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        lse = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        entropy = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        grad_logp = _common.new_empty(N, dtype=torch.float32, device=device) if compute_grad else None  # (N,)
        sums = torch.zeros(1 + len(STAT_NAMES), dtype=torch.float32, device=device)
        forward_chunk = token_logprobs_forward if use_triton else token_logprobs_forward_reference
        backward_chunk = token_logprobs_backward if use_triton else token_logprobs_backward_reference
        for start in range(0, N, chunk_rows):
            rows = slice(start, min(start + chunk_rows, N))
            h = hidden[rows].to(dtype)  # (C, H)
            logits = _common.mm(h, w.T)  # (C, V), matmul 1: the only logits alive at any time
            forward_chunk(
                logits,
                ids[rows],
                inv_temperature=1.0 / temperature,
                logp=logp[rows],
                lse=lse[rows],
                entropy=entropy[rows],
            )
            old = logp[rows] if old_logp is None else old_logp[rows]
            ref = ref_logp[rows] if ref_logp is not None else None
            is_w = is_weights[rows] if is_weights is not None else None
            g = grad_logp[rows] if grad_logp is not None else None
            if use_triton:
                sums += launch_token_terms(
                    logp[rows],
                    old,
                    ref,
                    is_w,
                    advantages,
                    cu_seqlens,
                    config,
                    w_const,
                    w_per_len,
                    grad=g,
                    token_offset=start,
                    first_advantages=first_advantages,
                )
            else:
                sums += _chunk_terms_torch(
                    logp[rows], old, ref, is_w, a_t[rows], seq_len_t[rows], config, w_const, w_per_len, g
                )
            if compute_grad:
                g_entropy = None
                if grad_entropy_value != 0.0:
                    g_entropy = torch.full_like(g, grad_entropy_value)
                backward_chunk(
                    logits,
                    ids[rows],
                    inv_temperature=1.0 / temperature,
                    lse=lse[rows],
                    entropy=entropy[rows],
                    grad_logp=g,
                    grad_entropy=g_entropy,
                    grad_logits=logits,
                )
                # logits now holds dloss/dlogits (C, V), in the matmul dtype
                if need_hidden and dtype == hidden.dtype:
                    _common.mm(logits, w, out=grad_hidden[rows])  # (C, H), matmul 2
                elif need_hidden:
                    grad_hidden[rows] = _common.mm(logits, w)
                if need_weight:
                    _accumulate(grad_weight, logits.T, h)  # (V, H) += (V, C) @ (C, H), matmul 3
            del logits
        entropy_sum = entropy.sum()
        loss = sums[0] - entropy_coef * entropy_sum / max(tokens, 1e-30)
        stats = torch.cat([sums[1:], entropy_sum[None]]) / max(N, 1)  # (len(LINEAR_STAT_NAMES),)
        if grad_weight is not None and grad_weight.dtype != weight.dtype:
            grad_weight = grad_weight.to(weight.dtype)  # 16-bit weights: rounded once, after the sum
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.mark_non_differentiable(stats, logp)
        return loss, stats, logp

    @staticmethod
    def backward(ctx, grad_loss, grad_stats, grad_logp):
        # scaled in place: no second (V, H) float32 tensor at the 1.5B/7B shapes (the graph runs backward once)
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss.to(grad_hidden.dtype))
        if grad_weight is not None:
            grad_weight.mul_(grad_loss.to(grad_weight.dtype))
        return grad_hidden, grad_weight, *([None] * 16)


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    old_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    temperature: float = 1.0,
    entropy_coef: float = 0.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    is_weights: torch.Tensor | None = None,
    agg: Aggregation = "token-mean",
    norm_length: float | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    return_logp: bool = False,
    first_advantages: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The clipped policy loss (and a token-mean entropy bonus) of ``hidden @ weight.T``; returns ``(loss, stats)``.

    hidden: (N, H), weight: (V, H) of one float dtype; ids: (N,) the sampled tokens; old_logp: (N,) or None
    (on-policy). The other arguments are ``clipped_policy_loss``'s, with its shapes and meaning. The loss is a
    float32 scalar, differentiable w.r.t. ``hidden`` and ``weight``; ``stats`` maps ``LINEAR_STAT_NAMES`` to float32
    scalars on the device (no host sync). ``return_logp``: also return the tokens' log-probs (N,) float32, detached
    (for diagnostics such as the rollout engine's mismatch). At most ``chunk_bytes`` of logits exist at once. On
    CUDA (or ``FASTTNT_KERNELS=triton``) each chunk runs the Triton kernels; elsewhere the references, with the same
    chunking.
    """
    chunk_rows = check_lm_head_inputs(hidden, weight, ids, temperature, chunk_bytes)
    N = hidden.shape[0]
    config = PolicyLossConfig(clip_low, clip_high, dual_clip, kl_coef, agg, norm_length)
    tensors = check_policy_loss_inputs(
        N,
        old_logp,
        advantages,
        cu_seqlens,
        ref_logp=ref_logp,
        kl_coef=kl_coef,
        is_weights=is_weights,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        first_advantages=first_advantages,
    )
    _common.check_same_device(hidden=hidden, weight=weight, ids=ids, **tensors)
    if not entropy_coef >= 0.0:
        raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef}")
    use_triton = _common.use_triton(hidden, weight, ids, *tensors.values())
    grad_on = torch.is_grad_enabled()
    loss, stats, logp = LinearPolicyLossFunction.apply(
        hidden,
        weight,
        ids.contiguous(),
        None if old_logp is None else old_logp.detach().float().contiguous(),
        None if ref_logp is None else ref_logp.detach().float().contiguous(),
        None if is_weights is None else is_weights.detach().float().contiguous(),
        advantages.detach().float().contiguous(),
        cu_seqlens.contiguous(),
        config,
        temperature,
        entropy_coef,
        total_tokens,
        total_seqs,
        chunk_rows,
        use_triton,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        None if first_advantages is None else first_advantages.detach().float().contiguous(),
    )
    stats = dict(zip(LINEAR_STAT_NAMES, stats.unbind(0), strict=True))
    return (loss, stats, logp) if return_logp else (loss, stats)
