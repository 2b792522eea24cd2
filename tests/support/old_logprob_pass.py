"""``python -m old_logprob_pass train ...`` (this folder on ``PYTHONPATH``): ``fasttnt train`` with the varied reward
scheme (``varied``) and the update as it ran before the fused loss formed the rollout correction itself: a separate
no-grad pass of the old log-probs at every step, their correction weights formed from it. The baseline that a run
one step off (k = 1) must train exactly as (tests/test_pipeline.py)."""

from __future__ import annotations

import sys

import varied

from fasttnt.actor import Actor

ACTOR_OLD_AND_REF = Actor.old_and_ref_logprobs


def with_the_old_logprob_pass(self, batch, think_end_rows=None, **kw):
    """``Actor.old_and_ref_logprobs`` with the old log-probs always computed where the batch is corrected."""
    out = ACTOR_OLD_AND_REF(self, batch, think_end_rows, **kw)
    if out.old_logp is None and self.correction != "none" and batch.rollout_logp is not None:
        out = out._replace(old_logp=self.logprobs(self.policy, batch, zero3_collectives=self.zero3))
    return out


if __name__ == "__main__":
    from fasttnt.cli import main

    varied.register()
    Actor.old_and_ref_logprobs = with_the_old_logprob_pass
    sys.exit(main(sys.argv[1:]))
