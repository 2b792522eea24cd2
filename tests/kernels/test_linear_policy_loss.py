"""linear_policy_loss: the fused lm_head + clipped loss against the composition of the two ops it fuses, and
against the materialised reference in float64."""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from fasttnt_kernels import (
    LINEAR_STAT_NAMES,
    PolicyLossConfig,
    PolicyLossInputs,
    clipped_policy_loss,
    clipped_policy_loss_reference,
    linear_policy_loss,
    linear_policy_loss_reference,
    linear_token_logprobs,
)

from checks import (
    DEVICE,
    FP32_LOG_RATIO_MARGIN,
    assert_close,
    assert_within,
    bf16_logit_bounds,
    hand_worked_case,
    off_the_bounds,
    sequences_off_the_bounds,
)

V, H = 300, 24
ROWS_PER_CHUNK = 16
# sequences crossing chunk boundaries, an empty one, a one-token one: 61 tokens in 4 chunks, the last ragged
LENGTHS = [9, 20, 0, 1, 17, 14]


def _batch(dtype=torch.float32, *, spread=0.5, logits_dtype=None):
    """``logits_dtype``: the precision the loss computes its logits in (``dtype``, or bfloat16 under autocast)."""
    lengths = torch.tensor(LENGTHS, device=DEVICE)
    cu = torch.zeros(len(LENGTHS) + 1, dtype=torch.int64, device=DEVICE)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    hidden = torch.randn(n, H, device=DEVICE).to(dtype)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5 * 3).to(dtype)
    ids = torch.randint(0, V, (n,), device=DEVICE)
    with torch.no_grad():
        logits = hidden.double() @ weight.double().T  # (N, V)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, None])[:, 0].float()
    # old and reference policies ~spread away in log space: ratios on both sides of both clip bounds, never within
    # the log-probs' rounding of one (16-bit logits: a per-token bound; float32: 10x a float32 matmul's error)
    old = logp + torch.randn(n, device=DEVICE) * spread
    if (logits_dtype or dtype) == torch.bfloat16:
        margin = bf16_logit_bounds(hidden.bfloat16(), weight.bfloat16(), ids, a=torch.zeros(n, device=DEVICE))["logp"]
    else:
        margin = 10 * FP32_LOG_RATIO_MARGIN
    for _ in range(50):  # each token's ratio, and each sequence's (GSPO's), off the bounds
        old = off_the_bounds(logp, old, spread=spread, margin=margin)
        shifted = sequences_off_the_bounds(logp, old, cu, margin=1e-3)
        if torch.equal(shifted, old):
            break
        old = shifted
    else:
        raise AssertionError("could not draw the token and sequence log-ratios off the clip bounds together")
    ref = logp + torch.randn(n, device=DEVICE) * spread
    is_w = torch.rand(n, device=DEVICE) * 1.5
    adv = torch.randn(len(LENGTHS), device=DEVICE)
    adv[1] = 0.0  # a zero advantage: no policy-gradient term
    return hidden, weight, ids, old, ref, is_w, adv, cu


def _loss_derivatives(hidden, weight, ids, old, adv, cu, *, entropy_coef: float = 0.0) -> dict[str, torch.Tensor]:
    """dL/dlogp, d2L/dlogp2 and dL/dH (N,) of _fused's loss (default clips, token mean, the 0.75 upstream) in float64,
    for bf16_logit_bounds."""
    z = hidden.double() @ weight.double().T
    logp = torch.log_softmax(z, -1).gather(-1, ids[:, None])[:, 0].detach().requires_grad_()
    loss, _ = clipped_policy_loss_reference(logp, old.double(), adv.double(), cu)
    (a,) = torch.autograd.grad(loss * 0.75, logp, create_graph=True)
    (a2,) = torch.autograd.grad(a.sum(), logp)  # diagonal: token i's term depends on logp_i alone
    return {"a": a.detach(), "a2": a2, "c": torch.full_like(a2, -entropy_coef * 0.75 / hidden.shape[0])}


def _chunk_bytes(dtype):
    return ROWS_PER_CHUNK * V * torch.empty((), dtype=dtype).element_size()


_SETTINGS = tuple(f.name for f in dataclasses.fields(PolicyLossConfig))


def _typed(old, adv, cu, kw):
    """The loss's tensors and settings of ``kw`` (clipped_policy_loss's keywords) as the op's two objects, and the
    keywords left (temperature)."""
    kw = dict(kw)
    config = PolicyLossConfig(**{k: kw.pop(k) for k in _SETTINGS if k in kw})
    tensors = ("ref_logp", "is_weights", "first_advantages", "total_tokens", "total_seqs", "token_mask", "rollout_logp",
               "rollout_correction", "rollout_correction_cap")  # fmt: skip
    inputs = PolicyLossInputs(adv, cu, old_logp=old, **{k: kw.pop(k) for k in tensors if k in kw})
    return inputs, config, kw


def _fused(hidden, weight, ids, old, adv, cu, **kw):
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    inputs, config, rest = _typed(old, adv, cu, kw)
    loss, stats = linear_policy_loss(h, w, ids, inputs, config=config, chunk_bytes=_chunk_bytes(hidden.dtype), **rest)
    (loss * 0.75).backward()  # an upstream gradient other than 1
    return loss.detach(), stats, h.grad, w.grad


def _composed(hidden, weight, ids, old, adv, cu, *, temperature=1.0, entropy_coef=0.0, total_tokens=None, **kw):
    """What the trainer ran before the fusion: linear_token_logprobs, then clipped_policy_loss and the bonus."""
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    logp, entropy = linear_token_logprobs(
        h, w, ids, temperature=temperature, with_entropy=True, chunk_bytes=_chunk_bytes(hidden.dtype)
    )
    loss, stats = clipped_policy_loss(
        logp, logp.detach() if old is None else old, adv, cu, total_tokens=total_tokens, **kw
    )
    tokens = hidden.shape[0] if total_tokens is None else total_tokens
    loss = loss - entropy_coef * entropy.sum() / tokens
    (loss * 0.75).backward()
    stats["entropy"] = entropy.detach().mean()
    return loss.detach(), stats, h.grad, w.grad


def _truth(hidden, weight, ids, old, adv, cu, *, dtype=torch.float64, **kw):
    """The materialised reference, in float64 unless told (float32 under autocast: bf16 logits)."""
    h = hidden.detach().to(dtype).requires_grad_()
    w = weight.detach().to(dtype).requires_grad_()
    for name in ("ref_logp", "is_weights", "first_advantages", "token_mask"):
        if kw.get(name) is not None:
            kw[name] = kw[name].to(dtype)
    inputs, config, rest = _typed(None if old is None else old.to(dtype), adv.to(dtype), cu, kw)
    loss, stats = linear_policy_loss_reference(h, w, ids, inputs, config=config, **rest)
    (loss * 0.75).backward()
    return loss.detach(), stats, h.grad, w.grad


VARIANTS = {
    "token-mean": dict(agg="token-mean"),
    "seq-mean-token-mean": dict(agg="seq-mean-token-mean", total_seqs=9.0),
    "dr-grpo": dict(agg="seq-mean-token-sum-norm", norm_length=24.0),
    "entropy": dict(entropy_coef=0.05, total_tokens=80.0),
    "kl+dual-clip": dict(kl_coef=0.1, use_ref=True, dual_clip=3.0, clip_high=0.28),
    "on-policy": dict(on_policy=True, entropy_coef=0.01, temperature=0.7),
    "first-advantages": dict(use_first=True, clip_high=0.28),  # a hybrid response's mode token (mode_advantages)
    "is-weights+everything": dict(
        use_is=True, use_ref=True, kl_coef=0.05, dual_clip=2.5, entropy_coef=0.02, agg="seq-mean-token-mean"
    ),
    # the other policy-gradient terms, with what composes with them: weights, the KL term, the entropy bonus
    "cispo": dict(policy_loss="cispo", clip_high=0.28, use_is=True, use_ref=True, kl_coef=0.05),
    "sapo": dict(policy_loss="sapo", agg="seq-mean-token-mean", total_seqs=9.0, entropy_coef=0.02, use_first=True),
    # sequences across chunks: their ratios from a first pass of log-probs; on-policy none (every ratio 1)
    "gspo": dict(policy_loss="gspo", agg="seq-mean-token-mean", use_ref=True, kl_coef=0.05, dual_clip=3.0),
    "gspo-on-policy": dict(policy_loss="gspo", on_policy=True, clip_high=0.28),
    # rollout weights inside the sequences' weights (VESPO), mode tokens' own advantages choosing (k, lambda)
    "vespo": dict(policy_loss="vespo", use_is=True, use_ref=True, kl_coef=0.05, use_first=True, entropy_coef=0.02),
    "vespo-on-policy": dict(policy_loss="vespo", on_policy=True, use_is=True),
    # CISPO's weight and SAPO's gate of each sequence's ratio
    "cispo-sequence": dict(policy_loss="cispo", ratio_level="sequence", clip_low=1.0, clip_high=0.28, use_is=True),
    "sapo-sequence": dict(
        policy_loss="sapo", ratio_level="sequence", agg="seq-mean-token-mean", use_ref=True, kl_coef=0.05
    ),
    # a 0/1 factor of each token's policy term after every weight (TRL's high-entropy mask): the KL term and the
    # entropy bonus keep every token, VESPO's sequence weights and GSPO's ratios do not read it
    "token-mask": dict(use_mask=True, use_is=True, use_ref=True, kl_coef=0.05, entropy_coef=0.02, clip_high=0.28),
    "vespo-token-mask": dict(policy_loss="vespo", use_is=True, use_mask=True, use_ref=True, kl_coef=0.05),
    "gspo-token-mask": dict(policy_loss="gspo", agg="seq-mean-token-mean", use_mask=True, dual_clip=3.0),
}


def _args(variant, old, ref, is_w):
    kw = dict(VARIANTS[variant])
    old = None if kw.pop("on_policy", False) else old
    if kw.pop("use_ref", False):
        kw["ref_logp"] = ref
    if kw.pop("use_is", False):
        kw["is_weights"] = is_w
    if kw.pop("use_first", False):
        kw["first_advantages"] = torch.randn(len(LENGTHS), device=DEVICE)
    if kw.pop("use_mask", False):  # about half the tokens kept
        kw["token_mask"] = (torch.rand(ref.shape[0], device=DEVICE) < 0.5).float()
        assert 0 < kw["token_mask"].sum() < ref.shape[0], "precondition: the mask keeps some tokens, not all"
    return old, kw


def _assert_same(got, want, *, rtol, atol, names=("loss", "stats", "grad hidden", "grad weight")):
    for name, a, b in zip(names, got, want, strict=True):
        if name == "stats":
            assert set(a) == set(LINEAR_STAT_NAMES)
            for stat in LINEAR_STAT_NAMES:
                assert not torch.isnan(a[stat]), stat
                torch.testing.assert_close(a[stat].double(), b[stat].double(), rtol=rtol, atol=atol, msg=stat)
        else:
            assert not torch.isnan(a).any(), name
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_equals_the_composition_in_float32(monkeypatch, variant, path):
    # the same chunked logits as linear_token_logprobs, the same per-token terms as clipped_policy_loss: equal up
    # to the order of float32 sums
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    hidden, weight, ids, old, ref, is_w, adv, cu = _batch()
    old, kw = _args(variant, old, ref, is_w)
    got = _fused(hidden, weight, ids, old, adv, cu, **kw)
    want = _composed(hidden, weight, ids, old, adv, cu, **kw)
    _assert_same(got, want, rtol=1e-6, atol=1e-6)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32


@pytest.mark.parametrize(
    "variant",
    ["token-mean", "is-weights+everything", "on-policy", "first-advantages", "cispo", "sapo", "gspo", "vespo",
     "vespo-on-policy", "cispo-sequence", "sapo-sequence", "token-mask", "vespo-token-mask", "gspo-token-mask"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_matches_the_float64_reference(monkeypatch, variant, path):
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    hidden, weight, ids, old, ref, is_w, adv, cu = _batch()
    old, kw = _args(variant, old, ref, is_w)
    got = _fused(hidden, weight, ids, old, adv, cu, **kw)
    truth = _truth(hidden, weight, ids, old, adv, cu, **kw)
    assert_close(got[0], truth[0], tol="fp32-matmul", name="loss")
    for stat in LINEAR_STAT_NAMES:
        assert_close(got[1][stat], truth[1][stat], tol="fp32-matmul", name=stat)
    assert_close(got[2], truth[2], tol="fp32-matmul", name="grad hidden")
    assert_close(got[3], truth[3], tol="fp32-matmul", name="grad weight")


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_clip", [False, True])
@pytest.mark.parametrize("kl", [False, True])
def test_asymmetric_clips_by_hand(monkeypatch, path, agg, dual_clip, kl):
    # the clipped loss's hand-worked tokens (tests/kernels/checks.py) behind a two-word lm_head: weight I, hidden
    # (x_t, 0), token 0, so logp_t = log sigmoid(x_t) and dlogp_t/dlogits_t = (1 - p_t, -(1 - p_t)); hence
    # dL/dhidden_t = g_t (1 - p_t) (1, -1) and dL/dweight = sum_t dL/dlogits_t (x) hidden_t, g_t = dL/dlogp_t
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    case = hand_worked_case(dual_clip=dual_clip, kl=kl, agg=agg)
    n = len(case["ratios"])
    x = torch.linspace(-1.0, 2.0, n, dtype=torch.float64)
    p = torch.sigmoid(x)
    logp = torch.log(p)  # (n,) float64, by hand
    old = (logp - torch.tensor(case["ratios"], dtype=torch.float64).log()).float().to(DEVICE)
    ref = None
    if case["ref_shifts"] is not None:
        ref = (logp + torch.tensor(case["ref_shifts"], dtype=torch.float64)).float().to(DEVICE)
    hidden = torch.stack([x, torch.zeros(n, dtype=torch.float64)], 1).float().to(DEVICE).requires_grad_()  # (n, 2)
    weight = torch.eye(2, device=DEVICE).requires_grad_()  # (V=2, H=2)
    ids = torch.zeros(n, dtype=torch.long, device=DEVICE)
    cu = torch.tensor([0, *itertools.accumulate(case["lengths"])], device=DEVICE)
    adv = torch.tensor(case["advantages"], device=DEVICE)
    inputs, config, _ = _typed(old, adv, cu, {"ref_logp": ref, **case["options"]})
    loss, stats = linear_policy_loss(hidden, weight, ids, inputs, config=config)
    loss.backward()
    assert math.isclose(loss.item(), case["loss"], rel_tol=1e-5, abs_tol=1e-7)
    for name, value in case["stats"].items():
        assert math.isclose(stats[name].item(), value, rel_tol=1e-5, abs_tol=1e-6), name
    g = torch.tensor(case["grad"], dtype=torch.float64)  # (n,) dL/dlogp
    d_logits = torch.stack([g * (1 - p), -g * (1 - p)], 1)  # (n, 2)
    torch.testing.assert_close(hidden.grad.double().cpu(), d_logits, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad.double().cpu(), d_logits.T @ hidden.detach().double().cpu(), rtol=1e-5,
                               atol=1e-7)  # fmt: skip


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_autocast_accumulates_the_weight_gradient_in_float32(monkeypatch, path):
    # float32 master weights under bf16 autocast: bf16 logits and gradient matmuls, the weight's gradient summed
    # over chunks in float32, within what the bf16 logits allow (checks.bf16_logit_bounds)
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    hidden, weight, ids, old, _ref, _is_w, adv, cu = _batch(logits_dtype=torch.bfloat16)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = _fused(hidden, weight, ids, old, adv, cu, entropy_coef=0.05)
    h16, w16 = hidden.bfloat16(), weight.bfloat16()  # what autocast computes from
    truth = _truth(h16, w16, ids, old, adv, cu, entropy_coef=0.05)
    derivatives = _loss_derivatives(h16, w16, ids, old, adv, cu, entropy_coef=0.05)
    bounds = bf16_logit_bounds(h16, w16, ids, **derivatives, float32_inputs=True)
    assert got[2].dtype == torch.float32 and got[3].dtype == torch.float32
    for name, a, t in zip(("grad hidden", "grad weight"), got[2:], truth[2:], strict=True):
        assert_within(a, t, bounds[name], name=name)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_bfloat16_weights_get_a_bfloat16_gradient_rounded_once(monkeypatch, path):
    # bf16 logits set the precision; the weight's gradient, summed over the chunks in float32 and rounded once, is
    # within what the logits' rounding, the bf16 logit gradient and one rounding of the output allow (checks.py)
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    hidden, weight, ids, old, _ref, _is_w, adv, cu = _batch(torch.bfloat16)
    got = _fused(hidden, weight, ids, old, adv, cu)
    truth = _truth(hidden, weight, ids, old, adv, cu)
    bounds = bf16_logit_bounds(hidden, weight, ids, **_loss_derivatives(hidden, weight, ids, old, adv, cu))
    assert got[2].dtype == torch.bfloat16 and got[3].dtype == torch.bfloat16
    for name, a, t in zip(("grad hidden", "grad weight"), got[2:], truth[2:], strict=True):
        assert_within(a, t, bounds[name], name=name)


def test_no_grad_computes_the_loss_only(triton_path):
    hidden, weight, ids, old, _ref, _is_w, adv, cu = _batch()
    with torch.no_grad():
        inputs = PolicyLossInputs(adv, cu, old_logp=old)
        loss, _stats = linear_policy_loss(hidden, weight, ids, inputs, chunk_bytes=_chunk_bytes(torch.float32))
    want = _composed(hidden, weight, ids, old, adv, cu)
    torch.testing.assert_close(loss, want[0], rtol=1e-6, atol=1e-6)
    assert not loss.requires_grad


def test_far_off_policy_tokens_stay_finite(triton_path):
    # log-ratios of +-200 would overflow exp in float32 without the clamp: no NaN, no inf, in value or gradient
    hidden, weight, ids, old, ref, _is_w, adv, cu = _batch()
    old = old + torch.where(torch.arange(old.numel(), device=DEVICE) % 2 == 0, 200.0, -200.0)
    loss, stats, gh, gw = _fused(hidden, weight, ids, old, adv, cu, kl_coef=0.1, ref_logp=ref - 300.0)
    for name, t in (("loss", loss), ("grad hidden", gh), ("grad weight", gw), *stats.items()):
        assert torch.isfinite(t).all(), name


def test_the_keyword_form_is_the_same_call(triton_path):
    # the fields of PolicyLossInputs and PolicyLossConfig by name (clipped_policy_loss's keywords, which TRL's
    # integration passes) build the same two objects: the same loss and gradients, to the bit
    hidden, weight, ids, old, ref, is_w, adv, cu = _batch()
    kw = dict(ref_logp=ref, is_weights=is_w, kl_coef=0.05, clip_high=0.28, entropy_coef=0.02, total_tokens=80.0)
    typed = _fused(hidden, weight, ids, old, adv, cu, **kw)
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    loss, stats = linear_policy_loss(
        h, w, ids, old_logp=old, advantages=adv, cu_seqlens=cu, chunk_bytes=_chunk_bytes(torch.float32), **kw
    )
    (loss * 0.75).backward()
    for a, b in zip(typed, (loss.detach(), stats, h.grad, w.grad), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a) if isinstance(a, dict) else torch.equal(a, b)


def test_bad_inputs_name_what_is_wrong():
    hidden, weight, ids, old, _ref, _is_w, adv, cu = _batch()
    inputs = PolicyLossInputs(adv, cu, old_logp=old)
    with pytest.raises(ValueError, match="old_logp must have"):
        linear_policy_loss(hidden, weight, ids, PolicyLossInputs(adv, cu, old_logp=old[:-1]))
    with pytest.raises(ValueError, match="cu_seqlens must have"):
        linear_policy_loss(hidden, weight, ids, PolicyLossInputs(adv, cu[:-1], old_logp=old))
    with pytest.raises(ValueError, match="needs ref_logp"):
        linear_policy_loss(hidden, weight, ids, inputs, config=PolicyLossConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="weight \\(V, H\\)"):
        linear_policy_loss(hidden, weight[:, :-1], ids, inputs)
    with pytest.raises(ValueError, match="entropy_coef"):
        linear_policy_loss(hidden, weight, ids, inputs, entropy_coef=-1.0)
    with pytest.raises(TypeError, match="not both"):
        linear_policy_loss(hidden, weight, ids, inputs, advantages=adv)
    with pytest.raises(TypeError, match="not both"):
        linear_policy_loss(hidden, weight, ids, inputs, config=PolicyLossConfig(), clip_high=0.3)


def _rollout_logp(hidden, weight, ids, cu, mode: str, cap: float, *, spread: float = 0.4) -> torch.Tensor:
    """An engine's log-probs ~spread from the policy's (N,), each weight's log (a token's, or its sequence's sum) at
    least 0.02 away from log ``cap``: the truncation and the mask are discontinuous there, and the kernel's float32
    log-probs differ from the float64 truth by ~1e-6. The first token's weight (its sequence's) is 0.5 above log
    ``cap``, so the cap binds whatever the draw."""
    with torch.no_grad():
        logp = torch.log_softmax(hidden.double() @ weight.double().T, -1).gather(-1, ids[:, None])[:, 0]  # (N,)
    rollout = logp - torch.randn(logp.shape[0], dtype=torch.float64, device=DEVICE) * spread
    nonempty = cu[1:] > cu[:-1]
    first, end = int(cu[:-1][nonempty][0]), int(cu[1:][nonempty][0])  # the first non-empty sequence
    target = math.log(cap) + 0.5
    if mode.startswith("sequence"):  # its summed log-ratio moved to the target by its first token's
        rollout[first] -= target - (logp - rollout)[first:end].sum()
    else:
        rollout[first] = logp[first] - target
    for _ in range(50):
        diff = logp - rollout  # (N,) log rho per token
        if mode.startswith("sequence"):
            lengths = cu[1:] - cu[:-1]
            sums = torch.zeros(len(lengths), dtype=torch.float64, device=DEVICE).index_add_(
                0, torch.repeat_interleave(torch.arange(len(lengths), device=DEVICE), lengths), diff
            )
            near = (sums - math.log(cap)).abs() < 0.02  # (S,)
            firsts = cu[:-1][near & (lengths > 0)]
            if len(firsts) == 0:
                break
            rollout[firsts] -= 0.05
        else:
            near = (diff - math.log(cap)).abs() < 0.02
            if not near.any():
                break
            rollout[near] -= 0.05
    else:
        raise AssertionError("could not draw the rollout log-probs off the cap")
    return rollout.float()


# the rollout correction formed in the pass from rollout_logp: on-policy each token's own weight in its chunk (token
# modes), a first pass of logits for a sequence mode and for VESPO; off-policy from old_logp before the pass
ROLLOUT_CASES = {
    "token-truncate-on-policy": dict(
        mode="token-truncate", on_policy=True, kw=dict(clip_high=0.28, use_ref=True, kl_coef=0.05)
    ),
    "token-mask-on-policy": dict(mode="token-mask", on_policy=True, kw=dict(use_is=True, entropy_coef=0.02)),
    "sequence-truncate-on-policy": dict(mode="sequence-truncate", on_policy=True, kw=dict(agg="seq-mean-token-mean")),
    "sequence-mask-off-policy": dict(mode="sequence-mask", on_policy=False, kw=dict(use_is=True, dual_clip=3.0)),
    "token-truncate-off-policy": dict(mode="token-truncate", on_policy=False, kw=dict(policy_loss="cispo")),
    "vespo-on-policy": dict(mode="token-truncate", on_policy=True, kw=dict(policy_loss="vespo", use_is=True)),
    "gspo-on-policy": dict(mode="token-mask", on_policy=True, kw=dict(policy_loss="gspo", clip_high=0.28)),
}


@pytest.mark.parametrize("case", list(ROLLOUT_CASES))
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_the_rollout_correction_in_the_pass_matches_the_float64_reference(monkeypatch, case, path):
    # the reference weighs the proximal log-probs (old, or the current ones detached) against the engine's with
    # rollout_correction_weights, times is_weights; the op forms the same weights in its pass
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    spec = ROLLOUT_CASES[case]
    hidden, weight, ids, old, ref, is_w, adv, cu = _batch()
    kw = dict(spec["kw"])
    old = None if spec["on_policy"] else old
    if kw.pop("use_ref", False):
        kw["ref_logp"] = ref
    if kw.pop("use_is", False):
        kw["is_weights"] = is_w
    rollout = _rollout_logp(hidden, weight, ids, cu, spec["mode"], 2.0)
    kw.update(rollout_logp=rollout, rollout_correction=spec["mode"], rollout_correction_cap=2.0)
    got = _fused(hidden, weight, ids, old, adv, cu, **kw)
    truth = _truth(hidden, weight, ids, old, adv, cu, **kw)
    for name, a, b in zip(
        ("loss", "grad hidden", "grad weight"), (got[0], *got[2:]), (truth[0], *truth[2:]), strict=True
    ):
        assert_close(a, b, tol="fp32-matmul", name=name)
    for stat in LINEAR_STAT_NAMES:
        assert_close(got[1][stat], truth[1][stat], tol="fp32-matmul", name=stat)
    # the correction matters: without it the hidden states' gradient is another (a scalar loss can coincide)
    uncorrected = _fused(hidden, weight, ids, old, adv, cu, **{**kw, "rollout_correction": "none"})
    assert not torch.allclose(uncorrected[2], got[2], rtol=1e-3), "precondition: the correction changes the gradient"


@pytest.mark.parametrize("mode", ["token-truncate", "sequence-mask"])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_the_rollout_correction_in_the_pass_equals_a_separate_old_logprob_pass(monkeypatch, mode, path):
    # what a trainer did at one mini-batch and one epoch: a no-grad pass of old log-probs, their correction weights,
    # then the loss with both; in the pass the proximal log-probs are the loss's own (the same chunks and kernels,
    # so the same float32 values): loss, gradients and statistics equal to float32 rounding of the sums' order
    monkeypatch.setenv("FASTTNT_KERNELS", path)
    from fasttnt_kernels import rollout_correction_weights

    hidden, weight, ids, _, ref, _, adv, cu = _batch()
    rollout = _rollout_logp(hidden, weight, ids, cu, mode, 2.0)
    with torch.no_grad():
        old = linear_token_logprobs(hidden, weight, ids, chunk_bytes=_chunk_bytes(hidden.dtype))  # (N,)
    weights, _ = rollout_correction_weights(old, rollout, cu, mode=mode, cap=2.0)
    assert (weights < 1.99).sum() > 0 and (weights != torch.exp(old - rollout)).any(), "precondition: it binds"
    kw = dict(clip_high=0.28, ref_logp=ref, kl_coef=0.05)
    separate = _fused(hidden, weight, ids, old, adv, cu, is_weights=weights, **kw)
    in_pass = _fused(hidden, weight, ids, None, adv, cu, rollout_logp=rollout, rollout_correction=mode,
                     rollout_correction_cap=2.0, **kw)  # fmt: skip
    _assert_same(in_pass, separate, rtol=1e-6, atol=1e-7)
