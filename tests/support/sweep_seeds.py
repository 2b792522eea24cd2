"""The seed sweep: the kernel tests at many seeds and the tests that train at fewer, each seed in its own pytest
process (FASTTNT_TEST_SEED), reporting every seed that failed and what failed at it.

    python tests/support/sweep_seeds.py              # kernels at seeds 1-200, trainer/distributed/resume at 1-20
    python tests/support/sweep_seeds.py --kernel-seeds 0 --run-seeds 5 --first 1000

A test that fails at one seed of these fails on somebody's machine: the suite draws a fresh seed every run. Exit
status 1 when any seed failed. One thread per job: two 2-thread processes on 2 cores run several times slower.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]
KERNEL_TESTS = ("tests/kernels",)
# the tests that train: the loop, the actor's update, checkpoints, the 2-rank runs against one process, resume and
# preemption, and the choice's bandit
RUN_TESTS = ("tests/test_trainer.py", "tests/test_actor.py", "tests/test_checkpoint.py", "tests/test_distributed.py",
             "tests/test_preemption.py", "tests/test_mode_choice.py")  # fmt: skip


@dataclass
class SeedResult:
    stage: str
    seed: int
    passed: int = 0
    failed: list[str] = field(default_factory=list)  # node ids that failed or errored
    why: dict[str, str] = field(default_factory=dict)  # node id -> the last line of its error
    returncode: int = 0
    tail: str = ""  # the end of pytest's output when it failed without a report (a crash, a collection error)


def _failures(report: Path) -> tuple[int, dict[str, str]]:
    """(tests passed, {node id failed or errored: the last ``E`` line of its report}) from a JUnit XML report."""
    passed, failed = 0, {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            lines = [line.strip() for line in (bad.text or "").splitlines() if line.startswith("E ")]
            failed[name] = (lines[-1] if lines else bad.get("message") or "")[:300]
        elif case.find("skipped") is None:
            passed += 1
    return passed, failed


def run_seed(stage: str, paths: tuple[str, ...], seed: int, workdir: Path) -> SeedResult:
    report = workdir / f"{stage}-{seed}.xml"
    env = {**os.environ, "FASTTNT_TEST_SEED": str(seed), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *paths]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    result = SeedResult(stage, seed, returncode=proc.returncode)
    if report.is_file():
        result.passed, result.why = _failures(report)
        result.failed = list(result.why)
    if proc.returncode not in (0, 1) or (proc.returncode == 1 and not result.failed):
        result.failed.append(f"<pytest exit {proc.returncode}>")
        result.tail = (proc.stdout + proc.stderr)[-3000:]
    return result


def sweep(
    stage: str,
    paths: tuple[str, ...],
    seeds: list[int],
    jobs: int,
    workdir: Path,
    *,
    done: list[SeedResult],
    out: Path | None,
) -> list[SeedResult]:
    """Every seed of one stage; each result is added to ``done`` (and ``out`` rewritten) as it comes, so a sweep
    stopped early keeps what it ran."""
    if not seeds:
        return []
    with ThreadPoolExecutor(jobs) as pool:
        futures = [pool.submit(run_seed, stage, paths, seed, workdir) for seed in seeds]
        results = []
        bar = tqdm(futures, desc=f"{stage} seeds", unit="seed")
        for future in bar:
            results.append(future.result())
            done.append(results[-1])
            if out:
                out.write_text(json.dumps([asdict(r) for r in done], indent=1))
            if results[-1].failed:  # as it happens: a long sweep is worth reading before it ends
                bar.write(f"{stage}: FASTTNT_TEST_SEED={results[-1].seed} failed {', '.join(results[-1].failed)}")
            bar.set_postfix(failed_seeds=sum(bool(r.failed) for r in results))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel-seeds", type=int, default=200, help="seeds for the kernel tests (default 200)")
    parser.add_argument("--run-seeds", type=int, default=20, help="seeds for the tests that train (default 20)")
    parser.add_argument("--first", type=int, default=1, help="the first seed (default 1)")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once, one thread each (default 2)")
    parser.add_argument("--out", type=Path, help="write every seed's result here as JSON")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fasttnt-sweep-") as tmp:
        workdir = Path(tmp)
        kernel_seeds = list(range(args.first, args.first + args.kernel_seeds))
        run_seeds = list(range(args.first, args.first + args.run_seeds))
        results: list[SeedResult] = []
        sweep("kernels", KERNEL_TESTS, kernel_seeds, args.jobs, workdir, done=results, out=args.out)
        # the 2-rank tests start two processes of their own: one seed at a time
        sweep("runs", RUN_TESTS, run_seeds, 1, workdir, done=results, out=args.out)

    for stage, seeds in (("kernels", kernel_seeds), ("runs", run_seeds)):
        if not seeds:
            continue
        bad = [r for r in results if r.stage == stage and r.failed]
        tests = sum(r.passed + len(r.failed) for r in results if r.stage == stage) // max(len(seeds), 1)
        print(f"{stage}: {len(seeds)} seeds ({seeds[0]}-{seeds[-1]}), ~{tests} tests each: "
              f"{len(bad)} seeds failed")  # fmt: skip
        for r in bad:
            print(f"  FASTTNT_TEST_SEED={r.seed}:")
            for name in r.failed:
                print(f"    {name}: {r.why.get(name, '')}")
            if r.tail:
                print("    " + r.tail.replace("\n", "\n    "))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
