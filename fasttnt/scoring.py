"""Scoring a rollout: decode -> verify -> reward -> hack flags, the one copy that training, evaluation and the TRL
and verl integrations share.

A response is *correct* when the verifier accepts its final answer (after ``</think>``) and it ended by itself: a
response cut by the length budget is wrong whatever it says (``judge``). Rewards are then the configured scheme's
(``fasttnt.rewards``), computed on device from the token ids, and a non-thinking response that thinks anyway after
its ``</think>`` is flagged as a hack (``fasttnt.metrics.hack_flags``): ``add_rewards``. ``score`` does both. What
comes out is a ``ScoredBatch``: the record of one draw of a training step (``fasttnt.dynamic_sampling`` joins and
cuts them) and of one chunk of an evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from fasttnt_kernels import TntRewards

from .engines.batch import RolloutBatch, decode_responses, truncated_without_eos
from .metrics import HackMarkers, hack_flags
from .rewards import RewardConfig, compute_rewards
from .verify import VerifierPool, verify_batch

Verify = Callable[[list[str], list[str]], Sequence[bool]]
"""A verifier of one's own: ``verify(texts, golds)`` -> one verdict per response."""


@dataclass
class Judged:
    """A batch's responses judged against their gold answers (S of them)."""

    texts: list[str]  # decoded, without the final EOS
    correct: torch.Tensor  # (S,) bool on the batch's device: verified right and not truncated
    timeouts: int = 0  # verifications killed at their timeout (counted wrong)
    crashes: int = 0  # verifications whose worker died (counted wrong)


@dataclass
class ScoredBatch:
    """A rollout batch through verify and reward: S responses, G = S / K groups."""

    batch: RolloutBatch
    judged: Judged  # the responses' texts and verdicts, and the verifier's counts
    rewards: TntRewards  # rewards, non_thinking, solution_len (S,); limit (G,)
    hacked: torch.Tensor | None = None  # (S,) bool: non-thinking, and thinking after its </think>; None: no markers
    levels: torch.Tensor | None = None  # (S,) int: each response's problem level, -1 where it has none (the trainer)


def batch_of(responses: list[list[int]], *, group_size: int, eos_ids: Collection[int], device="cpu") -> RolloutBatch:
    """Responses as token lists (another framework's completions, K per prompt adjacent) as a ``RolloutBatch``:
    truncated where they do not end with one of ``eos_ids`` (``engines.batch.eos_ids_of``)."""
    responses = [list(r) for r in responses]
    truncated = truncated_without_eos(responses, eos_ids)
    return RolloutBatch.of_responses([[] for _ in responses], responses, truncated, group_size, device=device)


def judge(
    tokenizer,
    batch: RolloutBatch,
    golds: list[str],
    *,
    eos_ids: Collection[int],
    verify: Verify | None = None,
    pool: VerifierPool | None = None,
) -> Judged:
    """Decode (without the final EOS: one of ``eos_ids``, the ids the responses stopped at) and verify each response
    (``verify``, default fasttnt's verifier in ``pool``'s workers) against its gold answer; a truncated response is
    wrong."""
    texts = decode_responses(tokenizer, batch.responses, eos_ids)
    if verify is None:
        verdicts = verify_batch(texts, golds, pool=pool, require_think_end=True)
        timeouts, crashes = verdicts.timeouts, verdicts.crashes
    else:
        verdicts, timeouts, crashes = [bool(v) for v in verify(texts, golds)], 0, 0
    device = batch.truncated.device
    correct = torch.tensor(list(verdicts), dtype=torch.bool, device=device) & ~batch.truncated.bool()  # (S,)
    return Judged(texts, correct, timeouts, crashes)


def add_rewards(
    judged: Judged,
    batch: RolloutBatch,
    *,
    reward: RewardConfig,
    think_end_id: int,
    markers: HackMarkers | None = None,
    max_new_tokens: int | None = None,
    dist=None,
) -> ScoredBatch:
    """The rewards of ``reward`` for judged responses (``compute_rewards``: each group's limit from its own thinking
    responses; the overlong shaping, if on, counts back from ``max_new_tokens``; the mode balance, if on, over the
    free rows of every rank of ``dist``) and, given ``markers``, the hack flags."""
    rewards = compute_rewards(batch, judged.correct, think_end_id, reward, max_new_tokens=max_new_tokens, dist=dist)
    hacked = None
    if markers is not None:
        non_thinking = rewards.non_thinking.tolist()  # sync: the hack flags need the text, on the host
        hacked = torch.tensor(hack_flags(judged.texts, non_thinking, markers), device=judged.correct.device)
    return ScoredBatch(batch, judged, rewards, hacked=hacked)


def score(
    tokenizer,
    batch: RolloutBatch,
    golds: list[str],
    *,
    eos_ids: Collection[int],
    verify: Verify | None = None,
    pool=None,
    **reward_args,
) -> ScoredBatch:
    """``judge`` then ``add_rewards``: a batch's responses decoded, verified, rewarded and flagged."""
    return add_rewards(judge(tokenizer, batch, golds, eos_ids=eos_ids, verify=verify, pool=pool), batch, **reward_args)
