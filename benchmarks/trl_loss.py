"""TRL's GRPOTrainer with its own loss against the same trainer with fasttnt's (``fasttnt.integrations.trl``), at
equal work on the embedded task: steps/s and the process's peak memory.

    python benchmarks/trl_loss.py [--rounds 2] [--steps 10] [--warmup-steps 2] [e2e.py's other options]

Each run is ``benchmarks/e2e.py --trl-only`` in a fresh process (so each peak resident set is its own), the two
losses taking turns round by round (TRL's first in even rounds), as a shared machine drifts over minutes. Reports,
per loss, the median of the runs' median step times and the largest peak resident set, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args, e2e_args = parser.parse_known_args(argv)
    runs: dict[str, list[dict]] = {"trl": [], "fasttnt": []}
    with tempfile.TemporaryDirectory() as tmp:
        for turn in range(args.rounds):
            for loss in ("trl", "fasttnt") if turn % 2 == 0 else ("fasttnt", "trl"):
                out = Path(tmp) / f"{loss}-{turn}.json"
                command = [sys.executable, str(HERE / "e2e.py"), "--trl-only", "--trl-loss", loss, "--json", str(out)]
                subprocess.run([*command, *e2e_args], check=True, stdout=subprocess.DEVNULL)
                result = json.loads(out.read_text())["trl"]
                runs[loss].append(result)
                print(f"round {turn + 1}: TRL with {loss}'s loss {result['step_s']:.3f} s/step, "
                      f"peak RSS {result['peak_rss_mib']:.0f} MiB", file=sys.stderr)  # fmt: skip
    summary = {
        loss: {
            "step_s": statistics.median(r["step_s"] for r in rs),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in rs),
            "runs": rs,
        }
        for loss, rs in runs.items()
    }
    trl, fast = summary["trl"], summary["fasttnt"]
    print(f"{'':24}{'s/step':>10}{'steps/s':>10}{'peak RSS MiB':>14}")
    for loss, r in summary.items():
        print(f"{'TRL, ' + loss + ' loss':24}{r['step_s']:10.3f}{1 / r['step_s']:10.3f}{r['peak_rss_mib']:14.0f}")
    print(f"steps/s with fasttnt's loss / TRL's own: {trl['step_s'] / fast['step_s']:.2f}; "
          f"peak RSS ratio {fast['peak_rss_mib'] / trl['peak_rss_mib']:.2f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
