"""clipped_policy_loss: the fused Triton kernel against the reference in float64; hand-worked tokens."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from fasttnt_kernels import (
    STAT_NAMES,
    PolicyLossConfig,
    SettingError,
    _common,
    clipped_policy_loss,
    clipped_policy_loss_reference,
)

from checks import (
    DEVICE,
    FP32_LOG_RATIO_MARGIN,
    assert_close,
    hand_worked_case,
    off_the_bounds,
    sequences_off_the_bounds,
)


def _packed_batch(lengths, dtype=torch.float32, *, spread=0.4):
    lengths = torch.tensor(lengths, device=DEVICE)
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=DEVICE)
    cu[1:] = lengths.cumsum(0)
    n = int(cu[-1])
    logp = (-torch.rand(n, device=DEVICE) * 4).to(dtype)
    # old and ref policies differ by ~spread in log space: ratios land on both sides of both clip bounds, never
    # within rounding of one (the kernel and the float64 truth compute the same ratio from the same inputs)
    old = (logp + torch.randn(n, device=DEVICE) * spread).to(dtype)
    old = off_the_bounds(logp, old, spread=spread, margin=FP32_LOG_RATIO_MARGIN)
    ref = (logp + torch.randn(n, device=DEVICE) * spread).to(dtype)
    adv = torch.randn(len(lengths), device=DEVICE)
    return logp, old, ref, adv, cu


def _run(logp, old, adv, cu, **kw):
    x = logp.detach().clone().requires_grad_()
    loss, stats = clipped_policy_loss(x, old, adv, cu, **kw)
    loss.backward()
    return loss.detach(), stats, x.grad


def _truth(
    logp, old, adv, cu, *, ref_logp=None, is_weights=None, total_tokens=None, total_seqs=None, token_mask=None, **kw
):
    x = logp.detach().double().requires_grad_()
    loss, stats = clipped_policy_loss_reference(
        x,
        old.double(),
        adv.double(),
        cu,
        config=PolicyLossConfig(**kw),
        ref_logp=None if ref_logp is None else ref_logp.double(),
        is_weights=None if is_weights is None else is_weights.double(),
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        token_mask=None if token_mask is None else token_mask.double(),
    )
    loss.backward()
    return loss.detach(), stats, x.grad


def _against_truth(logp, old, adv, cu, **kw):
    """The op and its float64 reference on the same batch: loss, gradient and every statistic close; the op's
    ``(loss, stats, grad)``."""
    loss, stats, grad = _run(logp, old, adv, cu, **kw)
    t_loss, t_stats, t_grad = _truth(logp, old, adv, cu, **kw)
    assert_close(loss, t_loss, name="loss")
    assert_close(grad, t_grad, name="grad")
    for name in STAT_NAMES:
        assert_close(stats[name], t_stats[name], name=name)
    return loss, stats, grad


# sequence lengths: empty ones between and at both ends; one sequence crossing the 1024-token block; 300
# sequences of 1-20 tokens (many per block, a 9-step search); a single token
LENGTHS = {
    "ragged": [5, 0, 3, 1500, 1, 0, 9, 0],
    "many-short": None,  # filled in the test from the seed
    "single-token": [1],
}


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_clip", [None, 1.5])
@pytest.mark.parametrize("with_ref", [False, True])
def test_matches_float64_reference(triton_path, lengths, agg, dual_clip, with_ref):
    lens = LENGTHS[lengths] or torch.randint(1, 21, (300,)).tolist()
    logp, old, ref, adv, cu = _packed_batch(lens)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, agg=agg, norm_length=2048.0)
    if with_ref:
        kw.update(ref_logp=ref, kl_coef=0.05)
    loss, stats, _ = _against_truth(logp, old, adv, cu, **kw)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    assert set(stats) == set(STAT_NAMES)
    assert all(stats[name].device == logp.device for name in STAT_NAMES)
    if lengths == "many-short":  # ~3,000 tokens with ratios spread around both bounds: both clips must bind
        assert 0 < stats["clip_frac_low"] < 1 and 0 < stats["clip_frac_high"] < 1, "the grid must exercise clipping"


@pytest.mark.parametrize("lengths", list(LENGTHS))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "sapo", "vespo", "cispo-sequence", "sapo-sequence"])
def test_other_policy_losses_match_float64_reference(triton_path, lengths, agg, policy_loss):
    # with what composes with them (the KL term, importance weights; GSPO's dual clip); the ratios are kept off the
    # clip bounds (CISPO's weight has a kink there; GSPO's sequence ratios too), SAPO's gate and VESPO's weight are
    # smooth (VESPO's clamps bind on the 1,500-token sequence, whose weight is then ~0 on both sides of them)
    # "-sequence": CISPO's weight and SAPO's gate of each sequence's ratio (TRL's importance_sampling_level)
    policy_loss, _, level = policy_loss.partition("-")
    lens = LENGTHS[lengths] or torch.randint(1, 21, (300,)).tolist()
    logp, old, ref, adv, cu = _packed_batch(lens)
    if policy_loss == "gspo" or level:  # a float32 mean of up to 1,500 log-ratios errs by ~1e-4 relative at worst
        old = sequences_off_the_bounds(logp, old, cu, margin=1e-3)
    weights = torch.rand(logp.shape[0], device=DEVICE) * 2
    kw = dict(policy_loss=policy_loss, ratio_level=level or "token", clip_low=0.2, clip_high=0.28, agg=agg,
              ref_logp=ref, kl_coef=0.05, is_weights=weights, sapo_tau_pos=1.0, sapo_tau_neg=1.05,
              dual_clip=1.5 if policy_loss == "gspo" else None)  # fmt: skip
    _, stats, grad = _against_truth(logp, old, adv, cu, **kw)
    assert not grad.isnan().any() and grad.abs().sum() > 0
    if lengths == "many-short" and policy_loss in ("cispo", "gspo"):  # the ratios clipped on both sides
        assert 0 < stats["clip_frac_low"] < 1 and 0 < stats["clip_frac_high"] < 1, "the grid must clip"
    if policy_loss in ("sapo", "vespo"):  # no clip: a soft gate, a smooth weight
        assert stats["clip_frac_low"] == 0 and stats["clip_frac_high"] == 0


def test_sequence_level_cispo_and_sapo_by_hand(triton_path):
    # one sequence of two tokens, logp -1, log-ratios 0.2 and 0.6 (mean 0.4: s = e^0.4 = 1.49), A = 1, token-mean
    # over 2. CISPO's weight of s is capped at 1.28 on both tokens (each token's own ratio would give e^0.2 = 1.22 on
    # the first); SAPO's gate reads s: pg = -4 sigmoid(s - 1), dloss/dlogp_t = -4 g (1 - g) s / 2 on each token
    logp = torch.full((2,), -1.0, device=DEVICE)
    old = logp - torch.tensor([0.2, 0.6], device=DEVICE)
    adv, cu = torch.tensor([1.0], device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    s = math.exp(0.4)
    loss, stats, grad = _run(logp, old, adv, cu, policy_loss="cispo", ratio_level="sequence", clip_high=0.28)
    assert math.isclose(loss.item(), 1.28, rel_tol=1e-6)  # -1.28 A logp on each token
    torch.testing.assert_close(grad.double().cpu(), torch.full((2,), -1.28 / 2, dtype=torch.float64))
    assert math.isclose(stats["clip_frac_high"].item(), 1.0, rel_tol=1e-6)  # the sequence's ratio, on both tokens
    loss, _, grad = _run(logp, old, adv, cu, policy_loss="sapo", ratio_level="sequence")
    g = 1 / (1 + math.exp(-(s - 1)))
    assert math.isclose(loss.item(), -4 * g, rel_tol=1e-6)
    torch.testing.assert_close(grad.double().cpu(), torch.full((2,), -4 * g * (1 - g) * s / 2, dtype=torch.float64))


def test_a_vespo_weight_past_float32_is_zero(triton_path):
    # k = 10, lambda = 1e-4 (TRL's floor): phi peaks at w = k / lambda = 1e5, log phi = 1e-4 + 10 log 1e5 - 10 = 105.1,
    # past float32's 88.7, which TRL's float32 exp makes inf and its nan_to_num 0; a sequence just below (w = 1e3,
    # log phi = 59.2) keeps its weight
    logp = torch.full((2,), -1.0, device=DEVICE)
    old = logp - torch.tensor([math.log(1e5), math.log(1e3)], device=DEVICE)
    adv, cu = torch.tensor([1.0, 1.0], device=DEVICE), torch.tensor([0, 1, 2], device=DEVICE)
    loss, _, grad = _run(logp, old, adv, cu, policy_loss="vespo", vespo_k_pos=10.0, vespo_lambda_pos=1e-4)
    below = math.exp(1e-4 + 10 * math.log(1e3) - 1e-4 * 1e3)
    assert torch.isfinite(grad).all() and grad[0].item() == 0.0
    assert math.isclose(grad[1].item(), -below / 2, rel_tol=1e-5) and math.isclose(loss.item(), below / 2, rel_tol=1e-5)


def test_vespo_by_hand(triton_path):
    # token-mean over 9 tokens, logp -1, so pg_t = -phi_s A_s logp_t = phi_s A_s and dloss/dlogp_t = -phi_s A_s / 9,
    # phi = exp(lambda + k log w - lambda w) with (k, lambda) = (2, 3) for A >= 0, (3, 2) below.
    # Sequence 0 (log-ratios 0.2, 0.3, A = 1): log w = 0.5. Sequence 1 is empty. Sequence 2 (one token, log-ratio
    # 0, A = -2): w = 1, phi = 1, the plain policy gradient. Sequence 3 (15 and 25, A = -1): 15 + 20 (each token's
    # log-ratio clamped at 20) clamped at 20: phi = exp(2 + 60 - 2 e^20) = 0, a weight, no gradient. Sequence 4 (-19
    # and 0, A = 0.5): log w clamped at log 1e-8. Sequence 5 (-25 and 12, A = 0.5): log w = -20 + 12 = -8
    logp = torch.full((9,), -1.0, device=DEVICE)
    log_ratios = torch.tensor([0.2, 0.3, 0.0, 15.0, 25.0, -19.0, 0.0, -25.0, 12.0], device=DEVICE)
    old = logp - log_ratios
    adv = torch.tensor([1.0, 5.0, -2.0, -1.0, 0.5, 0.5], device=DEVICE)
    cu = torch.tensor([0, 2, 2, 3, 5, 7, 9], device=DEVICE)
    floor = math.log(1e-8)

    def phi(log_w, a, k_pos=2.0):
        k, lam = (k_pos, 3.0) if a >= 0 else (3.0, 2.0)
        return math.exp(lam + k * log_w - lam * math.exp(log_w))

    def expected(phis):  # per token: each sequence's phi A, from (phi, A, tokens) per sequence
        return torch.tensor([p * a for p, a, n in phis for _ in range(n)], dtype=torch.float64)

    phis = [(phi(0.5, 1.0), 1.0, 2), (1.0, -2.0, 1), (0.0, -1.0, 2), (phi(floor, 0.5), 0.5, 2), (phi(-8, 0.5), 0.5, 2)]
    loss, stats, grad = _run(logp, old, adv, cu, policy_loss="vespo")
    assert math.isclose(loss.item(), expected(phis).sum().item() / 9, rel_tol=1e-6)
    torch.testing.assert_close(grad.double().cpu(), -expected(phis) / 9, rtol=1e-6, atol=1e-9)
    assert stats["clip_frac_low"].item() == 0 and stats["clip_frac_high"].item() == 0
    # a small k shows the clamps: sequence 4's floor (e^(3 + 0.1 log 1e-8) = 3.18, not e^(3 - 1.9) = 3.0
    # unclamped) and sequence 5's token clamp (e^(3 - 0.8), not e^(3 - 1.3))
    _, _, grad = _run(logp, old, adv, cu, policy_loss="vespo", vespo_k_pos=0.1)
    phis = [(phi(0.5, 1.0, 0.1), 1.0, 2), *phis[1:3], (phi(floor, 0.5, 0.1), 0.5, 2), (phi(-8, 0.5, 0.1), 0.5, 2)]
    assert phis[3][0] > 3.1 and phis[4][0] > 8.5, "precondition: the clamps move sequences 4 and 5's weights"
    torch.testing.assert_close(grad.double().cpu(), -expected(phis) / 9, rtol=1e-6, atol=1e-9)
    # rollout weights enter each sequence's log w, not each token's term: e^-0.5 on sequence 0's first token makes
    # its w 1 (phi 1) and leaves the token unscaled; a zero weight is log 1e-8 (sequence 2's w, phi ~ 0)
    is_w = torch.tensor([math.exp(-0.5), 1.0, 0.0, *[1.0] * 6], device=DEVICE)
    _, _, grad = _run(logp, old, adv, cu, policy_loss="vespo", is_weights=is_w)
    phis = [
        (1.0, 1.0, 2),
        (phi(floor, -2.0), -2.0, 1),
        (0.0, -1.0, 2),
        (phi(floor, 0.5), 0.5, 2),
        (phi(-8, 0.5), 0.5, 2),
    ]
    torch.testing.assert_close(grad.double().cpu(), -expected(phis) / 9, rtol=1e-6, atol=1e-9)
    # a token mask scales each token's term and no sequence's weight: the same phis, tokens 1, 4 and 8 zeroed
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0], device=DEVICE)
    _, _, grad = _run(logp, old, adv, cu, policy_loss="vespo", is_weights=is_w, token_mask=mask)
    torch.testing.assert_close(grad.double().cpu(), -expected(phis) * mask.double().cpu() / 9, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("kl_max", [10.0, None])
def test_the_kl_term_at_extreme_log_ratios(triton_path, kl_max):
    # d = ref - logp of +-5 and +-20, one token each, A = 0 (the KL term alone), token-mean over 4, kl_coef 0.1.
    # k3 = e^d - d - 1: 142.4 (d = 5), 4.0067 (-5), 4.85e8 (20), 19.0 (-20). Capped at 10 the three above it are
    # constants (no gradient); uncapped each keeps kl_coef (1 - e^d): -4.85e7 at d = 20, finite
    logp = torch.full((4,), -30.0, device=DEVICE)
    d = torch.tensor([5.0, -5.0, 20.0, -20.0], dtype=torch.float64)
    ref = (logp.double().cpu() + d).float().to(DEVICE)
    cu = torch.tensor([0, 4], device=DEVICE)
    loss, stats, grad = _run(logp, logp, torch.zeros(1, device=DEVICE), cu, ref_logp=ref, kl_coef=0.1, kl_max=kl_max)
    k3 = d.exp() - d - 1
    moves = torch.ones(4, dtype=torch.bool) if kl_max is None else k3 <= kl_max
    if kl_max is not None:
        k3 = k3.clamp(max=kl_max)
        assert moves.tolist() == [False, True, False, False], "precondition: the cap binds on three of the four"
    assert math.isclose(loss.item(), 0.1 * k3.mean().item(), rel_tol=1e-5)
    expected = torch.where(moves, 0.1 * (1 - d.exp()), 0.0) / 4
    torch.testing.assert_close(grad.double().cpu(), expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad).all() and math.isclose(stats["kl_ref"].item(), k3.mean().item(), rel_tol=1e-5)


def test_policy_loss_settings_are_checked():
    with pytest.raises(SettingError, match="policy_loss"):
        PolicyLossConfig(policy_loss="geo_mean")
    with pytest.raises(SettingError, match="dual_clip"):
        PolicyLossConfig(policy_loss="vespo", dual_clip=3.0)
    for key, bad in (("vespo_k_pos", -1.0), ("vespo_k_neg", math.inf), ("vespo_lambda_pos", 0.0),
                     ("vespo_lambda_neg", math.nan)):  # fmt: skip
        with pytest.raises(SettingError, match=key):
            PolicyLossConfig(policy_loss="vespo", **{key: bad})
    assert PolicyLossConfig(policy_loss="vespo", vespo_k_pos=0.0).vespo_k_pos == 0.0  # phi = e^(lambda (1 - w))
    for loss in ("vanilla", "gspo", "vespo"):  # gspo is the surrogate at the sequence level; vespo has its own
        with pytest.raises(SettingError, match="ratio_level"):
            PolicyLossConfig(policy_loss=loss, ratio_level="sequence")
    with pytest.raises(SettingError, match="ratio_level"):
        PolicyLossConfig(policy_loss="cispo", ratio_level="sentence")
    assert PolicyLossConfig(policy_loss="sapo", ratio_level="sequence").per_sequence
    with pytest.raises(SettingError, match="kl_max"):
        PolicyLossConfig(kl_max=0.0)
    assert PolicyLossConfig(policy_loss="gspo", dual_clip=3.0).dual_clip == 3.0  # a surrogate: its dual clip too
    with pytest.raises(SettingError, match="dual_clip"):
        PolicyLossConfig(policy_loss="cispo", dual_clip=3.0)
    with pytest.raises(SettingError, match="clip_low"):
        PolicyLossConfig(clip_low=1.0)  # a clipped surrogate with no bound below
    assert PolicyLossConfig(policy_loss="cispo", clip_low=1.0).clip_low == 1.0
    assert PolicyLossConfig(policy_loss="cispo", clip_low=1.0, clip_high=-0.8).clip_high == -0.8  # TRL's cap of 0.2
    with pytest.raises(SettingError, match="clip_high"):
        PolicyLossConfig(policy_loss="cispo", clip_low=0.2, clip_high=-0.5)  # [0.8, 0.5]: an empty band
    for key in ("sapo_tau_pos", "sapo_tau_neg"):
        with pytest.raises(SettingError, match=key):
            PolicyLossConfig(policy_loss="sapo", **{key: 0.0})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_importance_weights_match_float64_reference(triton_path, agg):
    # per-token weights in [0, 3) (truncated and masked ones: zeros included) with clipping, dual clip and KL
    lens = [*torch.randint(1, 40, (60,)).tolist(), 0, 1500]
    logp, old, ref, adv, cu = _packed_batch(lens)
    weights = torch.rand(logp.shape[0], device=DEVICE) * 3
    weights[torch.rand(logp.shape[0], device=DEVICE) < 0.1] = 0.0
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0, agg=agg, norm_length=2048.0, ref_logp=ref, kl_coef=0.05)
    _against_truth(logp, old, adv, cu, is_weights=weights, **kw)
    # the weights scale the policy-gradient term only: with unit weights the loss is the unweighted one
    unit, _, _ = _run(logp, old, adv, cu, is_weights=torch.ones_like(weights), **kw)
    assert_close(unit, _truth(logp, old, adv, cu, **kw)[0], name="unit weights")


@pytest.mark.parametrize("policy_loss", ["vanilla", "gspo", "cispo", "sapo", "vespo", "cispo-sequence"])
def test_a_token_mask_matches_float64_reference(triton_path, policy_loss):
    # about half the tokens masked, with importance weights, the KL term and (the surrogate's) dual clip; the mask
    # scales each token's policy term after its weight: with is_weights (outside VESPO's sequence weights) it is the
    # weights' product, and the KL term keeps every token
    policy_loss, _, level = policy_loss.partition("-")
    lens = [*torch.randint(1, 40, (60,)).tolist(), 0, 1500]
    logp, old, ref, adv, cu = _packed_batch(lens)
    if policy_loss == "gspo" or level:
        old = sequences_off_the_bounds(logp, old, cu, margin=1e-3)
    weights = torch.rand(logp.shape[0], device=DEVICE) * 2
    mask = (torch.rand(logp.shape[0], device=DEVICE) < 0.5).float()
    assert 0 < mask.sum() < mask.numel(), "precondition: the mask keeps some tokens, not all"
    kw = dict(policy_loss=policy_loss, ratio_level=level or "token", clip_high=0.28, ref_logp=ref, kl_coef=0.05,
              is_weights=weights, dual_clip=3.0 if policy_loss in ("vanilla", "gspo") else None)  # fmt: skip
    loss, _, grad = _against_truth(logp, old, adv, cu, token_mask=mask, **kw)
    unmasked, _, _ = _run(logp, old, adv, cu, **kw)
    assert not torch.equal(loss, unmasked), "precondition: the mask changes the loss"
    if policy_loss != "vespo":
        folded, _, folded_grad = _run(logp, old, adv, cu, **{**kw, "is_weights": weights * mask})
        assert_close(loss, folded, name="loss, the mask folded into the weights")
        assert_close(grad, folded_grad, name="grad, the mask folded into the weights")
    # without the KL term a masked token of a token-level loss has no gradient
    if not level and policy_loss != "gspo":
        _, _, grad = _run(logp, old, adv, cu, token_mask=mask, **{**kw, "ref_logp": None, "kl_coef": 0.0})
        assert grad[mask == 0].abs().max() == 0 and grad[mask == 1].abs().max() > 0


def test_importance_weights_by_hand(triton_path):
    # ratio 1, A = 1, token-mean over 3 tokens: pg_t = -w_t, dloss/dlogp_t = -w_t / 3; the KL term is unweighted
    logp = torch.full((3,), -1.0, device=DEVICE)
    ref = logp + torch.tensor([0.0, 0.5, -0.5], device=DEVICE)
    weights = torch.tensor([0.0, 1.0, 2.5], device=DEVICE)
    cu = torch.tensor([0, 3], device=DEVICE)
    loss, _, grad = _run(logp, logp, torch.ones(1, device=DEVICE), cu, is_weights=weights, ref_logp=ref, kl_coef=0.1)
    d = (ref - logp).double().cpu()
    kl = d.exp() - d - 1
    expected = (-weights.double().cpu() + 0.1 * kl).mean()
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-6)
    expected_grad = (-weights.double().cpu() + 0.1 * (1 - d.exp())) / 3
    torch.testing.assert_close(grad.double().cpu(), expected_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("with_ref", [False, True])
def test_extreme_log_ratios_stay_finite(triton_path, with_ref):
    # log-ratios of +-100 (exp overflows float32 past ~88) with zero and non-zero advantages: without the clamp
    # the ratio is inf and 0 * inf is NaN in the loss and its gradient
    old = torch.full((8,), -2.0, device=DEVICE)
    logp = old + torch.tensor([100.0, -100.0, 100.0, -100.0, 100.0, -100.0, 19.0, -19.0], device=DEVICE)
    adv = torch.tensor([0.0, 0.0, 1.0, 1.0, -1.0, -1.0, 0.0, 1.0], device=DEVICE)
    cu = torch.arange(9, device=DEVICE)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    if with_ref:  # the k3 exponent ref - logp is +-100 too
        kw.update(ref_logp=old, kl_coef=0.1)
    for path in ("triton", "reference"):
        if path == "triton":
            loss, stats, grad = _run(logp, old, adv, cu, **kw)
        else:
            loss, stats, grad = _truth(logp, old, adv, cu, **kw)
        assert torch.isfinite(loss), path
        assert torch.isfinite(grad).all(), path
        assert all(torch.isfinite(v) for v in stats.values()), path
    _, _, grad = _against_truth(logp, old, adv, cu, **kw)
    # outside the clamp the ratio does not move with logp: the only gradient left is the (unclamped) k3's inside
    assert grad[:6].abs().max() == 0


def test_bfloat16_log_probs(triton_path):
    logp, old, ref, adv, cu = _packed_batch([40, 17, 0, 300], torch.bfloat16)
    loss, _, grad = _run(logp, old, adv, cu, ref_logp=ref, kl_coef=0.1)
    t_loss, _, t_grad = _truth(logp, old, adv, cu, ref_logp=ref, kl_coef=0.1)
    assert_close(loss, t_loss, name="loss")  # float32 arithmetic on exactly-upcast inputs
    assert grad.dtype == torch.bfloat16
    assert_close(grad, t_grad, tol=torch.bfloat16, name="grad")


def test_int32_boundaries_and_bfloat16_advantages(triton_path):
    logp, old, _, adv, cu = _packed_batch([7, 0, 130, 2])
    adv16 = adv.bfloat16()
    loss, _, grad = _run(logp, old, adv16, cu.int(), dual_clip=2.0)
    t_loss, _, t_grad = _truth(logp, old, adv16, cu, dual_clip=2.0)
    assert_close(loss, t_loss, name="loss")
    assert_close(grad, t_grad, name="grad")


def test_hand_worked_tokens(triton_path):
    # one token per sequence, so A is that token's advantage; clip 0.2 both sides, dual clip 3, token-mean
    #   r = 1.0, A = +1: unclipped          pg = -1.0     dpg/dlogp = -r A = -1
    #   r = 1.5, A = +1: high clip binds    pg = -1.2     0
    #   r = 0.5, A = +1: below the range, r A is the min, unclipped    pg = -0.5   -0.5
    #   r = 0.5, A = -1: low clip binds     pg = 0.8      0
    #   r = 2.0, A = -1: unclipped          pg = 2.0      -r A = 2
    #   r = 4.0, A = -1: dual clip binds    pg = 3.0      0
    ratios = torch.tensor([1.0, 1.5, 0.5, 0.5, 2.0, 4.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -1.0], device=DEVICE)
    old = torch.full((6,), -1.0, dtype=torch.float64)
    logp = (old + ratios.log()).float().to(DEVICE)
    cu = torch.arange(7, device=DEVICE)
    loss, stats, grad = _run(logp, old.float().to(DEVICE), adv, cu, dual_clip=3.0)
    pg = torch.tensor([-1.0, -1.2, -0.5, 0.8, 2.0, 3.0], dtype=torch.float64)
    dpg = torch.tensor([-1.0, 0.0, -0.5, 0.0, 2.0, 0.0], dtype=torch.float64)
    assert math.isclose(loss.item(), pg.mean().item(), rel_tol=1e-6)
    torch.testing.assert_close(grad.double().cpu(), dpg / 6, rtol=1e-6, atol=1e-7)
    assert math.isclose(stats["clip_frac_high"].item(), 1 / 6, rel_tol=1e-6)
    assert math.isclose(stats["clip_frac_low"].item(), 1 / 6, rel_tol=1e-6)
    assert math.isclose(stats["dual_clip_frac"].item(), 1 / 6, rel_tol=1e-6)
    assert math.isclose(stats["ratio_mean"].item(), ratios.mean().item(), rel_tol=1e-6)


@pytest.mark.parametrize("path", ["triton", "torch"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_clip", [False, True])
@pytest.mark.parametrize("kl", [False, True])
def test_asymmetric_clips_by_hand(monkeypatch, path, agg, dual_clip, kl):
    # clip 0.1 / 0.3, ratios past each bound and inside, both advantage signs, uneven lengths (tests/kernels/checks.py
    # works every token out): a bound on the wrong side or a mixed-up aggregation fails here, in both paths, where a
    # comparison of the kernel with the reference would not see a mistake that both make
    monkeypatch.setenv(_common.BACKEND_ENV, path)
    case = hand_worked_case(dual_clip=dual_clip, kl=kl, agg=agg)
    old = torch.full((len(case["ratios"]),), -1.5, dtype=torch.float64)
    logp = (old + torch.tensor(case["ratios"], dtype=torch.float64).log()).float().to(DEVICE)
    cu = torch.tensor([0, *itertools.accumulate(case["lengths"])], device=DEVICE)
    ref = None
    if case["ref_shifts"] is not None:
        ref = logp + torch.tensor(case["ref_shifts"], device=DEVICE)
    adv = torch.tensor(case["advantages"], device=DEVICE)
    loss, stats, grad = _run(logp, old.float().to(DEVICE), adv, cu, ref_logp=ref, **case["options"])
    assert math.isclose(loss.item(), case["loss"], rel_tol=1e-5, abs_tol=1e-7)
    torch.testing.assert_close(grad.double().cpu(), torch.tensor(case["grad"], dtype=torch.float64), rtol=1e-5,
                               atol=1e-7)  # fmt: skip
    for name, value in case["stats"].items():
        assert math.isclose(stats[name].item(), value, rel_tol=1e-5, abs_tol=1e-7), name


def test_aggregations_by_hand(triton_path):
    # two sequences of lengths 1 and 3, ratio 1 everywhere, so pg_t = -A_s:
    #   token-mean               (-2 + 3 * -1) / 4      = -1.25
    #   seq-mean-token-mean      (-2/1 + -3/3) / 2      = -1.5
    #   seq-mean-token-sum-norm  (-2 + -3) / (2 * 10)   = -0.25
    logp = torch.full((4,), -0.5, device=DEVICE)
    adv = torch.tensor([2.0, 1.0], device=DEVICE)
    cu = torch.tensor([0, 1, 4], device=DEVICE)
    expected = {"token-mean": -1.25, "seq-mean-token-mean": -1.5, "seq-mean-token-sum-norm": -0.25}
    for agg, value in expected.items():
        loss, _ = clipped_policy_loss(logp, logp, adv, cu, agg=agg, norm_length=10)
        assert math.isclose(loss.item(), value, rel_tol=1e-6), agg


def test_micro_batches_with_global_normalisers_sum_to_the_whole(triton_path):
    lengths = [30, 12, 50, 7, 61, 4]
    logp, old, _, adv, cu = _packed_batch(lengths)
    n, s = int(cu[-1]), 6
    # the halves have opposite signs as often as not, so their sum can cancel to ~1e-3 of each: bound the float32
    # error by the summed magnitudes instead. |pg_t| <= |A| max(r_t, 1 + clip) <= |A| max(r_t, 2); each side is a
    # float32 sum of the same n terms (each with a few roundings of its own) in its own order, so each errs by at
    # most (n + 8) 2^-24 of their summed magnitudes, and the two sides by twice that
    per_seq = torch.tensor(lengths, device=DEVICE)
    magnitude = adv.double().abs().repeat_interleave(per_seq) * (logp.double() - old.double()).exp().clamp(min=2.0)
    weights = {"token-mean": 1.0 / n, "seq-mean-token-mean": 1.0 / (s * per_seq.double()).repeat_interleave(per_seq)}
    for agg in ("token-mean", "seq-mean-token-mean"):
        whole, _, whole_grad = _run(logp, old, adv, cu, agg=agg)
        halves, grads = [], []
        for seqs in (slice(0, 3), slice(3, 6)):
            lo, hi = int(cu[seqs.start]), int(cu[seqs.stop])
            part_cu = cu[seqs.start : seqs.stop + 1] - lo
            loss, _, grad = _run(logp[lo:hi], old[lo:hi], adv[seqs], part_cu, agg=agg, total_tokens=n, total_seqs=s)
            halves.append(loss)
            grads.append(grad)
        bound = 2 * (n + 8) * 2**-24 * (magnitude * weights[agg]).sum().item()
        # a real loss, and a bound far under what a wrong normaliser would miss by
        assert whole.abs().item() > 0 and bound < 1e-3, agg
        assert abs(sum(halves).item() - whole.item()) <= bound, agg
        torch.testing.assert_close(torch.cat(grads), whole_grad, rtol=1e-6, atol=1e-9)


def test_forward_only_without_grad(triton_path):
    logp, old, _, adv, cu = _packed_batch([10, 20])
    loss, _ = clipped_policy_loss(logp, old, adv, cu)  # logp does not require grad: no gradient written
    assert not loss.requires_grad
    assert_close(loss, _truth(logp, old, adv, cu)[0], name="loss")


def test_all_sequences_empty(triton_path):
    logp = torch.zeros(0, device=DEVICE, requires_grad=True)
    loss, stats = clipped_policy_loss(
        logp, logp.detach(), torch.ones(3, device=DEVICE), torch.zeros(4, device=DEVICE, dtype=torch.long)
    )
    loss.backward()
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"clip_low": 1.0}, "clip_low"),
        ({"dual_clip": 0.5}, "dual_clip must be > 1"),
        ({"agg": "sum"}, "agg must be one of"),
        ({"agg": "seq-mean-token-sum-norm"}, "norm_length must be > 0 with agg='seq-mean-token-sum-norm'"),
        ({"entropy_coef": 0.01}, "linear_policy_loss"),
        ({"kl_coef": 0.1}, "needs ref_logp"),
        ({"total_tokens": 0}, "total_tokens"),
        ({"is_weights": torch.ones(2)}, "is_weights must have 3 elements"),
    ],
)
def test_bad_options_name_the_problem(kwargs, match):
    logp = torch.zeros(3)
    with pytest.raises(ValueError, match=match):
        clipped_policy_loss(logp, logp, torch.zeros(1), torch.tensor([0, 3]), **kwargs)


def test_settings_as_one_config_or_as_keywords(triton_path):
    # the loss takes its settings as one PolicyLossConfig; the keywords are its fields, the same loss to the bit
    logp, old, ref, adv, cu = _packed_batch([5, 0, 40])
    config = PolicyLossConfig(clip_low=0.1, clip_high=0.3, dual_clip=2.0, kl_coef=0.05)
    by_config = _run(logp, old, adv, cu, ref_logp=ref, config=config)
    by_keywords = _run(logp, old, adv, cu, ref_logp=ref, clip_low=0.1, clip_high=0.3, dual_clip=2.0, kl_coef=0.05)
    assert torch.equal(by_config[0], by_keywords[0]) and torch.equal(by_config[2], by_keywords[2])
    with pytest.raises(TypeError, match="not both"):
        clipped_policy_loss(logp, old, adv, cu, config=config, clip_high=0.2)
    with pytest.raises(TypeError, match="'clip_hgh'"):
        clipped_policy_loss(logp, old, adv, cu, clip_hgh=0.2)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [({"clip_low": -0.1}, "clip_low"), ({"clip_high": float("nan")}, "clip_high"), ({"kl_coef": math.inf}, "kl_coef"),
     ({"entropy_coef": -1.0}, "entropy_coef"), ({"agg": "seq-mean-token-sum-norm"}, "norm_length")],
)  # fmt: skip
def test_a_bad_setting_names_its_field(kwargs, key):
    # validated once, where the config is made; the error carries the field, for a caller's own key (loss.<key>)
    with pytest.raises(SettingError, match=f"^{key} ") as err:
        PolicyLossConfig(**kwargs)
    assert err.value.key == key and str(err.value) == f"{key} {err.value.why}"


def test_bad_shapes_name_the_tensor():
    logp = torch.zeros(3)
    with pytest.raises(ValueError, match="cu_seqlens must have 2 elements"):
        clipped_policy_loss(logp, logp, torch.zeros(1), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="old_logp must have 3 elements"):
        clipped_policy_loss(logp, torch.zeros(4), torch.zeros(1), torch.tensor([0, 3]))
    with pytest.raises(TypeError, match="cu_seqlens has dtype float32"):
        clipped_policy_loss(logp, logp, torch.zeros(1), torch.tensor([0.0, 3.0]))


def _split_off_first_tokens(adv, first, cu):
    """The same tokens with each nonempty sequence's first token a sequence of its own: its advantage ``first``,
    the rest keeping ``adv`` (under token-mean, the loss and gradient a first-token advantage must give)."""
    advs, bounds = [], [0]
    for s in range(len(adv)):
        lo, hi = int(cu[s]), int(cu[s + 1])
        if hi > lo:
            advs.append(first[s])
            bounds.append(lo + 1)
        advs.append(adv[s])
        bounds.append(hi)
    return torch.stack(advs), torch.tensor(bounds, dtype=cu.dtype, device=cu.device)


@pytest.mark.parametrize("lengths", ["ragged", "many-short"])
@pytest.mark.parametrize("dual_clip", [None, 1.5])
def test_first_token_advantages(triton_path, lengths, dual_clip):
    lens = LENGTHS[lengths] or torch.randint(1, 21, (300,)).tolist()
    logp, old, _, adv, cu = _packed_batch(lens)
    # every first token's advantage is at least 1 above its sequence's: the objective rises strictly in the
    # advantage (its slope is the ratio, the clipped ratio or the dual clip, all > 0), so the loss must fall
    first = adv + 1 + torch.rand_like(adv)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip)
    loss, stats, grad = _run(logp, old, adv, cu, first_advantages=first, **kw)
    x = logp.detach().double().requires_grad_()
    t_loss, t_stats = clipped_policy_loss_reference(
        x, old.double(), adv.double(), cu, config=PolicyLossConfig(**kw), first_advantages=first.double()
    )
    t_loss.backward()
    assert_close(loss, t_loss, name="loss")
    assert_close(grad, x.grad, name="grad")
    for name in STAT_NAMES:
        assert_close(stats[name], t_stats[name], name=name)
    # the semantics, independently: the first tokens as sequences of their own (token-mean does not see the split)
    split_adv, split_cu = _split_off_first_tokens(adv, first, cu)
    s_loss, _, s_grad = _truth(logp, old, split_adv, split_cu, **kw)
    assert_close(loss, s_loss, name="loss against the split batch")
    assert_close(grad, s_grad, name="grad against the split batch")
    # precondition: the first tokens' advantages changed the loss (by >= S * min slope / N, far above 1e-4)
    plain, _, _ = _run(logp, old, adv, cu, **kw)
    assert plain - loss > 1e-4


def test_vespo_on_the_torch_path_by_hand(monkeypatch):
    # the same hand-worked weights on the autograd path (vespo_weights, token_terms_reference) that CPU tensors take
    # without the Triton interpreter: the by-hand checks above, run with the backend forced to torch
    monkeypatch.setenv(_common.BACKEND_ENV, "torch")
    test_vespo_by_hand(None)
    test_a_vespo_weight_past_float32_is_zero(None)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_vespo_clamps_each_tokens_log_ratio_before_the_sum(monkeypatch, path):
    # log-ratios 25 and -24: clamped to +-20 per token they sum to log w = 0 (phi = 1, the plain policy gradient);
    # summed first they would be 1 (phi = e^(3 + 2 - 3e) = 0.043). Token-mean over 2 tokens, A = 1: dloss/dlogp_t =
    # -phi A / 2
    monkeypatch.setenv(_common.BACKEND_ENV, path)
    logp = torch.full((2,), -1.0, device=DEVICE)
    old = logp - torch.tensor([25.0, -24.0], device=DEVICE)
    adv, cu = torch.tensor([1.0], device=DEVICE), torch.tensor([0, 2], device=DEVICE)
    _, _, grad = _run(logp, old, adv, cu, policy_loss="vespo")
    torch.testing.assert_close(grad.double().cpu(), torch.full((2,), -0.5, dtype=torch.float64), rtol=1e-6, atol=1e-9)
