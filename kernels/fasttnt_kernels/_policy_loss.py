"""What the two policy-loss ops share (``clipped_policy_loss``, ``linear_policy_loss``), and what a trainer hands
them: the hyper-parameters (``PolicyLossConfig``), the per-sequence and per-token tensors (``PolicyLossInputs``),
their checks, and the aggregation's token weights."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from . import _common
from ._common import LOG_RATIO_CLAMP, SettingError
from .rollout_correction_weights import check_correction

Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
PolicyLoss = Literal["vanilla", "gspo", "cispo", "sapo", "vespo"]
POLICY_LOSSES = ("vanilla", "gspo", "cispo", "sapo", "vespo")
"""The policy-gradient terms (``clipped_policy_loss``'s module docstring has each one's formula): the clipped
surrogate (PPO/GRPO, DAPO, Dr. GRPO), the same with each sequence's ratio (GSPO), CISPO's clipped and detached
importance weight times the log-prob, SAPO's soft gate, VESPO's gamma weight of each sequence's ratio times the
log-prob. Their names are verl's ``policy_loss.loss_mode`` names (VESPO's, which verl lacks, TRL's ``loss_type``)."""
RatioLevel = Literal["token", "sequence"]
RATIO_LEVELS = ("token", "sequence")
"""The ratio CISPO's weight and SAPO's gate read: each token's, or its sequence's (exp of the mean log-ratio, the
value GSPO's surrogate reads, with each token's own gradient), TRL 1.16's ``importance_sampling_level``."""
GSPO_LOG_RATIO_MAX = 10.0
"""GSPO's sequence log-ratio is clamped above at this (verl 0.9.1's ``compute_policy_loss_gspo``), its gradient 0
past it; the token-level ratio's clamp is ``LOG_RATIO_CLAMP``."""
VESPO_LOG_W_MIN = math.log(1e-8)
VESPO_LOG_W_MAX = 20.0
"""VESPO's sequence log-weight and each rollout log-weight in it are clamped to [log 1e-8, 20] (TRL 1.16's
``get_gamma_weights``)."""
VESPO_LOG_PHI_MAX = 88.0
"""A VESPO weight whose log is above this is 0: float32 overflows at e^88.72, which TRL's ``nan_to_num(posinf=0)``
turns into 0 (88, not 88.72, so that the exp of the clamped value itself stays finite in float32). Reached only
with a peak e^(lambda - k) (k / lambda)^k that large, k = 10 and lambda = 1e-4 say."""


@dataclass(frozen=True)
class PolicyLossConfig:
    """The loss's hyper-parameters, validated once, where the object is made; a ``SettingError`` names the field.

    A trainer builds one from its config section (``of``: fasttnt from its ``loss.*`` keys, once per run) and hands
    that very object to the ops. ``entropy_coef`` is here rather than beside it because it is a hyper-parameter of
    the same loss, written in the same config section: one object then carries every one of them from the config
    to the kernel and validates them together. Only ``linear_policy_loss`` applies it (it has the entropies);
    ``clipped_policy_loss`` sees log-probs alone and refuses a nonzero one.
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    kl_coef: float = 0.0
    agg: Aggregation = "token-mean"
    norm_length: float | None = None
    entropy_coef: float = 0.0
    # the k3 KL term's value is capped here, its gradient 0 above (verl's low_var_kl clamp; None: uncapped, TRL's)
    kl_max: float | None = 10.0
    policy_loss: PolicyLoss = "vanilla"
    # SAPO's gate temperatures for tokens of a positive advantage and of the others (TRL's and verl's defaults)
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05
    # "sequence": CISPO's weight and SAPO's gate read each sequence's ratio (GSPO's is the surrogate's at that level)
    ratio_level: RatioLevel = "token"
    # VESPO's gamma weight phi(w) = e^lambda w^k e^(-lambda w) for tokens of an advantage >= 0 and of the others
    # (TRL 1.16's vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg defaults)
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0

    def __post_init__(self) -> None:
        def need(ok: bool, key: str, why: str) -> None:
            if not ok:
                raise SettingError(key, f"{why}, got {getattr(self, key)!r}")

        need(self.policy_loss in POLICY_LOSSES, "policy_loss", f"must be one of {POLICY_LOSSES}")
        if self.policy_loss == "cispo":
            # CISPO clips a weight into [1 - clip_low, 1 + clip_high], any non-empty band of positive weights: TRL's
            # cispo caps it at epsilon_high alone (clip_low = 1, a bound of 0; clip_high = epsilon_high - 1, which
            # is negative for TRL's default epsilon_high of 0.2)
            need(0.0 <= self.clip_low <= 1.0, "clip_low", "must be in [0, 1] with policy_loss='cispo'")
            need(self.clip_high > -1.0 and self.clip_low + self.clip_high >= 0.0, "clip_high",
                 "must be > -1 and >= -clip_low with policy_loss='cispo' (a band of positive weights)")  # fmt: skip
        else:
            need(0.0 <= self.clip_low < 1.0, "clip_low", "must be in [0, 1)")
            need(self.clip_high >= 0.0, "clip_high", "must be >= 0")
        dual = self.dual_clip
        need(dual is None or dual > 1.0, "dual_clip", "must be > 1 (it bounds the loss of negative advantages)")
        finite_nonnegative = "must be a finite number >= 0"
        need(math.isfinite(self.kl_coef) and self.kl_coef >= 0.0, "kl_coef", finite_nonnegative)
        need(self.kl_max is None or self.kl_max > 0.0, "kl_max", "must be > 0 (or None: uncapped)")
        need(self.agg in AGGREGATIONS, "agg", f"must be one of {AGGREGATIONS}")
        need(
            self.agg != "seq-mean-token-sum-norm" or (self.norm_length is not None and self.norm_length > 0),
            "norm_length",
            f"must be > 0 with agg={self.agg!r} (usually the max response length)",
        )
        need(math.isfinite(self.entropy_coef) and self.entropy_coef >= 0.0, "entropy_coef", finite_nonnegative)
        need(dual is None or self.policy_loss in ("vanilla", "gspo"), "dual_clip", "bounds the clipped surrogate "
             f"only (policy_loss 'vanilla' or 'gspo'), not policy_loss={self.policy_loss!r}")  # fmt: skip
        need(self.ratio_level in RATIO_LEVELS, "ratio_level", f"must be one of {RATIO_LEVELS}")
        need(self.ratio_level == "token" or self.policy_loss in ("cispo", "sapo"), "ratio_level",
             "is 'sequence' with policy_loss 'cispo' or 'sapo' only (gspo is the surrogate at the sequence level, "
             f"vespo weighs whole sequences itself), not policy_loss={self.policy_loss!r}")  # fmt: skip
        for key in ("sapo_tau_pos", "sapo_tau_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            need(math.isfinite(getattr(self, key)) and getattr(self, key) > 0.0, key, "must be a finite number > 0")
        # k >= 0 bounds phi: its largest value is e^(lambda - k) (k / lambda)^k, at w = k / lambda
        for key in ("vespo_k_pos", "vespo_k_neg"):
            need(math.isfinite(getattr(self, key)) and getattr(self, key) >= 0.0, key, finite_nonnegative)

    @property
    def per_sequence(self) -> bool:
        """Whether the token terms read a per-sequence log-ratio (``sequence_log_ratios``): GSPO, VESPO, and CISPO
        or SAPO at ``ratio_level="sequence"``."""
        return self.policy_loss in ("gspo", "vespo") or self.ratio_level == "sequence"

    @classmethod
    def of(cls, settings: Any) -> PolicyLossConfig:
        """The settings read by field name from an object that has them as attributes (a trainer's config section,
        such as fasttnt's ``loss``; its other attributes are not read)."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


@dataclass(frozen=True)
class PolicyLossInputs:
    """The loss's tensors for S packed sequences of N tokens: constants of the update (no gradient reaches them).
    Sequence s owns tokens cu_seqlens[s]:cu_seqlens[s+1]."""

    advantages: torch.Tensor  # (S,) float, one per sequence
    cu_seqlens: torch.Tensor  # (S+1,) int32/int64, from 0 to N
    old_logp: torch.Tensor | None = None  # (N,) float; None (linear_policy_loss only): on-policy, the current ones
    ref_logp: torch.Tensor | None = None  # (N,) float, the reference policy's, for the k3 KL term
    is_weights: torch.Tensor | None = None  # (N,) float, per-token weights of the policy-gradient term
    first_advantages: torch.Tensor | None = None  # (S,) float, each sequence's first token's own (mode_advantages)
    # replace N and S as the normalisers, so that micro-batches (or ranks) add up to the whole batch's loss
    total_tokens: float | None = None
    total_seqs: float | None = None
    # (N,) float, 0 or 1 as a rule: a per-token factor of the policy-gradient term after every weight, which no
    # sequence weight reads (VESPO's neither): TRL's high-entropy mask (``top_entropy_quantile``)
    token_mask: torch.Tensor | None = None
    # (N,) float, the behaviour policy's log-probs (the engine that sampled the tokens), ``linear_policy_loss`` only:
    # the rollout correction's weights (``rollout_correction_weights`` at ``rollout_correction`` and its cap) of the
    # proximal log-probs against these, times ``is_weights``. The proximal ones are ``old_logp``, or without them
    # the current ones, detached: the decoupled objective at one mini-batch and one epoch with no old-log-prob pass
    rollout_logp: torch.Tensor | None = None
    rollout_correction: str = "none"
    rollout_correction_cap: float = 2.0

    def check(self, N: int, config: PolicyLossConfig) -> dict[str, torch.Tensor]:
        """Check the inputs for N tokens (shapes, dtypes, normalisers); returns the tensors given, by name."""
        tensors = {"advantages": self.advantages, "cu_seqlens": self.cu_seqlens}
        _common.check_1d("advantages", self.advantages)
        _common.check_1d("cu_seqlens", self.cu_seqlens, self.advantages.shape[0] + 1)
        _common.check_dtype("advantages", self.advantages, _common.FLOAT_DTYPES)
        if self.first_advantages is not None:
            _common.check_1d("first_advantages", self.first_advantages, self.advantages.shape[0])
            _common.check_dtype("first_advantages", self.first_advantages, _common.FLOAT_DTYPES)
            tensors["first_advantages"] = self.first_advantages
        _common.check_dtype("cu_seqlens", self.cu_seqlens, _common.INDEX_DTYPES)
        if self.ref_logp is None and config.kl_coef > 0:
            raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp")
        check_correction(self.rollout_correction, self.rollout_correction_cap,
                         names=("rollout_correction", "rollout_correction_cap"))  # fmt: skip
        if self.rollout_correction != "none" and self.rollout_logp is None:
            raise ValueError(f"rollout_correction={self.rollout_correction!r} needs rollout_logp")
        for name in ("old_logp", "ref_logp", "is_weights", "token_mask", "rollout_logp"):
            t = getattr(self, name)
            if t is not None:
                _common.check_1d(name, t, N)
                _common.check_dtype(name, t, _common.FLOAT_DTYPES)
                tensors[name] = t
        for name in ("total_tokens", "total_seqs"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 when given, got {value}")
        return tensors

    def constants(self, dtype: torch.dtype | None = None) -> PolicyLossInputs:
        """The tensors as a Function's forward reads them: detached, contiguous, and in ``dtype`` when given
        (``cu_seqlens`` keeps its integer dtype)."""

        def const(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            t = t.detach()
            return (t if dtype is None else t.to(dtype)).contiguous()

        return PolicyLossInputs(
            advantages=const(self.advantages),
            cu_seqlens=self.cu_seqlens.contiguous(),
            old_logp=const(self.old_logp),
            ref_logp=const(self.ref_logp),
            is_weights=const(self.is_weights),
            token_mask=const(self.token_mask),
            rollout_logp=const(self.rollout_logp),
            rollout_correction=self.rollout_correction,
            rollout_correction_cap=self.rollout_correction_cap,
            first_advantages=const(self.first_advantages),
            total_tokens=self.total_tokens,
            total_seqs=self.total_seqs,
        )

    def tokens(self, N: int) -> float:
        """The token normaliser: ``total_tokens``, or the N tokens given."""
        return float(N if self.total_tokens is None else self.total_tokens)

    def aggregation_weights(self, config: PolicyLossConfig, N: int) -> tuple[float, float]:
        """(w_const, w_per_len) of ``config.agg``, the weight of a token of a sequence of len_s tokens being
        w_const + w_per_len / len_s: token-mean 1 / tokens, seq-mean-token-mean 1 / (seqs len_s),
        seq-mean-token-sum-norm 1 / (seqs norm_length)."""
        tokens = self.tokens(N)
        seqs = float(self.advantages.shape[0] if self.total_seqs is None else self.total_seqs)
        if config.agg == "token-mean":
            return (1.0 / tokens if tokens > 0 else 0.0), 0.0
        if seqs <= 0:
            return 0.0, 0.0
        if config.agg == "seq-mean-token-mean":
            return 0.0, 1.0 / seqs
        return 1.0 / (seqs * config.norm_length), 0.0


def sequence_log_ratios(
    config: PolicyLossConfig,
    logp: torch.Tensor,
    old_logp: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    is_weights: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The per-sequence log-ratio (S,) float32, detached, that ``config``'s token terms read (``per_sequence``), or
    None for a token-level loss; ``old_logp`` None is on-policy (every log-ratio 0). Summed in float64 through a
    cumulative sum (deterministic on CUDA, where index_add_'s atomics are not).

        gspo    log s_s = mean over s of (logp - old_logp)    (0 for an empty sequence; also CISPO's and SAPO's at
                                                                ratio_level="sequence")
        vespo   log w_s = clamp(sum over s of clamp(logp - old_logp, -20, 20) + clamp(log is_w, log 1e-8, 20),
                                log 1e-8, 20)                 (TRL 1.16's ``get_gamma_weights``)

    VESPO's rollout weights ``is_weights`` enter the sequence's weight here (TRL's vespo), not each token's term."""
    if not config.per_sequence:
        return None
    diff = torch.zeros_like(logp, dtype=torch.float64) if old_logp is None else logp.double() - old_logp.double()
    diff = diff.detach()  # (N,)
    if config.policy_loss != "vespo":
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (S,)
        return (_sequence_sums(diff, cu_seqlens) / lengths.clamp(min=1).double()).float()
    diff = diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if is_weights is not None:
        diff = diff + is_weights.detach().double().log().clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    return _sequence_sums(diff, cu_seqlens).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX).float()


def _sequence_sums(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Each sequence's sum (S,) of the per-token ``values`` (N,), through a cumulative sum in their dtype."""
    ends = torch.cat([values.new_zeros(1), values.cumsum(0)])  # (N+1,): ends[i] = the sum of the first i tokens
    return ends[cu_seqlens[1:].long()] - ends[cu_seqlens[:-1].long()]


def vespo_weights(log_w: torch.Tensor, advantages: torch.Tensor, config: PolicyLossConfig) -> torch.Tensor:
    """VESPO's gamma weights phi = exp(lambda + k log w - lambda w), elementwise over log-weights ``log_w`` and the
    advantages beside them (k, lambda: ``config``'s _pos where the advantage is >= 0, _neg elsewhere); in their
    dtype, detached. phi(1) = 1: an on-policy sequence is weighted as the plain policy gradient."""
    log_w, a = log_w.detach(), advantages.detach()
    nonneg = a >= 0
    k = torch.where(nonneg, config.vespo_k_pos, config.vespo_k_neg).to(log_w.dtype)
    lam = torch.where(nonneg, config.vespo_lambda_pos, config.vespo_lambda_neg).to(log_w.dtype)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.where(log_phi > VESPO_LOG_PHI_MAX, 0.0, torch.exp(log_phi.clamp(max=VESPO_LOG_PHI_MAX)))


_INPUT_FIELDS = frozenset(f.name for f in fields(PolicyLossInputs))
_CONFIG_FIELDS = frozenset(f.name for f in fields(PolicyLossConfig))


def config_of(op: str, config: PolicyLossConfig | None, settings: dict[str, Any]) -> PolicyLossConfig:
    """``config``, or one made of ``settings``: ``PolicyLossConfig``'s fields as keywords (``clip_high=0.28``), the
    shorthand of a caller that sets a few. Not both; a keyword that is no field is refused by name."""
    unknown = sorted(settings.keys() - _CONFIG_FIELDS)
    if unknown:
        raise TypeError(f"{op}() got an unexpected keyword argument {unknown[0]!r}")
    if config is None:
        return PolicyLossConfig(**settings)
    if settings:
        raise TypeError(f"{op}(): give the loss's settings as config= or as keywords, not both: {sorted(settings)}")
    return config


def resolve(
    op: str, inputs: PolicyLossInputs | None, config: PolicyLossConfig | None, keywords: dict[str, Any]
) -> tuple[PolicyLossInputs, PolicyLossConfig]:
    """The inputs and the settings of an op that takes both objects, or in their place their fields by name
    (``old_logp=..., advantages=..., cu_seqlens=..., clip_high=0.28``): ``clipped_policy_loss``'s keyword form, in
    which callers such as TRL's integration call the fused op. A field given both ways is refused."""
    given = {name: value for name, value in keywords.items() if name in _INPUT_FIELDS}
    settings = {name: value for name, value in keywords.items() if name not in _INPUT_FIELDS}
    if inputs is None:
        inputs = PolicyLossInputs(**given)
    elif given:
        raise TypeError(f"{op}(): give the loss's tensors as inputs= or as keywords, not both: {sorted(given)}")
    return inputs, config_of(op, config, settings)
