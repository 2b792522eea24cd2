"""Figures from benchmarks/results.csv: speed-up over the eager PyTorch formulation per op and shape (GPU rows),
and peak memory of the fused lm_head path against materialised logits (memory rows).

    python benchmarks/plot_results.py [--csv benchmarks/results.csv] [--out benchmarks/results.png]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", type=Path, default=HERE / "results.csv")
    parser.add_argument("--out", type=Path, default=HERE / "results.png")
    args = parser.parse_args()
    rows = list(csv.DictReader(args.csv.open()))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # the memory rows: each case's newest (the CSV is appended to), when it measured
    newest = {(r["provider"], r["shape"]): r for r in rows if r["logits_mib"]}
    memory = [r for r in newest.values() if r["status"] == "ok" and r["peak_mib"]]
    speed = [r for r in rows if r["fwd_bwd_ms"] or r["fwd_ms"]]
    panels = (1 if memory else 0) + (1 if speed else 0)
    fig, axes = plt.subplots(1, max(panels, 1), figsize=(6.5 * max(panels, 1), 4.5), constrained_layout=True)
    axes = list(axes) if panels > 1 else [axes]
    i = 0
    if memory:
        ax = axes[i]
        i += 1
        for provider in dict.fromkeys(r["provider"] for r in memory):
            pts = [(int(r["shape"].split()[0][2:]), float(r["peak_mib"])) for r in memory if r["provider"] == provider]
            ax.plot(*zip(*sorted(pts), strict=True), marker="o", label=provider)
        ax.set_xlabel("tokens N (H=1536, V=151936, float32)")
        ax.set_ylabel("peak rise over the inputs, MiB (fwd+bwd)")
        ax.set_title(f"fused lm_head vs materialised logits ({memory[-1]['device']})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if speed:
        ax = axes[i]
        keyed = {(r["op"], r["shape"], r["provider"]): r for r in speed}
        labels, ratios = [], []
        for (op, shape, provider), r in keyed.items():
            base = keyed.get((op, shape, "torch")) or keyed.get((op, shape, "torch (materialised)"))
            if provider != "fasttnt" or base is None:
                continue
            key = "fwd_bwd_ms" if r["fwd_bwd_ms"] and base["fwd_bwd_ms"] else "fwd_ms"
            labels.append(f"{op}\n{shape}")
            ratios.append(float(base[key]) / float(r[key]))
        ax.barh(range(len(ratios)), ratios)
        ax.set_yticks(range(len(ratios)), labels, fontsize=6)
        ax.axvline(1.0, color="k", linewidth=0.8)
        ax.set_xlabel("speed-up over eager PyTorch (fwd+bwd where differentiable)")
        ax.set_title(f"speed ({speed[-1]['device']})")
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
