"""The policy's side of a step (verl calls it the actor): log-probs without gradients (old and reference), and the
update: ``ppo_epochs`` passes over the batch, each ``mini_batches`` optimizer steps, each in micro-batches of at
most ``micro_batch_tokens`` tokens whose gradients accumulate.

Every normaliser is the whole mini-batch's over all ranks, so the micro-batches' (and ranks') losses add up to the
mini-batch's loss and the accumulated gradient is the one-forward gradient. Under DeepSpeed every rank runs as many
forwards and backwards (a rank with fewer pads with dummy ones), since ZeRO's gathers and reductions are
collective.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace
from typing import NamedTuple

import torch

from fasttnt_kernels import PolicyLossConfig, rollout_correction_weights

from . import distributed
from .config import TrainConfig
from .engines.batch import RolloutBatch
from .policy import (
    MicroBatch,
    UpdateInputs,
    batch_logprobs,
    bf16_context,
    micro_batch_loss,
    plan_micro_batches,
    run_dummy,
)
from .step_metrics import ROLLOUT_METRICS, TOKEN_METRICS, add_into


class NoGradLogprobs(NamedTuple):
    """A batch's log-probs before the update, without gradients (``Actor.old_and_ref_logprobs``); None where not
    needed."""

    old_logp: torch.Tensor | None  # (N,) the policy's before the update (the old policy, pi_old)
    ref_logp: torch.Tensor | None  # (N,) the reference model's (the KL term)
    think_end_logp: torch.Tensor | None  # (G,) mode-mixed: log pi_old(</think> | x) at each group's first position


class Actor:
    def __init__(self, cfg: TrainConfig, parts, *, correction: str) -> None:
        """``parts``: the built run (``fasttnt.run_setup.RunParts``): model, head, optimizer, DeepSpeed's engine,
        ranks."""
        self.cfg = cfg
        self.model, self.head, self.optimizer = parts.model, parts.head, parts.optimizer
        self.ds_engine, self.ref_model = parts.ds_engine, parts.ref_model
        self.dist, self.world = parts.dist, parts.world
        self.device = parts.device
        self.autocast_on = parts.autocast
        self.correction = correction
        self.settings = PolicyLossConfig.of(cfg.loss)

    # -- log-probs without gradients ----------------------------------------------------------------------------

    def old_and_ref_logprobs(
        self, batch: RolloutBatch, think_end_rows: RolloutBatch | None = None, *, calibrating: bool = False
    ) -> NoGradLogprobs:
        """The old log-probs (N,), needed once the policy moves within the step (a second mini-batch or epoch: the
        rollout correction's weights are then those of the policy at the step's start, TRL's vLLM correction in
        grpo_trainer.py, trl 1.16, likewise), for a mode-mixed batch, whose ``think_end_rows``
        (``ModeMix.think_end_rows``) get the old policy's log-probs too (``fasttnt.modes``), or where the
        stale-weight guard measures its bf16 floor over the whole batch (``calibrating``:
        ``StaleWeightGuard.calibrates``); the reference model's log-probs when the KL term is on. None where not
        needed: at one mini-batch and one epoch the update's own pass is the old policy's, from which the fused loss
        forms the rollout correction (``corrects_in_the_pass``) and the stale-weight guard is judged (``update``'s
        ``judge``)."""
        loss_cfg = self.cfg.loss
        old_logp = ref_logp = think_end_logp = None
        if loss_cfg.ppo_epochs > 1 or loss_cfg.mini_batches > 1 or think_end_rows is not None or calibrating:
            old_logp = self.logprobs(self.policy, batch, zero3_collectives=self.zero3)
        if think_end_rows is not None:
            think_end_logp = self.logprobs(self.policy, think_end_rows, zero3_collectives=self.zero3)
        if self.ref_model is not None:  # a plain module on every rank: no collectives
            ref_logp = self.logprobs(self.ref_model, batch, zero3_collectives=False)
        return NoGradLogprobs(old_logp=old_logp, ref_logp=ref_logp, think_end_logp=think_end_logp)

    def logprobs(self, model, batch: RolloutBatch, *, zero3_collectives: bool) -> torch.Tensor:
        """Log-probs (N,) of the batch under ``model`` (the policy, ``policy``, or the reference model), without
        gradients, in micro-batches of ``micro_batch_tokens``. ``zero3_collectives``: the forwards gather
        parameters collectively, so every rank runs as many (the ones with fewer pad with dummy forwards)."""
        return batch_logprobs(model, batch, micro_batch_tokens=self.cfg.micro_batch_tokens,
                              temperature=self.cfg.rollout.temperature, bf16=self.autocast_on, dist=self.dist,
                              zero3_collectives=zero3_collectives)  # fmt: skip

    # -- the update ---------------------------------------------------------------------------------------------

    def update(
        self, inputs: UpdateInputs, mini_batch_groups: list[int] | None = None,
        judge: Callable[[float], None] | None = None,
    ) -> dict[str, torch.Tensor]:  # fmt: skip
        """``ppo_epochs`` passes over the batch, each ``mini_batches`` optimizer steps. Loss, grad norm and counts
        are means over the optimizer steps; the token metrics (``TOKEN_METRICS``) are means over every token they
        were measured on, NaN where that is none (every sequence skipped). ``mini_batch_groups``: the groups of
        each mini-batch on this rank, in order, where the ranks' groups were dealt (``fasttnt.balance``); None: the
        batch in equal parts. ``judge``: without old log-probs, called before the optimizer step with the mean
        |pi - rollout| log-prob per token trained on, over all ranks (the stale-weight guard's
        ``StaleWeightGuard.judge``, which raises to stop before anything is trained); not called where no token is
        trained."""
        loss_cfg, batch = self.cfg.loss, inputs.batch
        if inputs.old_logp is None and (loss_cfg.ppo_epochs > 1 or loss_cfg.mini_batches > 1):
            # past the first optimizer step the policy has moved: its own log-probs are no longer the old ones
            raise ValueError("several mini-batches or epochs need the old log-probs (old_and_ref_logprobs makes them)")
        groups = batch.lengths.numel() // batch.group_size
        if mini_batch_groups is None:
            mini_batch_groups = [groups // loss_cfg.mini_batches] * loss_cfg.mini_batches
        if len(mini_batch_groups) != loss_cfg.mini_batches or sum(mini_batch_groups) != groups:
            raise ValueError(f"mini_batch_groups={mini_batch_groups} is not {loss_cfg.mini_batches} mini-batches "
                             f"of this rank's {groups} groups")  # fmt: skip
        starts = [0, *itertools.accumulate(mini_batch_groups)]
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        token_sums = {name: torch.zeros((), device=self.device) for name in (*TOKEN_METRICS, "trained", "rollout")}
        count, waited = 0, 0.0
        for _epoch in range(loss_cfg.ppo_epochs):
            for first, last in itertools.pairwise(starts):
                metrics, step_sums, wait = self._optimizer_step(inputs.group_slice(first, last), judge)
                add_into(token_sums, step_sums)
                add_into(sums, metrics)
                count, waited = count + 1, waited + wait
        means = {name: value / count for name, value in sums.items()}
        if self.dist is not None:  # the rank that waited longest for the others
            means["time_rank_wait"] = distributed.all_max_tensor(torch.tensor([waited], device=self.device))[0]
        for name in TOKEN_METRICS:
            means[name] = token_sums[name] / token_sums["rollout" if name in ROLLOUT_METRICS else "trained"]
        if batch.rollout_logp is None:  # an engine that does not say what it sampled with
            for name in ROLLOUT_METRICS:
                means.pop(name)
        return means

    def _optimizer_step(self, inputs: UpdateInputs, judge: Callable[[float], None] | None = None):
        """One optimizer step on a mini-batch, its forward and backward in micro-batches, gradients accumulated.
        Sequences that cannot move the weights are left out first (``_drop_zero_advantage``); the normalisers
        still count them. Returns the step's metrics, its named sums over the ranks (``TOKEN_METRICS``' token
        sums, the tokens trained on, ``trained``, and the tokens the rollout diagnostics cover, ``rollout``), and,
        over several ranks, the seconds this rank waited for the others at the end of each forward
        (``distributed.wait_for_ranks``; the backward's share of an imbalance waits inside ZeRO's reductions, unseen
        here), else 0."""
        part, old_logp = inputs.batch, inputs.old_logp
        local = torch.tensor([float(part.bounds[-1]), float(part.lengths.numel())], device=self.device)
        n_tokens, n_seqs = distributed.sum_over_ranks(self.dist, local).tolist()  # sync: one read per mini-batch
        sums = {name: torch.zeros((), dtype=torch.float32, device=self.device) for name in ("loss", *TOKEN_METRICS)}
        # the rollout correction over the whole mini-batch when the old log-probs are known; else (on-policy, no
        # correction) its diagnostics come from each micro-batch's log-probs, of the sequences trained on
        rollout_tokens = None  # tokens the diagnostics cover: all of them here, else those trained on
        if part.rollout_logp is not None and old_logp is not None:
            weights, correction = rollout_correction_weights(
                old_logp,
                part.rollout_logp,
                part.cu_seqlens,
                mode=self.correction,
                cap=self.cfg.loss.rollout_correction_cap,
            )
            rollout_tokens = float(part.bounds[-1])
            for name in ROLLOUT_METRICS:
                sums[name] = correction[name] * rollout_tokens
            if weights is not None:  # the correction's weights times the modes' (fasttnt.modes)
                inputs = replace(
                    inputs, is_weights=weights if inputs.is_weights is None else weights * inputs.is_weights
                )
        inputs, skipped = self._drop_zero_advantage(inputs)
        part = inputs.batch
        plan = plan_micro_batches(part, self.cfg.micro_batch_tokens)
        n_micro = distributed.max_over_ranks(self.dist, len(plan)) if self.ds_engine is not None else len(plan)
        # at least one backward, so a step with every sequence skipped still steps on (zero) gradients, as the
        # unskipped update would
        n_micro = max(n_micro, 1)
        if self.ds_engine is None:
            self.optimizer.zero_grad(set_to_none=True)
        wait = 0.0
        for i in range(n_micro):
            if self.ds_engine is not None:
                self.ds_engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            if i < len(plan):
                total, micro_sums = self._micro_batch_loss(inputs, plan[i], n_tokens=n_tokens, n_seqs=n_seqs)
                add_into(sums, micro_sums)
            else:
                with self.autocast():
                    loss, _, _ = run_dummy(
                        self.policy, self.device, temperature=self.cfg.rollout.temperature, with_loss=True
                    )
                total = loss * 0.0  # the collectives of a forward and backward, no gradient
            if self.dist is not None:
                wait += distributed.wait_for_ranks(self.device)
            if self.ds_engine is not None:
                # DeepSpeed averages gradients over ranks; each rank's loss is its part of a global sum
                self.ds_engine.backward(total * self.world)
            else:
                total.backward()
        trained_tokens = float(part.bounds[-1])
        if rollout_tokens is None:
            rollout_tokens = trained_tokens
        counts = {"micro_batches": float(len(plan)), "skipped": float(skipped), "trained": trained_tokens,
                  "rollout": rollout_tokens}  # fmt: skip
        local_sums = {**sums, **{k: sums["loss"].new_tensor(v) for k, v in counts.items()}}
        totals = distributed.sum_named_over_ranks(self.dist, local_sums)  # one collective per optimizer step
        if judge is not None and old_logp is None and part.rollout_logp is not None:
            tokens = float(totals["rollout"])  # sync: one read
            if tokens > 0:  # the engine's log-probs against this pass's, before anything is trained on them
                judge(float(totals["rollout_logp_diff"]) / tokens)
        if self.ds_engine is not None:
            self.ds_engine.step()
            grad_norm = torch.tensor(float(self.ds_engine.get_global_grad_norm() or 0.0))
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            self.optimizer.step()
        metrics = {
            "loss": totals["loss"],
            "grad_norm": grad_norm.to(totals["loss"].device).float(),
            "micro_batches": totals["micro_batches"],  # run, dummy ones not counted
            "skipped_seq_frac": totals["skipped"] / max(n_seqs, 1.0),
        }
        return metrics, {name: totals[name] for name in (*TOKEN_METRICS, "trained", "rollout")}, wait

    def trained_rows(self, inputs: UpdateInputs) -> torch.Tensor:
        """(S,) bool: the sequences the update runs on. Those whose advantages (and first tokens' own) are exactly 0
        are left out where ``loss.skip_zero_advantage`` is on: such a sequence's policy-gradient term is
        -ratio * 0 = 0 for every token, whatever the ratio, clip, dual clip or importance weight, so it adds nothing
        to the gradient unless the entropy bonus or the KL term is on (with TNT, a solved prompt's K responses all
        score alike)."""
        if not self._skips_zero_advantage():
            return torch.ones_like(inputs.advantages, dtype=torch.bool)
        per_seq = (inputs.advantages, inputs.first_advantages)
        return torch.stack([t != 0 for t in per_seq if t is not None]).any(0)  # (S,)

    def _skips_zero_advantage(self) -> bool:
        loss_cfg = self.cfg.loss
        kl_on = self.ref_model is not None and loss_cfg.kl_coef > 0
        return loss_cfg.skip_zero_advantage and not loss_cfg.entropy_coef > 0 and not kl_on

    def _drop_zero_advantage(self, inputs: UpdateInputs) -> tuple[UpdateInputs, int]:
        """``inputs`` without the sequences the update does not run on (``trained_rows``), and how many those are."""
        if not self._skips_zero_advantage():
            return inputs, 0
        moving = self.trained_rows(inputs)  # (S,)
        keep = torch.nonzero(moving).flatten().tolist()  # sync: one read per mini-batch
        skipped = moving.numel() - len(keep)
        if skipped == 0:
            return inputs, 0
        return inputs.select(keep), skipped

    def _micro_batch_loss(self, inputs: UpdateInputs, mb: MicroBatch, *, n_tokens, n_seqs):
        """The loss of one micro-batch as its share of the mini-batch's (``linear_policy_loss``, the gradient formed
        in its forward), and its named sums (the rollout diagnostics only when on-policy)."""
        part = inputs.batch
        lo, hi = part.bounds[mb.first], part.bounds[mb.last]
        in_pass = self.corrects_in_the_pass(inputs)
        correction = {}
        if in_pass:  # the engine's log-probs against the update's own (the old policy's at one mini-batch and epoch)
            correction = {"rollout_logp": part.rollout_logp[lo:hi], "rollout_correction": self.correction,
                          "rollout_correction_cap": self.cfg.loss.rollout_correction_cap}  # fmt: skip
        loss_inputs = inputs.micro_batch(mb, total_tokens=n_tokens, total_seqs=n_seqs, settings=self.settings,
                                         **correction)  # fmt: skip
        with self.autocast():
            loss, stats, logp = micro_batch_loss(
                self.policy, part, mb, temperature=self.cfg.rollout.temperature, loss=loss_inputs
            )
        n = float(hi - lo)
        sums = {
            "entropy": stats["entropy"] * n,
            "clip_frac": (stats["clip_frac_low"] + stats["clip_frac_high"]) * n,
            "kl": stats["approx_kl"] * n,
            "kl_ref": stats["kl_ref"] * n,
        }
        zero = torch.zeros((), device=loss.device)
        rollout = dict.fromkeys(ROLLOUT_METRICS, zero)
        if part.rollout_logp is not None and inputs.old_logp is None:  # on-policy: the mismatch against these
            _, diagnostics = rollout_correction_weights(
                logp, part.rollout_logp[lo:hi], loss_inputs.cu_seqlens, mode=self.correction if in_pass else "none",
                cap=self.cfg.loss.rollout_correction_cap,
            )  # fmt: skip
            rollout = {name: diagnostics[name] * n for name in ROLLOUT_METRICS}
        # the logged loss is the policy loss alone, without the entropy bonus the fused op adds
        policy_loss = loss.detach() + self.settings.entropy_coef * stats["entropy"] * n / max(n_tokens, 1.0)
        return loss, {"loss": policy_loss, **sums, **rollout}

    def corrects_in_the_pass(self, inputs: UpdateInputs) -> bool:
        """Whether the fused loss forms the rollout correction's weights itself, from the engine's log-probs and the
        update's own (detached): where no old log-probs were computed (one mini-batch, one epoch, nothing else
        needing them), the update's first pass is the old policy's."""
        return self.correction != "none" and inputs.batch.rollout_logp is not None and inputs.old_logp is None

    # -- where the forwards run ---------------------------------------------------------------------------------

    @property
    def policy(self):
        """The policy's log-prob module: DeepSpeed's engine when distributed (its forward drives ZeRO)."""
        return self.ds_engine if self.ds_engine is not None else self.head

    @property
    def zero3(self) -> bool:
        return self.ds_engine is not None and self.cfg.distributed.zero3

    def autocast(self):
        return bf16_context(self.device, self.autocast_on)
