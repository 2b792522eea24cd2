"""The GRPO step of two commits of fasttnt side by side: what a change costs the step, in one command.

    python benchmarks/e2e_commits.py BASE [CHANGE] [--runs 3] [--trl] [--json FILE] [e2e.py's options]

BASE and CHANGE are git revisions of this repository (CHANGE defaults to HEAD; ``WORKTREE`` names the working tree
as it is, uncommitted changes included). Each is exported (``git archive``) to a temporary folder, and
``benchmarks/e2e.py``'s harness runs the two in processes of their own, taking turns step by step in an order
reversed every other step, both from this checkout's warmed-up tiny model (or ``--model``'s folder), on the same
prompts and settings. With ``--trl``, TRL's ``GRPOTrainer`` takes its turns too and each commit's ratio to it is
reported (the headline of benchmarks/RESULTS.md).

Each run gives the median over its timed steps of CHANGE's steps/s over BASE's, paired step by step; ``--runs``
fresh runs give the median of those. Equal to a ratio of ratios: with TRL's step in both, (CHANGE / TRL) /
(BASE / TRL) is CHANGE's steps/s over BASE's. Above 1, CHANGE is faster.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import e2e

ROOT = Path(__file__).resolve().parents[1]
WORKTREE = "WORKTREE"
KEPT = ("step_s", "steps_s", "phases_s", "update_peak_mib", "peak_rss_mib")  # of each trainer's e2e.py summary


def export(revision: str, dest: Path) -> str:
    """The tree of ``revision`` (or the working tree's files, for ``WORKTREE``) written to ``dest``; its label."""
    dest.mkdir(parents=True)
    if revision == WORKTREE:
        files = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout.split(b"\0")  # fmt: skip
        for name in filter(None, files):
            source = ROOT / name.decode()
            if source.is_file():  # a deleted, still-tracked file is not in the working tree
                (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
                (dest / name.decode()).write_bytes(source.read_bytes())
        return "worktree"
    sha = subprocess.run(
        ["git", "rev-parse", "--short", f"{revision}^{{commit}}"], cwd=ROOT, capture_output=True, text=True
    )
    if sha.returncode != 0:
        raise SystemExit(f"e2e_commits.py: {revision!r} is not a commit of {ROOT}")
    archive = subprocess.run(["git", "archive", "--format=tar", revision], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
    return sha.stdout.strip()


def paired_ratio(base: list[float], change: list[float], skip: int) -> float:
    """The median of CHANGE's steps/s over BASE's, step by step (seconds per step in, the first ``skip`` left out)."""
    return statistics.median(b / c for b, c in zip(base[skip:], change[skip:], strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("base", help="the git revision to compare against")
    parser.add_argument("change", nargs="?", default="HEAD", help=f"the revision measured (HEAD; {WORKTREE}: as is)")
    parser.add_argument("--runs", type=int, default=3, help="fresh runs, each its own processes (3)")
    parser.add_argument("--trl", action="store_true", help="TRL's trainer takes its turns too (needs trl)")
    args, rest = parser.parse_known_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    e2e_options = e2e.parser()
    e2e_args = e2e_options.parse_args(rest)
    e2e.check(e2e_options, e2e_args)
    if e2e_args.trl_only:
        parser.error("--trl-only measures no commit")
    if args.trl and importlib.util.find_spec("trl") is None:
        parser.error("--trl: TRL is not installed (pip install trl)")
    e2e_args.start_model = e2e.model_folder(e2e_args, e2e.resolved_config(e2e_args))  # warmed up once, here

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        labels = {}
        for role in ("base", "change"):
            labels[role] = export(getattr(args, role), Path(tmp) / role)
        base, change = f"base {labels['base']}", f"change {labels['change']}"
        workers = {
            base: functools.partial(e2e.fasttnt_worker, source=Path(tmp) / "base"),
            change: functools.partial(e2e.fasttnt_worker, source=Path(tmp) / "change"),
        }
        if args.trl:
            workers = {"trl": e2e.trl_worker, **workers}
        for run in range(args.runs):
            print(f"run {run + 1}/{args.runs}: {', '.join(workers)}", file=sys.stderr)
            results = e2e.run_turns(e2e_args, workers)
            row = {name: {k: results[name][k] for k in KEPT if k in results[name]} for name in workers}
            row["change_over_base"] = paired_ratio(
                results[base]["steps_s"], results[change]["steps_s"], e2e_args.warmup_steps
            )
            if args.trl:
                for name in (base, change):
                    row[f"{name} over trl"] = paired_ratio(
                        results["trl"]["steps_s"], results[name]["steps_s"], e2e_args.warmup_steps
                    )
            rows.append(row)
            print(f"  {change} steps/s / {base} steps/s = {row['change_over_base']:.3f}", file=sys.stderr)
            for name in (base, change):
                phases = ", ".join(f"{k} {v:.3f}" for k, v in row[name]["phases_s"].items() if v >= 0.001)
                print(
                    f"  {name}: {row[name]['step_s']:.3f} s/step ({phases}); peak MiB: update "
                    f"{row[name]['update_peak_mib']:.0f}, process {row[name]['peak_rss_mib']:.0f}",
                    file=sys.stderr,
                )

    keys = [k for k in rows[0] if k == "change_over_base" or k.endswith("over trl")]
    summary = {k: statistics.median(r[k] for r in rows) for k in keys}
    print(f"\n{base} against {change}: {e2e_args.prompts} prompts x {e2e_args.samples} samples, <= "
          f"{e2e_args.max_new_tokens} new tokens, {e2e_args.steps} timed steps after {e2e_args.warmup_steps}, "
          f"{args.runs} runs")  # fmt: skip
    for k in keys:
        label = f"{change} steps/s / {base} steps/s" if k == "change_over_base" else k.replace(" over ", " / ")
        runs = ", ".join(f"{r[k]:.3f}" for r in rows)
        print(f"{label}: {summary[k]:.3f} (median of {args.runs} runs: {runs})")
    if e2e_args.json:
        e2e_args.json.write_text(
            json.dumps({"base": base, "change": change, "summary": summary, "runs": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
