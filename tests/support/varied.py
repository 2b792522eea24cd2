"""A reward scheme whose rewards vary by construction, for the trainer tests that need the update to do something.

The test suite's tiny model, after its seconds-long warm-up, answers almost nothing right: under the real schemes
nearly every reward is 0, every advantage is 0, and a test of resume, dynamic sampling, the zero-advantage skip or
micro-batching passes whatever the update does. ``varied`` keeps everything real but the reward's last step: the
TNT reward is computed as usual (modes, limits and solution lengths are logged from it), then every even group of a
draw (index 0, 2, ... among its prompts, counted over all ranks) gets ``tnt + 5 * (j % 2)`` for its samples j and
every odd group 0 for all of its samples. TNT's rewards lie in [-2, 2], so an even group's odd samples always earn
more than its even ones (its rewards differ, whatever the model wrote) and an odd group's never differ: with 2 or
more samples per prompt, the even groups of any batch train and the odd ones have no advantage, on any machine.

In-process tests call ``register()``; launched ones run ``python -m varied train ...`` (``launch_command``
with module ``varied`` and this folder on ``PYTHONPATH``), which registers the scheme in each process first.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from fasttnt.engines.batch import RolloutBatch
from fasttnt.rewards import REWARD_SCHEMES, RewardConfig
from fasttnt_kernels import TntRewards

NAME = "varied"
OVERRIDE = f"reward.scheme={NAME}"
MODULE = "varied"  # launched as ``python -m varied train ...``, with PYTHONPATH below
PYTHONPATH = os.pathsep.join(p for p in (str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH")) if p)
BONUS = 5.0  # more than the width of TNT's rewards (-2 .. 2): an even group's odd samples always earn more


def varied_rewards(batch: RolloutBatch, correct: torch.Tensor, think_end_id: int, cfg: RewardConfig) -> TntRewards:
    tnt = REWARD_SCHEMES.get("tnt")(batch, correct, think_end_id, cfg)
    rows = torch.arange(batch.lengths.numel(), device=tnt.rewards.device)  # (S,)
    group, sample = rows // batch.group_size, rows % batch.group_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # rank r holds prompts r * P .. r * P + P - 1 of each draw: count groups over the whole draw, so N ranks
        # reward what one process does
        group = group + torch.distributed.get_rank() * (batch.lengths.numel() // batch.group_size)
    rewards = torch.where(group % 2 == 0, tnt.rewards + BONUS * (sample % 2), torch.zeros_like(tnt.rewards))
    return tnt._replace(rewards=rewards.to(tnt.rewards.dtype))


def register() -> None:
    if NAME not in REWARD_SCHEMES:
        REWARD_SCHEMES.add(NAME, varied_rewards)


if __name__ == "__main__":
    from fasttnt.cli import main

    register()
    sys.exit(main(sys.argv[1:]))
