"""``fasttnt compare``: the TNT paper in miniature. The embedded model is trained from one shared warm-up with each
reward scheme (same steps, seeds and prompts; the schemes differ only in the reward), each result is evaluated on
the synthetic held-out split, and the table and figure say which scheme hacks, which over-thinks, and which
learns when to think.

Each run and each evaluation is kept under the output directory when it finishes, so a rerun skips them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from .config import load_config, to_dict
from .evaluate import SYNTHETIC, EvalSettings, run_eval
from .trainer import Trainer, _read_jsonl

SCHEME_ORDER = ("tnt", "no-limit", "uniform-limit", "binary")
TABLE_KEYS = ("acc", "len", "te", "non_thinking_ratio", "hack_rate", "len_non_thinking")


@dataclass(frozen=True)
class CompareSettings:
    schemes: tuple[str, ...] = SCHEME_ORDER
    seeds: int = 2
    steps: int = 80
    # one cap for every query: longer than any honest direct answer (11-14 tokens with EOS) and shorter than every
    # 3- or 4-digit hacked one (40+ tokens), but not than most 2-digit hacks (29-35): it stops some hacks and not
    # others, as a uniform cap does
    uniform_limit: float = 32.0
    eval: EvalSettings = field(
        default_factory=lambda: EvalSettings(samples=4, max_new_tokens=96, synthetic_per_level=50)
    )


def run_dir(output_dir: Path, scheme: str, seed: int) -> Path:
    return output_dir / "runs" / f"{scheme}-seed{seed}"


def train_all(settings: CompareSettings, output_dir: Path, overrides: list[str]) -> dict[tuple[str, int], Path]:
    """Train every (scheme, seed), skipping those whose ``final/`` already exists; returns their output folders."""
    done: dict[tuple[str, int], Path] = {}
    for seed in range(settings.seeds):
        for scheme in settings.schemes:
            out = run_dir(output_dir, scheme, seed)
            key = (scheme, seed)
            cfg = load_config(
                None,
                [
                    *overrides,
                    f"steps={settings.steps}",
                    f"save_every={settings.steps}",
                    f"seed={seed}",
                    f"reward.scheme={scheme}",
                    f"reward.uniform_limit={settings.uniform_limit}",
                ],
            )
            # the run's identity is its resolved config: a finished run is kept only if it was trained with it
            fingerprint = hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()
            stamp = out / "compare_run.json"
            finished = (out / "final" / "config.json").is_file() and stamp.is_file()
            if finished and json.loads(stamp.read_text()).get("config_sha256") == fingerprint:
                tqdm.write(f"{scheme} seed {seed}: trained before with this config, kept ({out})")
                done[key] = out
                continue
            shutil.rmtree(out, ignore_errors=True)  # interrupted, or trained with other settings: start over
            tqdm.write(f"{scheme} seed {seed}: {settings.steps} GRPO steps -> {out}")
            Trainer(cfg, out).run()
            stamp.write_text(json.dumps({"config_sha256": fingerprint}))
            done[key] = out
    return done


def summarize_runs(settings: CompareSettings, runs: dict[tuple[str, int], Path], report: dict) -> dict:
    """compare.json's content: per scheme, every seed's evaluation and training curves, and their means."""
    out: dict = {"settings": {**settings.__dict__, "eval": settings.eval.__dict__}, "schemes": {}}
    for scheme in settings.schemes:
        seeds = []
        for seed in range(settings.seeds):
            path = runs[(scheme, seed)]
            metrics = report["results"][str(path / "final")][SYNTHETIC]
            rows = _read_jsonl(path / "metrics.jsonl")
            seeds.append(
                {
                    "seed": seed,
                    **{k: metrics[k] for k in TABLE_KEYS},
                    "non_thinking_ratio_by_level": {
                        lv: m["non_thinking_ratio"] for lv, m in metrics["by_level"].items()
                    },
                    "acc_by_level": {lv: m["acc"] for lv, m in metrics["by_level"].items()},
                    "train": {
                        key: [r[key] for r in rows]
                        for key in ("step", "reward", "acc", "non_thinking_ratio", "hack_rate", "len")
                    },
                }
            )
        n = len(seeds)
        levels = sorted(seeds[0]["non_thinking_ratio_by_level"], key=int)
        out["schemes"][scheme] = {
            "mean": {
                **{k: sum(s[k] for s in seeds) / n for k in TABLE_KEYS},
                "non_thinking_ratio_by_level": {
                    lv: sum(s["non_thinking_ratio_by_level"][lv] for s in seeds) / n for lv in levels
                },
                "acc_by_level": {lv: sum(s["acc_by_level"][lv] for s in seeds) / n for lv in levels},
            },
            "seeds": seeds,
        }
    return out


def markdown(summary: dict) -> str:
    s = summary["settings"]
    lines = [
        "| scheme | acc (%) | len | TE | non-thinking | hack rate | len non-thinking "
        "| non-thinking by level 1 / 2 / 3 / 4 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for scheme, data in summary["schemes"].items():
        m = data["mean"]
        by = " / ".join(f"{v:.2f}" for v in m["non_thinking_ratio_by_level"].values())
        lines.append(
            f"| {scheme} | {m['acc']:.1f} | {m['len']:.1f} | {m['te']:.2f} | {m['non_thinking_ratio']:.2f} | "
            f"{m['hack_rate']:.2f} | {m['len_non_thinking']:.1f} | {by} |"
        )
    lines += [
        "",
        f"Means over {s['seeds']} seeds; each seed's run: the shared warm-up, then {s['steps']} GRPO steps, evaluated "
        f"on the synthetic held-out split ({s['eval']['synthetic_per_level']} problems per level, 10 at level 1; "
        f"{s['eval']['samples']} samples each, temperature {s['eval']['temperature']}). uniform-limit caps every "
        f"non-thinking response at {s['uniform_limit']:.0f} tokens. Hack rate: the share of non-thinking responses "
        "that write column steps after </think>.",
        "",
        "Per seed:",
        "",
        "| scheme | seed | acc (%) | len | TE | non-thinking | hack rate | len non-thinking |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for scheme, data in summary["schemes"].items():
        for r in data["seeds"]:
            lines.append(
                f"| {scheme} | {r['seed']} | {r['acc']:.1f} | {r['len']:.1f} | {r['te']:.2f} | "
                f"{r['non_thinking_ratio']:.2f} | {r['hack_rate']:.2f} | {r['len_non_thinking']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _train_curve(train: dict, key: str) -> list[float]:
    if key == "hacked_share":
        return [h * n for h, n in zip(train["hack_rate"], train["non_thinking_ratio"], strict=True)]
    return train[key]


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (scheme, data) in enumerate(summary["schemes"].items()):
        colour = colours[i % len(colours)]
        for j, key in enumerate(("hacked_share", "non_thinking_ratio")):
            ax = axes[j]
            curves = [_train_curve(r["train"], key) for r in data["seeds"]]
            steps = data["seeds"][0]["train"]["step"]
            for c in curves:
                ax.plot(steps, c, color=colour, alpha=0.25, linewidth=0.8)
            mean = [sum(vals) / len(vals) for vals in zip(*curves, strict=True)]
            ax.plot(steps, mean, color=colour, linewidth=2, label=scheme)
        by = data["mean"]["non_thinking_ratio_by_level"]
        levels = [int(lv) for lv in by]
        width = 0.8 / len(summary["schemes"])
        axes[2].bar([lv + (i - 1.5) * width for lv in levels], list(by.values()), width, color=colour, label=scheme)
    # hack rate x non-thinking ratio: the hack rate alone swings 0 <-> 1 when a scheme has one or two
    # non-thinking responses in a step (binary), which says nothing
    axes[0].set_title(
        "hacked responses during training (non-thinking ones\nthat write steps after </think>, share of all)"
    )
    axes[1].set_title("non-thinking ratio during training")
    for ax in axes[:2]:
        ax.set_xlabel("GRPO step")
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[2].set_title("non-thinking ratio by difficulty after training (eval)")
    axes[2].set_xlabel("level (digits per operand)")
    axes[2].set_xticks(levels)
    axes[2].set_ylim(0, 1.02)
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3, axis="y")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_compare(settings: CompareSettings, output_dir: Path, overrides: list[str] = ()) -> dict:
    output_dir.mkdir(parents=True, exist_ok=True)
    runs = train_all(settings, output_dir, list(overrides))
    models = [str(runs[(scheme, seed)] / "final") for seed in range(settings.seeds) for scheme in settings.schemes]
    report = run_eval(models, [SYNTHETIC], settings.eval, output_dir / "eval")
    summary = summarize_runs(settings, runs, report)
    (output_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    (output_dir / "compare.md").write_text(markdown(summary))
    plot(summary, output_dir / "compare.png")
    return summary
