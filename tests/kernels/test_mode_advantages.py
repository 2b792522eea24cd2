"""mode_advantages: the Triton kernel against the float64 reference, hand-worked groups, and the zero rules."""

from __future__ import annotations

import pytest
import torch

from fasttnt_kernels import group_advantages_reference, mode_advantages, mode_advantages_reference

from checks import DEVICE, assert_close


def _both(rewards, modes, k, **kw):
    rewards = torch.tensor(rewards, dtype=torch.float32, device=DEVICE)
    nt = torch.tensor(modes, dtype=torch.bool, device=DEVICE)
    return mode_advantages(rewards, nt, k, **kw), mode_advantages_reference(rewards.double(), nt, k, **kw)


T, N = False, True


@pytest.mark.parametrize("scale", ["std", "none"])
def test_hand_worked_group_of_both_modes(triton_path, scale):
    # thinking 1, 1, 0, 1 (mean 0.75); direct 2, -1, 2, 2 (mean 1.25): the gap is 0.5 in reward units, whatever
    # the scale (which is the answers')
    out, ref = _both([1, 1, 0, 1, 2, -1, 2, 2], [T] * 4 + [N] * 4, 8, scale=scale, eps=0.0)
    mode = [-0.5] * 4 + [0.5] * 4
    if scale == "none":
        answer = [0.25, 0.25, -0.75, 0.25, 0.75, -2.25, 0.75, 0.75]
    else:  # std of the thinking rows 0.5, of the direct rows 1.5
        answer = [0.5, 0.5, -1.5, 0.5, 0.5, -1.5, 0.5, 0.5]
    for got in (out, ref):
        assert_close(got.answer.double(), torch.tensor(answer, dtype=torch.float64, device=DEVICE), name="answer")
        assert_close(got.mode.double(), torch.tensor(mode, dtype=torch.float64, device=DEVICE), name="mode")


@pytest.mark.parametrize("scale", ["std", "none"])
def test_hand_worked_edges(triton_path, scale):
    rewards = [
        1,
        0,
        1,
        1,  # one mode only: no mode gap; the answers are plain GRPO's
        1,
        1,
        0,
        2,  # a direct mode of one row: its answer advantage 0, its mode gap 2 - 2/3
        1,
        1,
        1,
        1,  # every reward equal, both modes present: all zero
        0,
        0,
        2,
        2,
    ]  # each mode flat, the modes apart: answers 0, mode gaps -+2
    modes = [T, T, T, T, T, T, T, N, T, N, T, N, T, T, N, N]  # fmt: skip
    out, ref = _both(rewards, modes, 4, scale=scale, eps=0.0)
    plain = group_advantages_reference(torch.tensor(rewards[:4], dtype=torch.float64), 4, scale=scale, eps=0.0)
    std = (lambda x: torch.tensor(x, dtype=torch.float64).std().item()) if scale == "std" else (lambda x: 1.0)
    answer = [*plain.tolist(), *[v / (std([1, 1, 0]) if scale == "std" else 1) for v in (1 / 3, 1 / 3, -2 / 3)], 0.0,
              *[0.0] * 8]  # fmt: skip
    mode = [0.0] * 4 + [-4 / 3] * 3 + [4 / 3] + [0.0] * 4 + [-2.0] * 2 + [2.0] * 2
    for got in (out, ref):
        assert not torch.isnan(got.answer).any() and not torch.isnan(got.mode).any()
        assert_close(got.answer.double(), torch.tensor(answer, dtype=torch.float64, device=DEVICE), name="answer")
        assert_close(got.mode.double(), torch.tensor(mode, dtype=torch.float64, device=DEVICE), name="mode")


@pytest.mark.parametrize("scale", ["std", "none"])
def test_groups_of_two_one_row_per_mode(triton_path, scale):
    # the smallest group with a mode gap: each mode one row, so every answer advantage is 0 and the gap is the
    # rewards' difference, signed by mode (a group of one row has none: test_group_size_one_is_zero)
    out, ref = _both([1, 0, 0, 2, 1, 1], [T, N, T, N, N, T], 2, scale=scale, eps=0.0)
    mode = torch.tensor([1.0, -1.0, -2.0, 2.0, 0.0, 0.0], dtype=torch.float64, device=DEVICE)
    for got in (out, ref):
        assert_close(got.answer.double(), torch.zeros_like(mode), name="answer")
        assert_close(got.mode.double(), mode, name="mode")


# (G, K) as group_advantages tests them: one group, the paper's 8, DeepScaleR's 16 x 128, dead tile columns
@pytest.mark.parametrize("shape", [(1, 8), (128, 16), (7, 5), (3, 33), (500, 3)])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_matches_float64_reference_on_table_rewards(triton_path, shape, scale):
    g, k = shape
    # the TNT table's values: many modes and groups flat, others mixed; the mode drawn at a random share per group
    table = torch.tensor([1.0, 0.0, 2.0, -1.0, -2.0], device=DEVICE)
    rewards = table[torch.randint(0, 5, (g * k,), device=DEVICE)]
    share = torch.rand(g, 1, device=DEVICE).expand(g, k).reshape(-1)
    nt = torch.rand(g * k, device=DEVICE) < share
    # group 0 holds both modes, their means apart (thinking 1 x k-1 against one direct 2): a gap to check
    rewards[: k - 1], nt[: k - 1], rewards[k - 1], nt[k - 1] = 1.0, False, 2.0, True
    out = mode_advantages(rewards, nt, k, scale=scale)
    ref = mode_advantages_reference(rewards.double(), nt, k, scale=scale)
    assert out.answer.dtype == out.mode.dtype == torch.float32
    assert_close(out.answer, ref.answer, name="answer")
    assert_close(out.mode, ref.mode, name="mode")
    # the defining properties on the kernel's output: answers centre within each (group, mode); the mode gaps
    # of the modes present in a group are opposite
    a, m = out.answer.double().reshape(g, k), out.mode.double().reshape(g, k)
    flags = nt.reshape(g, k)
    for flag in (False, True):
        assert ((a * (flags == flag)).sum(1).abs() < 1e-4).all()
    mean_gap = (m * flags).sum(1) / flags.sum(1).clamp(min=1) + (m * ~flags).sum(1) / (~flags).sum(1).clamp(min=1)
    assert (mean_gap.abs() < 1e-5).all()
    assert m[0].abs().min() > 0  # precondition: the gap was computed


def _conditioning(r: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """max|r| / std over each group's ``rows`` (G, K) bool, per row (G*K,): how many digits centring there loses."""
    x = torch.where(rows, r, torch.nan)
    n = rows.sum(1, keepdim=True)
    mean = x.nansum(1, keepdim=True) / n.clamp(min=1)
    std = (((x - mean) ** 2).nansum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    cond = x.abs().nan_to_num(0.0).amax(1, keepdim=True) / (std + 1e-6)
    return cond.expand_as(r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_rewards_match_the_reference(triton_path, dtype):
    g, k = 64, 8
    rewards = torch.randn(g * k, device=DEVICE).to(dtype)
    nt = torch.rand(g * k, device=DEVICE) < 0.5
    out = mode_advantages(rewards, nt, k)
    ref = mode_advantages_reference(rewards.double(), nt, k)
    # Rounding, from float32 sums of at most k terms (relative error <= k u, u = 2^-24) and the exact float64 truth:
    # a mean is off by <= k u max|x|, so a centred value, its std and the quotient are off by <= 2 k u cond (1 + |a|)
    # with cond = max|x| / std over the rows that were centred. An answer is centred within its (group, mode), whose
    # std can be far below the group's (three close rewards of one mode): its cond is that mode's. The gap is a
    # difference of two such means, each off by <= k u max|x| over the group, plus the subtraction's rounding.
    r, flags = rewards.double().reshape(g, k), nt.reshape(g, k)
    cond_answer = torch.where(flags, _conditioning(r, flags), _conditioning(r, ~flags)).reshape(-1)
    r_max = r.abs().amax(1, keepdim=True).expand(g, k).reshape(-1)
    u = 2.0**-24
    bounds = {
        "answer": 1e-6 + 2 * k * u * cond_answer * (1 + ref.answer.abs()),
        "mode": 1e-6 + (2 * k + 2) * u * r_max,
    }
    for name, got, truth in (("answer", out.answer, ref.answer), ("mode", out.mode, ref.mode)):
        assert not torch.isnan(got).any()
        assert truth.abs().max() > 0.1  # precondition: advantages were computed, not all zero
        err = (got.double() - truth).abs()
        bound = bounds[name]
        assert bool((err <= bound).all()), f"{name}: worst {(err / bound).max():.2f}"


@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_size_one_is_zero(triton_path, scale):
    out = mode_advantages(torch.randn(10, device=DEVICE), torch.rand(10, device=DEVICE) < 0.5, 1, scale=scale)
    assert torch.equal(out.answer, torch.zeros(10, device=DEVICE))
    assert torch.equal(out.mode, torch.zeros(10, device=DEVICE))


def test_bad_inputs_are_named(triton_path):
    with pytest.raises(ValueError, match="non_thinking must have 8 elements"):
        mode_advantages(torch.zeros(8, device=DEVICE), torch.zeros(4, dtype=torch.bool, device=DEVICE), 4)
    with pytest.raises(ValueError, match="not a multiple of group_size=3"):
        mode_advantages(torch.zeros(8, device=DEVICE), torch.zeros(8, dtype=torch.bool, device=DEVICE), 3)
