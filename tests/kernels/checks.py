"""Assertions shared by the kernel tests: the tolerance table and comparisons against the float64 truth."""

from __future__ import annotations

import math

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


# -- random ratios kept off the clip bounds -----------------------------------------------------------------------
# Every ratio at which a random kernel test's loss switches branch: 1 - clip_low (0.2), 1 + clip_high (0.2, 0.28) and
# the dual clips (1.5, 2, 2.5, 3). A token whose ratio lies within rounding of one of them takes one branch in the
# kernel and the other in the float64 truth, and its whole gradient becomes the error.
RATIO_BOUNDS = (0.8, 1.2, 1.28, 1.5, 2.0, 2.5, 3.0)
# float32 log-probs: the log-ratio errs by an ulp of |logp| + |old| (< 2^-23 * 16) and exp by 2^-23 relative
FP32_LOG_RATIO_MARGIN = 1e-5


def off_the_bounds(logp: torch.Tensor, old: torch.Tensor, *, spread: float, margin) -> torch.Tensor:
    """``old`` redrawn (logp + spread * N(0, 1)) wherever the log-ratio logp - old lies within ``margin`` (a float,
    or a per-token tensor) of the log of a RATIO_BOUNDS entry, until none does."""
    old = old.clone()
    bounds = torch.tensor(RATIO_BOUNDS, dtype=torch.float64, device=old.device).log()
    for _ in range(200):
        log_ratio = logp.double() - old.double()
        near = ((log_ratio[:, None] - bounds).abs() < torch.as_tensor(margin, device=old.device)[..., None]).any(-1)
        if not near.any():
            return old
        old[near] = (logp[near] + torch.randn(int(near.sum()), device=old.device) * spread).to(old.dtype)
    raise AssertionError("could not draw log-ratios off the clip bounds: the margin is too wide for the spread")


def sequences_off_the_bounds(logp: torch.Tensor, old: torch.Tensor, cu_seqlens: torch.Tensor, *, margin: float):
    """``old`` with each sequence shifted as a whole (every token by one constant) wherever the sequence's mean
    log-ratio (GSPO's log s) lies within ``margin`` of the log of a RATIO_BOUNDS entry, until none does: the same for
    the sequence ratio as ``off_the_bounds`` for the token's. Shifting a sequence moves each of its token ratios too,
    which GSPO's loss does not read (its token ratios enter the statistics only, which are smooth)."""
    old = old.clone()
    bounds = torch.tensor(RATIO_BOUNDS, dtype=torch.float64, device=old.device).log()
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(len(lengths), device=old.device), lengths, output_size=old.shape[0])
    for _ in range(200):
        diff = logp.double() - old.double()
        mean = torch.zeros(len(lengths), dtype=torch.float64, device=old.device).index_add_(0, seq, diff)
        mean = mean / lengths.clamp(min=1)
        near = ((mean[:, None] - bounds).abs() < margin).any(-1) & (lengths > 0)  # (S,)
        if not near.any():
            return old
        shift = torch.where(near, torch.rand(len(lengths), device=old.device) * 0.2 - 0.1, 0.0)  # (S,)
        old = old + shift[seq].to(old.dtype)
    raise AssertionError("could not draw sequence log-ratios off the clip bounds")


# -- 16-bit logits: first-order bounds on what their rounding does --------------------------------------------
# The lm_head ops with 16-bit inputs compute each logit z in float32 and round it to bfloat16 (|dz| <= EPS16 |z|:
# a whole ulp, since the interpreter truncates), store the logit gradient g = dL/dz in bfloat16 for the matmuls
# (|dg| <= EPS16 |g|) and round their 16-bit outputs (EPS16 |out|). To first order in the logits' errors, with
# p = softmax(z), e_v = EPS16 |z_v| and the loss L = sum_i f_i(logp_i) + c_i H_i (a policy loss and its entropy
# bonus, or any weighting of log-probs and entropies), a_i = dL/dlogp_i, a2_i = d2L/dlogp_i2:
#   |d logp_i| <= e_y + sum_v p_v e_v                      |d H_i| <= sum_v p_v |log p_v + H| e_v
#   |d g_iu|   <= |a2_i| |delta_uy - p_u| (e_y + sum_v p_v e_v) + |a_i| p_u (e_u + sum_v p_v e_v)
#               + |c_i| p_u ((|log p_u + H| + 1)(e_u + sum_v p_v e_v) + sum_v p_v |log p_v + H| e_v) + EPS16 |g_iu|
# and the gradients d hidden = g W, d weight = g^T hidden inherit |dg| through |W| and |hidden|, plus their float32
# accumulation (K 2^-24 of the absolute sum over K terms); a 16-bit output adds its own rounding (assert_within).
# Measured: the kernels reach at
# most 0.31 of these bounds over seeds 40-55 of the tests' shapes (0.25 under autocast).
EPS16 = 2**-7


def bf16_logit_bounds(
    hidden, weight, ids, *, a, a2=None, c=None, temperature: float = 1.0, float32_inputs: bool = False
) -> dict[str, torch.Tensor]:
    """First-order error bounds (float64) of logp (N,), entropy (N,), d hidden (N, H) and d weight (V, H) for logits
    hidden @ weight.T rounded to bfloat16; ``a``, ``a2``, ``c`` (N,): the loss's dL/dlogp, d2L/dlogp2 and dL/dH.
    ``float32_inputs``: float32 parameters under autocast, whose gradient matmuls may read the float32 inputs where
    the truth reads their bf16 casts (``hidden``, ``weight`` here): one more input rounding of EPS16 in each."""
    h, w = hidden.double(), weight.double()
    z = h @ w.T / temperature  # (N, V)
    a = a.double()
    a2 = torch.zeros_like(a) if a2 is None else a2.double()
    c = torch.zeros_like(a) if c is None else c.double()
    logq = torch.log_softmax(z, -1)
    p = logq.exp()
    ent = -(p * logq).sum(-1, keepdim=True)  # (N, 1)
    e = EPS16 * z.abs()
    mean_e = (p * e).sum(-1, keepdim=True)  # (N, 1)
    e_y = e.gather(-1, ids[:, None])
    spread = (logq + ent).abs()  # |log p_v + H| (N, V)
    d_ent = (p * spread * e).sum(-1, keepdim=True)
    onehot = torch.zeros_like(z).scatter_(-1, ids[:, None], 1.0)
    g = a[:, None] * (onehot - p) - c[:, None] * p * (logq + ent)  # (N, V) dL/dz
    dg = (a2.abs()[:, None] * (onehot - p).abs() * (e_y + mean_e) + a.abs()[:, None] * p * (e + mean_e)
          + c.abs()[:, None] * p * ((spread + 1) * (e + mean_e) + d_ent) + EPS16 * g.abs()) / temperature  # fmt: skip
    g = g / temperature
    n, v = z.shape
    inputs = EPS16 if float32_inputs else 0.0
    return {
        "logp": (e_y + mean_e)[:, 0],
        "entropy": d_ent[:, 0],
        "grad hidden": dg @ w.abs() + (v * 2**-24 + inputs) * (g.abs() @ w.abs()),
        "grad weight": dg.T @ h.abs() + (n * 2**-24 + inputs) * (g.abs().T @ h.abs()),
    }


def assert_within(actual: torch.Tensor, truth: torch.Tensor, bound: torch.Tensor, *, name: str = "") -> None:
    """|actual - truth| <= bound elementwise, plus a 16-bit ``actual``'s own rounding (EPS16 |truth|) and 1e-12 for
    the float64 truth's noise; NaN fails."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in the result"
    if actual.dtype in (torch.bfloat16, torch.float16):
        bound = bound + EPS16 * truth.double().abs()
    err = (actual.double() - truth.double()).abs()
    ratio = (err / (bound + 1e-12)).max().item()
    assert ratio <= 1.0, f"{name}: an error {ratio:.3g}x its bound (max error {err.max().item():.3g})"


def assert_bool_written(t: torch.Tensor, name: str) -> None:
    raw = t.view(torch.uint8)
    assert bool((raw <= 1).all()), f"{name}: bytes other than 0/1 (an element was never written)"


# -- a hand-worked clipped-loss case that breaks every symmetry -------------------------------------------------
# clip_low != clip_high, ratios beyond each bound and inside, advantages of both signs and several magnitudes,
# sequences of different lengths (so the three aggregations differ), a dual-clip case and a zero advantage. A
# bound used on the wrong side, a sign flipped, a length or a normaliser swapped changes the expected numbers.
HAND_CLIP_LOW, HAND_CLIP_HIGH, HAND_DUAL_CLIP, HAND_KL_COEF, HAND_NORM_LENGTH = 0.1, 0.3, 3.0, 0.1, 8.0
# (advantage, [(ratio, pg, dpg/dlogp, clip side, pg and dpg when the dual clip of 3 binds)])
#   pg = -min(r A, clip(r, 0.9, 1.3) A); dpg = -r A where the unclipped branch is taken, else 0
# fmt: off
HAND_SEQUENCES = [
    (2.0, [  # A > 0: the high bound 1.3 binds above it; below 0.9 r A is the smaller, unclipped
        (1.5, -2.6, 0.0, "high", None),  # -1.3 * 2
        (1.2, -2.4, -2.4, None, None),  # inside (0.9, 1.3); clip_low on the high side (1.1) would clip it
        (0.85, -1.7, -1.7, None, None),
        (1.0, -2.0, -2.0, None, None),
    ]),
    (-0.5, [  # A < 0: the low bound 0.9 binds below it
        (0.85, 0.45, 0.0, "low", None),  # -0.9 * -0.5; clip_high on the low side (0.7) would not clip it
        (0.95, 0.475, 0.475, None, None),
        (0.5, 0.45, 0.0, "low", None),
    ]),
    (-1.0, [(1.5, 1.5, 1.5, None, None)]),  # A < 0 above the range: r A is the smaller, unclipped
    (-1.0, [
        (4.0, 4.0, 4.0, None, (3.0, 0.0)),  # the dual clip bounds the loss of a negative advantage by -3 A
        (2.5, 2.5, 2.5, None, None),
    ]),
    (0.0, [(1.7, 0.0, 0.0, None, None)]),  # no advantage, no policy-gradient term
]
# fmt: on
HAND_REF_SHIFTS = [0.2, -0.3, 0.0, 0.5, -0.1, 0.4, 0.25, -0.6, 0.1, -0.2, 0.3]  # ref - logp, one per token


def hand_worked_case(*, dual_clip: bool, kl: bool, agg: str) -> dict:
    """The case's inputs (float64, as lists) and the loss, dloss/dlogp and statistics worked out by hand."""
    ratios, pg, dpg, lengths, advantages, low, high, dual = [], [], [], [], [], 0, 0, 0
    for a, tokens in HAND_SEQUENCES:
        advantages.append(a)
        lengths.append(len(tokens))
        for r, p, d, side, dual_value in tokens:
            if dual_clip and dual_value is not None:
                p, d = dual_value
                dual += 1
            ratios.append(r)
            pg.append(p)
            dpg.append(d)
            low += side == "low"
            high += side == "high"
    n, s = len(ratios), len(lengths)
    seq_len = [length for length in lengths for _ in range(length)]
    if agg == "token-mean":
        weights = [1.0 / n] * n
    elif agg == "seq-mean-token-mean":
        weights = [1.0 / (s * length) for length in seq_len]
    else:
        weights = [1.0 / (s * HAND_NORM_LENGTH)] * n
    k3 = [math.exp(d) - d - 1.0 if kl else 0.0 for d in HAND_REF_SHIFTS]
    dk3 = [1.0 - math.exp(d) if kl else 0.0 for d in HAND_REF_SHIFTS]  # d/dlogp of exp(d) - d - 1, d = ref - logp
    c = HAND_KL_COEF if kl else 0.0
    return {
        "ratios": ratios,
        "lengths": lengths,
        "advantages": advantages,
        "ref_shifts": HAND_REF_SHIFTS if kl else None,
        "options": dict(
            clip_low=HAND_CLIP_LOW,
            clip_high=HAND_CLIP_HIGH,
            dual_clip=HAND_DUAL_CLIP if dual_clip else None,
            kl_coef=c,
            agg=agg,
            norm_length=HAND_NORM_LENGTH,
        ),
        "loss": sum(w * (p + c * k) for w, p, k in zip(weights, pg, k3, strict=True)),
        "grad": [w * (d + c * dk) for w, d, dk in zip(weights, dpg, dk3, strict=True)],
        "stats": {
            "clip_frac_low": low / n,
            "clip_frac_high": high / n,
            "dual_clip_frac": dual / n,
            "approx_kl": sum(r - 1.0 - math.log(r) for r in ratios) / n,
            "ratio_mean": sum(ratios) / n,
            "kl_ref": sum(k3) / n,
        },
    }
