"""group_advantages: the Triton kernel against the reference in float64, and the zero-variance rules."""

from __future__ import annotations

import math

import pytest
import torch

from fasttnt_kernels import group_advantages, group_advantages_reference

from checks import DEVICE, assert_close


def error_bound(rewards: torch.Tensor, k: int, scale: str) -> torch.Tensor:
    """A first-order bound on each float32 advantage's error, from the kernel's arithmetic, per group of K (u =
    2^-24, M = max|r|). Each division and square root is allowed 4u: CUDA's float32 division and Triton's sqrt
    there are not correctly rounded (within 2 ulp); the interpreter's are. The sum of K terms errs by (K - 1) K u M
    in any order, so the mean by (K + 3) u M and each centred value by (K + 5) u M; with scale="std" that is
    (K + 5) u cond of an advantage (cond = M / (s + eps)). The denominator, the norm of the centred values over
    sqrt(K - 1) plus eps, errs relatively by sqrt(K / (K - 1)) (K + 5) u cond from the centring and by (K + 7) u from
    its own roundings (squares, sum, division, sqrt, eps's cast and sum), which an advantage (|A| <= (K - 1) /
    sqrt(K)) carries, plus the last division's 4u. 1% for the second order. Centring a group of 3 normals with std
    1e-3 loses most of float32's digits; a fixed tolerance fails there."""
    r = rewards.double().reshape(-1, k)  # (G, K)
    u, m = 2.0**-24, r.abs().amax(1)
    if scale == "none":
        bound = (k + 5) * u * m
    else:
        cond = m / (r.std(1) + 1e-6)
        rho = math.sqrt(k / (k - 1)) * (k + 5) * u * cond + (k + 7) * u
        bound = (k + 5) * u * cond + (k - 1) / math.sqrt(k) * (rho + 4 * u)
    return 1.01 * bound  # (G,)


# (G, K): one group; the paper's 8 samples; 16 samples x 128 prompts (verl's DeepScaleR setup); K not a power
# of two (5, 33) so the tile has dead columns; many groups of 3 spread over several programs.
@pytest.mark.parametrize("shape", [(1, 8), (128, 16), (7, 5), (3, 33), (3000, 3)])
@pytest.mark.parametrize("scale", ["std", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_float64_reference(triton_path, shape, scale, dtype):
    g, k = shape
    rewards = torch.randn(g * k, device=DEVICE).to(dtype)
    adv = group_advantages(rewards, k, scale=scale)
    assert adv.dtype == torch.float32 and adv.shape == (g * k,)
    assert not torch.isnan(adv).any()
    truth = group_advantages_reference(rewards.double(), k, scale=scale)
    bound = error_bound(rewards, k, scale)  # (G,)
    err = (adv.double() - truth).abs().reshape(g, k)
    assert bool((err <= bound[:, None]).all()), f"worst {(err / bound[:, None]).max():.2f} of the bound"
    # the defining properties, checked on the kernel's output: zero mean per group (the truth's is 0 to float64
    # rounding, so the output's is within its largest error), unit unbiased std (std moves by at most the errors'
    # norm over sqrt(K - 1))
    per_group = adv.double().reshape(g, k)
    assert bool((per_group.mean(1).abs() <= bound + 1e-12).all())
    if scale == "std":
        # std(A) = s / (s + eps) for the rewards' unbiased std s
        s = rewards.double().reshape(g, k).std(1)
        std_err = (per_group.std(1) - s / (s + 1e-6)).abs()
        assert bool((std_err <= math.sqrt(k / (k - 1)) * bound + 1e-12).all())


def test_verifier_style_rewards(triton_path):
    # rewards from the TNT table: a handful of values, so many groups are flat and others mix
    table = torch.tensor([1.0, 0.0, 2.0, -1.0, -2.0], device=DEVICE)
    rewards = table[torch.randint(0, 5, (64 * 8,), device=DEVICE)]
    rewards[:16] = 1.0  # two groups where every sample is right
    adv = group_advantages(rewards, 8)
    assert_close(adv, group_advantages_reference(rewards.double(), 8), name="advantages")
    assert torch.equal(adv[:16], torch.zeros(16, device=DEVICE))


@pytest.mark.parametrize("value", [0.1, 1.0 / 3.0, 1e6, -7.25])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_all_equal_group_is_exactly_zero(triton_path, value, scale):
    # 0.1 x 7 / 7 is not 0.1 in float32: centring leaves an ulp that eps=1e-6 would amplify; it must be 0
    rewards = torch.full((7 * 4,), value, device=DEVICE)
    rewards[7:14] = torch.arange(7, device=DEVICE, dtype=torch.float32)  # one ordinary group beside them
    adv = group_advantages(rewards, 7, scale=scale)
    assert torch.equal(adv[:7], torch.zeros(7, device=DEVICE))
    assert torch.equal(adv[14:], torch.zeros(14, device=DEVICE))
    assert adv[7:14].abs().sum() > 0


@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_size_one_is_zero(triton_path, scale):
    adv = group_advantages(torch.randn(10, device=DEVICE), 1, scale=scale)
    assert torch.equal(adv, torch.zeros(10, device=DEVICE))


def test_eps_is_added_to_the_std(triton_path):
    rewards = torch.tensor([0.0, 1e-7, 0.0, 1e-7], device=DEVICE)  # std ~5.8e-8, far below eps
    adv = group_advantages(rewards, 4, eps=1e-6)
    assert adv.abs().max() < 0.1  # (r - mean) / (std + eps), not / std
    assert_close(adv, group_advantages_reference(rewards.double(), 4, eps=1e-6), name="advantages")


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64])
def test_other_reward_dtypes_and_zero_eps(triton_path, dtype):
    rewards = torch.randn(40 * 6, device=DEVICE).to(dtype)
    adv = group_advantages(rewards, 6, eps=0.0)
    assert adv.dtype == torch.float32
    assert_close(adv, group_advantages_reference(rewards.double(), 6, eps=0.0), name="advantages")


def test_empty_input(triton_path):
    assert group_advantages(torch.zeros(0, device=DEVICE), 4).shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"rewards": torch.zeros(10), "group_size": 3}, "not a multiple of group_size=3"),
        ({"rewards": torch.zeros(10), "group_size": 0}, "group_size"),
        ({"rewards": torch.zeros(10), "group_size": 5, "scale": "mad"}, "scale"),
        ({"rewards": torch.zeros(2, 5), "group_size": 5}, "1-D"),
    ],
)
def test_bad_input_names_the_problem(kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(**kwargs)
