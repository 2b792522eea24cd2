"""The lm_head's matmuls alone in a GRPO step at a real vocabulary, at this machine's measured rates: a floor on
any trainer's step at equal work in that dtype.

    python benchmarks/lm_head_floor.py                     # the 0.5B shape, 8 rows x 512 tokens, float32
    python benchmarks/lm_head_floor.py --train-tokens 4350 --dtype bfloat16

Generation runs one (rows x H) @ (H x V) product per new token (the decode step's logits), the update three per
trained token: the logits, the hidden states' gradient (logits grad @ W) and the weight's (logits grad^T @ h, summed
in float32 as fasttnt's lm_head ops do), at the row chunk fasttnt's CPU path uses (256 MiB of logits in the dtype).
Each is timed alone (median of ``--repeats`` after one warm-up) and scaled by how often a step runs it; nothing
else of the step (the body's layers, attention, sampling, the optimizer) is counted, so a step cannot be faster
than the sum. ``--json`` also writes the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: the first call pays for page faults and the BLAS's dispatch
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(*, vocab: int, hidden: int, decode_rows: int, decode_steps: int, train_tokens: int, chunk_rows: int,
            dtype: str, repeats: int) -> dict:  # fmt: skip
    """Seconds per call and per step of each product, and their sum."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(vocab, hidden, generator=gen) * 0.02).to(dt)  # (V, H)
    x = torch.randn(decode_rows, hidden, generator=gen).to(dt)  # (B, H)
    h = torch.randn(chunk_rows, hidden, generator=gen).to(dt)  # (C, H)
    g = (torch.randn(chunk_rows, vocab, generator=gen) * 1e-3).to(dt)  # (C, V) dloss/dlogits
    acc = torch.zeros(vocab, hidden, dtype=torch.float32)  # (V, H): the weight gradient's float32 sum
    chunks = train_tokens / chunk_rows
    ops = {
        "decode logits (B x H) @ (H x V)": (lambda: torch.nn.functional.linear(x, w), decode_steps),
        "update logits (C x H) @ (H x V)": (lambda: torch.nn.functional.linear(h, w), chunks),
        "update grad hidden (C x V) @ (V x H)": (lambda: g @ w, chunks),
        "update grad weight (V x C) @ (C x H)": (lambda: acc.addmm_(g.T.float(), h.float()), chunks),
    }
    rows = []
    for name, (fn, calls) in ops.items():
        seconds = _median_seconds(fn, repeats)
        m = decode_rows if name.startswith("decode") else chunk_rows
        flop = 2.0 * m * hidden * vocab
        rows.append({"op": name, "ms_per_call": seconds * 1e3, "calls": calls, "seconds": seconds * calls,
                     "gflop_per_s": flop / seconds / 1e9})  # fmt: skip
    total = math.fsum(r["seconds"] for r in rows)
    return {"vocab": vocab, "hidden": hidden, "decode_rows": decode_rows, "decode_steps": decode_steps,
            "train_tokens": train_tokens, "chunk_rows": chunk_rows, "dtype": dtype, "repeats": repeats,
            "threads": torch.get_num_threads(), "ops": rows, "floor_seconds": total}  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--decode-rows", type=int, default=8, help="rows of the decode batch (prompts x samples)")
    parser.add_argument("--decode-steps", type=int, default=512, help="new tokens per response")
    parser.add_argument("--train-tokens", type=int, default=4350, help="response tokens the update trains on")
    parser.add_argument("--chunk-rows", type=int, help="rows per logits chunk (default: fasttnt's on the CPU)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.chunk_rows is None:
        from fasttnt_kernels._lm_head import DEFAULT_CPU_CHUNK_BYTES, chunk_rows_for

        itemsize = 4 if args.dtype == "float32" else 2
        args.chunk_rows = chunk_rows_for(args.train_tokens, args.vocab, itemsize, DEFAULT_CPU_CHUNK_BYTES)
    for name in ("vocab", "hidden", "decode_rows", "decode_steps", "train_tokens", "chunk_rows", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    result = measure(vocab=args.vocab, hidden=args.hidden, decode_rows=args.decode_rows,
                     decode_steps=args.decode_steps, train_tokens=args.train_tokens, chunk_rows=args.chunk_rows,
                     dtype=args.dtype, repeats=args.repeats)  # fmt: skip
    print(f"V = {args.vocab:,}, H = {args.hidden}, {args.dtype}, {result['threads']} threads")
    print(f"{'product':40s} {'ms/call':>9s} {'GFLOP/s':>8s} {'calls':>7s} {'s/step':>7s}")
    for r in result["ops"]:
        print(f"{r['op']:40s} {r['ms_per_call']:9.1f} {r['gflop_per_s']:8.1f} {r['calls']:7.1f} {r['seconds']:7.1f}")
    print(f"{'the lm_head alone, per step':40s} {'':9s} {'':8s} {'':7s} {result['floor_seconds']:7.1f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
