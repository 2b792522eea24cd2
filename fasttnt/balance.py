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

``deal_groups`` deals a step's groups to the ranks after the advantages: each global mini-batch (the union of every
rank's slice of it) is split by ``karmarkar_karp`` on the groups' workloads, so each optimizer step sums the same
terms over the ranks as before, only on other ranks; every normaliser is already the whole mini-batch's over all
ranks (``fasttnt.actor``), so the update is the unbalanced one up to the order of float sums. The rows travel by one
all-gather per field: every rank briefly holds the step's packed rows on its device (token ids and a few floats per
token, a few hundred MB for 128 x 8 responses of 16K tokens, small beside a model's memory), and reads only the rows
it keeps to the host.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from . import distributed
from .engines.batch import RolloutBatch, missing_code
from .policy import SEQUENCE_INPUTS, TOKEN_INPUTS, UpdateInputs


def workload(length: int, hidden_size: int, intermediate_size: int) -> float:
    """A sequence's forward cost in units of one token's projections and MLP (module docstring)."""
    return length * (1.0 + length / (4 * hidden_size + 3 * intermediate_size))


def karmarkar_karp(weights: Sequence[float], parts: int) -> list[list[int]]:
    """The indices of ``weights`` in ``parts`` lists whose sums are near-equal: the largest differencing method.

    Each item starts as a partial partition of ``parts`` subsets, the item alone in one of them. The two partial
    partitions of the largest spread (largest subset sum minus smallest) are merged, the heaviest subset of one with
    the lightest of the other, until one is left: combining the extremes cancels the largest differences first.
    Deterministic: ties break on the items' order. Each list is in increasing index order. With at least ``parts``
    items no part is empty: among subsets of equal sums the empty ones sort as the lightest, so a merge pairs an
    empty subset of one partition with a filled one of the other while it can.
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
        a = sorted(a, key=lambda s: (-s[0], -len(s[1])))
        b = sorted(b, key=lambda s: (s[0], len(s[1])))
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


@dataclass(frozen=True)
class Deal:
    """A step's groups dealt to the ranks (``deal_groups``): this rank's rows and what the step's row logs."""

    inputs: UpdateInputs  # this rank's rows, mini-batch after mini-batch
    mini_batch_groups: list[int]  # the groups of each mini-batch on this rank
    tokens_before: list[int]  # per rank, as drawn, the tokens of its forward: prompts once, trained responses
    tokens: list[int]  # and as dealt
    moved: int  # groups that changed rank

    def logged(self) -> dict[str, float]:
        """The step's row: each rank's tokens as dealt, the slowest's over the mean as dealt and as drawn, and the
        groups that changed rank (docs/metrics.md)."""
        each = [[r] for r in range(len(self.tokens))]
        return {
            **{f"rank_tokens_{rank}": float(n) for rank, n in enumerate(self.tokens)},
            "rank_tokens_max_over_mean": slowest_over_mean(self.tokens, each),
            "rank_tokens_max_over_mean_drawn": slowest_over_mean(self.tokens_before, each),
            "moved_groups": float(self.moved),
        }


def deal_groups(
    inputs: UpdateInputs, ctx: distributed.DistContext, *, mini_batches: int, hidden_size: int,
    intermediate_size: int, trained: torch.Tensor | None = None, balance: bool = True,
) -> Deal:  # fmt: skip
    """This rank's share of the step's groups: each global mini-batch split over the ranks by ``karmarkar_karp`` on
    its groups' work (``group_workload``: what the update's forward runs), each part to the rank that already holds
    most of its groups, so few rows travel. ``trained`` (S,) bool: the sequences the update runs on
    (``Actor.trained_rows``; None: all), the others weighing nothing. Every rank holds as many groups as drawn (the
    ranks share each draw's prompts equally) and computes the same deal from the same gathered lengths. ``balance``
    False: each rank keeps its own groups (the tokens per rank still counted). A collective: every rank calls it."""
    batch, k = inputs.batch, inputs.batch.group_size
    groups = batch.lengths.numel() // k
    if groups % mini_batches:
        raise ValueError(f"{groups} groups on rank {ctx.rank} do not split into {mini_batches} mini-batches")
    device = batch.lengths.device
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.int64, device=device)
    if trained is None:
        trained = torch.ones(batch.lengths.numel(), dtype=torch.bool, device=device)
    # (world, 3, S): every rank's response and prompt lengths and which sequences train, one column per sequence
    columns = torch.stack([batch.lengths.to(torch.int64), prompt_lengths, trained.to(torch.int64)])
    gathered = distributed.all_gather_cat(columns[None]).tolist()  # sync: one read
    response_lengths, prompt_lengths, trains = ([rank[i] for rank in gathered] for i in range(3))
    world, per_mb = ctx.world, groups // mini_batches

    def run(r: int, g: int) -> tuple[int, list[int]]:  # group g of rank r: its prompt's length, its trained rows'
        seqs = range(g * k, (g + 1) * k)
        return prompt_lengths[r][g * k], [response_lengths[r][i] for i in seqs if trains[r][i]]

    runs = [[run(r, g) for g in range(groups)] for r in range(world)]  # (world, groups) by the rank that drew each
    costs = [[group_workload(p, rs, hidden_size, intermediate_size) for p, rs in row] for row in runs]
    tokens_of = [[(p + sum(rs) if rs else 0) for p, rs in row] for row in runs]
    owner = [[] for _ in range(world)]  # per rank, per mini-batch, the (rank drawn on, group there) it updates on
    for mb in range(mini_batches):
        items = [(r, g) for r in range(world) for g in range(mb * per_mb, (mb + 1) * per_mb)]
        if balance:
            parts = karmarkar_karp([costs[r][g] for r, g in items], world)
        else:  # as drawn
            parts = [[i for i, (r, _) in enumerate(items) if r == rank] for rank in range(world)]
        for part, rank in zip(parts, _ranks_for(parts, items, world), strict=True):
            owner[rank].append([items[i] for i in part])
    tokens_before = [sum(t) for t in tokens_of]
    tokens = [sum(tokens_of[r][g] for part in owner[rank] for r, g in part) for rank in range(world)]
    moved = sum(r != rank for rank in range(world) for part in owner[rank] for r, _ in part)
    mine = owner[ctx.rank]
    mini_batch_groups = [len(part) for part in mine]
    if moved == 0:  # every rank keeps its own rows, in their order
        return Deal(inputs, mini_batch_groups, tokens_before, tokens, moved)
    keep = [(r * groups + g) * k + j for part in mine for r, g in part for j in range(k)]
    return Deal(_kept_rows(inputs, keep, response_lengths, prompt_lengths), mini_batch_groups, tokens_before, tokens,
                moved)  # fmt: skip


def group_workload(prompt: int, responses: list[int], hidden_size: int, intermediate_size: int) -> float:
    """A group's work in the update's forward: its prompt once (the packed forward runs a prompt that consecutive
    sequences share once, ``policy.pack_micro_batch``) and each trained response's tokens, whose attention reads the
    prompt and the response before them: ``workload(p) + sum_j (workload(p + r_j) - workload(p))``; 0 where no
    response trains."""
    if not responses:
        return 0.0
    base = workload(prompt, hidden_size, intermediate_size)
    return base + sum(workload(prompt + r, hidden_size, intermediate_size) - base for r in responses)


def _ranks_for(parts: list[list[int]], items: list[tuple[int, int]], world: int) -> list[int]:
    """The rank each part goes to: greedily the part and rank with the most of the part's groups drawn there first,
    so that the fewest rows move (each rank takes one part)."""
    held = [[0] * world for _ in parts]  # held[part][rank]: the part's groups drawn on that rank
    for p, part in enumerate(parts):
        for i in part:
            held[p][items[i][0]] += 1
    pairs = sorted(((held[p][r], -p, -r) for p in range(len(parts)) for r in range(world)), reverse=True)
    rank_of, taken = [None] * len(parts), set()
    for _, p, r in pairs:
        p, r = -p, -r
        if rank_of[p] is None and r not in taken:
            rank_of[p] = r
            taken.add(r)
    return rank_of


def _kept_rows(
    inputs: UpdateInputs, keep: list[int], response_lengths: list[list[int]], prompt_lengths: list[list[int]]
) -> UpdateInputs:
    """Rows ``keep`` (indices into every rank's rows, rank after rank) of every rank's ``UpdateInputs``, in that
    order: each per-sequence field gathered as it is (every rank holds as many sequences), each per-token field
    padded to the longest rank's tokens, the prompts as one padded row of token ids; only the kept rows' tokens are
    read to the host. ``response_lengths``, ``prompt_lengths``: per rank, each sequence's (gathered)."""
    batch = inputs.batch
    device = batch.response_ids.device
    n_tokens = [sum(r) for r in response_lengths]
    per_token = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch) if f.metadata.get("per") == "token"}
    per_token |= {name: getattr(inputs, name) for name in TOKEN_INPUTS}
    per_sequence = {f.name: getattr(batch, f.name) for f in fields(RolloutBatch)
                    if f.metadata.get("per") == "sequence" and f.name != "prompt_ids"}  # fmt: skip
    per_sequence |= {name: getattr(inputs, name) for name in SEQUENCE_INPUTS}
    present = _present_on_every_rank(batch, {**per_token, **per_sequence}, world=len(response_lengths))
    gathered = {}
    for name, value in per_sequence.items():
        if name in present:
            # a field some rank lacks is a mode code (_present_on_every_rank): that rank's filled as a join fills it
            gathered[name] = distributed.all_gather_cat(value if value is not None else batch.filled(name))
    for name, value in per_token.items():
        if name in present:
            gathered[name] = _gather_padded(value, n_tokens)
    flat_prompts = torch.tensor([t for p in batch.prompt_ids for t in p], dtype=torch.int64, device=device)
    prompts = _gather_padded(flat_prompts, [sum(p) for p in prompt_lengths])  # (P,) every rank's, rank after rank
    lengths = [x for p in prompt_lengths for x in p]
    starts = [0, *itertools.accumulate(lengths)]
    response_bounds = [0, *itertools.accumulate(x for r in response_lengths for x in r)]  # (S_all+1,) on the host
    gathered["prompt_ids"] = [[] for _ in lengths]  # the kept rows' are set below
    per_row = {f.name: gathered.get(f.name) for f in fields(RolloutBatch) if f.metadata.get("per")}
    cu_seqlens = torch.tensor(response_bounds, dtype=batch.cu_seqlens.dtype, device=device)
    every = replace(batch, cu_seqlens=cu_seqlens, **per_row)
    every.bounds = response_bounds  # known here: no device read
    every = replace(inputs, batch=every, **{name: gathered.get(name) for name in (*SEQUENCE_INPUTS, *TOKEN_INPUTS)})
    kept = every.select(keep)
    index = torch.tensor([t for i in keep for t in range(starts[i], starts[i + 1])], dtype=torch.long)  # (P_kept,)
    ids = prompts[index.to(device)].tolist()  # sync: one read
    bounds = [0, *itertools.accumulate(lengths[i] for i in keep)]
    kept.batch.prompt_ids = [ids[a:b] for a, b in itertools.pairwise(bounds)]
    return kept


def _present_on_every_rank(batch: RolloutBatch, values: dict[str, torch.Tensor | None], *, world: int) -> set[str]:
    """The fields some rank holds. A field one rank holds and another does not is refused, but a mode code
    (``forced``): a rank whose rows were all free fills it with the free code (``RolloutBatch.concat`` likewise)."""
    names = list(values)
    held = torch.tensor([values[n] is not None for n in names], dtype=torch.int64, device=batch.cu_seqlens.device)
    counts = distributed.all_sum(held).tolist()  # sync: one read
    for name, count in zip(names, counts, strict=True):
        if 0 < count < world and missing_code(name) is None:
            raise RuntimeError(f"{name} is held by {count} of {world} ranks: the ranks' rows cannot be dealt")
    return {name for name, count in zip(names, counts, strict=True) if count > 0}


def _gather_padded(t: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Every rank's ``t`` (its first dimension ``counts[rank]`` long) concatenated, through an all-gather padded to
    the longest."""
    longest = max(counts)
    padded = torch.zeros((longest, *t.shape[1:]), dtype=t.dtype, device=t.device)
    padded[: t.shape[0]] = t
    parts = distributed.all_gather_cat(padded[None])  # (world, longest, ...)
    return torch.cat([parts[r, :n] for r, n in enumerate(counts)])
