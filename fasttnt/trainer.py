"""The GRPO loop. ``Trainer.step`` reads as the algorithm, phase by phase:

    rollout -> verify -> reward (once per draw) -> old/ref log-probs -> advantage (over several ranks, then the
    groups dealt to them by their work) -> update -> weight sync -> log

With DAPO's dynamic sampling (``fasttnt.dynamic_sampling``) a step draws more batches of prompts until enough of
their groups have rewards that differ. The pieces live in their own modules: building the run (``run_setup``), the
micro-batched update (``actor``), the advantages (``advantages``), mode-mixed rollouts (``modes``), the stale-weight
guard (``guard``), the deal of the groups to the ranks (``balance``), scoring (``scoring``), the logged numbers
(``step_metrics``), checkpoints (``checkpoint``), signals (``preemption``), the collectives over ranks
(``distributed``) and the run's files (``runlog``). The rewards, advantages, log-probs and loss are the project's
kernels. The device is read where a decision on the host needs it, each read marked ``# sync:``: per draw, the
groups whose rewards differ and the modes the hack flags need; per mini-batch, the normalisers and the sequences the
update skips; in the log phase, the step's metrics in three reads (the levels present, the metrics, the counts).
"""

from __future__ import annotations

import functools
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import balance, checkpoint, distributed, run_setup
from .actor import Actor
from .advantages import step_advantages
from .checkpoint import TrainerState
from .config import TrainConfig, rollout_correction
from .data import PromptMode
from .engines.batch import FORCED_CODES
from .guard import StaleWeightGuard
from .metrics import (
    CHOICE_PREFIXES,
    choice_metrics,
    levels_present,
    mode_accuracies,
    own_limits,
    rollout_metrics,
    to_floats,
)
from .modes import ModeMix, forced_rows
from .pipeline import remote, roles
from .plots import plot_curves
from .policy import UpdateInputs
from .preemption import Preempted, StopSignals
from .rollouts import EngineSync, Rollouts
from .runlog import RunLog
from .scoring import ScoredBatch
from .step_metrics import TOKEN_METRICS, PhaseClock
from .verify import VerifierPool
from .wandb_log import WandbRun


class Trainer:
    """A GRPO run: the built run (``parts``, ``fasttnt.run_setup.RunParts``: model, engine, ranks, data; read
    through it), the trainer's state (``state``, replaced each step), the rollouts (``rollouts``), the update
    (``actor``), the stale-weight guard (``guard``), a mode-mixed run's rows and rules (``mode_mix``, else None) and
    the verifier's workers."""

    def __init__(
        self, cfg: TrainConfig, output_dir: Path, *, resume: bool = False, new_config_ok: bool = False,
        progress: bool = True,
    ) -> None:  # fmt: skip
        """``progress``: show the step bar (off where several runs share one terminal, ``fasttnt compare --jobs``)."""
        self.cfg, self.out, self.progress, self.resumed = cfg, Path(output_dir), progress, resume
        # with rollout workers, the trainers' world (fasttnt.pipeline.roles) before anything else connects
        pipeline = roles.trainers_world(cfg, run_setup.device_type_of(cfg))
        self.parts = parts = run_setup.build(cfg, self.out, pipeline=pipeline, resume=resume,
                                             new_config_ok=new_config_ok)  # fmt: skip
        self.state = parts.state  # the trainer's own from here: each step replaces it
        # a worker samples from a copy of the weights: on-policy (k = 0) the one the trainer holds, checked as vLLM's
        separate = parts.engine.separate_weights or (parts.pipeline is not None and cfg.rollout.max_staleness == 0)
        self.guard = StaleWeightGuard(cfg, separate_weights=separate, bf16=parts.autocast, dist=parts.dist,
                                      floor=parts.state.logp_diff_floor)  # fmt: skip
        self.correction = rollout_correction(cfg)
        self.actor = Actor(cfg, parts, correction=self.correction)
        # the sizes a group's work is counted in when the ranks' groups are dealt (fasttnt.balance.group_workload)
        text = parts.model.config.get_text_config()
        self.model_sizes = (text.hidden_size, getattr(text, "intermediate_size", 4 * text.hidden_size))
        self.mode_mix = ModeMix.of(cfg)  # mode-mixed: the modes of each group's rows and the mode tokens' terms
        self.mode_floor = parts.state.mode_token_floor_logp  # loss.mode_token_floor=auto: measured at step 1
        self.verifier = VerifierPool(cfg.verify_workers, cfg.verify_timeout)
        # where each step's rollouts come from (``rollouts``: made here, or shipped by rollout workers of their own,
        # rollout.workers > 0) and how the weights that make them follow the update (``weights``)
        if parts.pipeline is not None:
            self.rollouts, self.weights = remote.connect(cfg, parts, self.state, self._probe_logprobs)
        else:
            self.rollouts = Rollouts.of(cfg, parts, self.mode_mix, self.verifier)
            self.weights = EngineSync(parts.engine)
        self.stop_asked = False  # a rollout worker was asked to stop (Provenance.stop)
        self._warned_cap = False
        self._checked_floor = False  # a fixed loss.mode_token_floor against the first step's pi_old(</think>)

    # -- one step, phase by phase -------------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        cfg = self.cfg
        step, clock = self.state.step + 1, PhaseClock()
        lr = cfg.optim.lr_at(self.state.step, cfg.steps)  # the rate this step's update uses
        for group in self.actor.optimizer.param_groups:
            group["lr"] = lr

        # rollout -> verify -> reward, once per draw of prompts_per_step prompts; with dynamic sampling, more draws
        # until the step has prompts_per_step groups whose rewards differ (or the cap)
        rolled = self.rollouts.step(step, clock)
        drawn, trained = rolled.drawn, rolled.trained

        # old and reference log-probs (and, mode-mixed, of </think> first)
        batch, mix = trained.batch, self.mode_mix
        think_end_rows = mix.think_end_rows(batch, self.parts.think_end_id) if mix is not None else None
        logp = self.actor.old_and_ref_logprobs(batch, think_end_rows, calibrating=self.guard.calibrates(step, batch))
        clock.lap("logprobs")

        # advantage (fasttnt.advantages)
        advantages, first_advantages = step_advantages(trained.rewards, cfg, mix, logp.think_end_logp)
        inputs = UpdateInputs(batch, advantages, first_advantages, logp.old_logp, logp.ref_logp)
        # mode-mixed: the mode tokens' terms (fasttnt.modes), faded below the floor of a settled choice (under
        # loss.mode_token_floor=auto, the first step's smallest pi_old(</think> | x)); they set the old log-probs of
        # the first tokens, which the engine's weights are checked against next
        below_floor = None
        if mix is not None:
            inputs, below_floor = self._mode_token_terms(mix, inputs, trained.rewards.non_thinking, logp.think_end_logp)
        self.guard.check(step, batch, inputs.old_logp)
        # over several ranks, each mini-batch's groups dealt to them by their work (fasttnt.balance): the same
        # update, without the step waiting on the rank that drew the longest responses
        mini_batch_groups, dealt = None, {}
        if self.parts.dist:
            deal = balance.deal_groups(inputs, self.parts.dist, mini_batches=cfg.loss.mini_batches,
                                       hidden_size=self.model_sizes[0], intermediate_size=self.model_sizes[1],
                                       trained=self.actor.trained_rows(inputs),
                                       balance=cfg.distributed.balance_ranks)  # fmt: skip
            inputs, mini_batch_groups, dealt = deal.inputs, deal.mini_batch_groups, deal.logged()
        clock.lap("advantage")

        # update (without old log-probs, the guard judges the engine's against the update's own pass, before its
        # optimizer step)
        judge = functools.partial(self.guard.judge, step) if self.guard.checks(batch) else None
        update = self.actor.update(inputs, mini_batch_groups=mini_batch_groups, judge=judge)
        if below_floor is not None:  # the share of the groups over all ranks whose choice is below the floor
            counts = torch.stack([below_floor.sum(), torch.tensor(below_floor.numel(), device=below_floor.device)])
            counts = distributed.sum_over_ranks(self.parts.dist, counts.double())
            update["mode_floored"] = counts[0] / counts[1].clamp(min=1)
        clock.lap("update")

        # weight sync (the vllm engine gathers ZeRO-3 shards bucket by bucket itself; a worker's push runs in the
        # background, at k >= 1 with the trainer's log-probs of a probe that the worker's are checked against)
        self.weights.sync(self.parts.model, step)
        clock.lap("sync")

        # log (what the rollouts' source adds: a worker's data position, weight version and seconds)
        made = rolled.provenance
        values = self._record(step=step, lr=lr, drawn=drawn, trained=trained, update=update, n_draws=rolled.draws,
                              varied=rolled.varied, filled=rolled.filled, times=clock.times,
                              generate_seconds=made.generate_seconds,
                              think_end_logp=logp.think_end_logp, below_floor=below_floor)  # fmt: skip
        values.update(made.logged)
        values.update(dealt)
        self.stop_asked = made.stop
        self.state = TrainerState(step=step, data_position=made.data_position, world=self.parts.world,
                                  logp_diff_floor=self.guard.floor, mode_token_floor_logp=self.mode_floor)  # fmt: skip
        return values

    def _probe_logprobs(self, probe) -> torch.Tensor:
        """The policy's log-probs of ``probe`` (the push check: ``fasttnt.pipeline.push``)."""
        return self.actor.logprobs(self.actor.policy, probe, zero3_collectives=self.actor.zero3)

    def _mode_token_terms(
        self, mix: ModeMix, inputs: UpdateInputs, non_thinking: torch.Tensor, think_end_logp: torch.Tensor
    ) -> tuple[UpdateInputs, torch.Tensor | None]:  # fmt: skip
        """``ModeMix.mode_token_terms`` at the fade's floor: measured at the first step under ``auto`` (the smallest
        pi_old(</think> | x) over all ranks), a fixed one checked once against the first step's largest."""
        if mix.measures_floor(self.mode_floor):
            self.mode_floor = distributed.min_over_ranks(self.parts.dist, think_end_logp)
        if mix.fixed_floor and not self._checked_floor:
            self._checked_floor = True
            warning = mix.floor_above_start(-distributed.min_over_ranks(self.parts.dist, -think_end_logp))
            if warning and self.parts.is_main:
                tqdm.write(f"fasttnt: {warning}")
        return mix.mode_token_terms(inputs, non_thinking, think_end_logp, self.parts.think_end_id,
                                    floor_logp=mix.floor_logp(self.mode_floor))  # fmt: skip

    def _record(
        self, *, step: int, lr: float, drawn: ScoredBatch, trained: ScoredBatch, update: dict[str, torch.Tensor],
        n_draws: int, varied: list[bool], filled: int, times: dict[str, float], generate_seconds: float,
        think_end_logp: torch.Tensor | None, below_floor: torch.Tensor | None = None,
    ) -> dict:  # fmt: skip
        """The step's row of metrics.jsonl: every metric over all ranks' responses (N ranks log what one process
        would), the update's means, counts, rates and times. ``drawn``: every response of the step's draws, which
        the metrics describe; ``trained``: the groups the update ran on; ``varied``: per drawn group, whether its
        rewards differ; ``filled``: the equal-reward groups that filled the batch; ``think_end_logp``: mode-mixed,
        each trained group's log pi_old(</think> | x), and ``below_floor`` which of them the settled-choice fade
        scales down (``ModeMix.mode_token_terms``). Three reads from the device: the levels present, the metrics and
        the counts."""
        r = self.cfg.rollout
        rewards = drawn.rewards
        per_response = {"correct": drawn.judged.correct, "non_thinking": rewards.non_thinking,
                        "lengths": drawn.batch.lengths, "hacked": drawn.hacked, "truncated": drawn.batch.truncated,
                        "limit": rewards.limit, "rewards": rewards.rewards}  # fmt: skip
        if self.cfg.reward.scheme == "tnt":  # where the limit comes from the query's own thinking responses
            per_response["own_limit"] = own_limits(rewards.non_thinking, rewards.solution_len, r.group_size)
        mix = self.mode_mix
        if mix is not None and mix.free_rows:  # mode-mixed: what the model chooses unforced
            per_response["free"] = ~forced_rows(drawn.batch)
        by_mode = {"free": ~forced_rows(drawn.batch), "levels": drawn.levels}  # the accuracies by mode (and level)
        if mix is not None and mix.forced_non_thinking_rows:
            by_mode["forced_direct"] = drawn.batch.forced == FORCED_CODES[PromptMode.NON_THINKING]
        by_mode = {k: v for k, v in by_mode.items() if v is not None}
        # the choice (metrics.choice_metrics): mode-mixed, each trained group's log pi_old(</think> | x) and level
        choice = {}
        if think_end_logp is not None:
            choice = {"think_end_logp": think_end_logp, "group_levels": trained.levels[:: r.group_size]}
            if below_floor is not None:
                choice["below_floor"] = below_floor
        if self.parts.dist:
            per_response = {k: distributed.all_gather_cat(v) for k, v in per_response.items()}
            by_mode = {k: distributed.all_gather_cat(v) for k, v in by_mode.items()}
            choice = {k: distributed.all_gather_cat(v) for k, v in choice.items()}
        batch = trained.batch
        judged = drawn.judged
        counts = {"drawn_tokens": drawn.batch.response_ids.numel(), "trained_tokens": batch.response_ids.numel(),
                  "prompt_tokens": sum(len(p) for p in batch.prompt_ids), "timeouts": judged.timeouts,
                  "crashes": judged.crashes, "varied": sum(varied), "groups": len(varied),
                  "filled": filled}  # fmt: skip
        counts = {k: torch.tensor(float(v), dtype=torch.float64, device=self.parts.device) for k, v in counts.items()}
        counts = distributed.sum_named_over_ranks(self.parts.dist, counts)
        present = levels_present(by_mode.get("levels"))  # sync: the levels present
        accuracies = mode_accuracies(per_response["correct"], per_response["non_thinking"], **by_mode, present=present)
        choices = choice_metrics(per_response["rewards"], per_response["non_thinking"], by_mode.get("levels"), present,
                                 free=per_response.get("free"), **choice)  # fmt: skip
        values = to_floats({**rollout_metrics(**per_response), **accuracies, **choices, **update})  # sync: one read
        for name in list(values):  # measured on no token (every sequence skipped), or no response of a mode: not
            if (name in TOKEN_METRICS or name.startswith(CHOICE_PREFIXES)) and not math.isfinite(values[name]):
                del values[name]  # NaN rows
        n = dict(zip(counts, torch.stack(list(counts.values())).tolist(), strict=True))  # sync: one read
        values.update(times)
        values.update(
            step=step, lr=lr, verify_timeouts=int(n["timeouts"]), verify_crashes=int(n["crashes"]),
            generated_tokens_per_s=n["drawn_tokens"] / max(generate_seconds, 1e-9),
            trained_tokens_per_s=(n["trained_tokens"] + n["prompt_tokens"]) * self.cfg.loss.ppo_epochs
            / max(times["time_update"], 1e-9),
            time_step=sum(times.values()),
        )  # fmt: skip
        if r.dynamic_sampling:
            values.update(
                draws=n_draws,
                varied_group_frac=n["varied"] / n["groups"],  # of the groups drawn, those whose rewards differ
                kept_group_frac=(r.prompts_per_step - n["filled"]) / n["groups"],  # of those drawn, trained on
                filled_groups=int(n["filled"]),
            )
            if n["filled"] and not self._warned_cap and self.parts.is_main:
                self._warned_cap = True
                tqdm.write(
                    f"step {step}: after rollout.max_draws={r.max_draws} draws, {int(n['filled'])} of the step's "
                    f"{r.prompts_per_step} groups are equal-reward fills (zero advantage, no policy-gradient term); "
                    "logged per step as filled_groups"
                )
        return values

    # -- the run ------------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Train to ``steps``; raises ``Preempted`` when a signal stopped the run (after a checkpoint)."""
        cfg = self.cfg
        wandb = WandbRun.start(cfg, self.out, resume=self.resumed) if self.parts.is_main and cfg.logging.wandb else None
        log = RunLog(self.out, steps=cfg.steps, done=self.state.step, active=self.parts.is_main, progress=self.progress,
                     wandb=wandb)  # fmt: skip
        last_save = time.monotonic()
        try:
            with StopSignals() as signals:
                while self.state.step < cfg.steps:
                    log.write(self.step())
                    step, minutes = self.state.step, cfg.save_every_minutes
                    timed = minutes is not None and time.monotonic() - last_save >= 60 * minutes
                    # every rank stops and saves at the same step: one collective a step; a rollout worker asked
                    # to stop says so with its batch
                    asked = signals.requested is not None or self.stop_asked
                    stop, timed = distributed.any_over_ranks(self.parts.dist, asked, timed)
                    if step % cfg.save_every == 0 or step == cfg.steps or timed or stop:
                        self._save()
                        last_save = time.monotonic()
                    if stop and step < cfg.steps:  # a signal during the last step: finish normally
                        self._close(log)
                        where = checkpoint.checkpoint_paths(self.out / "checkpoints", step)[0]
                        raise Preempted(signals.requested or "a signal to another rank", step, where)
        finally:
            log.close_file()
            self.verifier.close()
        self.weights.wait()  # the last push taken (not after a stop: a worker is not taking it then)
        checkpoint.export_final(self.out, self.parts.model, self.out / "tokenizer", rank=self.parts.rank)
        if self.parts.is_main and log.history:
            plot_curves(log.history, self.out / "curves.png")
            if log.wandb is not None:
                log.wandb.log_image("curves", self.out / "curves.png", step=self.state.step)
        self._close(log)
        return log.history

    def _save(self) -> None:
        # with rollout workers at k >= 1, the batches in flight are kept with the weights (RemoteRollouts.in_flight)
        in_flight = self.rollouts.in_flight(self.state.step)
        checkpoint.save(self.out / "checkpoints", self.cfg, self.state, self.parts.model, self.actor.optimizer,
                        self.parts.ds_engine, rank=self.parts.rank, tokenizer=self.out / "tokenizer",
                        extra=in_flight)  # fmt: skip

    def _close(self, log: RunLog) -> None:
        """The engine's memory and the run log's buffered events."""
        self.parts.engine.close()
        log.close()
