"""One rank of a 2-rank check of ``fasttnt.balance.deal_groups`` over a real gloo group (``python -m deal_ranks
[balance|keep]``, launched by ``support.small.run_ranks``): each rank builds its own step of 4 groups of 2 rows in 2
mini-batches, rank 0's responses long and rank 1's short, rank 0's rows forced and rank 1's all free (``forced``
None there), some rows not trained (``trained_rows``), and prints one JSON line: the rows it was dealt (each field
of each row), the groups of each mini-batch and the deal's counts. The rows it drew are ``drawn_inputs(rank)``, so the
test sees both ranks' without a collective."""

from __future__ import annotations

import json
import os
import sys

import torch

from fasttnt import distributed
from fasttnt.balance import deal_groups
from fasttnt.engines.batch import RolloutBatch
from fasttnt.policy import UpdateInputs

GROUPS, K, MINI_BATCHES = 4, 2, 2
SIZES = {"hidden_size": 8, "intermediate_size": 8}  # 4 H + 3 I = 56: attention weighs in at these lengths


def drawn_inputs(rank: int) -> UpdateInputs:
    """Rank ``rank``'s step, the same in every process that asks (seeded by the rank)."""
    g = torch.Generator().manual_seed(1000 + rank)
    rows = GROUPS * K
    # rank 0: responses of 20-40 tokens, rank 1: 2-6; prompts of 1-5 tokens on both
    low, high = (20, 41) if rank == 0 else (2, 7)
    lengths = torch.randint(low, high, (rows,), generator=g).tolist()
    responses = [torch.randint(0, 50, (n,), generator=g).tolist() for n in lengths]
    prompts = [torch.randint(0, 50, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
               for _ in range(GROUPS)]  # fmt: skip
    prompt_ids = [p for p in prompts for _ in range(K)]
    truncated = (torch.rand(rows, generator=g) < 0.5).tolist()
    logp = (-torch.rand(sum(lengths), generator=g)).tolist()
    forced = torch.tensor([1, 2] * GROUPS, dtype=torch.int8) if rank == 0 else None
    batch = RolloutBatch.of_responses(prompt_ids, responses, truncated, K, rollout_logp=logp, forced=forced)
    n = sum(lengths)
    return UpdateInputs(
        batch,
        advantages=torch.arange(rows, dtype=torch.float32) + 100 * rank,  # (S,) each row's id
        first_advantages=torch.randn(rows, generator=g),
        old_logp=-torch.rand(n, generator=g),
        is_weights=torch.rand(n, generator=g),
    )


def trained_rows(rank: int) -> torch.Tensor:
    """(S,) bool: the rows rank ``rank``'s update runs on (``Actor.trained_rows``): all but one row of rank 0's group
    1 and of rank 1's group 2, and rank 1's group 3, which weighs nothing in the deal."""
    trained = torch.ones(GROUPS * K, dtype=torch.bool)
    if rank == 0:
        trained[1 * K + 1] = False
    else:
        trained[2 * K] = False
        trained[3 * K : 4 * K] = False
    return trained


def rows_of(inputs: UpdateInputs) -> list[dict]:
    """Each row's fields as plain values."""
    b, out = inputs.batch, []
    for i, (lo, hi) in enumerate(zip(b.bounds, b.bounds[1:], strict=False)):
        out.append({
            "prompt": b.prompt_ids[i], "response": b.response_ids[lo:hi].tolist(),
            "truncated": bool(b.truncated[i]), "forced": None if b.forced is None else int(b.forced[i]),
            "rollout_logp": b.rollout_logp[lo:hi].tolist(), "advantage": float(inputs.advantages[i]),
            "first_advantage": float(inputs.first_advantages[i]), "old_logp": inputs.old_logp[lo:hi].tolist(),
            "is_weights": inputs.is_weights[lo:hi].tolist(), "ref_logp": inputs.ref_logp,
        })  # fmt: skip
    return out


def main() -> None:
    ctx = distributed.init("cpu")
    deal = deal_groups(drawn_inputs(ctx.rank), ctx, mini_batches=MINI_BATCHES, balance=sys.argv[1] == "balance",
                       trained=trained_rows(ctx.rank), **SIZES)  # fmt: skip
    result = {"rank": ctx.rank, "rows": rows_of(deal.inputs), "mini_batch_groups": deal.mini_batch_groups,
              "tokens": deal.tokens, "tokens_before": deal.tokens_before, "moved": deal.moved,
              "logged": deal.logged(), "world": int(os.environ["WORLD_SIZE"])}  # fmt: skip
    print(json.dumps(result))
    distributed.shutdown()


if __name__ == "__main__":
    main()
