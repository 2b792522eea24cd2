"""One rank of a 2-rank check of ``FastTNTGRPOTrainer``'s high-entropy mask against TRL's own
``get_high_entropy_mask``, over a real gloo group (``python -m trl_entropy_ranks``, launched by
``support.small.run_ranks``): each rank holds a different number of tokens, so TRL's pad-and-gather runs, and both
masks read the same entropies (the fused kernel's). Prints one JSON line: the tokens each mask keeps, whether they
are equal, and whether the threshold over both ranks differs from this rank's own quantile."""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch
from accelerate import Accelerator
from trl import GRPOTrainer

from fasttnt.integrations.trl import FastTNTGRPOTrainer
from fasttnt_kernels import linear_token_logprobs

QUANTILE = 0.3
TOKENS = (37, 50)  # per rank: uneven, so the gather pads rank 0's


def main() -> None:
    accelerator = Accelerator(cpu=True)
    rank = int(os.environ["RANK"])
    g = torch.Generator().manual_seed(100 + rank)
    n, H, V = TOKENS[rank], 16, 40
    states = torch.randn(n, H, generator=g)  # (n, H)
    # rank 1's logits sharper than rank 0's: its entropies lower, so the ranks' own quantiles differ
    weight = torch.randn(V, H, generator=torch.Generator().manual_seed(7)) * (1.0 if rank == 0 else 2.5)  # (V, H)
    targets = torch.randint(0, V, (n,), generator=g)
    trainer = SimpleNamespace(accelerator=accelerator, temperature=0.9, top_entropy_quantile=QUANTILE)
    ours = FastTNTGRPOTrainer._high_entropy_mask(trainer, states, weight, targets)  # (n,)
    with torch.no_grad():
        _, entropy = linear_token_logprobs(states, weight, targets, temperature=0.9, with_entropy=True)
    ones = torch.ones(1, n, dtype=torch.long)
    theirs = GRPOTrainer.get_high_entropy_mask(trainer, entropy[None, :], ones, 1.0 - QUANTILE)[0]  # (n,)
    local = entropy >= torch.quantile(entropy, 1.0 - QUANTILE)
    result = {"rank": rank, "tokens": n, "kept": int(ours.sum()), "equal": bool(torch.equal(ours.bool(), theirs)),
              "local_differs": bool(not torch.equal(local, theirs))}  # fmt: skip
    print(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
