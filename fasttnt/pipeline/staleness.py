"""How old the weights that sampled a batch may be.

Weight version v is the trainer's weights after v optimizer steps of training (v = 0: the run's start; a step's
update ends in version = its step number). Step t trains on weights version t - 1, so a batch sampled with version v
is t - 1 - v versions behind: its staleness. With ``rollout.max_staleness`` k, step t trains only on a batch sampled
with version t - 1 - k or newer (k = 0: on-policy, the colocated loop), and a worker may sample step t's batch once
it holds that version.
"""

from __future__ import annotations

from .peer import PipelineError


class StaleBatchError(PipelineError):
    """A batch sampled with weights older than ``rollout.max_staleness`` allows."""


def oldest_version(step: int, max_staleness: int) -> int:
    """The oldest weight version step ``step`` (1-based) may train on, and a worker must hold to sample its batch."""
    return max(0, step - 1 - max_staleness)


def staleness(step: int, version: int) -> int:
    """How many versions the weights that sampled step ``step``'s batch are behind the ones it trains."""
    return step - 1 - version


def check_fresh(step: int, version: int, max_staleness: int, *, worker: str) -> None:
    """Refuse (``StaleBatchError``) a batch for ``step`` sampled with ``version``: one past the bound, or from weights
    the trainer has not made yet."""
    if version > step - 1:
        raise StaleBatchError(
            f"{worker}: step {step}'s batch says weight version {version}, which the trainer has not made yet (it "
            f"trains step {step} on version {step - 1}); not training on it"
        )
    if version < oldest_version(step, max_staleness):
        raise StaleBatchError(
            f"{worker}: step {step}'s batch was sampled with weight version {version}, {staleness(step, version)} "
            f"behind, past rollout.max_staleness={max_staleness}; not training on it"
        )
