"""How long the slowest data-parallel rank's update takes over the mean rank's, with R1-like response lengths: the
prompts dealt in the order drawn (each rank its own consecutive share, as fasttnt's ranks draw them) against whole
groups dealt by ``fasttnt.balance.karmarkar_karp`` on their workload (tokens plus attention's share).

    python benchmarks/rank_balance.py --steps 200 --json benchmarks/rank-balance-2026-12-07.json

The lengths (a model of R1-Distill-Qwen-1.5B's on DeepScaleR-Preview, from DeepScaleR's report, Luo et al. 2025:
incorrect responses about 3x longer than correct ones, a mean near 5,500 tokens at the start of training, many
responses cut at the context limit): per prompt a solve rate p ~ Beta(0.5, 0.5) (most prompts solved always or
never) and a length scale ~ LogNormal(0, 0.4); per response, correct with probability p, its length LogNormal with
median 2,500 x scale tokens if correct, 7,500 x scale if not, sigma 0.7, capped at 16,384 (the context limit), at
least 20. The model's shape for the workload: H = 1536, I = 8960 (R1-Distill-Qwen-1.5B). Pure Python: no torch.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fasttnt.balance import karmarkar_karp, slowest_over_mean, workload

HIDDEN, INTERMEDIATE = 1536, 8960
MAX_LEN = 16_384


def draw_lengths(rng: random.Random, prompts: int, group: int) -> list[list[int]]:
    """One step's response lengths: ``prompts`` groups of ``group`` (module docstring)."""
    groups = []
    for _ in range(prompts):
        solve, scale = rng.betavariate(0.5, 0.5), rng.lognormvariate(0.0, 0.4)
        lengths = []
        for _ in range(group):
            median = (2_500 if rng.random() < solve else 7_500) * scale
            lengths.append(max(20, min(MAX_LEN, round(rng.lognormvariate(0.0, 0.7) * median))))
        groups.append(lengths)
    return groups


def ratios(groups: list[list[int]], assignment: list[list[int]]) -> dict[str, float]:
    """The slowest rank's over the mean rank's: tokens, sum of squared lengths, workload."""
    measures = {
        "tokens": [sum(g) for g in groups],
        "squares": [sum(n * n for n in g) for g in groups],
        "workload": [sum(workload(n, HIDDEN, INTERMEDIATE) for n in g) for g in groups],
    }
    return {name: slowest_over_mean(values, assignment) for name, values in measures.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    steps = [draw_lengths(rng, args.prompts, args.group) for _ in range(args.steps)]
    flat = [n for g in steps for lengths in g for n in lengths]
    capped = sum(n == MAX_LEN for n in flat) / len(flat)
    print(f"{args.steps} steps of {args.prompts} prompts x {args.group}: mean length {statistics.mean(flat):.0f}, "
          f"median {statistics.median(flat):.0f}, at the cap {capped:.1%}")  # fmt: skip
    results = {}
    header = "".join(f"{name:>14}" for name in ("tokens", "sum len^2", "workload"))
    print(f"{'ranks':>5} {'dealing':>14}{header}   (slowest / mean: median, p95)")
    for ranks in args.ranks:
        if args.prompts % ranks:
            raise SystemExit(f"--prompts {args.prompts} is not a multiple of {ranks} ranks")
        per_rank = args.prompts // ranks
        for dealing in ("in order", "karmarkar-karp"):
            rows = []
            for groups in steps:
                if dealing == "in order":
                    assignment = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(ranks)]
                else:
                    costs = [sum(workload(n, HIDDEN, INTERMEDIATE) for n in g) for g in groups]
                    assignment = karmarkar_karp(costs, ranks)
                rows.append(ratios(groups, assignment))
            summary = {
                name: {"median": statistics.median(r[name] for r in rows),
                       "p95": sorted(r[name] for r in rows)[int(0.95 * (len(rows) - 1))]}
                for name in rows[0]
            }  # fmt: skip
            results[f"{ranks}-{dealing}"] = summary
            cells = "".join(f"{v['median']:>8.3f} {v['p95']:>5.3f}" for v in summary.values())
            print(f"{ranks:>5} {dealing:>14} {cells}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
