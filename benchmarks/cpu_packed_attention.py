"""The CPU's packed attention (``fasttnt.attention``, the padded SDPA path), forward + backward, at the embedded
task's update shapes: 256 sequences of a ~12-token prompt and an 11-64-token response, GQA 4/2 heads of 32.

    python benchmarks/cpu_packed_attention.py [--reps 15] [--against OTHER_CHECKOUT]

Times this checkout's ``varlen_attention`` with its default length-sorted chunks and with one chunk, and with
``--against`` another checkout's (its ``fasttnt/attention.py``, e.g. an older commit's ``git worktree``),
interleaved repetition by repetition; prints the medians and the ratios to the first.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--against", type=Path, help="another checkout whose fasttnt/attention.py to time too")
    args = parser.parse_args(argv)

    import fasttnt.attention as current

    def one_chunk(*a, **k):
        saved, current._PADDED_CHUNKS = current._PADDED_CHUNKS, 1
        try:
            return current.varlen_attention(*a, **k)
        finally:
            current._PADDED_CHUNKS = saved

    variants = {"this checkout": (current, current.varlen_attention), "one chunk": (current, one_chunk)}
    if args.against:
        other = _load(args.against / "fasttnt" / "attention.py", "fasttnt_attention_against")
        variants[f"{args.against}"] = (other, other.varlen_attention)

    torch.manual_seed(0)
    lengths = (12 + torch.randint(11, 65, (256,))).tolist()  # (S,) prompt + response tokens
    tokens = sum(lengths)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, (module, attention) in variants.items():
            q, k, v = (torch.randn(tokens, h, 32, requires_grad=True) for h in (4, 2, 2))  # (T, H, D)
            packing = module.Packing.of(lengths, "cpu")
            start = time.perf_counter()
            out = attention(q, k, v, packing, scale=32**-0.5)
            out.backward(torch.ones_like(out))
            times[name].append(time.perf_counter() - start)
    first = statistics.median(next(iter(times.values())))
    print(f"{len(lengths)} sequences, {tokens} tokens; forward + backward, median of {args.reps} interleaved reps")
    for name, t in times.items():
        print(f"{name:40} {statistics.median(t) * 1e3:8.1f} ms  {statistics.median(t) / first:5.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
