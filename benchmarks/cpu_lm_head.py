"""The fused lm_head loss on the CPU: time and memory of ``linear_policy_loss``'s forward and backward at a real
vocabulary, per logits chunk size, each measurement in a fresh process (its resident set's high-water mark).

    python benchmarks/cpu_lm_head.py                                   # 2,556 x 896 tokens, V = 151,936
    python benchmarks/cpu_lm_head.py --tokens 4350 --chunk-mib 128 256 512 --repeats 3

The shape is the 0.5B stand-in's update at 128-token responses (benchmarks/RESULTS.md). Prints one row per run and
the medians per chunk size; ``--json`` also writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import proc_memory


def one_run(tokens: int, hidden: int, vocab: int, chunk_mib: int, seed: int) -> dict[str, float]:
    """One forward and backward in this process: seconds, and the high-water mark's rise over the inputs."""
    import torch

    from fasttnt_kernels import linear_policy_loss

    gen = torch.Generator().manual_seed(seed)
    seqs = 16
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()  # (N, H)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).requires_grad_()  # (V, H)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)  # (N,)
    cu = torch.linspace(0, tokens, seqs + 1).long()  # (S+1,)
    adv = torch.randn(seqs, generator=gen)  # (S,)
    peaks = proc_memory.Peaks()
    peaks.start_window()
    start = time.perf_counter()
    loss, _ = linear_policy_loss(h, w, ids, advantages=adv, cu_seqlens=cu, total_tokens=tokens, total_seqs=seqs,
                                 entropy_coef=0.01, chunk_bytes=chunk_mib * 2**20)  # fmt: skip
    loss.backward()
    seconds = time.perf_counter() - start
    if not (torch.isfinite(loss) and torch.isfinite(w.grad).all() and torch.isfinite(h.grad).all()):
        raise RuntimeError("cpu_lm_head.py: a non-finite loss or gradient")
    return {"seconds": seconds, "rise_mib": peaks.end_window()["rise_mib"], "loss": loss.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2556)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--repeats", type=int, default=2, help="fresh processes per chunk size, taking turns")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: this chunk size, print one row
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_run(args.tokens, args.hidden, args.vocab, args.one, seed=0)))
        return
    rows = []
    for repeat in range(args.repeats):
        for mib in args.chunk_mib:
            child = [sys.executable, __file__, "--one", str(mib), "--tokens", str(args.tokens),
                     "--hidden", str(args.hidden), "--vocab", str(args.vocab)]  # fmt: skip
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            row = {"chunk_mib": mib, "repeat": repeat, **json.loads(out.strip().splitlines()[-1])}
            rows.append(row)
            print(f"chunk {mib:4d} MiB  {row['seconds']:7.2f} s  rise {row['rise_mib']:7.0f} MiB", flush=True)
    summary = {
        mib: {
            "seconds_median": statistics.median(r["seconds"] for r in rows if r["chunk_mib"] == mib),
            "rise_mib_median": statistics.median(r["rise_mib"] for r in rows if r["chunk_mib"] == mib),
        }
        for mib in args.chunk_mib
    }
    for mib, s in summary.items():
        print(f"median: chunk {mib:4d} MiB  {s['seconds_median']:7.2f} s  rise {s['rise_mib_median']:7.0f} MiB")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args), "rows": rows, "summary": summary}, indent=1, default=str) + "\n"
        )


if __name__ == "__main__":
    main()
