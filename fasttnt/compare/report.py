"""``fasttnt compare``'s report: mean and standard error of every number over the runs, the warm-ups' forced-mode
accuracies against each variant's threshold, compare.md and compare.png."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict
from pathlib import Path

from ..config import TrainConfig
from ..runlog import read_jsonl
from .plan import CompareSettings, Run

TABLE_KEYS = ("acc", "len", "te", "non_thinking_ratio", "hack_rate", "len_non_thinking")
TRAIN_KEYS = (
    "step", "reward", "acc", "non_thinking_ratio", "free_non_thinking_ratio", "hack_rate", "len", "time_step", "draws",
    "varied_group_frac",
    "filled_groups", "grad_norm", "entropy", "kl", "clip_frac",
)  # fmt: skip
# how a run trained, from its training rows (``stability``): compare.md's stability table
STABILITY_KEYS = ("train_acc_last10", "entropy_first10", "entropy_last10", "kl_last10", "clip_frac_last10",
                  "max_grad_norm", "nonfinite_grad_steps")  # fmt: skip
SOLVED_ACC = 0.9  # steps-to-solve: the first step whose 5-step mean training accuracy reaches this
PREFERENCE_WINDOW = 10  # the last training steps whose reward gap per level says which mode the table pays more
LEVEL_COLUMNS = "acc / non-thinking | direct acc | direct pays | ends in the better mode"  # compare.md, per level


def mean_se(values: list[float | None]) -> dict:
    """Mean and standard error (sample std / sqrt(n)) of the values that exist; n = how many."""
    xs = [float(v) for v in values if v is not None and math.isfinite(v)]
    n = len(xs)
    if n == 0:
        return {"mean": None, "se": None, "n": 0}
    se = statistics.stdev(xs) / math.sqrt(n) if n > 1 else 0.0
    return {"mean": statistics.fmean(xs), "se": se, "n": n}


def direct_threshold(cfg: TrainConfig, p_think: float) -> float | None:
    """The direct-answer accuracy above which a direct answer earns more reward on average than thinking, under
    the run's reward table, for thinking accuracy ``p_think`` (0..1); None when a right direct answer does not pay
    more than a wrong one (no accuracy makes the trade). binary pays both modes alike. The limit is left out: this
    is the trade of an honest direct answer within it (with omega = 1 on the synthetic task none is)."""
    if cfg.reward.scheme == "binary":
        return p_think
    r = cfg.reward.values  # the table the kernel pays (reward.direct_margin's included)
    if r.direct_correct <= r.direct_wrong:
        return None
    expected_thinking = r.think_wrong + p_think * (r.think_correct - r.think_wrong)
    return (expected_thinking - r.direct_wrong) / (r.direct_correct - r.direct_wrong)


def preferred_mode(rows: list[dict], level: str, window: int = PREFERENCE_WINDOW) -> dict:
    """The mode the run's reward table paid more for at ``level`` in its last ``window`` training steps: the mean of
    each step's gap ``reward_direct_l<level> - reward_thinking_l<level>`` (metrics.choice_metrics: both modes'
    rows, forced and free) with its standard error; "direct" or "thinking" where the mean is more than two
    standard errors from 0, "tie" within, None where fewer than two steps of the window had both modes (free
    prompts that never answered directly; one step has no standard error). Each step's mode means pool the
    level's groups, so they weigh a prompt by its rows of each mode; the estimator's gap is within each group
    (``fasttnt.modes``)."""
    gaps = [r[f"reward_direct_l{level}"] - r[f"reward_thinking_l{level}"] for r in rows[-window:]
            if f"reward_direct_l{level}" in r and f"reward_thinking_l{level}" in r]  # fmt: skip
    if len(gaps) < 2:
        return {"mode": None, "gap": None, "se": None}
    stat = mean_se(gaps)
    clear = abs(stat["mean"]) > 2 * stat["se"]
    mode = ("direct" if stat["mean"] > 0 else "thinking") if clear else "tie"
    return {"mode": mode, "gap": stat["mean"], "se": stat["se"]}


def seconds_to(step: int | None, times: list[float]) -> float | None:
    """Training seconds (summed step times) up to and including ``step``."""
    return None if step is None else sum(times[:step])


def steps_to_solve(acc: list[float], window: int = 5) -> int | None:
    """The first step whose mean training accuracy over the last ``window`` steps reaches ``SOLVED_ACC``."""
    for i in range(window, len(acc) + 1):
        if sum(acc[i - window : i]) / window >= SOLVED_ACC:
            return i
    return None


def summarize_runs(
    settings: CompareSettings, runs: list[Run], results: list[dict], warmups: dict[int, dict[str, dict]]
) -> dict:
    """compare.json's content: per variant every run's evaluation and training curves, and mean +- SE of each
    number; per warm-up its forced-mode accuracies by level."""
    out: dict = {
        "settings": {**asdict(settings), "variants": list(settings.variants)},
        "warmups": {},
        "variants": {},
    }
    levels = None
    for w, by_mode in warmups.items():
        lv = sorted(by_mode["thinking"]["by_level"], key=int)
        levels = levels or lv
        direct = by_mode["non-thinking"]["by_level"]
        out["warmups"][str(w)] = {
            "p_think": {level: by_mode["thinking"]["by_level"][level]["acc"] / 100 for level in lv},
            # right and not hacked: a hacked direct answer (steps after </think>) is not the trade the threshold
            # describes, and TNT's limit punishes it
            "p_direct": {level: direct[level]["acc_honest"] / 100 for level in lv},
            # each forced mode's mean tokens and the split's responses by level: the tokens of each level in the
            # mode its table pays more for (benchmarks/choice_grid.py's T_opt)
            "len_think": {level: by_mode["thinking"]["by_level"][level]["len"] for level in lv},
            "len_direct": {level: direct[level]["len"] for level in lv},
            "responses": {level: by_mode["thinking"]["by_level"][level]["responses"] for level in lv},
        }
    for variant in settings.variants:
        rows = []
        for run, result in zip(runs, results, strict=True):
            if run.variant != variant:
                continue
            metrics = result["metrics"]
            evaluations = list(result.get("by_step", {}).values()) or [metrics]
            train_rows = read_jsonl(run.out / "metrics.jsonl")
            train = {key: [r.get(key) for r in train_rows] for key in TRAIN_KEYS}
            by = metrics["by_level"]
            levels = levels or sorted(by, key=int)
            wu = out["warmups"].get(str(run.warmup))
            thresholds = {lv: direct_threshold(run.cfg, wu["p_think"][lv]) if wu else None for lv in by}
            solved = steps_to_solve(train["acc"])
            by_level = {}
            for lv in sorted(by, key=int):
                preferred = preferred_mode(train_rows, lv)
                chosen = "direct" if by[lv]["non_thinking_ratio"] >= 0.5 else "thinking"  # what the model chose
                by_level[lv] = {
                    "acc": by[lv]["acc"],
                    "non_thinking_ratio": by[lv]["non_thinking_ratio"],
                    "acc_thinking": by[lv].get("acc_thinking"),
                    "acc_non_thinking": by[lv].get("acc_non_thinking"),
                    # does the warm-up's direct accuracy clear this variant's threshold?
                    "direct_pays": wu["p_direct"][lv] > thresholds[lv] if thresholds[lv] is not None else None,
                    "threshold": thresholds[lv],
                    # the mode the table paid more for at the end of training, and whether the evaluation chose it
                    "preferred": preferred,
                    "in_preferred_mode": None if preferred["mode"] is None else preferred["mode"] in ("tie", chosen),
                    # the largest non-thinking ratio of the evaluated steps (one step: the same as above)
                    "most_non_thinking": max(e["by_level"][lv]["non_thinking_ratio"] for e in evaluations),
                }
            rows.append(
                {
                    "warmup": run.warmup,
                    "seed": run.seed,
                    **{k: metrics[k] for k in TABLE_KEYS},
                    "by_level": by_level,
                    # each evaluated step's own numbers (none when the final model alone was evaluated)
                    "by_step": {str(k): {x: e[x] for x in TABLE_KEYS} for k, e in result.get("by_step", {}).items()},
                    "train_seconds": sum(t for t in train["time_step"] if t is not None),
                    "run_seconds": result["seconds"],
                    "steps_to_solve": solved,
                    "seconds_to_solve": seconds_to(solved, train["time_step"]),
                    "draws_per_step": mean_se(train["draws"])["mean"] if any(train["draws"]) else 1.0,
                    "train_hacked_share_last10": mean_se(_train_curve(train, "hacked_share")[-10:])["mean"],
                    **stability(train),
                    "train": train,
                }
            )
        keys = (*TABLE_KEYS, "train_seconds", "draws_per_step", "seconds_to_solve")
        stats = {k: mean_se([r[k] for r in rows]) for k in keys}
        stats["train_hacked_share_last10"] = mean_se([r["train_hacked_share_last10"] for r in rows])
        stats.update({k: mean_se([r.get(k) for r in rows]) for k in STABILITY_KEYS})
        solved = [r["steps_to_solve"] for r in rows]
        stats["steps_to_solve"] = {**mean_se(solved), "unsolved": sum(s is None for s in solved)}
        stats["by_level"] = {}
        for lv in levels:
            level_rows = [r["by_level"][lv] for r in rows]
            stats["by_level"][lv] = {
                key: mean_se([b[key] for b in level_rows])
                for key in ("acc", "non_thinking_ratio", "acc_thinking", "acc_non_thinking")
            }
            pays = [float(b["direct_pays"]) for b in level_rows if b["direct_pays"] is not None]
            stats["by_level"][lv]["direct_pays"] = mean_se(pays)
            ends = [float(b["in_preferred_mode"]) for b in level_rows if b["in_preferred_mode"] is not None]
            stats["by_level"][lv]["in_preferred_mode"] = mean_se(ends)
        out["variants"][variant] = {"stats": stats, "runs": rows}
    _pair_with_first(out["variants"])
    return out


def _pair_with_first(variants: dict) -> None:
    """Each run against the first variant's run of the same warm-up and seed (same prompts, starting model, code,
    threads and temperatures): ``vs_first`` its accuracy difference (points) and length ratio, per run and as mean
    +- SE over the pairs; the first variant itself has none."""
    names = list(variants)
    baseline = {(r["warmup"], r["seed"]): r for r in variants[names[0]]["runs"]} if names else {}
    for name in names[1:]:
        pairs = []
        for r in variants[name]["runs"]:
            base = baseline.get((r["warmup"], r["seed"]))
            r["vs_first"] = None if base is None else {"acc": r["acc"] - base["acc"], "len": r["len"] / base["len"]}
            pairs += [r["vs_first"]] if base is not None else []
        variants[name]["stats"]["vs_first"] = {k: mean_se([p[k] for p in pairs]) for k in ("acc", "len")}


def stability(train: dict) -> dict:
    """How a run trained (its training rows' curves, ``train``): the training accuracy, KL(old || new) and clip
    fraction over its last 10 steps, its entropy over the first and the last 10, the largest of its steps' gradient
    norms (each step's mean over its optimizer steps, before clipping) and how many steps had a non-finite one,
    which the largest leaves out. A step that trained no sequence has none of the token means: left out."""

    def mean(key: str, part: slice) -> float | None:
        return mean_se((train.get(key) or [])[part])["mean"]

    norms = [g for g in train.get("grad_norm") or [] if g is not None]
    first, last = slice(None, 10), slice(-10, None)
    return {
        "train_acc_last10": mean("acc", last),
        "entropy_first10": mean("entropy", first),
        "entropy_last10": mean("entropy", last),
        "kl_last10": mean("kl", last),
        "clip_frac_last10": mean("clip_frac", last),
        "max_grad_norm": max((g for g in norms if math.isfinite(g)), default=None),
        "nonfinite_grad_steps": sum(not math.isfinite(g) for g in norms),
    }


def _pm(stat: dict, fmt: str = "{:.1f}", scale: float = 1.0) -> str:
    if stat["mean"] is None:
        return "-"
    text = fmt.format(stat["mean"] * scale)
    return text if stat["n"] < 2 else f"{text} ± {fmt.format(stat['se'] * scale)}"


def markdown(summary: dict) -> str:
    s = summary["settings"]
    n_runs = s["seeds"] * s["warmup_seeds"]
    lines = [
        "| variant | acc (%) | len | TE | non-thinking | hack rate | len non-thinking | acc - first's | len / first's "
        "| steps to 90% train acc | s to 90% | draws / step | train s / run |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for variant, data in summary["variants"].items():
        st = data["stats"]
        vs = st.get("vs_first", {"acc": mean_se([]), "len": mean_se([])})
        solved = _pm(st["steps_to_solve"], "{:.0f}")
        if st["steps_to_solve"]["unsolved"]:
            solved += f" ({st['steps_to_solve']['unsolved']} never)"
        lines.append(
            f"| {variant} | {_pm(st['acc'])} | {_pm(st['len'])} | {_pm(st['te'], '{:.2f}')} | "
            f"{_pm(st['non_thinking_ratio'], '{:.2f}')} | {_pm(st['hack_rate'], '{:.2f}')} | "
            f"{_pm(st['len_non_thinking'])} | {_pm(vs['acc'], '{:+.1f}')} | {_pm(vs['len'], '{:.2f}')} | "
            f"{solved} | {_pm(st['seconds_to_solve'], '{:.0f}')} | "
            f"{_pm(st['draws_per_step'], '{:.2f}')} | "
            f"{_pm(st['train_seconds'], '{:.0f}')} |"
        )
    e = s["eval"]
    lines += [
        "",
        f"Mean ± standard error over {n_runs} runs per variant ({s['warmup_seeds']} warm-up(s) x {s['seeds']} "
        f"seed(s)); each run: its warm-up, then {s['steps']} GRPO steps, evaluated on the synthetic held-out split "
        f"({_per_level(e['synthetic_per_level'])}; {e['samples']} samples each, temperature "
        f"{e['temperature']}){_evaluated(s)}. acc - first's and len / first's: each run against the first "
        "variant's of the same warm-up and seed. "
        f"uniform-limit caps every non-thinking response at {s['uniform_limit']:.0f} tokens "
        "unless the variant says otherwise. Hack rate: the share of non-thinking responses that write column steps "
        f"after </think>. Steps to 90% train acc: the first step whose 5-step mean training accuracy reaches "
        f"{SOLVED_ACC:.0%} (s to 90%: the training seconds up to it; unsolved runs left out of both). Train s / run: "
        "the summed step times of one run (runs shared the cores with --jobs). The runs of one warm-up share "
        "their starting model, so they are not independent draws: with few warm-ups the ± understates the spread "
        "between warm-ups (the per-run rows below show it).",
        "",
        "How each variant trained (its training rows): the training accuracy over the last 10 steps, the entropy of "
        "the sampled tokens over the first and the last 10, KL(old || new) (the k3 estimate over the update's "
        "tokens) and the clipped share over the last 10, the largest of a run's per-step gradient norms (each "
        "step's mean over its optimizer steps, before clipping) and its steps whose norm was not finite.",
        "",
        "| variant | train acc, last 10 | entropy, first 10 | entropy, last 10 | KL(old \\|\\| new), last 10 | "
        "clipped, last 10 | largest grad norm | non-finite grad steps |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {variant} | {_pm(st['train_acc_last10'], '{:.1f}', 100)} | {_pm(st['entropy_first10'], '{:.3f}')} | "
            f"{_pm(st['entropy_last10'], '{:.3f}')} | {_pm(st['kl_last10'], '{:.4f}')} | "
            f"{_pm(st['clip_frac_last10'], '{:.3f}')} | {_pm(st['max_grad_norm'], '{:.2f}')} | "
            f"{_pm(st['nonfinite_grad_steps'], '{:.1f}')} |"
            for variant, st in ((v, d["stats"]) for v, d in summary["variants"].items())
        ),
    ]
    levels = next(iter(summary["variants"].values()))["stats"]["by_level"]
    if summary["warmups"]:
        lines += [
            "",
            "What a direct answer can do: each warm-up evaluated forced to think (p_t, accuracy) and forced to answer "
            "directly (p_d, the share right without thinking after </think>), by level; with the paper's reward "
            "table a direct answer pays more when p_d > (1 + p_t) / 3. The threshold leaves the limit out: a direct "
            "answer over it earns the over-limit reward whatever it says.",
            "",
            "| warm-up | " + " | ".join(f"level {lv} p_t / p_d / (1+p_t)/3" for lv in levels) + " |",
            "| --- |" + " --- |" * len(levels),
        ]
        for w, wu in summary["warmups"].items():
            cells = [
                f"{wu['p_think'][lv]:.2f} / {wu['p_direct'][lv]:.2f} / {(1 + wu['p_think'][lv]) / 3:.2f}"
                for lv in levels
            ]
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "By level: accuracy (%) / non-thinking ratio after training; then the accuracy of the direct answers the "
        "trained models gave (- where none); in how many runs the warm-up's direct accuracy cleared the "
        f"variant's threshold (direct pays); and in how many the model ended in the mode its table paid more for "
        f"over the last {PREFERENCE_WINDOW} training steps (each mode's mean reward over its rows, forced and free: "
        "the mean gap more than two standard errors from 0; a tie counts as either; - where training never saw "
        "both modes, as with free prompts from a thinking-only model).",
        "",
        "| variant | " + " | ".join(f"level {lv}: {LEVEL_COLUMNS}" for lv in levels) + " |",
        "| --- |" + " ---: | ---: | ---: | ---: |" * len(levels),
    ]
    for variant, data in summary["variants"].items():
        cells = []
        for lv in levels:
            b = data["stats"]["by_level"][lv]
            cells += [
                f"{_pm(b['acc'], '{:.0f}')} / {_pm(b['non_thinking_ratio'], '{:.2f}')}",
                _pm(b["acc_non_thinking"], "{:.0f}"),
                _count(b["direct_pays"]),
                _count(b["in_preferred_mode"]),
            ]
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Per run (most non-thinking by level: the largest non-thinking ratio among the evaluated steps):",
        "",
        "| variant | warm-up | seed | acc (%) | len | TE | non-thinking | hack rate | acc by level | "
        "non-thinking by level | most non-thinking by level | reward gap by level (end) | in the worse mode | "
        "train s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- | --- | --- | ---: |",
    ]
    for variant, data in summary["variants"].items():
        for r in data["runs"]:
            levels_of = r["by_level"].values()
            acc = " / ".join(f"{v['acc']:.0f}" for v in levels_of)
            by = " / ".join(f"{v['non_thinking_ratio']:.2f}" for v in levels_of)
            most = " / ".join(f"{v['most_non_thinking']:.2f}" for v in levels_of)
            gaps = " / ".join("-" if v["preferred"]["gap"] is None else f"{v['preferred']['gap']:+.2f}"
                              for v in levels_of)  # fmt: skip
            worse = ", ".join(lv for lv, v in r["by_level"].items() if v["in_preferred_mode"] is False) or "-"
            lines.append(
                f"| {variant} | {r['warmup']} | {r['seed']} | {r['acc']:.1f} | {r['len']:.1f} | {r['te']:.2f} | "
                f"{r['non_thinking_ratio']:.2f} | {r['hack_rate']:.2f} | {acc} | {by} | {most} | {gaps} | {worse} | "
                f"{r['train_seconds']:.0f} |"
            )
    return "\n".join(lines) + "\n"


def _evaluated(settings: dict) -> str:
    """How a run's evaluation was taken, for the report: "" for the final model alone."""
    steps = sorted(set(settings.get("eval_steps") or ()))
    if not steps:
        return ""
    return f" at steps {', '.join(map(str, steps))}, each number the mean over those evaluations"


def _count(stat: dict) -> str:
    """k/n of a mean of 0/1 values ("-" where none)."""
    return "-" if stat["mean"] is None else f"{round(stat['mean'] * stat['n'])}/{stat['n']}"


def _train_curve(train: dict, key: str) -> list[float]:
    if key == "hacked_share":
        return [h * n for h, n in zip(train["hack_rate"], train["non_thinking_ratio"], strict=True)]
    if key == "chosen_non_thinking":  # what the model chose: of the free rows where some were forced
        free = train.get("free_non_thinking_ratio") or []
        return free if free and all(v is not None for v in free) else train["non_thinking_ratio"]
    return train[key]


def plot(summary: dict, path: Path) -> None:
    """Training curves (mean over runs, a band of +- one standard error), and by level the non-thinking ratio and
    accuracy after training with error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(15, 9), constrained_layout=True)
    axes = axes.flat
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    variants = list(summary["variants"].items())
    width = 0.8 / len(variants)
    for i, (variant, data) in enumerate(variants):
        colour = colours[i % len(colours)]
        style = "-" if i < len(colours) else "--"
        for j, key in enumerate(("hacked_share", "chosen_non_thinking")):
            curves = [_train_curve(r["train"], key) for r in data["runs"]]
            steps = data["runs"][0]["train"]["step"]
            stats = [mean_se(list(vals)) for vals in zip(*curves, strict=True)]
            mean = [st["mean"] for st in stats]
            se = [st["se"] for st in stats]
            axes[j].plot(steps, mean, color=colour, linestyle=style, linewidth=1.6, label=variant)
            axes[j].fill_between(
                steps, [m - e for m, e in zip(mean, se, strict=True)], [m + e for m, e in zip(mean, se, strict=True)],
                color=colour, alpha=0.15, linewidth=0,
            )  # fmt: skip
        by = data["stats"]["by_level"]
        levels = [int(lv) for lv in by]
        x = [lv + (i - (len(variants) - 1) / 2) * width for lv in levels]
        for ax, key, scale in ((axes[2], "non_thinking_ratio", 1.0), (axes[3], "acc", 1.0)):
            vals = [by[lv][key] for lv in by]
            ax.bar(
                x, [v["mean"] * scale for v in vals], width, yerr=[v["se"] * scale for v in vals],
                color=colour, label=variant, capsize=2, error_kw={"linewidth": 0.8},
            )  # fmt: skip
    n = summary["settings"]["seeds"] * summary["settings"]["warmup_seeds"]
    axes[0].set_title(f"hacked responses during training (share of all; mean ± SE over {n} runs)")
    axes[1].set_title("non-thinking ratio during training (of the free rows where some are forced)")
    for ax in axes[:2]:
        ax.set_xlabel("GRPO step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=7, ncol=2)
    axes[2].set_title("non-thinking ratio by level after training (eval, ± SE)")
    axes[2].set_ylim(0, 1.05)
    axes[3].set_title("accuracy (%) by level after training (eval, ± SE)")
    lows = [v["acc"]["mean"] - v["acc"]["se"] for _, d in variants for v in d["stats"]["by_level"].values()]
    axes[3].set_ylim(max(0, min(lows) - 5), 101)
    for ax in axes[2:]:
        ax.set_xlabel("level (digits per operand)")
        ax.set_xticks(levels)
        ax.grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _per_level(n: int) -> str:
    """The held-out problems per level: level 1 has about 10 in the test split (``synthetic.held_out``)."""
    return f"{n} problems per level, 10 at level 1" if n > 10 else f"{n} problems per level"
