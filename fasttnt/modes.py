"""Mode-mixed rollouts: both modes in every group, from a model that would rarely choose one of them.

A thinking-only model (DeepSeek-R1-Distill-Qwen, DeepScaleR) practically never writes ``</think>`` first, so with
free prompts TNT would see almost no non-thinking response. A mode-mixed group answers ``n_N`` of its K samples
with ``</think>`` pre-filled (``rollout.forced_non_thinking`` of K), ``n_T`` with ``</think>`` forbidden as the
first token (``rollout.forced_thinking``), and samples the rest freely (AdaptThink, Zhang et al. 2025, forces half
of each group into each mode). The forced first token stays a response token; the loss weighs it against the
probability it was drawn with by one of three rules (``loss.mode_token_logp``):

* ``mixture``: the exact behaviour probability of *every* sample's first token y1 under the group's mixture of
  sampling procedures, with shares s_N = n_N / K, s_T = n_T / K, s_F = 1 - s_N - s_T, p = pi_old(</think> | x):

      mu(</think>) = s_N + s_F p
      mu(y1)       = pi_old(y1) (s_T / (1 - p) + s_F)           for y1 != </think>

  (forced thinking draws from pi_old renormalised without ``</think>``). The group is a stratified sample of mu,
  so w = pi_old(y1) / mu(y1) is an unbiased importance weight for the mode token's term (the balance heuristic of
  multiple importance sampling); token-level, as PPO's ratio is: the later tokens of a forced row keep weight 1,
  though their context was reached with probability mu, not pi_old. It multiplies the token's clipped term from
  outside, as the rollout correction does, so the PPO ratio pi / pi_old starts at 1 and clips as for any other
  token; w is at most 1 / (the smallest nonzero share), so it needs no truncation.
* ``half``: AdaptThink's fixed behaviour probability, log mu = log 0.5, for the forced first tokens, as their old
  log-prob inside the ratio (its paper's eq. 8, its code's ``adjust_old_logprobs``); free samples keep their own.
  Biased wherever the group is not half and half; the ratio pi / 0.5 of a token the policy gives 1e-5 starts far
  below the clip range, so a negative advantage does not move it and a positive one by pi / 0.5.
* ``policy`` (the default): no importance weight on the mode token: a forced first token keeps the old policy's own
  log-prob, as a free sample's. Biased towards the forced modes (they are trained as if the policy had chosen
  them). What AdaptThink's code amounts to: its ratio is the exponent of the *mean* log-prob difference of a
  sequence, which dilutes the first token's log 0.5 correction by 1/T.

Both weighted rules give the mode token the gradient scaled by the policy's own probability of ``</think>`` (for
``mixture`` the free policy's true gradient, p (A_N - A_mean) on its logit): from a thinking-only start, p ~ 1e-5,
neither moved the free choice in 80 steps of the CPU measurement (docs/experiments.md); ``policy`` gives the forced
rows their full advantage and did. Its flaw: a forced token with a negative advantage is pushed down at full
strength however improbable it already is, log pi having no floor; at the one position every response shares,
that drift moved the first token of the other mode and broke the hard levels' thinking (accuracy 2%).
``loss.mode_token_floor`` (0.1) stops it: where the forced mode pi_old gives less than the floor (p for forced
non-thinking, 1 - p for forced thinking) and that mode loses in its group, the forced first tokens of that mode
are left out of the gradient (``ModeMix.floored``). "Loses" is the mode's group-level advantage, the mean
mode-token advantage of the group's rows in it (``loss.mode_token_floor_gate=mode``): gated on each row's own sign
instead (``row``), the right answers of a losing mode keep pushing its token up while its wrong ones are left out,
so below the floor the token rises wherever that mode's accuracy is above zero, and settles near the floor
(measured in docs/experiments.md). With both shares 0 nothing here runs.

Advantages (``loss.mode_advantage``, ``ModeMix.advantages``): ``shared`` gives the mode token and the answer one
GRPO advantage; ``decoupled`` gives ``</think>`` (a non-thinking response's first token) the gap between the
non-thinking mode's mean reward and the modes' mean, and every other token an advantage against the rows of its
own mode (``fasttnt_kernels.mode_advantages``), so forced direct answers at a level where thinking pays do not
push down the digits of right direct answers, nor right thinking answers those of the thinking mode.

The TNT limit, rewards, advantages and hack flags treat forced and free responses alike: a forced non-thinking
response is a non-thinking response.

Everything here is ``ModeMix``, which the trainer asks at three points: ``rollout`` (each row's prompt in its mode
for the engine, which only sees per-row prompts, and the rows' codes on the batch), ``probe`` (the rows whose old
log-probs are each group's log pi_old(</think> | x)) and, after the old log-probs, ``loss_terms`` (the advantages,
the first tokens' behaviour log-probs or weights, the floor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from fasttnt_kernels import group_advantages, mode_advantages

from .data import Prompt, PromptMode
from .engines.batch import FORCED_CODES, RolloutBatch


class Advantages(NamedTuple):
    answer: torch.Tensor  # (S,) every token's but the first's when ``first`` is given
    first: torch.Tensor | None  # (S,) the first token's own (loss.mode_advantage=decoupled), else None
    mode: torch.Tensor  # (S,) the mode's advantage the floor's gate averages: the gap, or the shared advantage

    @property
    def mode_token(self) -> torch.Tensor:
        """(S,) the advantage each row's first token is trained with (the row floor gate's)."""
        return self.answer if self.first is None else self.first


class LossTerms(NamedTuple):
    """What the update needs of a step's modes: advantages, old log-probs and weights, and the floor's counts."""

    advantages: torch.Tensor  # (S,) every token's but the mode token's when decoupled
    first_advantages: torch.Tensor | None  # (S,) the mode token's own (loss.mode_advantage=decoupled), else None
    old_logp: torch.Tensor | None  # (N,) the old log-probs ("half": log 0.5 at the forced first tokens)
    token_weights: torch.Tensor | None  # (N,) "mixture"'s pi_old / mu and the floor's zeros at first tokens
    floored: torch.Tensor | None  # (2,) float64: first tokens the floor left out, forced rows (this rank's)


@dataclass(frozen=True)
class ModeMix:
    non_thinking: int  # of each group's K rows, pre-filled with </think>
    thinking: int  # of each group's K rows, with </think> forbidden first
    group_size: int
    rule: str  # "mixture" | "half" | "policy": how the first token is weighed (module docstring)
    floor: float = 0.0  # loss.mode_token_floor: no push-down of a forced first token the model gives less than this
    floor_gate: str = "mode"  # loss.mode_token_floor_gate: "mode" | "row", the advantage the floor looks at
    advantage: str = "shared"  # loss.mode_advantage: "shared" | "decoupled"
    scale: str = "std"  # loss.adv_scale
    eps: float = 1e-6  # loss.adv_eps

    @classmethod
    def of(cls, cfg) -> ModeMix:
        """From ``rollout.forced_non_thinking`` / ``forced_thinking`` (shares of K, ``RolloutConfig.forced_rows``)
        and the ``loss.mode_*`` and ``loss.adv_*`` keys."""
        non_thinking, thinking = cfg.rollout.forced_rows()
        loss = cfg.loss
        return cls(non_thinking, thinking, cfg.rollout.group_size, loss.mode_token_logp, loss.mode_token_floor,
                   loss.mode_token_floor_gate, loss.mode_advantage, loss.adv_scale, loss.adv_eps)  # fmt: skip

    def advantages(self, rewards: torch.Tensor, non_thinking: torch.Tensor) -> Advantages:
        """The advantages of rewards (S,) with modes ``non_thinking`` (S,), laid out group after group.

        ``decoupled``: a non-thinking response's first token is ``</think>``, the choice itself, and gets the
        mode gap; a thinking response's first token is already its answer (the template opened the think block),
        so it keeps the answer's advantage: the gap pushed onto it would move a digit of the answer, not the choice,
        which in the CPU stand-in broke the thinking (accuracy at level 3 from 100% to 31% in 9 steps). The
        thinking side of the choice is learned through ``</think>``'s probability, which the direct rows move."""
        k = self.group_size
        if self.advantage == "decoupled":
            out = mode_advantages(rewards, non_thinking, k, scale=self.scale, eps=self.eps)
            return Advantages(out.answer, torch.where(non_thinking.bool(), out.mode, out.answer), out.mode)
        shared = group_advantages(rewards, k, scale=self.scale, eps=self.eps)
        return Advantages(shared, None, shared)

    @property
    def active(self) -> bool:
        return self.non_thinking + self.thinking > 0

    @property
    def free(self) -> int:
        """Of each group's K rows, the ones sampled freely."""
        return self.group_size - self.non_thinking - self.thinking

    def modes(self, groups: int) -> list[PromptMode]:
        """Each row's mode (groups * K,): a group's forced non-thinking rows first, then its forced thinking ones,
        then its free ones (runs of one mode: one prefill, one vLLM request each)."""
        group = [PromptMode.NON_THINKING] * self.non_thinking + [PromptMode.THINKING] * self.thinking
        return (group + [PromptMode.FREE] * self.free) * groups

    # -- point 1: the rollout ------------------------------------------------------------------------------------

    def rollout(self, engine, prompts: list[Prompt], **generate) -> RolloutBatch:
        """K samples of each prompt from ``engine``, each row's prompt in its mode, the rows' modes coded on the
        batch (``RolloutBatch.forced``); the engine's own ``generate`` when nothing is forced."""
        if not self.active:
            return engine.generate(prompts, self.group_size, **generate)
        modes = self.modes(len(prompts))
        rows = [p.in_mode(m) for p, m in zip([p for p in prompts for _ in range(self.group_size)], modes, strict=True)]
        batch = engine.generate(prompts, self.group_size, rows=rows, **generate)
        codes = [FORCED_CODES[m] for m in modes]
        batch.forced = torch.tensor(codes, dtype=torch.int8, device=batch.truncated.device)  # (S,)
        return batch

    # -- point 2: the old log-probs ------------------------------------------------------------------------------

    def probe(self, batch: RolloutBatch, think_end_id: int) -> RolloutBatch | None:
        """The rows whose log-probs the old policy gives ``loss_terms`` (``think_end_probe``); None when unmixed."""
        return think_end_probe(batch, think_end_id) if self.active else None

    # -- point 3: after the old log-probs ------------------------------------------------------------------------

    def loss_terms(
        self, batch: RolloutBatch, rewards, old_logp: torch.Tensor | None, end_logp: torch.Tensor | None,
        think_end_id: int,
    ) -> LossTerms:  # fmt: skip
        """The update's inputs for ``batch``, given its rewards (``TntRewards``: rewards, non_thinking), the old
        log-probs (N,) and, mode-mixed, each group's log pi_old(</think> | x) (G,) (``probe``). The first tokens'
        rollout log-probs become their old ones, so the engine's correction, the stale-weight guard and its
        diagnostics leave them out (a pre-filled token was not sampled)."""
        adv = self.advantages(rewards.rewards, rewards.non_thinking)
        if not self.active:
            return LossTerms(adv.answer, adv.first, old_logp, None, None)
        first = first_token_index(batch)
        behaviour = self.behaviour_logp(batch, old_logp[first], end_logp, think_end_id)
        weights = None
        if self.rule == "mixture":
            weight = torch.exp(old_logp[first] - behaviour)  # at most 1 / (the smallest share): no cap needed
            weights = torch.ones_like(old_logp).index_copy(0, first, weight)
        else:
            old_logp = old_logp.index_copy(0, first, behaviour)
        if batch.rollout_logp is not None:
            batch.rollout_logp = batch.rollout_logp.index_copy(0, first, old_logp[first])
        counts = None
        if self.floor > 0:
            gate = adv.mode if self.floor_gate == "mode" else adv.mode_token
            drop = self.floored(batch, gate, rewards.non_thinking, end_logp)  # (S,)
            counts = torch.stack([drop.sum(), forced_rows(batch).sum()]).double()
            weights = torch.ones_like(old_logp) if weights is None else weights
            weights = weights.index_copy(0, first, torch.where(drop, torch.zeros_like(weights[first]), weights[first]))
        return LossTerms(adv.answer, adv.first, old_logp, weights, counts)

    def behaviour_logp(
        self, batch: RolloutBatch, first_logp: torch.Tensor, end_logp: torch.Tensor, think_end_id: int
    ) -> torch.Tensor:
        """The behaviour log-prob (S,) of each row's first token: ``first_logp`` (S,) is its log-prob under the old
        policy, ``end_logp`` (G,) each group's log pi_old(</think> | x) at the first position."""
        if self.rule == "policy":
            return first_logp
        if self.rule == "half":
            return torch.where(forced_rows(batch), torch.full_like(first_logp, math.log(0.5)), first_logp)
        k = self.group_size
        s_n, s_t, s_f = self.non_thinking / k, self.thinking / k, self.free / k
        end = end_logp.double().repeat_interleave(k)  # (S,) log p
        first = batch.response_ids[first_token_index(batch)]  # (S,) every response has a first token
        # log(s_N + s_F p), the two terms in log space (either share may be 0)
        log_end = torch.logaddexp(torch.full_like(end, _log(s_n)), end + _log(s_f))
        # log pi_old(y1) + log(s_T / (1 - p) + s_F)
        not_end = _log1mexp(end)  # (S,) log(1 - p)
        log_other = first_logp.double() + torch.logaddexp(_log(s_t) - not_end, torch.full_like(end, _log(s_f)))
        return torch.where(first == think_end_id, log_end, log_other).to(first_logp.dtype)

    def floored(
        self, batch: RolloutBatch, mode_adv: torch.Tensor, non_thinking: torch.Tensor, end_logp: torch.Tensor
    ) -> torch.Tensor:
        """(S,) True for the forced first tokens left out of the gradient by ``floor``: on a row whose forced mode the
        old policy gives less than ``floor`` (pi_old(</think>) for forced non-thinking, 1 - pi_old(</think>) for
        forced thinking; ``end_logp`` (G,), each group's log pi_old(</think> | x): the probability of the one
        thinking token drawn says nothing of the mode), where that mode's advantage is negative: its group-level
        one (``floor_gate="mode"``: the mean of ``mode_adv`` (S,), ``Advantages.mode``, over the group's
        rows of that mode, ``non_thinking`` (S,)) or the row's own (``"row"``: ``mode_adv`` is then
        ``Advantages.mode_token``, what the row's first token is trained with). The model already refuses that mode
        there; pushing log pi further down has no bound and, at the one position every response shares, moves the
        tokens the other mode starts with (measured in docs/experiments.md)."""
        end = end_logp.repeat_interleave(self.group_size)  # (S,)
        mode_logp = torch.where(batch.forced == FORCED_CODES[PromptMode.NON_THINKING], end, _log1mexp(end))
        gate = mode_adv if self.floor_gate == "row" else mode_means(mode_adv, non_thinking, self.group_size)
        return forced_rows(batch) & (gate < 0) & (mode_logp < _log(self.floor))


def mode_means(values: torch.Tensor, non_thinking: torch.Tensor, group_size: int) -> torch.Tensor:
    """(S,) each row's mean of ``values`` (S,) over the rows of its group in its mode (``non_thinking`` (S,))."""
    v = values.double().view(-1, group_size)  # (G, K)
    nt = non_thinking.bool().view(-1, group_size)
    out = torch.zeros_like(v)
    for mode in (nt, ~nt):
        mean = (v * mode).sum(1, keepdim=True) / mode.sum(1, keepdim=True).clamp(min=1)  # (G, 1)
        out = torch.where(mode, mean, out)
    return out.view(-1).to(values.dtype)


def _log(share: float) -> float:
    return math.log(share) if share > 0 else -math.inf


def _log1mexp(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - p) from log p, with p allowed to round to 1 (then a very small number, not -inf)."""
    return torch.log(-torch.expm1(logp).clamp(max=-1e-30))


def forced_rows(batch: RolloutBatch) -> torch.Tensor:
    """(S,) True for the responses sampled with a forced mode (none when the batch has no ``forced`` codes)."""
    if batch.forced is None:
        return torch.zeros(len(batch.cu_seqlens) - 1, dtype=torch.bool, device=batch.cu_seqlens.device)
    return batch.forced != FORCED_CODES[PromptMode.FREE]


def first_token_index(batch: RolloutBatch) -> torch.Tensor:
    """(S,) the packed index of each response's first token (every response has one: an engine returns at least
    one token, the pre-filled ``</think>`` or a sampled one)."""
    return batch.cu_seqlens[:-1]


def think_end_probe(batch: RolloutBatch, think_end_id: int) -> RolloutBatch:
    """One row per group: the group's prompt and the one-token response ``</think>``, whose log-prob under a model
    is log pi(</think> | x) at the first position."""
    k = batch.group_size
    prompts = batch.prompt_ids[::k]
    device = batch.response_ids.device
    ids = torch.full((len(prompts),), think_end_id, dtype=batch.response_ids.dtype, device=device)
    cu = torch.arange(len(prompts) + 1, dtype=batch.cu_seqlens.dtype, device=device)
    return RolloutBatch(prompts, ids, cu, torch.zeros(len(prompts), dtype=torch.bool, device=device), 1)
