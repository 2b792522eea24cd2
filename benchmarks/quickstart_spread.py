"""How much the quick start's numbers move: ``fasttnt train`` on the embedded default from an empty warm-up cache, at
each warm-up seed (``warmup.seed``: the tiny model's initialisation and the warm-up's data) and torch thread count,
and the spread of the first and last 5 steps' means over those runs.

    python benchmarks/quickstart_spread.py --seeds 0 1 2 3 --threads 1 --jobs 2 --out runs/spread
    python benchmarks/quickstart_spread.py --seeds 0 --threads 2 --out runs/spread   # the README's own run
    python benchmarks/quickstart_spread.py --table-only --out runs/spread            # the table of what is there

Each run is a fresh ``fasttnt train`` process with its own cache folder (so every run trains its warm-up), under
``OMP_NUM_THREADS``; a run whose metrics.jsonl is complete is not run again. ``--jobs 2`` runs two at once: give
each one thread on a 2-core machine (two 2-thread torch processes there run several times slower). The table (also
``spread.json`` in ``--out``): per run, the last 5 steps' means of the README's metrics and its wall time; per
metric, the smallest and largest over the runs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

METRICS = ("reward", "acc", "non_thinking_ratio", "len", "len_thinking", "len_non_thinking", "hack_rate")
WINDOW = 5  # as the summary fasttnt train prints (fasttnt.plots.summary_table)


def run_one(out: Path, seed: int, threads: int, overrides: list[str]) -> dict:
    """One ``fasttnt train`` from an empty cache; its wall time, exit status and log in its folder."""
    folder = out / f"seed{seed}-threads{threads}"
    rows = _rows(folder)
    if rows and (folder / "wall.json").is_file():
        return json.loads((folder / "wall.json").read_text())
    folder.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "fasttnt", "train", "--output-dir", str(folder), f"warmup.seed={seed}",
           f"cache_dir={folder / 'cache'}", *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    start = time.monotonic()
    with (folder / "train.log").open("w") as log:
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    result = {"seed": seed, "threads": threads, "exit": code, "wall_s": round(time.monotonic() - start, 1)}
    (folder / "wall.json").write_text(json.dumps(result))
    print(f"seed {seed}, {threads} thread(s): exit {code} after {result['wall_s']:.0f} s", flush=True)
    return result


def _rows(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def table(out: Path) -> dict:
    """Each finished run's first and last ``WINDOW`` steps' means, and each metric's range over the runs."""
    runs = []
    for folder in sorted(out.glob("seed*-threads*")):
        rows = _rows(folder)
        wall = json.loads((folder / "wall.json").read_text()) if (folder / "wall.json").is_file() else {}
        if len(rows) < 2 * WINDOW or wall.get("exit") != 0:
            continue

        def means(part):
            return {k: sum(r[k] for r in part) / len(part) for k in METRICS}

        runs.append({"run": folder.name, "steps": len(rows), "wall_s": wall.get("wall_s"),
                     "first": means(rows[:WINDOW]), "last": means(rows[-WINDOW:])})  # fmt: skip
    spread = {k: (min(r["last"][k] for r in runs), max(r["last"][k] for r in runs)) for k in METRICS} if runs else {}
    print(f"last {WINDOW} steps' means per run (first {WINDOW} in brackets):")
    print(f"{'run':<18}{'wall s':>8}" + "".join(f"{k:>20}" for k in METRICS))
    for r in runs:
        cells = "".join(f"{r['last'][k]:>11.3f} ({r['first'][k]:.3f})" for k in METRICS)
        print(f"{r['run']:<18}{r['wall_s'] or float('nan'):>8.0f}{cells}")
    if runs:
        print(f"{'range':<26}" + "".join(f"{f'{lo:.3f}-{hi:.3f}':>20}" for lo, hi in spread.values()))
    summary = {"window": WINDOW, "runs": runs, "last_range": spread}
    (out / "spread.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--jobs", type=int, default=1, help="runs at once (one thread each on 2 cores)")
    parser.add_argument("--out", type=Path, default=Path("runs/quickstart-spread"))
    parser.add_argument("--table-only", action="store_true", help="only the table of the runs already in --out")
    parser.add_argument("overrides", nargs="*", help="config overrides for every run (dotted keys)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.table_only:
        plan = [(s, t) for t in args.threads for s in args.seeds]
        with ThreadPoolExecutor(args.jobs) as pool:
            results = list(pool.map(lambda st: run_one(args.out, *st, args.overrides), plan))
        failed = [r for r in results if r["exit"] != 0]
        for r in failed:
            print(f"seed {r['seed']}, {r['threads']} thread(s) failed: see its train.log", file=sys.stderr)
    summary = table(args.out)
    return 0 if summary["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
