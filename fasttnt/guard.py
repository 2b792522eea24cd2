"""The stale-weight guard: a run whose rollout engine samples from a copy of the weights (vllm) stops before it
trains on samples drawn from other weights than the trainer's (a weight push that did not arrive, or a garbled one).

The rule, decided once when the run is built (``StaleWeightGuard``): the guard runs where the engine holds weights of
its own, ``rollout.max_logp_diff`` is set and ``rollout.top_p`` is 1 (under top-p the engine reports log-probs
renormalised over the nucleus, the trainer of the whole distribution: they differ by design, which the rollout
correction weighs). Where the step computes old log-probs (several mini-batches or epochs, mode-mixed rows), the
trainer asks ``check`` after them and before the update; otherwise the update's own pass is the old policy's, and the
update asks ``judge`` with the difference over the tokens it trains on, before its optimizer step: either way nothing
is trained on a batch that fails.

Under bf16 two implementations of one network (the engine's kernels, the trainer's autocast) differ in every
rounding, so their log-probs differ even on the same weights; at step 1 of a run they hold the same weights by
construction (the engine loaded the checkpoint the trainer starts from, and nothing has moved), so that step's
difference is the run's noise floor (``floor``, kept in the trainer's state), measured over the whole batch by a
pass of old log-probs that step 1 runs for it (``calibrates``); a run resumed without a floor keeps
rollout.max_logp_diff alone. The guard then stops past max(rollout.max_logp_diff, GUARD_NOISE_FACTOR x floor): a
mean over a step's thousands of tokens moves little from step to step, and 3x leaves room for the logits to grow as
the policy sharpens, while a push that did not arrive or was garbled (a tied head left out measured 3.7 nats) is far
past it. A floor whose 3x passes GUARD_CEILING (0.5 nats per token, a likelihood ratio of e^0.5 per token on
average) is no rounding: that engine is not serving the trainer's model.
"""

from __future__ import annotations

import math
import warnings

import torch

from . import distributed
from .config import TrainConfig
from .engines.batch import RolloutBatch

GUARD_NOISE_FACTOR = 3.0
GUARD_CEILING = 0.5


class StaleWeightsError(RuntimeError):
    """The rollout engine sampled from other weights than the trainer's: a weight push that did not arrive."""


def stale_weights(diff: float, limit: float) -> bool:
    """The guard's rule: the engine's mean log-prob difference per token is over ``limit``, or NaN (an engine whose
    numbers cannot be checked is not trusted)."""
    return not diff <= limit


def mean_logp_diff(a: torch.Tensor, b: torch.Tensor, *, keep: torch.Tensor | None = None, dist=None) -> float:
    """The mean |a - b| per token of two sets of log-probs of the same tokens (in float64), over the tokens ``keep``
    marks (None: all) and over all ranks (``dist``; None: this process's): the one number the stale-weight guard, the
    push check and a vLLM worker's engine check each hold against ``rollout.max_logp_diff``. sync: one read."""
    diff = (a.double() - b.to(a.device).double()).abs()
    if keep is not None:
        diff = diff[keep]
    total = distributed.sum_over_ranks(dist, torch.stack([diff.sum(), diff.new_tensor(float(diff.numel()))]))
    return float(total[0] / total[1]) if total[1] > 0 else math.nan  # nothing compared: no check passes (NaN)


class StaleWeightGuard:
    def __init__(
        self, cfg: TrainConfig, *, separate_weights: bool, bf16: bool, dist, floor: float | None = None
    ) -> None:  # fmt: skip
        """``separate_weights``: the engine samples from its own copy of the weights (``engine.separate_weights``);
        ``bf16``: the trainer runs under bf16 autocast (step 1 measures the floor); ``floor``: the one a resumed run
        measured (``TrainerState.logp_diff_floor``)."""
        r = cfg.rollout
        asked = separate_weights and r.max_logp_diff is not None
        self.active = asked and r.top_p == 1.0
        if asked and not self.active:
            warnings.warn(
                f"rollout.max_logp_diff: the stale-weight guard is off at rollout.top_p={r.top_p} (the engine's "
                "log-probs are renormalised over the nucleus, the trainer's are not); nothing checks that the engine "
                "samples from the trainer's weights",
                stacklevel=3,
            )
        self.engine, self.limit, self.bf16, self.dist = r.engine, r.max_logp_diff, bf16, dist
        self.floor = floor  # measured at step 1 under bf16 (GUARD_NOISE_FACTOR)

    def checks(self, batch: RolloutBatch) -> bool:
        """Whether ``batch`` is checked: the guard runs and the engine said what it sampled with."""
        return self.active and batch.rollout_logp is not None

    def engine_logp_diff(self, batch: RolloutBatch, old_logp: torch.Tensor) -> float:
        """The mean |old - rollout| log-prob per sampled token, over all ranks (``mean_logp_diff``)."""
        return mean_logp_diff(old_logp, batch.rollout_logp, dist=self.dist)

    def calibrates(self, step: int, batch: RolloutBatch) -> bool:
        """Whether step ``step`` measures the bf16 floor: step 1 of a run under bf16 whose engine is checked. It
        needs the old log-probs of the whole batch (the update's own pass covers only the tokens it trains on, which
        may be few or none)."""
        return self.checks(batch) and self.bf16 and self.floor is None and step == 1

    def check(self, step: int, batch: RolloutBatch, old_logp: torch.Tensor | None) -> None:
        """``judge`` the batch's old log-probs against the engine's, where the step computed them (None: the update
        judges its own pass)."""
        if not self.checks(batch) or old_logp is None:
            return
        self.judge(step, self.engine_logp_diff(batch, old_logp))

    def judge(self, step: int, diff: float) -> None:
        """Stop (``StaleWeightsError``) before training on samples that the engine drew from weights other than the
        trainer's: ``diff``, the mean |old - rollout| log-prob per token over all ranks; under bf16, step 1 measures
        the floor."""
        if self.bf16 and self.floor is None and step == 1:  # the noise floor, on weights that match by construction
            if stale_weights(GUARD_NOISE_FACTOR * diff, GUARD_CEILING):
                raise StaleWeightsError(
                    f"step {step}: the {self.engine} engine's log-probs differ from the trainer's by {diff:.3g} per "
                    "token while both hold the run's starting weights: more than bf16 rounding explains (the "
                    f"guard's ceiling {GUARD_CEILING} / {GUARD_NOISE_FACTOR}); the engine is not serving this model"
                )
            self.floor = diff
        limit = self.limit if self.floor is None else max(self.limit, GUARD_NOISE_FACTOR * self.floor)
        if stale_weights(diff, limit):
            floor = "" if self.floor is None else f", or {GUARD_NOISE_FACTOR:g}x step 1's bf16 floor {self.floor:.3g}"
            raise StaleWeightsError(
                f"step {step}: the {self.engine} engine's log-probs differ from the trainer's by {diff:.3g} per "
                f"token, past the guard's {limit:.3g} (rollout.max_logp_diff={self.limit}{floor}): it sampled from "
                "other weights (a weight push that did not arrive?); not training on them"
            )
