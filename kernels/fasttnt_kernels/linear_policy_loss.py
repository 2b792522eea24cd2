"""The clipped policy loss straight from the last hidden states: lm_head, log-probs, loss and its gradient in one
chunked pass, in three matmuls per chunk.

    linear_policy_loss(hidden, weight, ids, inputs, config=config)
        == clipped_policy_loss(logp, old_logp, advantages, cu_seqlens, ...) - config.entropy_coef * sum(entropy) / T
    with logp, entropy = linear_token_logprobs(hidden, weight, ids, with_entropy=True)

where ``inputs`` (``PolicyLossInputs``) holds clipped_policy_loss's tensors and normalisers, ``config``
(``PolicyLossConfig``) its settings, and T is ``total_tokens`` (N by default): a token-mean entropy bonus over the
same tokens as the loss's normaliser. ``old_logp=None`` means on-policy (old = the current log-probs, detached).

Why the gradient is formed in the forward: every term of the loss is per token once the normalisers are known
(they are inputs), so dloss/dlogp_t and dloss/dentropy_t are known as soon as a chunk's logits are. Each chunk
then runs one matmul for its logits, turns them into their gradient in place, and two matmuls for the gradients
of the hidden states and of the weight (``_lm_head``, shared with ``linear_token_logprobs``; the weight's
accumulates in float32). The composition above spends four: its backward recomputes the logits. The same order as
Liger-Kernel's fused linear losses (``liger_kernel/chunked_loss``).

GSPO and VESPO (``policy_loss="gspo"``, ``"vespo"``), and CISPO or SAPO at ``ratio_level="sequence"``, off-policy
are the exception: a token's gradient needs its sequence's log-ratio, so one pass of logits computes every log-prob
first (four matmuls per chunk). The rollout correction (``rollout_logp``) on-policy forms each token's weight from
its own log-prob in its chunk; a sequence mode, or VESPO, takes the same first pass.

The gradients are kept from the forward and scaled in place by the upstream gradient in the backward, so the
backward holds no logits and reads no weight (under ZeRO-3 the weight need not be gathered again), and runs once
(no ``retain_graph``). The cost: the (N, H) hidden-state gradient and a float32 (V, H) weight gradient live from
the forward to the backward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from . import _common
from ._lm_head import LmHeadGrads, LmHeadPlan, check_lm_head_inputs, chunks, matmul_dtype
from ._policy_loss import PolicyLossConfig, PolicyLossInputs, resolve, sequence_log_ratios
from .clipped_policy_loss import STAT_NAMES, TokenTerms, clipped_policy_loss_reference
from .linear_token_logprobs import linear_token_logprobs_reference
from .rollout_correction_weights import rollout_correction_weights_reference, token_correction_weights

LINEAR_STAT_NAMES = (*STAT_NAMES, "entropy")
"""``clipped_policy_loss``'s statistics and the token-mean entropy (over the N tokens given)."""


def linear_policy_loss_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    inputs: PolicyLossInputs | None = None,
    *,
    config: PolicyLossConfig | None = None,
    temperature: float = 1.0,
    **fields: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The semantics: materialise the logits and compose the two references (arguments as ``linear_policy_loss``'s)."""
    x, config = resolve("linear_policy_loss_reference", inputs, config, fields)
    logp, entropy = linear_token_logprobs_reference(hidden, weight, ids, temperature=temperature, with_entropy=True)
    old = logp.detach() if x.old_logp is None else x.old_logp
    if x.rollout_logp is not None and x.rollout_correction != "none":  # the proximal log-probs against the engine's
        weights, _ = rollout_correction_weights_reference(
            old.detach(), x.rollout_logp, x.cu_seqlens, mode=x.rollout_correction, cap=x.rollout_correction_cap
        )
        x = dataclasses.replace(x, is_weights=weights if x.is_weights is None else weights * x.is_weights)
    loss, stats = clipped_policy_loss_reference(
        logp,
        old,
        x.advantages,
        x.cu_seqlens,
        config=config,
        ref_logp=x.ref_logp,
        is_weights=x.is_weights,
        total_tokens=x.total_tokens,
        total_seqs=x.total_seqs,
        first_advantages=x.first_advantages,
        token_mask=x.token_mask,
    )
    n = hidden.shape[0]
    loss = loss - config.entropy_coef * entropy.sum() / max(x.tokens(n), 1e-30)
    stats["entropy"] = entropy.detach().sum() / max(n, 1)
    return loss, stats


def _first_pass_logprobs(hidden, w, ids, plan: LmHeadPlan) -> torch.Tensor:
    """Every token's log-probs (N,) float32 from one pass of logits (a fourth matmul per chunk), the same chunks and
    kernels as the loss's pass, so the same log-probs."""
    N = hidden.shape[0]
    logp = _common.new_empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
    lse = _common.new_empty(N, dtype=torch.float32, device=hidden.device)  # (N,) written, unread
    for rows, _, logits in chunks(hidden, w, plan.chunk_rows):
        plan.logprobs_forward(logits, ids[rows], inv_temperature=1.0 / plan.temperature, logp=logp[rows],
                              lse=lse[rows], entropy=None)  # fmt: skip
        del logits
    return logp


def _rollout_weights(hidden, w, ids, inputs: PolicyLossInputs, config: PolicyLossConfig, plan: LmHeadPlan):
    """The rollout correction's weights (``PolicyLossInputs.rollout_logp``): folded into ``is_weights`` before the
    pass where they can be, or left to each chunk (True). With old log-probs they are known now; on-policy a token
    mode's weight needs its own log-prob alone, formed in its chunk; a sequence mode's needs every token of its
    sequence, and VESPO's sequence weights need every token's weight, so one pass of logits first
    (``_first_pass_logprobs``). Returns ``(inputs, per_chunk)``."""
    if inputs.rollout_logp is None or inputs.rollout_correction == "none":
        return inputs, False
    if inputs.old_logp is None and inputs.rollout_correction.startswith("token") and config.policy_loss != "vespo":
        return inputs, True
    proximal = inputs.old_logp if inputs.old_logp is not None else _first_pass_logprobs(hidden, w, ids, plan)
    weights, _ = rollout_correction_weights_reference(
        proximal, inputs.rollout_logp, inputs.cu_seqlens, mode=inputs.rollout_correction,
        cap=inputs.rollout_correction_cap,
    )  # fmt: skip
    is_weights = weights if inputs.is_weights is None else weights * inputs.is_weights
    return dataclasses.replace(inputs, is_weights=is_weights), False


def _sequence_log_ratios(hidden, w, ids, inputs: PolicyLossInputs, config: PolicyLossConfig, plan: LmHeadPlan):
    """The sequence log-ratios (S,) of a loss that reads them (``sequence_log_ratios``), or None. A token's
    gradient needs its sequence's log-ratio, which needs every token of the sequence, and a sequence may span
    chunks: off-policy, one pass of logits first (``_first_pass_logprobs``). On-policy every token's log-ratio is 0:
    no pass."""
    if not config.per_sequence:
        return None
    N = hidden.shape[0]
    if inputs.old_logp is None:
        logp = torch.zeros(N, dtype=torch.float32, device=hidden.device)  # (N,)
    else:
        logp = _first_pass_logprobs(hidden, w, ids, plan)
    return sequence_log_ratios(config, logp, inputs.old_logp, inputs.cu_seqlens, inputs.is_weights)


class LinearPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, inputs: PolicyLossInputs, config: PolicyLossConfig, plan: LmHeadPlan, needs):
        need_hidden, need_weight = needs  # which gradients to form (grad mode on and the input requires one)
        N = hidden.shape[0]
        device = hidden.device
        w = weight.to(matmul_dtype(hidden))  # (V, H): a copy only under autocast, as autocast's own matmul would make
        inputs, correct_per_chunk = _rollout_weights(hidden, w, ids, inputs, config, plan)
        seq_log_ratio = _sequence_log_ratios(hidden, w, ids, inputs, config, plan)
        terms = TokenTerms(inputs, config, N, use_triton=plan.use_triton, seq_log_ratio=seq_log_ratio)
        tokens = inputs.tokens(N)
        grad_entropy_value = -config.entropy_coef / tokens if tokens > 0 else 0.0  # d(loss)/d(entropy_t), every token
        compute_grad = need_hidden or need_weight
        grads = LmHeadGrads(hidden, weight, need_hidden=need_hidden, need_weight=need_weight)
        logp = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        lse = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        entropy = _common.new_empty(N, dtype=torch.float32, device=device)  # (N,)
        grad_logp = _common.new_empty(N, dtype=torch.float32, device=device) if compute_grad else None  # (N,)
        sums = torch.zeros(1 + len(STAT_NAMES), dtype=torch.float32, device=device)
        inv_temperature = 1.0 / plan.temperature
        for rows, h, logits in chunks(hidden, w, plan.chunk_rows):  # matmul 1: the only logits alive at any time
            plan.logprobs_forward(
                logits,
                ids[rows],
                inv_temperature=inv_temperature,
                logp=logp[rows],
                lse=lse[rows],
                entropy=entropy[rows],
            )
            g = grad_logp[rows] if grad_logp is not None else None
            correction = None
            if correct_per_chunk:  # a token mode on-policy: each weight from the token's own log-prob
                correction = token_correction_weights(
                    logp[rows],
                    inputs.rollout_logp[rows],
                    mode=inputs.rollout_correction,
                    cap=inputs.rollout_correction_cap,
                )
            sums += terms(rows, logp[rows], g, correction)
            if compute_grad:
                g_entropy = torch.full_like(g, grad_entropy_value) if grad_entropy_value != 0.0 else None
                plan.logprobs_backward(
                    logits,
                    ids[rows],
                    inv_temperature=inv_temperature,
                    lse=lse[rows],
                    entropy=entropy[rows],
                    grad_logp=g,
                    grad_entropy=g_entropy,
                    grad_logits=logits,
                )
                grads.add(rows, logits, h, w)  # logits now holds dloss/dlogits (C, V): matmuls 2 and 3
            del logits
        entropy_sum = entropy.sum()
        loss = sums[0] - config.entropy_coef * entropy_sum / max(tokens, 1e-30)
        stats = torch.cat([sums[1:], entropy_sum[None]]) / max(N, 1)  # (len(LINEAR_STAT_NAMES),)
        ctx.save_for_backward(*grads.result())
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
        return grad_hidden, grad_weight, None, None, None, None, None


def linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    ids: torch.Tensor,
    inputs: PolicyLossInputs | None = None,
    *,
    config: PolicyLossConfig | None = None,
    temperature: float = 1.0,
    chunk_bytes: int | None = None,
    return_logp: bool = False,
    **fields: Any,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """The clipped policy loss (and a token-mean entropy bonus) of ``hidden @ weight.T``; returns ``(loss, stats)``.

    hidden: (N, H), weight: (V, H) of one float dtype; ids: (N,) the sampled tokens. ``inputs``: the loss's
    tensors and normalisers (``PolicyLossInputs``: advantages (S,), cu_seqlens (S+1,), old_logp (N,) or None for
    on-policy, ...), ``config``: its settings (``PolicyLossConfig``, its defaults when None), entropy_coef
    included. In place of either object its fields may be given by name (``old_logp=..., advantages=...,
    cu_seqlens=..., clip_high=0.28``), ``clipped_policy_loss``'s keyword form. The loss is a float32 scalar,
    differentiable w.r.t. ``hidden`` and ``weight``; ``stats`` maps ``LINEAR_STAT_NAMES`` to float32 scalars on the
    device (no host sync). ``return_logp``: also return the tokens' log-probs (N,) float32, detached (for
    diagnostics such as the rollout engine's mismatch). At most ``chunk_bytes`` of logits exist at once (None: 512
    MiB on CUDA, 256 MiB elsewhere). On CUDA (or ``FASTTNT_KERNELS=triton``) each chunk runs the Triton kernels;
    elsewhere ``token_logprobs``' PyTorch path, with the same chunking.
    """
    inputs, config = resolve("linear_policy_loss", inputs, config, fields)
    chunk_rows = check_lm_head_inputs(hidden, weight, ids, temperature, chunk_bytes)
    tensors = inputs.check(hidden.shape[0], config)
    _common.check_same_device(hidden=hidden, weight=weight, ids=ids, **tensors)
    plan = LmHeadPlan(chunk_rows, _common.use_triton(hidden, weight, ids, *tensors.values()), temperature)
    grad_on = torch.is_grad_enabled()
    needs = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    loss, stats, logp = LinearPolicyLossFunction.apply(
        hidden, weight, ids.contiguous(), inputs.constants(torch.float32), config, plan, needs
    )
    stats = dict(zip(LINEAR_STAT_NAMES, stats.unbind(0), strict=True))
    return (loss, stats, logp) if return_logp else (loss, stats)
