"""Mode-mixed rollouts: both modes in every group, from a model that would rarely choose one of them, and the
estimator that teaches the choice.

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
  log-prob, as a free sample's: every direct row's ``</think>`` is trained as if chosen. With the decoupled
  advantage below this is what makes the choice's step independent of p (the weighted rules scale it with p:
  ~1e-9 for the thinking-only stand-in at T = 0.6: a step of nothing).

**The choice** (``loss.mode_advantage``; ``auto`` is ``decoupled`` for mode-mixed rollouts). ``decoupled``
(``fasttnt_kernels.mode_advantages``): the ``</think>`` that opens each non-thinking response (forced or free)
gets the gap between the group's mean reward over its non-thinking rows and over its thinking rows,
A_c = mu_N - mu_T, in reward units; every other token an advantage against the rows of its own mode. A thinking
response's first token is already part of its answer (the template opens the think block), so it keeps its
answer advantage; those sum to zero over the mode's rows, which share the first position, so they do not move
the ``</think>`` logit. Given how many rows each mode has, mu_N - mu_T is an unbiased estimate of the modes'
expected reward gap R_N - R_T at the sampling temperature (a mode's rows are draws of its reward however the mode
was reached; TNT's limit is set by the group's own thinking rows, so: given the limit; ``reward.mode_balance``
couples the free rows too). So, with w the aggregation's weight of a token, the same for every token (1 / tokens
for token-mean, a constant for seq-mean-token-sum-norm; seq-mean-token-mean weighs a row by 1 / its length, which
can follow its reward, and then the thinking rows' first-token terms need not cancel), and the ratio at 1 (the
first optimizer step of a batch), the loss's expected gradient step on the ``</think>`` logit z at the first
position, per group and for an SGD step of size eta on the logits at temperature T, is

    E[dz_</think>] = eta * a(p) * w * E[n_N 1{n_T > 0}] * (R_N - R_T) * (1 - p) / T

(every other first-position logit moves by -pi_j / (1 - p) times as much, so the step is zero-sum), where n_N, n_T
count each mode's rows: this has the sign of the gap at every p and T, and is zero only at a tie
(tests/test_mode_choice.py checks it exactly, by enumerating a group's outcomes). a(p) is the settled-choice
fade: min(1, p / floor) ** FADE_POWER with ``floor = loss.mode_token_floor`` (``auto``: the smallest
pi_old(</think> | x) among the first step's groups, ``ModeMix.floor_logp``). It is one number per group, the
same for either sign, so it changes the step size and never its sign; it stops the push-down of a choice already
settled further than the start: a ``</think>`` pushed on without bound at a level where thinking pays drags the
first position every prompt shares with it, and under
Adam a term that is merely small still moves the parameters only it touches at the full rate, so the fade is
steep.

``saturating`` judges the answers as ``decoupled`` does and sizes the choice's step by the group's own evidence
(``saturating_choice``): a push towards direct shrinks as (1 - p)^0.5 and one towards thinking as p^0.5, each
chosen by the sign of one half of the group's rows and multiplied by the other half's gap, so its expectation is
CHOICE_SCALE * (R_N - R_T) * E[m] (the gap's sign at every p), it fades at each level's preferred mode as far as the
halves agree, and a level at the wrong extreme is pulled back at full strength; no fade is needed.

``shared`` gives the mode token and the answer one GRPO advantage, as the TNT paper and AdaptThink do. Its
expectation on the choice can take the wrong sign: divided by the group's reward std, a small margin of the
accuracy-aware table becomes a full unit where every answer is right (docs/algorithms.md), and right answers of
the mode that loses are pushed down.

The TNT limit, rewards, advantages and hack flags treat forced and free responses alike: a forced non-thinking
response is a non-thinking response.

A mode-mixed run's trainer asks its ``ModeMix`` at three points: ``rollout`` (each row's prompt in its mode for the
engine, which only sees per-row prompts, and the rows' codes on the batch), ``think_end_rows`` (the rows whose old
log-probs are each group's log pi_old(</think> | x)) and, after the old log-probs and the advantages
(``fasttnt.advantages``), ``mode_token_terms`` (the first tokens' behaviour log-probs or weights, the fade).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .data import Prompt, PromptMode
from .engines.batch import FORCED_CODES, RolloutBatch
from .policy import UpdateInputs

FADE_POWER = 4
"""Below the floor, the mode token's term is scaled by (p / floor) ** FADE_POWER: 1.8% one nat below, 6e-6 three
nats below. Steep, because under Adam a parameter moves at about the learning rate while its gradient keeps one
sign, whatever its size: a term that fell only as p would hardly slow the push-down."""


def mode_advantage_of(cfg) -> str:
    """``loss.mode_advantage`` resolved: ``auto`` is ``decoupled`` for mode-mixed rollouts, ``shared`` otherwise."""
    if cfg.loss.mode_advantage != "auto":
        return cfg.loss.mode_advantage
    return "decoupled" if sum(cfg.rollout.forced_rows()) > 0 else "shared"


@dataclass(frozen=True)
class ModeMix:
    """A mode-mixed run's rows and rules (``rollout.forced_*``, ``loss.mode_*``); a run without forced rows has
    none (``ModeMix.of`` is None)."""

    forced_non_thinking_rows: int  # of each group's K rows, pre-filled with </think>
    forced_thinking_rows: int  # of each group's K rows, with </think> forbidden first
    group_size: int
    mode_token_logp: str  # loss.mode_token_logp: "mixture" | "half" | "policy" (module docstring)
    mode_advantage: str  # loss.mode_advantage, resolved (mode_advantage_of)
    # loss.mode_token_floor: "auto" (measured at the first step), a probability, or 0 (off)
    mode_token_floor: float | str = "auto"

    @classmethod
    def of(cls, cfg) -> ModeMix | None:
        """From ``rollout.forced_non_thinking`` / ``forced_thinking`` (shares of K, ``RolloutConfig.forced_rows``)
        and the ``loss.mode_*`` keys; None when no row is forced."""
        non_thinking, thinking = cfg.rollout.forced_rows()
        if non_thinking + thinking == 0:
            return None
        return cls(non_thinking, thinking, cfg.rollout.group_size, cfg.loss.mode_token_logp, mode_advantage_of(cfg),
                   cfg.loss.mode_token_floor)  # fmt: skip

    @property
    def free_rows(self) -> int:
        """Of each group's K rows, the ones sampled freely."""
        return self.group_size - self.forced_non_thinking_rows - self.forced_thinking_rows

    def modes(self, groups: int) -> list[PromptMode]:
        """Each row's mode (groups * K,): a group's forced non-thinking rows first, then its forced thinking ones,
        then its free ones (runs of one mode: one prefill, one vLLM request each)."""
        group = [PromptMode.NON_THINKING] * self.forced_non_thinking_rows
        group += [PromptMode.THINKING] * self.forced_thinking_rows
        return (group + [PromptMode.FREE] * self.free_rows) * groups

    # -- point 1: the rollout ------------------------------------------------------------------------------------

    def rollout(self, engine, prompts: list[Prompt], **generate) -> RolloutBatch:
        """K samples of each prompt from ``engine``, each row's prompt in its mode, the rows' modes coded on the
        batch (``RolloutBatch.forced``)."""
        modes = self.modes(len(prompts))
        rows = [p.in_mode(m) for p, m in zip([p for p in prompts for _ in range(self.group_size)], modes, strict=True)]
        batch = engine.generate(prompts, self.group_size, rows=rows, **generate)
        codes = [FORCED_CODES[m] for m in modes]
        batch.forced = torch.tensor(codes, dtype=torch.int8, device=batch.truncated.device)  # (S,)
        return batch

    # -- point 2: the old log-probs ------------------------------------------------------------------------------

    def think_end_rows(self, batch: RolloutBatch, think_end_id: int) -> RolloutBatch | None:
        """The rows whose log-probs under the old policy are each group's log pi_old(</think> | x)
        (``think_end_rows``)."""
        return think_end_rows(batch, think_end_id)

    def measures_floor(self, kept: float | None) -> bool:
        """Whether this step measures the fade's floor: under ``auto`` while the trainer's state keeps none
        (the first step; after a resume, only from a checkpoint written without one, and then at the resumed
        policy)."""
        return self.mode_token_floor == "auto" and self.mode_advantage not in UNFADED and kept is None

    @property
    def fixed_floor(self) -> bool:
        return self.mode_token_floor not in ("auto", 0)

    def floor_above_start(self, largest_logp: float) -> str | None:
        """A warning when a fixed ``loss.mode_token_floor`` lies above every group's pi_old(</think>) (the largest
        log of them ``largest_logp``): the fade then holds the choice's term at most at (p / floor) ** FADE_POWER
        and the choice cannot move; None otherwise."""
        if not self.fixed_floor or largest_logp >= math.log(self.mode_token_floor):
            return None
        scale = math.exp(FADE_POWER * (largest_logp - math.log(self.mode_token_floor)))
        return (
            f"loss.mode_token_floor={self.mode_token_floor:g} lies above every group's pi_old(</think>) "
            f"(the largest {math.exp(largest_logp):.1e}): the fade scales the choice's term by at most {scale:.1e}, "
            "so the choice cannot move; set loss.mode_token_floor=auto or a floor below the start"
        )

    def floor_logp(self, measured: float | None) -> float | None:
        """The log of the fade's floor: ``loss.mode_token_floor``'s, or under ``auto`` the one ``measured`` at the
        first step (the smallest log pi_old(</think> | x) of its groups over all ranks, kept in the trainer's
        state); None when off (0, or ``auto`` under a choice in ``UNFADED``) or not measured yet."""
        if self.mode_token_floor == 0:
            return None
        if self.mode_token_floor == "auto" and self.mode_advantage in UNFADED:  # no fade
            return None
        return measured if self.mode_token_floor == "auto" else math.log(self.mode_token_floor)

    # -- point 3: after the old log-probs ------------------------------------------------------------------------

    def mode_token_terms(
        self, inputs: UpdateInputs, non_thinking: torch.Tensor, think_end_logp: torch.Tensor, think_end_id: int,
        floor_logp: float | None = None,
    ) -> tuple[UpdateInputs, torch.Tensor | None]:  # fmt: skip
        """The update's inputs with the mode tokens' terms: each first token's behaviour log-prob as its old one
        (``half``, ``policy``) or as the importance weight pi_old / mu (``mixture``) in ``is_weights``, and the
        settled-choice fade a(p) on the ``</think>`` of every non-thinking row (``non_thinking`` (S,)) given the log
        of the fade's floor (``floor_logp``; None: no fade); and the groups below the floor (G,) bool, or None.
        ``think_end_logp`` (G,): each group's log pi_old(</think> | x) (``think_end_rows``). A batch that older weights
        sampled (a rollout worker's at ``rollout.max_staleness`` >= 1) carries their log-probs
        (``behaviour_logprobs``): the mixture and the fade read the sampling policy's, the ratio stays pi / pi_old
        (the decoupled objective). The first tokens' rollout log-probs become their old ones, so the engine's
        correction, the stale-weight guard and its diagnostics leave them out (a pre-filled token was not
        sampled)."""
        batch, old_logp, is_weights = inputs.batch, inputs.old_logp, inputs.is_weights
        first = first_token_index(batch)
        behaviour = self.behaviour_logp(batch, old_logp[first], think_end_logp, think_end_id)
        if batch.behaviour_think_end_logp is not None:  # sampled from older weights: the fade reads their choice
            think_end_logp = batch.behaviour_think_end_logp[:: self.group_size]
        if self.mode_token_logp == "mixture":
            weight = torch.exp(old_logp[first] - behaviour)  # at most 1 / (the smallest share): no cap needed
            is_weights = torch.ones_like(old_logp).index_copy(0, first, weight)
        else:
            old_logp = old_logp.index_copy(0, first, behaviour)
        if batch.rollout_logp is not None:
            batch.rollout_logp = batch.rollout_logp.index_copy(0, first, old_logp[first])
        below_floor = None
        if floor_logp is not None:
            fade = settled_fade(think_end_logp, floor_logp)  # (G,)
            on_choice = torch.where(non_thinking.bool(), fade.repeat_interleave(self.group_size), 1.0)  # (S,)
            is_weights = torch.ones_like(old_logp) if is_weights is None else is_weights
            is_weights = is_weights.index_copy(0, first, is_weights[first] * on_choice.to(is_weights.dtype))
            below_floor = fade < 1
        return replace(inputs, old_logp=old_logp, is_weights=is_weights), below_floor

    def behaviour_logp(
        self, batch: RolloutBatch, first_logp: torch.Tensor, think_end_logp: torch.Tensor, think_end_id: int
    ) -> torch.Tensor:
        """The behaviour log-prob (S,) of each row's first token: ``first_logp`` (S,) is its log-prob under the old
        policy, ``think_end_logp`` (G,) each group's log pi_old(</think> | x) at the first position. Under
        ``mixture`` the policy in mu is the one that sampled the batch: the old policy's, or the older weights'
        that the batch carries (``RolloutBatch.behaviour_first_logp``)."""
        if self.mode_token_logp == "policy":
            return first_logp
        if self.mode_token_logp == "half":
            return torch.where(forced_rows(batch), torch.full_like(first_logp, math.log(0.5)), first_logp)
        k = self.group_size
        s_n, s_t, s_f = self.forced_non_thinking_rows / k, self.forced_thinking_rows / k, self.free_rows / k
        end = think_end_logp.double().repeat_interleave(k)  # (S,) log p
        if batch.behaviour_first_logp is not None:
            first_logp, end = batch.behaviour_first_logp, batch.behaviour_think_end_logp.double()
        first = batch.response_ids[first_token_index(batch)]  # (S,) every response has a first token
        # log(s_N + s_F p), the two terms in log space (either share may be 0)
        log_end = torch.logaddexp(torch.full_like(end, _log(s_n)), end + _log(s_f))
        # log pi_old(y1) + log(s_T / (1 - p) + s_F)
        not_end = _log1mexp(end)  # (S,) log(1 - p)
        log_other = first_logp.double() + torch.logaddexp(_log(s_t) - not_end, torch.full_like(end, _log(s_f)))
        return torch.where(first == think_end_id, log_end, log_other).to(first_logp.dtype)


CHOICE_SCALE = 16.0
"""The saturating choice's step on the ``</think>`` logit per group and unit of reward gap, in units of one token's
weight in the loss (the answer tokens' advantages are std-normalised, of order 1)."""
CHOICE_POWER = 0.5
"""gamma of the saturating choice: a push towards a mode shrinks as (its missing probability) ** gamma."""
EVIDENCE_SCALE = 1.0
"""The evidence choice's step on the ``</think>`` logit per group whose halves agree on a side, in units of one
token's weight in the loss: as large as one answer token's term at a unit advantage."""
EVIDENCE_FLOOR = 0.05
"""The smallest half's gap the evidence choice sizes by: the accuracy-aware table's margin (a right direct answer
against a right thinking one), the smallest gap that is evidence of a side rather than a tie."""
UNFADED = ("saturating", "centered")
"""Choices without the settled-choice fade (``loss.mode_token_floor`` auto or 0): the saturating one is bounded at each
mode by itself; the centered one would lose its zero mean over the batch's groups, and has no bound (a level below
the batch's mean gap is pushed down at every step, refused or not)."""
HALF_SPLIT = ("saturating", "evidence")
"""Choices that size one half of each group's rows by the other half (``saturating_choice``, ``evidence_choice``)."""


def saturating_choice(
    rewards: torch.Tensor, non_thinking: torch.Tensor, think_end_logp: torch.Tensor, group_size: int,
    forced: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """The saturating choice's first-token advantage (S,) float32 of each row (0 where a row carries none), from the
    rows' ``rewards`` and modes ``non_thinking`` (S,), laid out group after group (``forced`` = (n_N, n_T) forced
    rows of each mode first, then the free ones: ``ModeMix.modes``), and each group's log pi_old(</think> | x)
    ``think_end_logp`` (G,).

    Per group, split its rows into two halves (``_half_split_choice``), each half's gap d = its direct rows' mean
    reward minus its thinking rows' mean. The group's target step on the ``</think>`` logit is C = CHOICE_SCALE *
    (d_B m(d_A) + d_A m(d_B)) / 2, with m(d) = (1 - p) ** CHOICE_POWER where d > 0 (the other half finds direct
    better: a push that saturates as p -> 1) and p ** CHOICE_POWER otherwise (one that vanishes where direct is
    refused). The halves' rows are independent draws, so each factor m is independent of the gap it multiplies:
    E[C] = CHOICE_SCALE * (R_N - R_T) * E[m], which has the sign of the modes' expected reward gap at every p, also
    where a group's gap is noisy, and |E[C]| <= CHOICE_SCALE |R_N - R_T|. (Exactly so where the rewards of rows are
    independent given their modes; TNT's limit, set by the group's thinking rows, and ``reward.mode_balance``, by
    the batch's free rows, couple them a little.) A level at the wrong extreme is pulled back at full strength."""
    p = think_end_logp.double().clamp(max=0.0).exp()  # (G,) a log-prob rounded above 0 is p = 1, not NaN below
    up, down = (1 - p) ** CHOICE_POWER, p**CHOICE_POWER

    def size(gap: torch.Tensor) -> torch.Tensor:
        return CHOICE_SCALE * torch.where(gap > 0, up, down)

    return _half_split_choice(rewards, non_thinking, p, group_size, forced, size)


def evidence_choice(
    rewards: torch.Tensor, non_thinking: torch.Tensor, think_end_logp: torch.Tensor, group_size: int,
    forced: tuple[int, int],
) -> torch.Tensor:  # fmt: skip
    """The evidence choice's first-token advantage (S,) float32 (arguments as ``saturating_choice``): the group's
    target step on the ``</think>`` logit is C = EVIDENCE_SCALE * (d_B / max(|d_A|, EVIDENCE_FLOOR) + d_A /
    max(|d_B|, EVIDENCE_FLOOR)) / 2, each half's gap divided by the other half's size. A level whose halves agree
    steps by about EVIDENCE_SCALE whatever its gap, so a clear level counts as much as another (the decoupled
    gap weighs levels 3-4's -0.85 against level 1's +0.05, 17:1); a near tie's halves often differ in sign and
    size (+0.05 against -0.45: C = -4.4), so its steps are large and noisy, and small only in expectation. The
    halves are independent, so E[C] = EVIDENCE_SCALE * (R_N - R_T) * E[1 / max(|d|, EVIDENCE_FLOOR)]: the gap's
    sign at every p. Not bounded at the modes: the settled-choice fade
    (``loss.mode_token_floor``) stops the push-down of a refused mode, as for ``decoupled``."""
    p = think_end_logp.double().clamp(max=0.0).exp()  # (G,)

    def size(gap: torch.Tensor) -> torch.Tensor:
        return EVIDENCE_SCALE / gap.abs().clamp(min=EVIDENCE_FLOOR)

    return _half_split_choice(rewards, non_thinking, p, group_size, forced, size)


def _half_split_choice(
    rewards: torch.Tensor, non_thinking: torch.Tensor, p: torch.Tensor, group_size: int, forced: tuple[int, int],
    size,
) -> torch.Tensor:  # fmt: skip
    """The first-token advantages (S,) float32 of a half-split choice: per group, two halves of its rows (alternate
    rows within each block of forced direct, forced thinking and free rows, so a mode forced on two rows or more is
    in both halves), each half's gap d (its direct rows' mean reward minus its thinking rows'), and the target step
    C = (d_B size(d_A) + d_A size(d_B)) / 2 on the ``</think>`` logit (0 where a half lacks a mode); ``p`` (G,)
    each group's pi_old(</think> | x), float64. While p < 1/2 C rides on the direct rows' ``</think>`` (whose
    log-prob moves the logit by 1 - p: C / (n_N (1 - p)) each), from 1/2 on the thinking rows' first tokens (-p:
    -C / (n_T p) each, on top of their answer advantages), so no advantage is divided by less than 1/2."""
    k = group_size
    r = rewards.double().view(-1, k)  # (G, K)
    direct = non_thinking.bool().view(-1, k)  # (G, K)
    position = torch.arange(k, device=r.device)  # (K,)
    n_end, t_end = forced[0], forced[0] + forced[1]  # where the forced direct and forced thinking blocks end
    start = torch.where(position < n_end, 0, torch.where(position < t_end, n_end, t_end))  # (K,) each row's block
    odd = ((position - start) % 2).bool()  # (K,) the second half's rows: every other row of each block

    def half_gap(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(G,) the half's mean direct reward minus its mean thinking reward, and whether it has both modes."""
        n, t = direct & rows, ~direct & rows  # (G, K)
        count_n, count_t = n.sum(1), t.sum(1)  # (G,)
        gap = (r * n).sum(1) / count_n.clamp(min=1) - (r * t).sum(1) / count_t.clamp(min=1)
        return gap, (count_n > 0) & (count_t > 0)

    gap_a, both_a = half_gap(~odd)
    gap_b, both_b = half_gap(odd)
    step = (gap_b * size(gap_a) + gap_a * size(gap_b)) / 2  # (G,)
    step = torch.where(both_a & both_b, step, 0.0)
    n_direct, n_thinking = direct.sum(1, keepdim=True), (~direct).sum(1, keepdim=True)  # (G, 1)
    # each used on its side of 1/2 only, where its divisor is at least 1/2 (the clamp keeps the other side finite)
    on_direct = (step / (1 - p).clamp(min=0.5)).unsqueeze(1) / n_direct.clamp(min=1)  # (G, 1)
    on_thinking = (-step / p.clamp(min=0.5)).unsqueeze(1) / n_thinking.clamp(min=1)  # (G, 1)
    low = (p < 0.5).unsqueeze(1)  # (G, 1)
    out = torch.where(direct, torch.where(low, on_direct, 0.0), torch.where(low, 0.0, on_thinking))  # (G, K)
    return out.reshape(-1).float()


def centered_choice(mode_gap: torch.Tensor, non_thinking: torch.Tensor, group_size: int) -> torch.Tensor:
    """The centered choice's advantage (S,) of each direct row's ``</think>`` (0 on thinking rows): from the decoupled
    gap ``mode_gap`` (S,) (``mode_advantages``' ``mode``: on a direct row its group's gap, on a thinking row minus
    it, 0 where the group lacks a mode) and
    the rows' modes ``non_thinking`` (S,). A group's decoupled step on the ``</think>`` logit is s = n_N * gap (its
    n_N direct rows each carry the gap); the centered one is s minus the mean s over the batch's groups that hold
    both modes, spread over the same rows, so a push shared by every level (levels 3-4's -0.85 outweighing level
    1's +0.05 at the first position they share) cancels and only what separates the groups moves the choice. Its
    expectation is a group's decoupled step minus the batch's mean one: the sign of the gap against the batch's
    mean gap, not against 0 (a level at a near tie among levels that refuse direct answers is pushed towards
    direct). The mean is the rank's own batch's. No settled-choice fade (it would break the zero mean), and no
    bound: a level below the batch's mean gap is pushed down at every step."""
    k = group_size
    direct = non_thinking.bool().view(-1, k)  # (G, K)
    n_direct = direct.sum(1)  # (G,)
    gap = torch.where(direct, mode_gap.double().view(-1, k), -mode_gap.double().view(-1, k))[:, 0]  # (G,)
    both = (n_direct > 0) & (n_direct < k)  # (G,)
    step = gap * n_direct  # (G,)
    mean = step[both].mean() if both.any() else step.new_zeros(())
    on_direct = torch.where(both, (step - mean) / n_direct.clamp(min=1), 0.0)  # (G,)
    return torch.where(direct, on_direct.unsqueeze(1), 0.0).reshape(-1).to(mode_gap.dtype)


def settled_fade(think_end_logp: torch.Tensor, floor_logp: float) -> torch.Tensor:
    """a(p) (G,) of each group: min(1, p / floor) ** FADE_POWER, from log p = ``think_end_logp`` (G,) and log floor."""
    return torch.exp(FADE_POWER * (think_end_logp.float() - floor_logp).clamp(max=0.0))


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


def first_token_rows(batch: RolloutBatch) -> RolloutBatch:
    """Each row's prompt and its first response token alone, whose log-prob under a model is log pi(y1 | x)."""
    device = batch.response_ids.device
    ids = batch.response_ids[first_token_index(batch)]  # (S,)
    cu = torch.arange(ids.numel() + 1, dtype=batch.cu_seqlens.dtype, device=device)  # (S+1,)
    return RolloutBatch(batch.prompt_ids, ids, cu, torch.zeros_like(batch.truncated), batch.group_size)


def behaviour_logprobs(batch: RolloutBatch, think_end_id: int, logprobs) -> RolloutBatch:
    """``batch`` with the log-probs the mixture's behaviour policy needs under the weights that sampled it
    (``logprobs(rows)``: the log-probs (n,) of ``rows``' response tokens under them): each row's first token's, and
    its group's log pi(</think> | x) on each of the group's rows. A rollout worker adds them at
    ``rollout.max_staleness`` >= 1, where those weights are older than the trainer's."""
    batch.behaviour_first_logp = logprobs(first_token_rows(batch)).float()  # (S,)
    ends = logprobs(think_end_rows(batch, think_end_id)).float()  # (G,)
    batch.behaviour_think_end_logp = ends.repeat_interleave(batch.group_size)  # (S,)
    return batch


def think_end_rows(batch: RolloutBatch, think_end_id: int) -> RolloutBatch:
    """One row per group: the group's prompt and the one-token response ``</think>``, whose log-prob under a model
    is log pi(</think> | x) at the first position."""
    k = batch.group_size
    prompts = batch.prompt_ids[::k]
    device = batch.response_ids.device
    ids = torch.full((len(prompts),), think_end_id, dtype=batch.response_ids.dtype, device=device)
    cu = torch.arange(len(prompts) + 1, dtype=batch.cu_seqlens.dtype, device=device)
    return RolloutBatch(prompts, ids, cu, torch.zeros(len(prompts), dtype=torch.bool, device=device), 1)
