"""Training curves and the end-of-run summary."""

from __future__ import annotations

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


def plot_curves(history: list[dict[str, float]], path: Path, *, title: str = "fasttnt GRPO") -> None:
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

    fig, axes = plt.subplots(2, 3, figsize=(13, 7), constrained_layout=True)
    for ax, (name, series) in zip(axes.flat, _PANELS, strict=True):
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
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    for key in ("generate", "verify", "reward", "logprobs", "advantage", "update", "sync"):
        t = sum(r[f"time_{key}"] for r in history)
        lines.append(f"  {key:<12}{t:8.1f} s  {100 * t / max(total, 1e-9):5.1f}%")
    return "\n".join(lines)
