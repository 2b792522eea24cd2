"""The choice grid's table: each run of ``fasttnt compare`` (late means over ``--eval-steps``) against free TNT's run
of the same warm-up and seed, and the targets of a recipe that teaches a thinking-only model when to think.

Reads one or more ``compare.json`` files (one per temperature) and prints a Markdown table, a run a row: accuracy,
its difference from the baseline's run, tokens as a share of the baseline's, accuracy and the direct share by level,
the largest direct share over the evaluated steps by level, the hack rate, and which targets the run misses:

* ``l1``: the easiest level answered directly on at least ``--easy-direct`` (0.9) of its late answers;
* ``l3-4``: the hardest levels direct on at most ``--hard-direct`` (1%) of their answers at every evaluated step;
* ``l2``: the middle level in the mode its table pays more for, by the warm-up's forced-mode accuracies
  (``compare.json``'s ``direct_pays``): direct on at least half its answers exactly when direct pays;
* ``acc``: within ``--acc-within`` (2.5) points of the baseline's run; ``tok``: no more tokens than it, or with
  ``--tokens-over-opt F`` at most T_opt + F * T_free (T_free the baseline run's tokens, T_opt those of each level in
  the mode its table pays more for, from the warm-up's forced-mode evaluations and the split's mix);
* ``hack``: a hack rate of at most ``--hack`` (2%).

Then each variant's means with their standard errors and how many of its runs met every target. With ``--probe``,
a JSONL of ``benchmarks/choice_probe.py`` rows of the runs' final models adds each run's choice AUROC.

    python benchmarks/choice_grid.py runs/choice-t0.6/compare.json --baseline tnt --probe probe.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

LEVELS = ("1", "2", "3", "4")


def mean_se(values: list[float]) -> tuple[float, float]:
    if not values:
        return math.nan, math.nan
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return statistics.fmean(values), se


def probe_auroc(path: Path | None) -> dict[str, float]:
    """Each run folder's choice AUROC from choice_probe.py rows of its ``final/`` model."""
    if path is None:
        return {}
    out = {}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        out[str(Path(row["model"]).resolve().parent)] = row["choice_auroc"]
    return out


def run_rows(summary: dict, baseline: str, args, aurocs: dict[str, float]) -> list[dict]:
    """One row per run of every variant, against the baseline's run of the same warm-up and seed."""
    variants = summary["variants"]
    if baseline not in variants:
        raise SystemExit(f"choice_grid.py: no variant {baseline!r} in the summary (it has {', '.join(variants)})")
    base = {(r["warmup"], r["seed"]): r for r in variants[baseline]["runs"]}
    warmups = summary.get("warmups", {})
    temperature = summary["settings"]["eval"]["temperature"]
    rows = []
    for name, data in variants.items():
        for run in data["runs"]:
            ref = base.get((run["warmup"], run["seed"]))
            by = run["by_level"]
            t_opt = optimal_tokens(warmups.get(str(run["warmup"])), by)
            misses = []
            if by["1"]["non_thinking_ratio"] < args.easy_direct:
                misses.append("l1")
            if any(by[lv]["most_non_thinking"] > args.hard_direct for lv in ("3", "4")):
                misses.append("l3-4")
            pays = by["2"]["direct_pays"]
            if pays is not None and (by["2"]["non_thinking_ratio"] >= 0.5) != pays:
                misses.append("l2")
            if ref is None and name != baseline:
                misses.append("no-baseline")  # nothing to hold its accuracy and tokens against
            if ref is not None and name != baseline:
                if run["acc"] < ref["acc"] - args.acc_within:
                    misses.append("acc")
                over = args.tokens_over_opt
                if run["len"] > (ref["len"] if over is None or t_opt is None else t_opt + over * ref["len"]):
                    misses.append("tok")
            if run["hack_rate"] > args.hack:
                misses.append("hack")
            if name == baseline:  # what the others are held against, under its own table: not judged
                misses = None
            rows.append({
                "T": temperature, "variant": name, "seed": run["seed"], "acc": run["acc"],
                "d_acc": None if ref is None or name == baseline else run["acc"] - ref["acc"],
                "tokens": run["len"] / ref["len"] if ref is not None and name != baseline else None,
                "len": run["len"], "t_opt": t_opt, "t_free": None if ref is None else ref["len"],
                "acc_by_level": [by[lv]["acc"] for lv in LEVELS],
                "direct_by_level": [by[lv]["non_thinking_ratio"] for lv in LEVELS],
                "most_direct_by_level": [by[lv]["most_non_thinking"] for lv in LEVELS],
                "hack": run["hack_rate"], "misses": misses,
                "choice_auroc": aurocs.get(str(Path(run["out"]).resolve())) if "out" in run else None,
            })  # fmt: skip
    return rows


def optimal_tokens(warmup: dict | None, by_level: dict) -> float | None:
    """T_opt: the split's mean tokens with each level in the mode its table pays more for (a run's ``direct_pays``
    by level), at the warm-up's forced-mode lengths, weighted by the split's responses per level; None where the
    summary has no such lengths."""
    if not warmup or "len_think" not in warmup or any(b["direct_pays"] is None for b in by_level.values()):
        return None
    n = warmup["responses"]
    tokens = sum(n[lv] * (warmup["len_direct" if b["direct_pays"] else "len_think"][lv]) for lv, b in by_level.items())
    return tokens / sum(n[lv] for lv in by_level)


def _levels(values: list[float]) -> str:
    return " / ".join(f"{v:.2f}" for v in values)


def markdown(rows: list[dict]) -> str:
    lines = [
        "| T | variant | seed | acc (%) | Δ acc | tokens | acc by level (%) | direct by level | most direct by level "
        "| hack | choice AUROC | misses |",
        "| ---: | --- | ---: | ---: | ---: | ---: | --- | --- | --- | ---: | ---: | --- |",
    ]
    for r in rows:
        d_acc = "" if r["d_acc"] is None else f"{r['d_acc']:+.1f}"
        tokens = f"{r['len']:.1f}" if r["tokens"] is None else f"{r['tokens']:.2f}"
        auroc = "" if r["choice_auroc"] is None else f"{r['choice_auroc']:.2f}"
        lines.append(
            f"| {r['T']:.1f} | {r['variant']} | {r['seed']} | {r['acc']:.1f} | {d_acc} | {tokens} | "
            f"{' / '.join(f'{v:.0f}' for v in r['acc_by_level'])} | {_levels(r['direct_by_level'])} | "
            f"{_levels(r['most_direct_by_level'])} | {r['hack']:.3f} | {auroc} | "
            f"{'(baseline)' if r['misses'] is None else ', '.join(r['misses']) or 'none'} |"
        )
    return "\n".join(lines)


def means(rows: list[dict]) -> str:
    lines = ["| T | variant | runs | acc (%) | Δ acc | tokens | T_opt / T_free | direct by level | all targets met |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]  # fmt: skip
    for key in dict.fromkeys((r["T"], r["variant"]) for r in rows):
        group = [r for r in rows if (r["T"], r["variant"]) == key]
        acc, acc_se = mean_se([r["acc"] for r in group])
        d = [r["d_acc"] for r in group if r["d_acc"] is not None]
        d_acc = "" if not d else "{:+.1f} ± {:.1f}".format(*mean_se(d))
        t = [r["tokens"] for r in group if r["tokens"] is not None]
        tokens = "" if not t else f"{mean_se(t)[0]:.2f}"
        opt = [r["t_opt"] / r["t_free"] for r in group if r["t_opt"] is not None and r["t_free"]]
        t_opt = "" if not opt else f"{mean_se(opt)[0]:.2f}"
        direct = " / ".join(f"{mean_se([r['direct_by_level'][i] for r in group])[0]:.2f}" for i in range(4))
        met = "" if group[0]["misses"] is None else f"{sum(not r['misses'] for r in group)} of {len(group)}"
        lines.append(f"| {key[0]:.1f} | {key[1]} | {len(group)} | {acc:.1f} ± {acc_se:.1f} | {d_acc} | {tokens} | "
                     f"{t_opt} | {direct} | {met} |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("summaries", nargs="+", type=Path, help="compare.json files")
    parser.add_argument("--baseline", default="tnt", help="the variant each run is held against (free TNT)")
    parser.add_argument("--probe", type=Path, help="choice_probe.py rows of the runs' final models")
    parser.add_argument("--easy-direct", type=float, default=0.9)
    parser.add_argument("--hard-direct", type=float, default=0.01)
    parser.add_argument("--acc-within", type=float, default=2.5)
    parser.add_argument("--hack", type=float, default=0.02)
    parser.add_argument("--tokens-over-opt", type=float, help="the tokens target T_opt + F * T_free (the mix's: 0.1)")
    args = parser.parse_args()
    from fasttnt.compare.plan import run_dir  # where compare keeps each run, beside its compare.json

    aurocs = probe_auroc(args.probe)
    rows = []
    for path in args.summaries:
        summary = json.loads(path.read_text())
        for name, data in summary["variants"].items():  # each run's folder, for the probe's rows
            for run in data["runs"]:
                run["out"] = str(run_dir(path.parent, run["warmup"], run["seed"], name))
        rows += run_rows(summary, args.baseline, args, aurocs)
    if aurocs and not any(r["choice_auroc"] is not None for r in rows):
        print(f"choice_grid.py: no row of {args.probe} names a run of these summaries' final/ models", file=sys.stderr)
    print(markdown(rows))
    print()
    print(means(rows))


if __name__ == "__main__":
    main()
