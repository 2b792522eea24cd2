"""Training curves and the end-of-run summary."""

from __future__ import annotations

import math
from pathlib import Path

# (title, [(metric, label), ...]) per panel
_PANELS = [
    ("reward", [("reward", "mean reward")]),
    (
        "accuracy",
        [
            ("acc", "all"),
            ("acc_thinking", "thinking"),
            ("acc_free_direct", "direct, chosen"),
            ("acc_forced_direct", "direct, forced"),
        ],
    ),
    ("mean tokens by mode", [("len", "all"), ("len_thinking", "thinking"), ("len_non_thinking", "non-thinking")]),
    ("non-thinking ratio", [("non_thinking_ratio", "non-thinking ratio")]),
    ("hack rate", [("hack_rate", "hack rate (of non-thinking)")]),
    ("per-query limit L_x", [("limit_thinking_mean", "mean, queries with a thinking response")]),
]


def choice_levels(history: list[dict[str, float]]) -> list[int]:
    """The levels at which a run logged direct answers' rewards (``reward_direct_l2``, ...;
    metrics.choice_metrics), in order: none for a run that never answered directly."""
    return sorted({int(k.rsplit("_l", 1)[1]) for h in history for k in h if k.startswith("reward_direct_l")})


def _rolling(values: list[float], window: int) -> list[float]:
    """The mean of each value and the ``window - 1`` before it, NaNs left out (NaN where all are): a step's per-level
    numbers come from a few groups."""
    out = []
    for i in range(len(values)):
        seen = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(seen) / len(seen) if seen else float("nan"))
    return out


def plot_curves(history: list[dict[str, float]], path: Path, *, title: str = "fasttnt GRPO") -> None:
    """curves.png: the run's metrics by step; where direct answers were trained on data with levels, a row shows the
    choice by level (``_plot_choice``); where rollout workers generated, a row shows them (``_plot_pipeline``); over
    several ranks, a row shows their tokens and waits (``_plot_ranks``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]

    def value(h: dict, key: str) -> float:
        # a mode with no response in a step has no length and no hack rate: a gap, not a dip to 0
        if key in ("len_non_thinking", "hack_rate") and h.get("non_thinking_ratio") == 0:
            return float("nan")
        if key == "len_thinking" and h.get("non_thinking_ratio") == 1:
            return float("nan")
        return h.get(key, float("nan"))  # the accuracies by mode: absent in a step without such a response

    levels = choice_levels(history)
    pipeline = any("weight_version" in h for h in history)
    ranks = rank_count(history)
    rows = 2 + bool(levels) + pipeline + bool(ranks)
    fig, axes = plt.subplots(rows, 3, figsize=(13, 3.5 * rows), constrained_layout=True)
    for ax, (name, series) in zip(axes.flat, _PANELS, strict=False):
        for key, label in series:
            if all(key in h for h in history) or (key.startswith("acc_") and any(key in h for h in history)):
                ax.plot(steps, [value(h, key) for h in history], label=label, linewidth=1.5)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if name.startswith("per-query limit") and all("limit_fallback_frac" in h for h in history):
            # the fallback limit (1000 tokens) of queries without a thinking response would flatten the rest:
            # their share goes on its own axis instead
            share = ax.twinx()
            share.plot(steps, [h["limit_fallback_frac"] for h in history], color="grey", linestyle="--",
                       linewidth=1, label="share on the fallback limit")  # fmt: skip
            share.set_ylim(-0.02, 1.02)
            share.set_ylabel("share of queries on the fallback")
            share.legend(fontsize=8, loc="upper right")
        if len(series) > 1:
            ax.legend(fontsize=8)
    if levels:
        _plot_choice(axes[2], steps, history, levels)
    if pipeline:
        _plot_pipeline(axes[-1 - bool(ranks)], steps, history)
    if ranks:
        _plot_ranks(axes[-1], steps, history, ranks)
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


CHOICE_WINDOW = 5
"""Steps each per-level curve of the choice row averages over (a level has a few groups a step)."""


def _plot_choice(axes, steps: list[int], history: list[dict[str, float]], levels: list[int]) -> None:
    """The choice by level: the free p(</think>) (log scale), the gap between the modes' mean rewards (above 0 the
    table pays direct answers more), and each mode's accuracy."""
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def series(key: str) -> list[float]:
        return _rolling([h.get(key, float("nan")) for h in history], CHOICE_WINDOW)

    p_ax, gap_ax, acc_ax = axes
    for i, level in enumerate(levels):
        colour, label = colours[i % len(colours)], f"level {level}"
        if any(f"think_end_prob_l{level}" in h for h in history):
            p_ax.plot(steps, series(f"think_end_prob_l{level}"), color=colour, label=label)
        gaps = [h.get(f"reward_direct_l{level}", math.nan) - h.get(f"reward_thinking_l{level}", math.nan)
                for h in history]  # fmt: skip
        gap_ax.plot(steps, _rolling(gaps, CHOICE_WINDOW), color=colour, label=label)
        acc_ax.plot(steps, series(f"acc_thinking_l{level}"), color=colour, linestyle="--")
        # forced direct answers where the run forces them, else the chosen ones
        direct = "forced" if any(f"acc_forced_direct_l{level}" in h for h in history) else "free"
        acc_ax.plot(steps, series(f"acc_{direct}_direct_l{level}"), color=colour, label=label)
    gap_ax.axhline(0.0, color="black", linewidth=0.8)
    p_ax.set_yscale("log")
    p_ax.set_title(f"free p(</think>) by level ({CHOICE_WINDOW}-step mean)")
    gap_ax.set_title("reward gap, direct - thinking (> 0: direct pays)")
    acc_ax.set_title("accuracy (solid direct: forced, else chosen; dashed thinking)")
    acc_ax.set_ylim(-0.02, 1.02)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)


# (title, [(metric, label), ...]) per panel of the pipeline's row
_PIPELINE_PANELS = [
    ("idle seconds a step", [("time_wait", "trainer: waiting for a batch"),
                             ("worker_time_idle", "worker: waiting for weights or for the trainer")]),
    ("tokens/s", [("generated_tokens_per_s", "generated (worker)"), ("trained_tokens_per_s", "trained")]),
    ("weight staleness", [("staleness", "versions behind the trained weights")]),
]  # fmt: skip


def _plot_pipeline(axes, steps: list[int], history: list[dict[str, float]]) -> None:
    """Generation apart from training (``rollout.workers``): how long each side waited for the other, the tokens
    generated and trained per second, and how stale each step's batch was."""
    for ax, (name, series) in zip(axes, _PIPELINE_PANELS, strict=True):
        for key, label in series:
            ax.plot(steps, [h.get(key, math.nan) for h in history], label=label, linewidth=1.5)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


def rank_count(history: list[dict[str, float]]) -> int:
    """The ranks a distributed run logged tokens for (``rank_tokens_0``, ...); 0 for one process."""
    return len({k for h in history for k in h if k.startswith("rank_tokens_") and k.rsplit("_", 1)[1].isdigit()})


RANK_LINES = 8
"""Up to this many ranks, each rank's tokens get a line; past it, the fewest, the mean and the most."""


def _plot_ranks(axes, steps: list[int], history: list[dict[str, float]], ranks: int) -> None:
    """Over several ranks: the tokens each rank updated on, the most over the mean as dealt and as drawn
    (``distributed.balance_ranks``), and the longest wait for the others beside the update's time."""
    tokens_ax, ratio_ax, wait_ax = axes
    per_rank = [[h.get(f"rank_tokens_{r}", math.nan) for h in history] for r in range(ranks)]
    if ranks <= RANK_LINES:
        for r, series in enumerate(per_rank):
            tokens_ax.plot(steps, series, label=f"rank {r}", linewidth=1.2)
    else:
        columns = list(zip(*per_rank, strict=True))
        tokens_ax.plot(steps, [max(c) for c in columns], label="most", linewidth=1.2)
        tokens_ax.plot(steps, [sum(c) / ranks for c in columns], label="mean", linewidth=1.2)
        tokens_ax.plot(steps, [min(c) for c in columns], label="fewest", linewidth=1.2)
    tokens_ax.set_title("tokens per rank")
    for key, label in (("rank_tokens_max_over_mean", "as dealt"), ("rank_tokens_max_over_mean_drawn", "as drawn")):
        ratio_ax.plot(steps, [h.get(key, math.nan) for h in history], label=label, linewidth=1.5)
    ratio_ax.axhline(1.0, color="black", linewidth=0.8)
    ratio_ax.set_title("most tokens on a rank / mean (1: even)")
    for key, label in (("time_rank_wait", "longest wait for the other ranks"), ("time_update", "update")):
        wait_ax.plot(steps, [h.get(key, math.nan) for h in history], label=label, linewidth=1.5)
    wait_ax.set_title("seconds a step")
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)


SUMMARY_KEYS = [
    ("reward", "{:.3f}"),
    ("acc", "{:.3f}"),
    ("non_thinking_ratio", "{:.3f}"),
    ("len", "{:.1f}"),
    ("len_thinking", "{:.1f}"),
    ("len_non_thinking", "{:.1f}"),
    ("hack_rate", "{:.3f}"),
    ("limit_mean", "{:.1f}"),
]


def summary_table(history: list[dict[str, float]], *, window: int = 5) -> str:
    """First vs last steps (means over ``window`` steps each) and where the time went."""
    first, last = history[:window], history[-window:]

    def mean(rows, key):
        return sum(r[key] for r in rows) / len(rows)

    lines = [f"{'metric':<20}{'first ' + str(len(first)) + ' steps':>18}{'last ' + str(len(last)) + ' steps':>18}"]
    for key, fmt in SUMMARY_KEYS:
        lines.append(f"{key:<20}{fmt.format(mean(first, key)):>18}{fmt.format(mean(last, key)):>18}")
    total = sum(r["time_step"] for r in history)
    if all("draws" in r for r in history):  # dynamic sampling
        draws = [r["draws"] for r in history]
        filled = sum(r["filled_groups"] > 0 for r in history)
        lines.append(
            f"\ndynamic sampling: {sum(draws) / len(draws):.2f} draws per step (at most {max(draws)}); "
            f"{filled} step(s) reached rollout.max_draws and filled their batch with equal-reward groups"
        )
    lines.append("")
    lines.append(f"time over {len(history)} steps: {total:.1f} s")
    # the trainer's phases; with rollout workers it waits for their batches instead of generating
    for key in ("generate", "verify", "reward", "wait", "logprobs", "advantage", "update", "sync"):
        if all(f"time_{key}" in r for r in history):
            t = sum(r[f"time_{key}"] for r in history)
            lines.append(f"  {key:<12}{t:8.1f} s  {100 * t / max(total, 1e-9):5.1f}%")
    return "\n".join(lines)
