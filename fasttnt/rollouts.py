"""A step's rollouts: rollout -> verify -> reward, once per draw of ``prompts_per_step`` prompts, and with DAPO's
dynamic sampling (``fasttnt.dynamic_sampling``) more draws until enough groups have rewards that differ. The
colocated trainer runs it between its updates (``Trainer.step``); it holds all a rollout needs of a run, so that a
process that only generates can run it too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import distributed, scoring
from .config import TrainConfig
from .data import Problem
from .dynamic_sampling import choose_groups, concat_draws, select_groups, varied_groups
from .engines.sampler import step_seed
from .metrics import HackMarkers
from .modes import ModeMix
from .scoring import ScoredBatch
from .verify import VerifierPool


class VerificationError(RuntimeError):
    """A step's rewards cannot be trusted: too many answers could not be verified."""


@dataclass(frozen=True)
class Provenance:
    """Where a step's rollouts come from, as the trainer logs and checkpoints them: this process's draws, or a rollout
    worker's shipment (``fasttnt.pipeline.remote``)."""

    data_position: int  # problems of the training stream consumed once the step's draws were made
    generate_seconds: float  # the seconds the responses took to generate (the worker's, where a worker generated)
    stop: bool = False  # a rollout worker was asked to stop (a signal to it alone): the trainers stop too
    logged: dict[str, float] = field(default_factory=dict)  # the source's own numbers in the step's row


@dataclass
class StepRollouts:
    """What a step drew and what it trains on, and where it comes from."""

    drawn: ScoredBatch  # every response of the step's draws: what its metrics describe
    trained: ScoredBatch  # the groups the update runs on (all of ``drawn`` without dynamic sampling)
    varied: list[bool]  # per drawn group, whether its rewards differ
    filled: int  # equal-reward groups that filled the batch (dynamic sampling at rollout.max_draws)
    draws: int
    provenance: Provenance


class Rollouts:
    def __init__(
        self, cfg: TrainConfig, *, engine, stream, tokenizer, prompt: Callable[[Problem], object], think_end_id: int,
        markers: HackMarkers | None, mode_mix: ModeMix | None, verifier: VerifierPool, dist=None, rank: int = 0,
        prompts_per_rank: int,
    ) -> None:  # fmt: skip
        """``engine``, ``stream`` (the training problems), ``prompt`` (a problem's prompt) and the rest: a built run's
        (``RunParts``); ``dist``, ``rank``, ``prompts_per_rank``: the ranks that share each draw's prompts."""
        self.cfg, self.engine, self.stream, self.tokenizer, self.prompt = cfg, engine, stream, tokenizer, prompt
        self.think_end_id, self.markers, self.mode_mix, self.verifier = think_end_id, markers, mode_mix, verifier
        self.dist, self.rank, self.prompts_per_rank = dist, rank, prompts_per_rank

    @classmethod
    def of(cls, cfg: TrainConfig, parts, mode_mix: ModeMix | None, verifier: VerifierPool) -> Rollouts:
        """The rollouts of a built run (``fasttnt.run_setup.RunParts``)."""
        return cls(cfg, engine=parts.engine, stream=parts.stream, tokenizer=parts.tokenizer, prompt=parts.prompt,
                   think_end_id=parts.think_end_id, markers=parts.markers, mode_mix=mode_mix, verifier=verifier,
                   dist=parts.dist, rank=parts.rank, prompts_per_rank=parts.prompts_per_rank)  # fmt: skip

    def step(self, step: int, clock) -> StepRollouts:
        """Step ``step``'s draws (``clock``: a ``PhaseClock``, lapped per phase of each draw), and the groups it
        trains on; the engine's memory handed back for the update."""
        r = self.cfg.rollout
        draws = [self.draw(step, 0, clock)]
        varied = varied_groups(draws[0].rewards.rewards, r.group_size).tolist()  # sync: one read per draw
        while r.dynamic_sampling and len(draws) < r.max_draws and self._short_of_groups(sum(varied)):
            draws.append(self.draw(step, len(draws), clock))
            varied += varied_groups(draws[-1].rewards.rewards, r.group_size).tolist()
        self.engine.end_rollout()  # the engine's memory back for the update
        drawn = concat_draws(draws)
        trained, filled = drawn, 0
        if r.dynamic_sampling:
            groups, filled = choose_groups(varied, self.prompts_per_rank)
            trained = select_groups(drawn, groups)
        provenance = Provenance(data_position=self.stream.position, generate_seconds=clock.times["time_generate"])
        return StepRollouts(drawn, trained, varied, filled, len(draws), provenance)

    def in_flight(self, step: int) -> None:
        """Nothing is in flight between steps of rollouts made here (``RemoteRollouts.in_flight``'s counterpart)."""
        del step

    def draw(self, step: int, draw: int, clock) -> ScoredBatch:
        """Draw ``draw`` of a step: the next prompts_per_step prompts, this rank's share generated (seeded per
        response; draw 0's seeds are those of a step without dynamic sampling), verified and rewarded."""
        cfg, r, per_rank = self.cfg, self.cfg.rollout, self.prompts_per_rank
        problems = self.stream.take(r.prompts_per_step)  # every rank draws the step's prompts, generates its share
        problems = problems[self.rank * per_rank : (self.rank + 1) * per_rank]
        first_row = (draw * r.prompts_per_step + self.rank * per_rank) * r.group_size
        prompts = [self.prompt(p) for p in problems]
        seeds = {"seed": step_seed(cfg.seed, step), "first_row": first_row}
        if self.mode_mix is not None:
            batch = self.mode_mix.rollout(self.engine, prompts, **seeds)
        else:
            batch = self.engine.generate(prompts, r.group_size, **seeds)
        clock.lap("generate")

        golds = [p.answer for p in problems for _ in range(r.group_size)]
        judged = scoring.judge(self.tokenizer, batch, golds, eos_ids=self.engine.eos_ids, pool=self.verifier)
        if judged.crashes >= 2 and judged.crashes > cfg.verify_max_crash_share * len(golds):
            # a crashed item counts as wrong: past a few, the rewards would be the verifier's, not the model's
            raise VerificationError(
                f"step {step}: the verification of {judged.crashes} of {len(golds)} answers crashed (its workers "
                f"died; more than one and above verify_max_crash_share={cfg.verify_max_crash_share}); not training "
                "on those rewards. Out of memory is the usual cause: lower verify_workers"
            )
        clock.lap("verify")

        # all K samples of a prompt are on this rank, so the reward is local (the mode balance counts over ranks)
        scores = scoring.add_rewards(judged, batch, reward=cfg.reward, think_end_id=self.think_end_id,
                                     markers=self.markers, max_new_tokens=r.max_new_tokens,
                                     dist=self.dist)  # fmt: skip
        clock.lap("reward")
        # the accuracies by mode and level (metrics.mode_accuracies); -1 marks a problem without a level, so every
        # rank and draw has the same fields to gather and concatenate
        levels = torch.tensor([-1 if p.level is None else p.level for p in problems], device=judged.correct.device)
        scores.levels = levels.repeat_interleave(r.group_size)
        return scores

    def _short_of_groups(self, varied: int) -> bool:
        """Whether this rank, or any other, has fewer than its share of groups with differing rewards (every rank
        then draws again, so the ranks stay in step)."""
        return any(distributed.any_over_ranks(self.dist, varied < self.prompts_per_rank))


class EngineSync:
    """The colocated engine kept in step with the trained weights: ``sync`` after each update (the hf engine samples
    from the model itself; vLLM reloads them, gathering ZeRO-3's shards bucket by bucket); the pipeline's counterpart
    is ``fasttnt.pipeline.push.WeightPush``."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def sync(self, model, step: int) -> None:
        del step  # the engine holds one version: the latest
        self.engine.sync_weights(model)

    def wait(self) -> None:
        """Nothing runs in the background."""
