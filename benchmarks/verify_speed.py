"""Time per item of answer verification: integer answers (the fast path) and LaTeX answers (symbolic, in workers).

python benchmarks/verify_speed.py [--integers 8192] [--symbolic 256] [--workers 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from fasttnt.verify import VerifierPool, verify_batch

# LaTeX answer pairs that need the symbolic path (none is decided by strings or exact numbers); each template
# takes a number, so every item is distinct and math-verify's parse cache does not flatter the timing
_SYMBOLIC = [
    (lambda k: f"\\sqrt{{{8 * k * k}}}", lambda k: f"{2 * k}\\sqrt{{2}}", True),
    (lambda k: f"\\frac{{\\sqrt{{3}}}}{{{2 * k}}}", lambda k: f"\\frac{{1}}{{{2 * k}}}\\sqrt{{3}}", True),
    (lambda k: f"x^2+{2 * k}x+{k * k}", lambda k: f"(x+{k})^2", True),
    (lambda k: f"\\{{{k},{k + 1}\\}}", lambda k: f"\\{{{k + 1},{k}\\}}", True),
    (lambda k: f"(-\\infty, {k}]", lambda k: f"x \\le {k}", True),
    (lambda k: f"{k}\\pi", lambda k: f"\\pi \\cdot {k}", True),
    (lambda k: f"\\sqrt{{{k + 2}}}", lambda k: f"\\sqrt{{{k + 1}}}", False),
    (lambda k: f"x^2+{k}", lambda k: f"(x+{k})^2", False),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--integers", type=int, default=8192)
    parser.add_argument("--symbolic", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)

    values = [rng.randint(0, 20000) for _ in range(args.integers)]
    responses = [f"{v}+0={v}\n</think>\\boxed{{{v}}}" for v in values]
    golds = [str(v + (i % 2)) for i, v in enumerate(values)]
    fast = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        verdicts = verify_batch(responses, golds)
        fast.append(time.perf_counter() - start)
        assert verdicts.symbolic == 0 and sum(verdicts) == (args.integers + 1) // 2

    slow = []
    with VerifierPool(workers=args.workers, timeout=10.0) as pool:
        verify_batch(["\\boxed{\\sqrt{2}}"] * 4, ["\\sqrt{2}"] * 4, pool=pool)  # start the workers untimed
        for r in range(args.repeats):
            ks = range(3 + r * args.symbolic, 3 + (r + 1) * args.symbolic)  # new items every repeat
            pairs = [(p(k), g(k), e) for k in ks for p, g, e in [_SYMBOLIC[k % len(_SYMBOLIC)]]]
            sym_responses = [f"</think>So \\boxed{{{p}}}." for p, _, _ in pairs]
            sym_golds = [g for _, g, _ in pairs]
            start = time.perf_counter()
            verdicts = verify_batch(sym_responses, sym_golds, pool=pool)
            slow.append(time.perf_counter() - start)
            assert list(verdicts) == [e for _, _, e in pairs] and verdicts.timeouts == 0

    print(
        f"integer answers, fast path:  {args.integers} items, median {statistics.median(fast):.3f} s "
        f"({statistics.median(fast) / args.integers * 1e6:.1f} us/item), runs {', '.join(f'{t:.3f}' for t in fast)}"
    )
    print(
        f"LaTeX answers, symbolic ({args.workers} workers): {args.symbolic} items, "
        f"median {statistics.median(slow):.3f} s "
        f"({statistics.median(slow) / args.symbolic * 1e3:.2f} ms/item), runs {', '.join(f'{t:.3f}' for t in slow)}"
    )


if __name__ == "__main__":
    main()
