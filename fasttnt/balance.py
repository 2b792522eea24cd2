"""Dealing a step's work to the data-parallel ranks so that their updates take as long as each other.

Each rank's update runs on its own rows, and the step waits for the slowest rank: with R1-style responses (a few
sequences of 16K tokens among many of a few hundred) the rank that drew the long ones sets the pace. The cost of a
sequence of L tokens in a transformer's forward (and backward, proportionally) is its projections and MLP, linear in
L, plus its causal attention, quadratic:

    per layer, 2 (4 H^2 + 3 H I) L  +  2 H L^2  =  2 H L (4 H + 3 I + L)   FLOPs

(H the hidden size, I the MLP's intermediate size; grouped-query attention's smaller k/v projections and the lm_head
aside), so ``workload`` counts L (1 + L / (4 H + 3 I)): tokens, plus attention's share, which passes the rest's at
L = 4 H + 3 I (33,024 tokens for R1-Distill-Qwen-1.5B, H = 1536, I = 8960).

``karmarkar_karp`` splits items into k parts of near-equal sums by the largest differencing method (Karmarkar and
Karp 1982, k-way as in Michiels et al. 2003), the partition verl balances its batches with
(``verl/utils/seqlen_balancing.py``). The items are whole groups (the K responses to one prompt), which fasttnt's
advantages, mini-batches and mode terms keep together.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence


def workload(length: int, hidden_size: int, intermediate_size: int) -> float:
    """A sequence's forward cost in units of one token's projections and MLP (module docstring)."""
    return length * (1.0 + length / (4 * hidden_size + 3 * intermediate_size))


def karmarkar_karp(weights: Sequence[float], parts: int) -> list[list[int]]:
    """The indices of ``weights`` in ``parts`` lists whose sums are near-equal: the largest differencing method.

    Each item starts as a partial partition of ``parts`` subsets, the item alone in one of them. The two partial
    partitions of the largest spread (largest subset sum minus smallest) are merged, the heaviest subset of one with
    the lightest of the other, until one is left: combining the extremes cancels the largest differences first.
    Deterministic: ties break on the items' order. Each list is in increasing index order.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    counter = itertools.count()  # ties in spread: the earlier partition first, whatever the machine
    heap = []
    for index, weight in enumerate(weights):
        if not weight >= 0:
            raise ValueError(f"weights must be >= 0 (and not NaN), got {weight} at index {index}")
        subsets = [(float(weight), [index])] + [(0.0, []) for _ in range(parts - 1)]
        heapq.heappush(heap, (-float(weight), next(counter), subsets))
    if not heap:
        return [[] for _ in range(parts)]
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        # a's subsets heaviest first against b's lightest first
        a = sorted(a, key=lambda s: -s[0])
        b = sorted(b, key=lambda s: s[0])
        merged = [(wa + wb, ia + ib) for (wa, ia), (wb, ib) in zip(a, b, strict=True)]
        sums = [s[0] for s in merged]
        heapq.heappush(heap, (-(max(sums) - min(sums)), next(counter), merged))
    _, _, subsets = heap[0]
    return [sorted(indices) for _, indices in sorted(subsets, key=lambda s: min(s[1], default=len(weights)))]


def slowest_over_mean(weights: Sequence[float], assignment: Sequence[Sequence[int]]) -> float:
    """The largest part's sum over the mean part's: 1 is a perfect balance, and the step's time over the ideal."""
    sums = [sum(weights[i] for i in part) for part in assignment]
    mean = sum(sums) / len(sums)
    return max(sums) / mean if mean > 0 else 1.0
