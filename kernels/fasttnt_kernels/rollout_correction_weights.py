"""Importance weights for samples drawn by another engine than the one that scores them, for the ``is_weights`` of
``clipped_policy_loss`` and ``linear_policy_loss``.

The rollout engine samples with its own kernels and numerics (vLLM: bf16, its own sampler), so its token
probabilities differ from the trainer's. With rho = exp(old - rollout), per token (``token-*``) or per sequence
from the sum of its tokens' differences (``sequence-*``), clamped to +-20 before ``exp``:

    *-truncate   w = min(rho, cap)
    *-mask       w = rho where rho <= cap, 0 elsewhere
    none         no weights (the statistics only)

The same modes and formulas as TRL's ``vllm_importance_sampling_mode`` (grpo_trainer.py, trl 1.16) with its lower
bound unset; verl calls it rollout correction. No Triton kernel: elementwise work and one segment sum, which the
reference does in a handful of memory-bound PyTorch ops with no host sync, so it is the implementation too.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import _common
from ._common import LOG_RATIO_CLAMP

RolloutCorrection = Literal["none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"]
ROLLOUT_CORRECTIONS = ("none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask")


def check_correction(mode: str, cap: float, *, names: tuple[str, str] = ("mode", "cap")) -> None:
    """Refuse a correction ``mode`` not in ``ROLLOUT_CORRECTIONS`` or a ``cap`` below 1, naming each by ``names``
    (the caller's own names for them)."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"{names[0]} must be one of {ROLLOUT_CORRECTIONS}, got {mode!r}")
    if not cap >= 1.0:
        raise ValueError(f"{names[1]} must be >= 1 (a weight of 1 means on-policy), got {cap}")


def token_correction_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, *, mode: str, cap: float):
    """A token mode's weights (n,) float32 (None for ``none``) of any range of tokens, no statistics: each token's
    weight reads its own log-probs alone (``linear_policy_loss`` forms them chunk by chunk)."""
    if mode.startswith("sequence"):
        raise ValueError(f"mode={mode!r}: a sequence's weight needs all of its tokens (rollout_correction_weights)")
    return _weights_of(old_logp.detach().float() - rollout_logp.detach().float(), mode, cap)[2]


def _weights_of(log_rho: torch.Tensor, mode: str, cap: float):
    """rho = exp(log_rho) clamped, the tokens past the cap, and the mode's weights (None for ``none``)."""
    rho = torch.exp(log_rho.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))  # (N,)
    over = rho > cap  # (N,) the tokens a truncation or a mask changes
    if mode == "none":
        weights = None
    elif mode.endswith("truncate"):
        weights = rho.clamp(max=cap)
    else:
        weights = rho.masked_fill(over, 0.0)
    return rho, over, weights


def rollout_correction_weights_reference(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    mode: RolloutCorrection,
    cap: float,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The semantics in plain PyTorch (``rollout_correction_weights`` runs it after checking its inputs)."""
    N = old_logp.shape[0]
    diff = old_logp.detach().float() - rollout_logp.detach().float()  # (N,)
    if mode.startswith("sequence"):
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (S,)
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=diff.device), lengths, output_size=N)
        per_seq = torch.zeros(lengths.numel(), dtype=diff.dtype, device=diff.device).index_add_(0, seq, diff)
        log_rho = per_seq[seq]  # (N,) each token carries its sequence's summed difference
    else:
        log_rho = diff
    rho, over, weights = _weights_of(log_rho, mode, cap)
    applied = rho if weights is None else weights
    changed = over if weights is not None else torch.zeros_like(over)
    n = max(N, 1)
    stats = {
        "rollout_logp_diff": diff.abs().sum() / n,
        "rollout_is_mean": applied.sum() / n,
        "rollout_is_clipped_frac": changed.sum().float() / n,
    }
    return weights, stats


def rollout_correction_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    mode: RolloutCorrection,
    cap: float,
) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """Importance weights (N,) float32 for the ``is_weights`` of the policy-loss ops, and their statistics.

    old_logp, rollout_logp: (N,) float, the trainer's and the engine's log-probs of the sampled tokens;
    cu_seqlens: (S+1,) int, from 0 to N; ``mode`` one of ``ROLLOUT_CORRECTIONS`` (module docstring), ``cap`` >= 1.
    Returns ``(weights, stats)``, weights None for ``none``. Statistics (float32 scalars, token means):
    ``rollout_logp_diff`` mean |old - rollout|, ``rollout_is_mean`` the mean weight as applied (of rho itself for
    ``none``), ``rollout_is_clipped_frac`` the share of tokens whose weight was truncated or masked.
    """
    check_correction(mode, cap)
    _common.check_1d("old_logp", old_logp)
    _common.check_1d("rollout_logp", rollout_logp, old_logp.shape[0])
    _common.check_1d("cu_seqlens", cu_seqlens)
    return rollout_correction_weights_reference(old_logp, rollout_logp, cu_seqlens, mode=mode, cap=cap)
