"""Token-level clipped policy-gradient loss over packed sequences, forward and backward in one pass.

Sequence s owns tokens cu_seqlens[s]:cu_seqlens[s+1] and one advantage A_s (its first token A'_s instead, when
``first_advantages`` are given: the mode token of a hybrid response, ``mode_advantages``). Per token t of s:

    r_t  = exp(clamp(logp_t - old_logp_t, -20, 20))
    pg_t = -min(r_t A_s, clip(r_t, 1 - clip_low, 1 + clip_high) A_s)
    pg_t = min(pg_t, -dual_clip A_s)                            when dual_clip is set and A_s < 0
    pg_t = w_t pg_t                                             when is_weights w (N,) are given
    pg_t = m_t pg_t                                             when a token_mask m (N,) is given
    d_t  = clamp(ref_t - logp_t, -20, 20)
    k_t  = min(exp(d_t) - d_t - 1, kl_max)                      the k3 estimate, capped (kl_max None: not)
    l_t  = pg_t + kl_coef k_t                                   when ref_logp is given

and the loss is sum_t w_t l_t with the aggregation's weights:

    token-mean                w_t = 1 / total_tokens                  (total_tokens defaults to N)
    seq-mean-token-mean       w_t = 1 / (total_seqs * len_s)          (total_seqs defaults to S)
    seq-mean-token-sum-norm   w_t = 1 / (total_seqs * norm_length)    (Dr. GRPO)

``config.policy_loss`` picks the policy-gradient term pg_t in place of the clipped surrogate above (the ratio, the
weights, the KL term and the aggregation as above; verl's names and formulas, verl 0.9.1 ``core_algos``):

    gspo    pg_t the surrogate's, r_t = exp(sg(log s_s) + logp_t - sg(logp_t)): the value of the sequence's ratio,
            log s_s = mean over s of (logp - old_logp), clamped above at 10  (arXiv 2507.18071; verl's GSPO-token)
    cispo   pg_t = -sg(clip(r_t, 1 - clip_low, 1 + clip_high)) A_s logp_t     (MiniMax-M1, arXiv 2506.13585)
    sapo    pg_t = -(4 / tau) sigmoid(tau (r_t - 1)) A_s,  tau = sapo_tau_pos if A_s > 0 else sapo_tau_neg
                                                                              (arXiv 2511.20347)
    vespo   pg_t = -sg(phi_s) A_s logp_t,  phi_s = exp(lambda + k log w_s - lambda w_s)  (TRL 1.16's vespo)
            log w_s = clamp(sum over s of clamp(logp - old_logp, -20, 20) + clamp(log is_w, log 1e-8, 20),
                            log 1e-8, 20),  (k, lambda) = vespo_k_pos, vespo_lambda_pos if A_s >= 0, else _neg;
            a phi past float32's range is 0 (TRL's)

``ratio_level="sequence"`` gives CISPO's weight and SAPO's gate GSPO's r_t in place of the token's ratio (TRL 1.16's
``importance_sampling_level="sequence"`` with its cispo and sapo). CISPO's weight is a constant of the gradient (sg:
stop-gradient), so every token keeps a gradient, -w A_s, where the surrogate's clip zeroes it; TRL 1.16's ``cispo``
caps the weight above only, at ``epsilon_high``: clip_low = 1, clip_high = epsilon_high - 1 here. GSPO's token ratio
has the value of its sequence's and the gradient of the token's own log-prob (d r_t / d logp_t = r_t): under
seq-mean-token-mean that is the gradient of the sequence ratio itself, s_s / |s| per token, as TRL 1.16's
``importance_sampling_level="sequence"`` differentiates it, and under every aggregation equal to TRL's (its
token-summing losses count a sequence's one value on each of its tokens). VESPO's gamma weight of the sequence's
summed log-ratio is 1 on-policy and falls off on both sides, so stale sequences fade out rather than being clipped;
it is a constant of the gradient, as CISPO's weight, and the rollout weights ``is_weights`` enter w_s (as TRL's
``importance_sampling_ratio``), not each token's term. SAPO's gate is TRL 1.16's and verl 0.9.1's alike (verl also
forces the seq-mean-token-mean aggregation, TRL's ``sapo`` aggregates as its ``grpo``: the same; here ``agg``
decides).

The cap on k3 is verl's (its low_var_kl clamps the value at 10): a token whose reference log-prob is far above its
own (d = 20 is e^20 - 21 = 4.9e8) would otherwise outweigh the whole batch's loss, and its gradient
kl_coef (1 - e^d) every other token's; above the cap the term is a constant, as the surrogate's clip makes the
policy term one. TRL clamps neither d nor k3: its drop-in (``fasttnt.integrations.trl``) passes kl_max=None.

Both exponents are clamped to +-20 before ``exp`` (as verl does): unclamped, a log-ratio above ~88 is inf in
float32, and a zero advantage times inf is NaN in the loss and its gradient. Outside the clamp the gradient is
0, as ``torch.clamp``'s is. ``is_weights`` are constants of the update, e.g. the truncated importance weights
``rollout_correction_weights`` makes for samples drawn by another engine (vLLM) than the one that scores them.

The kernel writes dloss/dlogp_t beside the loss, so the backward is one multiply by the upstream gradient.
The statistics are token means: clip fractions (low: A < 0 and r < 1 - clip_low; high: A > 0 and
r > 1 + clip_high; for cispo, the weight clipped: r below its band, r above it; none for sapo; dual), the k3 estimate
of KL(old || new), the mean ratio and the mean k3 KL to the reference (capped as the loss's term).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from . import _common
from ._common import LOG_RATIO_CLAMP
from ._policy_loss import (
    GSPO_LOG_RATIO_MAX,
    VESPO_LOG_PHI_MAX,
    VESPO_LOG_W_MAX,
    VESPO_LOG_W_MIN,
    PolicyLossConfig,
    PolicyLossInputs,
    config_of,
    sequence_log_ratios,
    vespo_weights,
)

STAT_NAMES = ("clip_frac_low", "clip_frac_high", "dual_clip_frac", "approx_kl", "ratio_mean", "kl_ref")
# the partials buffer's columns: the loss first, then one per statistic
_N_PARTIALS = 1 + len(STAT_NAMES)
_BLOCK = 1024
_DEFAULT_CONFIG = PolicyLossConfig()
# the kernel's LOSS_MODE of each PolicyLossConfig.policy_loss
_LOSS_MODE = {"vanilla": 0, "cispo": 1, "sapo": 2, "gspo": 0, "vespo": 4}  # gspo: the surrogate, SEQ_RATIO


@triton.jit
def _clipped_policy_loss_kernel(
    # pointers
    logp_ptr,
    old_logp_ptr,
    ref_logp_ptr,
    is_weight_ptr,
    adv_ptr,
    first_adv_ptr,  # (S,) the advantage of each sequence's first token, read only when HAS_FIRST_ADV
    seq_log_ratio_ptr,  # (S,) the per-sequence log-ratio (sequence_log_ratios), read only with SEQ_RATIO or vespo
    cu_seqlens_ptr,
    grad_ptr,  # (N,) dloss/dlogp, written only when COMPUTE_GRAD
    partials_ptr,  # (num_blocks, N_PARTIALS): per-block sums, reduced by the caller in a fixed order
    # sizes
    N,
    S,
    n_search_steps,
    token_offset,  # the batch index of this launch's token 0 (a chunk of a longer batch; 0 otherwise)
    # scalars
    clip_low,
    clip_high,
    dual_clip,
    kl_coef,
    kl_max,  # inf when uncapped: k3 is finite (d is clamped), so min(k3, inf) = k3 and no 0 * inf arises
    sapo_tau_pos,
    sapo_tau_neg,
    vespo_k_pos,
    vespo_lambda_pos,
    vespo_k_neg,
    vespo_lambda_neg,
    vespo_log_phi_max,
    w_const,  # w_t = w_const + w_per_len / len_s covers all three aggregations
    w_per_len,
    log_ratio_clamp,
    gspo_log_ratio_max,
    # meta
    HAS_DUAL_CLIP: tl.constexpr,  # off, the bound has no value to compare with (an infinite one gives 0 * inf)
    HAS_REF: tl.constexpr,  # skips the read of ref_logp and the k3 term
    HAS_IS_WEIGHT: tl.constexpr,  # skips the read of the per-token weights
    HAS_FIRST_ADV: tl.constexpr,  # skips the read of the first tokens' advantages
    COMPUTE_GRAD: tl.constexpr,  # skips the gradient write when logp does not require grad (old/ref passes)
    LOSS_MODE: tl.constexpr,  # _LOSS_MODE: 0 the clipped surrogate, 1 cispo, 2 sapo, 4 vespo
    SEQ_RATIO: tl.constexpr,  # the terms read each sequence's ratio (gspo; cispo, sapo at ratio_level="sequence")
    N_PARTIALS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # reads 2-4 floats per token (+ a log2(S)-step search in the small cu_seqlens), writes 1
    pid = tl.program_id(0)
    t = pid * BLOCK + tl.arange(0, BLOCK)
    mask = t < N

    # the sequence owning token t: the largest s in [0, S) with cu_seqlens[s] <= t (empty sequences skip)
    t_batch = t + token_offset
    lo = tl.zeros([BLOCK], dtype=tl.int32)
    hi = tl.zeros([BLOCK], dtype=tl.int32) + (S - 1)
    for _ in range(n_search_steps):
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_seqlens_ptr + mid, mask=mask, other=0)
        go_right = start <= t_batch
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid - 1)
    seq = lo
    seq_start = tl.load(cu_seqlens_ptr + seq, mask=mask, other=0)
    seq_len = tl.load(cu_seqlens_ptr + seq + 1, mask=mask, other=1) - seq_start
    a = tl.load(adv_ptr + seq, mask=mask, other=0.0).to(tl.float32)
    if HAS_FIRST_ADV:
        first = mask & (t_batch == seq_start)
        a = tl.where(first, tl.load(first_adv_ptr + seq, mask=first, other=0.0).to(tl.float32), a)

    logp = tl.load(logp_ptr + t, mask=mask, other=0.0).to(tl.float32)
    old = tl.load(old_logp_ptr + t, mask=mask, other=0.0).to(tl.float32)
    raw_log_ratio = logp - old
    log_ratio = tl.minimum(tl.maximum(raw_log_ratio, -log_ratio_clamp), log_ratio_clamp)
    ratio_moves = (raw_log_ratio >= -log_ratio_clamp) & (raw_log_ratio <= log_ratio_clamp)  # d(clamp)/dx = 1
    ratio = tl.exp(log_ratio)  # the token's own (the statistics read it)
    r = ratio
    r_moves = ratio_moves
    if SEQ_RATIO:  # the sequence's ratio, through the token's own log-prob (d r / d logp = r)
        seq_log_ratio = tl.load(seq_log_ratio_ptr + seq, mask=mask, other=0.0)
        r = tl.exp(tl.minimum(seq_log_ratio, gspo_log_ratio_max))
        r_moves = seq_log_ratio <= gspo_log_ratio_max
    if LOSS_MODE == 1:  # cispo: the clipped weight is a constant, the gradient flows through logp alone
        clipped = tl.minimum(tl.maximum(r, 1.0 - clip_low), 1.0 + clip_high)
        pg = -clipped * a * logp
        dpg = -clipped * a
        low_binds = r < 1.0 - clip_low
        high_binds = r > 1.0 + clip_high
    elif LOSS_MODE == 2:  # sapo: the soft gate, its slope 4 s (1 - s) in r, times dr/dlogp = r inside the clamp
        tau = tl.where(a > 0.0, sapo_tau_pos, sapo_tau_neg)
        gate_s = tl.sigmoid(tau * (r - 1.0))
        pg = -gate_s * (4.0 / tau) * a
        dpg = tl.where(r_moves, -4.0 * gate_s * (1.0 - gate_s) * r * a, 0.0)
        low_binds = tl.zeros([BLOCK], dtype=tl.int1)
        high_binds = tl.zeros([BLOCK], dtype=tl.int1)
    elif LOSS_MODE == 4:  # vespo: the gamma weight of the sequence's log-weight, a constant, times -A logp
        log_w = tl.load(seq_log_ratio_ptr + seq, mask=mask, other=0.0)
        nonneg = a >= 0.0
        k = tl.where(nonneg, vespo_k_pos, vespo_k_neg)
        lam = tl.where(nonneg, vespo_lambda_pos, vespo_lambda_neg)
        log_phi = lam + k * log_w - lam * tl.exp(log_w)
        # past float32's range phi is 0, as TRL's; exp of the clamped value, so nothing overflows on the side
        phi = tl.where(log_phi > vespo_log_phi_max, 0.0, tl.exp(tl.minimum(log_phi, vespo_log_phi_max)))
        pg = -phi * a * logp
        dpg = -phi * a
        low_binds = tl.zeros([BLOCK], dtype=tl.int1)
        high_binds = tl.zeros([BLOCK], dtype=tl.int1)
    else:  # the clipped surrogate (gspo: of the sequence's ratio)
        pg_unclipped = -r * a
        pg_clipped = -tl.minimum(tl.maximum(r, 1.0 - clip_low), 1.0 + clip_high) * a
        # the clipped branch binds (and stops the gradient) exactly when it is the larger loss
        clip_binds = pg_clipped > pg_unclipped
        pg = tl.where(clip_binds, pg_clipped, pg_unclipped)
        dpg = tl.where(clip_binds | (r_moves == 0), 0.0, -r * a)  # dpg/dlogp
        low_binds = clip_binds & (a < 0.0)
        high_binds = clip_binds & (a > 0.0)
    dual_binds = tl.zeros([BLOCK], dtype=tl.int1)
    if HAS_DUAL_CLIP:
        dual_binds = (a < 0.0) & (pg > -dual_clip * a)
        pg = tl.where(dual_binds, -dual_clip * a, pg)
        dpg = tl.where(dual_binds, 0.0, dpg)
    if HAS_IS_WEIGHT:
        w_is = tl.load(is_weight_ptr + t, mask=mask, other=0.0).to(tl.float32)
        pg = w_is * pg
        dpg = w_is * dpg

    weight = w_const + w_per_len / seq_len.to(tl.float32)
    loss_t = pg
    kl_ref = tl.zeros([BLOCK], dtype=tl.float32)
    if HAS_REF:
        ref = tl.load(ref_logp_ptr + t, mask=mask, other=0.0).to(tl.float32)
        raw_d = ref - logp
        d = tl.minimum(tl.maximum(raw_d, -log_ratio_clamp), log_ratio_clamp)
        e = tl.exp(d)
        k3 = e - d - 1.0
        kl_ref = tl.minimum(k3, kl_max)
        loss_t += kl_coef * kl_ref
        d_moves = (raw_d >= -log_ratio_clamp) & (raw_d <= log_ratio_clamp) & (k3 <= kl_max)
        dpg += tl.where(d_moves, kl_coef * (1.0 - e), 0.0)  # d/dlogp of exp(d) - d - 1, d = ref - logp
    if COMPUTE_GRAD:
        tl.store(grad_ptr + t, weight * dpg, mask=mask)

    zero = tl.zeros([BLOCK], dtype=tl.float32)
    row = partials_ptr + pid * N_PARTIALS
    tl.store(row + 0, tl.sum(tl.where(mask, weight * loss_t, zero), axis=0))
    tl.store(row + 1, tl.sum(tl.where(mask & low_binds, 1.0, zero), axis=0))
    tl.store(row + 2, tl.sum(tl.where(mask & high_binds, 1.0, zero), axis=0))
    tl.store(row + 3, tl.sum(tl.where(mask & dual_binds, 1.0, zero), axis=0))
    # k3 estimate of KL(old || new) from samples of old: (r - 1) - log r
    tl.store(row + 4, tl.sum(tl.where(mask, ratio - 1.0 - log_ratio, zero), axis=0))
    tl.store(row + 5, tl.sum(tl.where(mask, ratio, zero), axis=0))
    tl.store(row + 6, tl.sum(tl.where(mask, kl_ref, zero), axis=0))


def clipped_policy_loss_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    config: PolicyLossConfig = _DEFAULT_CONFIG,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    first_advantages: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The semantics in plain differentiable PyTorch (float32, or float64 for float64 ``logp``); ``config``'s
    ``entropy_coef`` is not read (the entropy bonus is ``linear_policy_loss``'s)."""
    N = logp.shape[0]
    normalisers = PolicyLossInputs(advantages, cu_seqlens, total_tokens=total_tokens, total_seqs=total_seqs)
    w_const, w_per_len = normalisers.aggregation_weights(config, N)
    a, seq_len = per_token_advantages(advantages, cu_seqlens, N, first_advantages)
    seq_log_ratio = None
    if config.per_sequence:  # each token's sequence's log-ratio, in logp's own dtype, detached
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]
        seq = torch.repeat_interleave(torch.arange(len(lengths), device=logp.device), lengths, output_size=N)
        diff = (logp - old_logp.to(logp.dtype)).detach()
        if config.policy_loss == "vespo":  # the sum of clamped log-ratios and rollout log-weights, clamped
            diff = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            if is_weights is not None:
                diff = diff + is_weights.to(diff.dtype).log().clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
        sums = torch.zeros(len(lengths), dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff)
        if config.policy_loss != "vespo":  # the mean
            seq_log_ratio = (sums / lengths.clamp(min=1).to(diff.dtype))[seq]  # (N,)
        else:
            seq_log_ratio = sums.clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)[seq]  # (N,)
            is_weights = None  # in the sequence's weight, not each token's term
    loss_t, indicators = token_terms_reference(
        logp, old_logp, a, seq_len, config=config, ref_logp=ref_logp, is_weights=is_weights,
        seq_log_ratio=seq_log_ratio, token_mask=token_mask,
    )  # fmt: skip
    loss = (loss_t * (w_const + w_per_len / seq_len.to(loss_t.dtype))).sum()
    n = max(N, 1)
    stats = {name: value.sum() / n for name, value in indicators.items()}
    return loss, stats


def per_token_advantages(
    advantages: torch.Tensor, cu_seqlens: torch.Tensor, N: int, first_advantages: torch.Tensor | None = None
):
    """Each token's advantage (N,), its sequence's or, for a first token, ``first_advantages``' (S,) when given,
    and its sequence's length (N,), from the packed layout."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (S,)
    a = torch.repeat_interleave(advantages, lengths, output_size=N)  # (N,)
    if first_advantages is not None:
        nonempty = lengths > 0
        a = a.index_copy(0, cu_seqlens[:-1][nonempty].long(), first_advantages.to(a.dtype)[nonempty])
    seq_len = torch.repeat_interleave(lengths, lengths, output_size=N)  # (N,)
    return a, seq_len


def token_terms_reference(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    a: torch.Tensor,
    seq_len: torch.Tensor,
    *,
    config: PolicyLossConfig,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    seq_log_ratio: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per token: the unweighted loss l_t (differentiable w.r.t. ``logp``) and each statistic's summand, for
    tokens given with their sequence's advantage ``a`` (N,) (``per_token_advantages``) and, for GSPO and VESPO,
    their sequence's log-ratio ``seq_log_ratio`` (N,), a constant (VESPO's holds its rollout weights: then
    ``is_weights`` must be None). ``token_mask`` scales the policy-gradient term after every weight. ``seq_len``
    is unused here but keeps the signature of a chunk's view of the batch."""
    del seq_len
    if config.policy_loss == "vespo" and is_weights is not None:
        raise ValueError("policy_loss='vespo' takes the rollout weights in seq_log_ratio, not as is_weights")
    dtype = _common.compute_dtype(logp.dtype)
    a = a.to(dtype)
    logp = logp.to(dtype)
    log_ratio = torch.clamp(logp - old_logp.to(dtype), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # the token's own (the statistics read it)
    r = ratio
    if config.per_sequence and config.policy_loss != "vespo":  # the sequence's value, the token's own gradient
        log_r = seq_log_ratio.to(dtype).detach() + logp - logp.detach()
        r = torch.exp(torch.clamp(log_r, max=GSPO_LOG_RATIO_MAX))
    if config.policy_loss == "cispo":
        pg = -torch.clamp(r, 1.0 - config.clip_low, 1.0 + config.clip_high).detach() * a * logp
        low_binds, high_binds = r < 1.0 - config.clip_low, r > 1.0 + config.clip_high
    elif config.policy_loss == "sapo":
        tau = torch.where(a > 0, config.sapo_tau_pos, config.sapo_tau_neg).to(dtype)
        pg = -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * a
        low_binds = high_binds = torch.zeros_like(ratio, dtype=torch.bool)
    elif config.policy_loss == "vespo":
        pg = -vespo_weights(seq_log_ratio.to(dtype), a, config) * a * logp
        low_binds = high_binds = torch.zeros_like(ratio, dtype=torch.bool)
    else:  # the clipped surrogate (gspo: of the sequence's ratio, GSPO-token)
        pg_unclipped = -r * a
        pg_clipped = -torch.clamp(r, 1.0 - config.clip_low, 1.0 + config.clip_high) * a
        pg = torch.maximum(pg_unclipped, pg_clipped)
        clip_binds = pg_clipped > pg_unclipped
        low_binds, high_binds = clip_binds & (a < 0), clip_binds & (a > 0)
    dual_binds = torch.zeros_like(low_binds)
    if config.dual_clip is not None:
        dual_binds = (a < 0) & (pg > -config.dual_clip * a)
        pg = torch.where(a < 0, torch.minimum(pg, -config.dual_clip * a), pg)
    if is_weights is not None:
        pg = is_weights.to(dtype) * pg
    if token_mask is not None:
        pg = token_mask.to(dtype) * pg
    loss_t = pg
    kl_ref = torch.zeros_like(pg)
    if ref_logp is not None:
        d = torch.clamp(ref_logp.to(dtype) - logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl_ref = torch.exp(d) - d - 1.0
        if config.kl_max is not None:
            kl_ref = torch.clamp(kl_ref, max=config.kl_max)
        loss_t = loss_t + config.kl_coef * kl_ref
    with torch.no_grad():
        indicators = {
            "clip_frac_low": low_binds.to(dtype),
            "clip_frac_high": high_binds.to(dtype),
            "dual_clip_frac": dual_binds.to(dtype),
            "approx_kl": ratio - 1.0 - log_ratio,
            "ratio_mean": ratio,
            "kl_ref": kl_ref,
        }
    return loss_t, indicators


class TokenTerms:
    """The loss's per-token terms over one packed batch, a range of its tokens at a time: the range's weighted loss
    and statistic sums (N_PARTIALS,), with dloss/dlogp written into ``grad`` when given. The Triton kernel finds each
    token's sequence in the whole batch's ``cu_seqlens``; the reference path (autograd through
    ``token_terms_reference``, the CPU's) reads per-token advantages made here once. ``clipped_policy_loss`` runs
    it over all N tokens at once, ``linear_policy_loss`` over each chunk of rows as its log-probs are made.
    ``seq_log_ratio`` (S,): the sequences' log-ratios (``sequence_log_ratios``), needed with GSPO and VESPO; VESPO's
    hold the rollout weights, which its token terms then do not read."""

    def __init__(
        self,
        inputs: PolicyLossInputs,
        config: PolicyLossConfig,
        N: int,
        *,
        use_triton: bool,
        seq_log_ratio: torch.Tensor | None = None,
    ) -> None:
        if config.per_sequence != (seq_log_ratio is not None):
            raise ValueError("the sequences' log-ratios are taken by a loss that reads them (config.per_sequence) only")
        self.inputs, self.config, self.use_triton = inputs, config, use_triton
        self.seq_log_ratio = seq_log_ratio
        self.w_const, self.w_per_len = inputs.aggregation_weights(config, N)
        if not use_triton:  # the reference's per-token view of the batch, made once for every range
            x = inputs
            self.a_t, self.seq_len_t = per_token_advantages(x.advantages, x.cu_seqlens, N, x.first_advantages)
            self.seq_log_ratio_t = None
            if seq_log_ratio is not None:  # (N,) each token's sequence's
                lengths = x.cu_seqlens[1:] - x.cu_seqlens[:-1]
                self.seq_log_ratio_t = torch.repeat_interleave(seq_log_ratio, lengths, output_size=N)

    def __call__(
        self, rows: slice, logp: torch.Tensor, grad: torch.Tensor | None, weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The sums of tokens ``rows`` of the batch, whose log-probs are ``logp`` (n,); an on-policy loss (no
        ``old_logp``) takes ``logp`` as the old ones. ``weights`` (n,): the range's own per-token weights, times
        ``is_weights`` (a rollout correction formed from ``logp``, ``linear_policy_loss``)."""
        x = self.inputs
        old = logp if x.old_logp is None else x.old_logp[rows]
        ref = x.ref_logp[rows] if x.ref_logp is not None else None
        # VESPO's rollout weights are in its sequences' log-weights
        is_w = x.is_weights[rows] if x.is_weights is not None and self.config.policy_loss != "vespo" else None
        if weights is not None:
            is_w = weights if is_w is None else is_w * weights
        mask = x.token_mask[rows] if x.token_mask is not None else None
        if self.use_triton:  # one per-token factor: the kernel reads a single weight
            weight = is_w if mask is None else (mask if is_w is None else is_w * mask)
            return self._launch(rows.start, logp, old, ref, weight, grad)
        return self._autograd(rows, logp, old, ref, is_w, mask, grad)

    def _autograd(self, rows: slice, logp, old_logp, ref_logp, is_weights, token_mask, grad) -> torch.Tensor:
        """The reference's terms of tokens ``rows``, and dloss/dlogp through autograd."""
        seq_len = self.seq_len_t[rows]
        with torch.enable_grad():
            x = logp.detach().requires_grad_()
            seq_log_ratio = self.seq_log_ratio_t[rows] if self.seq_log_ratio_t is not None else None
            loss_t, indicators = token_terms_reference(
                x, old_logp, self.a_t[rows], seq_len, config=self.config, ref_logp=ref_logp, is_weights=is_weights,
                seq_log_ratio=seq_log_ratio, token_mask=token_mask,
            )  # fmt: skip
            weighted = (loss_t * (self.w_const + self.w_per_len / seq_len.to(loss_t.dtype))).sum()
            if grad is not None:
                (g,) = torch.autograd.grad(weighted, x)
                grad.copy_(g)
        sums = [weighted.detach()] + [indicators[name].sum() for name in STAT_NAMES]
        return torch.stack(sums).float()

    def _launch(self, token_offset: int, logp, old_logp, ref_logp, is_weights, grad) -> torch.Tensor:
        """The kernel over the n tokens ``token_offset ..`` of the batch (``logp`` and the other per-token tensors
        are those n tokens')."""
        x, config = self.inputs, self.config
        n, S = logp.shape[0], x.advantages.shape[0]
        num_blocks = max(1, triton.cdiv(n, _BLOCK))
        partials = _common.new_empty((num_blocks, _N_PARTIALS), dtype=torch.float32, device=logp.device)
        if n == 0 or S == 0:
            partials.zero_()
            if grad is not None:
                grad.zero_()
        else:
            _clipped_policy_loss_kernel[(num_blocks,)](
                logp,
                old_logp,
                ref_logp if ref_logp is not None else logp,
                is_weights if is_weights is not None else logp,
                x.advantages,
                x.first_advantages if x.first_advantages is not None else x.advantages,
                self.seq_log_ratio if self.seq_log_ratio is not None else x.advantages,
                x.cu_seqlens,
                grad if grad is not None else partials,
                partials,
                n,
                S,
                max(1, math.ceil(math.log2(S)) + 1),
                token_offset,
                config.clip_low,
                config.clip_high,
                config.dual_clip if config.dual_clip is not None else 0.0,
                config.kl_coef,
                config.kl_max if config.kl_max is not None else math.inf,
                config.sapo_tau_pos,
                config.sapo_tau_neg,
                config.vespo_k_pos,
                config.vespo_lambda_pos,
                config.vespo_k_neg,
                config.vespo_lambda_neg,
                VESPO_LOG_PHI_MAX,
                self.w_const,
                self.w_per_len,
                LOG_RATIO_CLAMP,
                GSPO_LOG_RATIO_MAX,
                HAS_DUAL_CLIP=config.dual_clip is not None,
                HAS_REF=ref_logp is not None,
                HAS_IS_WEIGHT=is_weights is not None,
                HAS_FIRST_ADV=x.first_advantages is not None,
                COMPUTE_GRAD=grad is not None,
                LOSS_MODE=_LOSS_MODE[config.policy_loss],
                SEQ_RATIO=config.per_sequence and config.policy_loss != "vespo",
                N_PARTIALS=_N_PARTIALS,
                BLOCK=_BLOCK,
            )
        return partials.sum(dim=0)  # (N_PARTIALS,): a fixed-order reduction, so the loss is deterministic


class ClippedPolicyLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logp, inputs: PolicyLossInputs, config: PolicyLossConfig):
        N = logp.shape[0]
        grad = _common.new_empty(N, dtype=torch.float32, device=logp.device) if logp.requires_grad else None  # (N,)
        # GSPO and VESPO: the whole batch's log-probs are here, the sequences' log-ratios first (S,); else None
        seq_log_ratio = sequence_log_ratios(config, logp, inputs.old_logp, inputs.cu_seqlens, inputs.is_weights)
        sums = TokenTerms(inputs, config, N, use_triton=True, seq_log_ratio=seq_log_ratio)(slice(0, N), logp, grad)
        ctx.save_for_backward(grad)
        ctx.logp_dtype = logp.dtype
        stats = sums[1:] / max(N, 1)
        ctx.mark_non_differentiable(stats)
        return sums[0], stats

    @staticmethod
    def backward(ctx, grad_loss, grad_stats):
        (grad,) = ctx.saved_tensors
        grad_logp = (grad * grad_loss).to(ctx.logp_dtype) if grad is not None else None
        return grad_logp, None, None


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    config: PolicyLossConfig | None = None,
    ref_logp: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    first_advantages: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    **settings: float | str | None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level clipped policy-gradient loss of packed sequences; returns ``(loss, stats)``.

    logp, old_logp, ref_logp: (N,) float; advantages: (S,) float; cu_seqlens: (S+1,) int32/int64, starting at 0
    and ending at N. ``config``: the hyper-parameters (``PolicyLossConfig()``'s defaults when None), or their
    fields as keywords in its place (``clip_high=0.28, kl_coef=0.05``); its ``entropy_coef`` must be 0 here (the
    bonus needs entropies: ``linear_policy_loss``). The loss is a float32 scalar, differentiable w.r.t. ``logp``
    only (the others are constants of the update). ``is_weights`` (N,) float, optional: a per-token weight of the
    policy-gradient term (not of the KL term), e.g. ``rollout_correction_weights``. ``stats`` maps the names in
    ``STAT_NAMES`` to float32 scalars on the device (no host sync). ``total_tokens``/``total_seqs`` replace N/S as
    the normalisers, for a loss split into micro-batches or across ranks whose sum must equal the whole batch's
    mean. ``first_advantages`` (S,) float, optional: the advantage of each sequence's first token in place of its
    sequence's (``mode_advantages``' mode-token advantage). ``token_mask`` (N,) float, optional: a per-token factor of
    the policy-gradient term after ``is_weights``, which no sequence weight reads (VESPO's neither), e.g. TRL's mask
    of the tokens of highest entropy.
    """
    config = config_of("clipped_policy_loss", config, settings)
    if config.entropy_coef != 0.0:
        raise ValueError(
            f"entropy_coef={config.entropy_coef}: clipped_policy_loss sees log-probs, not entropies; use "
            "linear_policy_loss, or subtract the bonus from this loss"
        )
    _common.check_1d("logp", logp)
    _common.check_dtype("logp", logp, _common.FLOAT_DTYPES)
    inputs = PolicyLossInputs(
        advantages,
        cu_seqlens,
        old_logp=old_logp,
        ref_logp=ref_logp,
        is_weights=is_weights,
        first_advantages=first_advantages,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        token_mask=token_mask,
    )
    tensors = inputs.check(logp.shape[0], config)
    tensors["logp"] = logp
    _common.check_same_device(**tensors)

    if not _common.use_triton(*tensors.values()):
        loss, stats = clipped_policy_loss_reference(
            logp,
            old_logp,
            advantages,
            cu_seqlens,
            config=config,
            ref_logp=ref_logp,
            is_weights=None if is_weights is None else is_weights.detach(),
            total_tokens=total_tokens,
            total_seqs=total_seqs,
            first_advantages=first_advantages,
            token_mask=None if token_mask is None else token_mask.detach(),
        )
        return loss.float(), {k: v.float() for k, v in stats.items()}

    loss, stats = ClippedPolicyLossFunction.apply(logp.contiguous(), inputs.constants(), config)
    return loss, dict(zip(STAT_NAMES, stats.unbind(0), strict=True))
