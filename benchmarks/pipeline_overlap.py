"""Generation beside training on the embedded default: the colocated loop (one process), a rollout worker on-policy
(``rollout.workers=1``, k = 0: two processes in turn) and one step off-policy (k = 1: the next batch generated during
the update), side by side in one run, one thread per process.

    python benchmarks/pipeline_overlap.py --steps 20 --out runs/overlap --json benchmarks/pipeline-overlap-cpu.json

Per layout: the median seconds per step over the steps after the first few (``--skip``), from each step's
``time_step`` (the trainer's wall time of the step, its wait for the worker included). From the k = 0 run, the two
halves of a synchronous step: generation (the worker's generate + verify + reward) and the update (the trainer's
log-probs + advantage + update + push); perfect overlap would take max of the two per step, and the k = 1 step's
ratio to it says how close the pipeline comes. Runs use the warm-up cache of ``fasttnt train`` (its default
``cache_dir``).

The runs learn apart (each its own samples), and the update's time follows the tokens it trains on (the sequences
of zero advantage are skipped), which differ by a factor of two from step to step: so the trainer's side is also
compared per thousand trained tokens. ``trainer_s_per_1k_tokens``: each step's time without generation and without
the wait for a worker (log-probs, advantage, update, push, bookkeeping), over its trained prompt and response
tokens; the colocated loop's ``update_s_per_1k_tokens`` is its ``time_update`` alone over the same.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYOUTS = {
    "colocated": [],
    "worker_k0": ["rollout.workers=1"],
    "worker_k1": ["rollout.workers=1", "rollout.max_staleness=1"],
}
GENERATION = ("worker_time_generate", "worker_time_verify", "worker_time_reward")
IN_STEP_GENERATION = ("time_generate", "time_verify", "time_reward", "time_wait")  # a trainer's step, not its own
UPDATE = ("time_logprobs", "time_advantage", "time_update", "time_sync")


def run(layout: str, out: Path, steps: int, port: int, overrides: list[str], module: str) -> list[dict]:
    """One ``fasttnt train`` of ``layout`` (then ``overrides``), as ``python -m module train``; its metrics rows."""
    folder = out / layout
    cmd = ["-m", module, "train", "--output-dir", str(folder), f"steps={steps}", f"save_every={steps}",
           *LAYOUTS[layout], *overrides]  # fmt: skip
    if LAYOUTS[layout]:
        cmd = ["-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port), *cmd]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    with open(out / f"{layout}.log", "w") as log:
        subprocess.run([sys.executable, *cmd], env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def trainer_side(row: dict) -> float:
    """A step's seconds on the trainer's side: all of it but generation and the wait for a worker's batch."""
    return row["time_step"] - sum(row.get(k, 0.0) for k in IN_STEP_GENERATION)


def per_1k_tokens(rows: list[dict], seconds) -> float:
    """The median over ``rows`` of ``seconds(row)`` per thousand trained tokens (prompts and responses; one epoch:
    ``trained_tokens_per_s`` x ``time_update``)."""
    return statistics.median(1000 * seconds(x) / (x["trained_tokens_per_s"] * x["time_update"]) for x in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="first steps left out of the medians")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--port", type=int, default=29655, help="the first of three rendezvous ports")
    parser.add_argument("--module", default="fasttnt.cli", help="the CLI module to run (one that wraps fasttnt's)")
    parser.add_argument("overrides", nargs="*", help="config overrides for every layout (key=value)")
    args = parser.parse_intermixed_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for i, layout in enumerate(LAYOUTS):  # one at a time: each takes the machine's cores (a thread per process)
        rows[layout] = run(layout, args.out, args.steps, args.port + i, args.overrides, args.module)
    later = {layout: r[args.skip :] for layout, r in rows.items()}
    step = {layout: statistics.median(x["time_step"] for x in r) for layout, r in later.items()}
    generation = statistics.median(sum(x[k] for k in GENERATION) for x in later["worker_k0"])
    update = statistics.median(sum(x[k] for k in UPDATE) for x in later["worker_k0"])
    result = {
        "command": " ".join(["python", "benchmarks/pipeline_overlap.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "steps": args.steps,
        "skip": args.skip,
        "median_step_s": step,
        "k0_generation_s": generation,
        "k0_update_s": update,
        "k1_over_perfect_overlap": step["worker_k1"] / max(generation, update),
        "k1_speedup_over_colocated": step["colocated"] / step["worker_k1"],
        "trainer_s_per_1k_tokens": {layout: per_1k_tokens(r, trainer_side) for layout, r in later.items()},
        "update_s_per_1k_tokens": {layout: per_1k_tokens(r, lambda x: x["time_update"]) for layout, r in later.items()},
        "final_acc": {layout: r[-1]["acc"] for layout, r in rows.items()},
    }
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
