"""``fasttnt eval``: accuracy, tokens, token efficiency, non-thinking ratio and hack rate of models on benchmarks.

Every (model, benchmark) result is written to ``results/`` the moment it is finished, so a crash loses only the
benchmark in progress and a rerun with the same output directory skips what is done (when its settings match).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm.auto import tqdm

from . import files, scoring
from .data import (
    DATASETS,
    SYNTHETIC,
    DataError,
    Problem,
    PromptMode,
    build_prompt,
    dataset_style,
    load_problems,
    loading_model,
    think_end_token_id,
)
from .distributed import local_device
from .embedded.synthetic import held_out
from .engines import EngineSettings, build_engine
from .engines.sampler import step_seed
from .eval_settings import BENCHMARK_ORDER, MATH_MAX_NEW_TOKENS, EvalSettings
from .metrics import rollout_metrics, to_floats, token_efficiency
from .rewards import RewardConfig
from .verify import VerifierPool

PAPER_MEAN = ("aime24", "aime25", "amc23", "minerva", "olympiad")
"""The five math sets whose mean the TNT paper reports (AIME24, AIME25, AMC23, Minerva, OlympiadBench); MATH-500 and
GPQA-Diamond are reported beside it, not averaged in. With none of them evaluated, the mean is over all."""


def default_max_new_tokens(benchmarks: list[str]) -> int:
    """The length budget where none is given: the synthetic task's (``EvalSettings.max_new_tokens``) when it is the
    only benchmark, else the math sets' (``MATH_MAX_NEW_TOKENS``)."""
    return EvalSettings.max_new_tokens if benchmarks == [SYNTHETIC] else MATH_MAX_NEW_TOKENS


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "__", name.strip("/")) or "model"


def load_benchmark(name: str, settings: EvalSettings) -> list[Problem]:
    """A registered set, ``synthetic`` (the held-out split, levels 1-4), or a local file named by its path."""
    if name == SYNTHETIC:
        items = held_out(settings.synthetic_per_level, seed=settings.seed, weights=settings.synthetic_level_weights)
        problems = [Problem(p.problem, p.answer, p.level) for p in items]
    elif name in DATASETS or Path(name).suffix in (".jsonl", ".json", ".parquet"):
        problems = load_problems(name)
    else:
        raise DataError(f"{name}: not a benchmark; use synthetic, {', '.join(BENCHMARK_ORDER)} or a local file")
    return problems[: settings.limit] if settings.limit else problems


def _open_engine(name: str, device: torch.device, settings: EvalSettings):
    """The rollout engine and tokenizer of one model, built once and used for every benchmark: a vLLM engine
    holds most of the GPU, and a second one in the same process fails vLLM's memory check until the first is
    closed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = None
    with loading_model(f"--model {name}"):
        tokenizer = AutoTokenizer.from_pretrained(name)
        if settings.engine != "vllm":  # vLLM loads the weights itself
            dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
            model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype).to(device).eval()
    engine_settings = EngineSettings(
        max_new_tokens=settings.max_new_tokens,
        temperature=settings.temperature,
        top_p=settings.top_p,
        model_path=name,  # max_model_len: the model's own
        seed=settings.seed,
        dtype="bfloat16" if device.type == "cuda" else "float32",
        device=device,
        gpu_memory_utilization=0.8,
        forbid_think_end_first=settings.mode == PromptMode.THINKING.value,
    )
    return build_engine(settings.engine, model, tokenizer, engine_settings), tokenizer


def evaluate_one(
    engine, tokenizer, name: str, problems: list[Problem], settings: EvalSettings, pool
) -> tuple[dict, list]:
    """Metrics of one model (its rollout engine) on one benchmark, and every response as a record."""
    style = dataset_style(name)  # the instruction and hack markers training on this set would use
    think_end_id = think_end_token_id(tokenizer)
    records: list[dict] = []
    k = settings.samples
    for start in range(0, len(problems), settings.batch_prompts):
        chunk = problems[start : start + settings.batch_prompts]
        prompts = [
            build_prompt(
                tokenizer,
                p.problem,
                PromptMode(settings.mode),
                instruction=style.instruction,
                style=settings.prompt_style,
            )
            for p in chunk
        ]
        batch = engine.generate(prompts, k, seed=step_seed(settings.seed, start))
        golds = [p.answer for p in chunk for _ in range(k)]
        scores = scoring.score(
            tokenizer,
            batch,
            golds,
            eos_ids=engine.eos_ids,
            pool=pool,
            reward=RewardConfig(),
            think_end_id=think_end_id,
            markers=style.markers,
        )
        truncated, correct = batch.truncated.tolist(), scores.judged.correct.tolist()
        modes, hacked = scores.rewards.non_thinking.tolist(), scores.hacked.tolist()
        lengths = batch.lengths.tolist()
        for i, text in enumerate(scores.judged.texts):
            p = chunk[i // k]
            records.append(
                {
                    "problem": p.problem,
                    "answer": p.answer,
                    "level": p.level,
                    "sample": i % k,
                    "response": text,
                    "non_thinking": modes[i],
                    "tokens": lengths[i],
                    "correct": bool(correct[i]),
                    "hacked": hacked[i],
                    "truncated": truncated[i],
                }
            )
    return summarize(records), records


def summarize(records: list[dict]) -> dict:
    """The metrics of a set of response records (the same code recomputes them from a saved jsonl)."""

    def metrics_of(rows: list[dict]) -> dict:
        values = to_floats(
            rollout_metrics(
                correct=torch.tensor([r["correct"] for r in rows]),
                non_thinking=torch.tensor([r["non_thinking"] for r in rows]),
                lengths=torch.tensor([r["tokens"] for r in rows]),
                hacked=torch.tensor([r["hacked"] for r in rows]),
                truncated=torch.tensor([r["truncated"] for r in rows]),
            )
        )
        acc = 100 * values["acc"]
        by_mode = {
            mode: [r["correct"] for r in rows if bool(r["non_thinking"]) == direct]
            for mode, direct in (("thinking", False), ("non_thinking", True))
        }
        return {
            "acc": acc,
            "len": values["len"],
            "te": token_efficiency(acc, values["len"]),
            "non_thinking_ratio": values["non_thinking_ratio"],
            "hack_rate": values["hack_rate"],
            "len_thinking": values["len_thinking"],
            "len_non_thinking": values["len_non_thinking"],
            "truncated_ratio": values["truncated_ratio"],
            # accuracy (%) among the responses of each mode; None where the model chose that mode for none
            **{f"acc_{mode}": 100 * sum(c) / len(c) if c else None for mode, c in by_mode.items()},
            # the share (%) right without writing thinking after </think> (a hacked right answer does not count)
            "acc_honest": 100 * sum(r["correct"] and not r["hacked"] for r in rows) / max(len(rows), 1),
            "responses": len(rows),
        }

    out = metrics_of(records)
    levels = sorted({r["level"] for r in records if r["level"] is not None})
    if levels:
        out["by_level"] = {str(lv): metrics_of([r for r in records if r["level"] == lv]) for lv in levels}
    return out


def run_eval(
    models: list[str],
    benchmarks: list[str],
    settings: EvalSettings,
    output_dir: Path,
    *,
    save_responses: bool = False,
    device: torch.device | None = None,
) -> dict:
    device = device or local_device("cuda" if torch.cuda.is_available() else "cpu")
    output_dir.mkdir(parents=True, exist_ok=True)
    # every benchmark is loaded, and so checked, before any generation starts
    problem_sets = {name: load_benchmark(name, settings) for name in benchmarks}
    results: dict[str, dict[str, dict]] = {}
    pool = VerifierPool(workers=2)
    try:
        for model_name in models:
            results[model_name] = _eval_model(
                model_name, benchmarks, problem_sets, settings, output_dir, pool, device, save_responses
            )
    finally:
        pool.close()
    averaged = mean_over(benchmarks)
    report = {"settings": asdict(settings), "benchmarks": benchmarks, "mean_over": averaged, "results": results,
              "mean": {name: benchmark_mean(per_bench, averaged) for name, per_bench in results.items()}}  # fmt: skip
    files.write_text(output_dir / "eval.json", json.dumps(report, indent=1))
    files.write_text(output_dir / "eval.md", markdown_table(report))
    plot_eval(report, output_dir / "eval.png")
    return report


def mean_over(benchmarks: list[str]) -> list[str]:
    """The benchmarks the mean is over: the paper's five math sets among them (``PAPER_MEAN``), else all."""
    return [b for b in benchmarks if b in PAPER_MEAN] or list(benchmarks)


def benchmark_mean(per_bench: dict[str, dict], averaged: list[str]) -> dict:
    """Accuracy, tokens, non-thinking ratio and hack rate averaged over ``averaged``, and the TE of the means."""
    means = {key: sum(per_bench[b][key] for b in averaged) / len(averaged)
             for key in ("acc", "len", "non_thinking_ratio", "hack_rate")}  # fmt: skip
    return {**means, "te": token_efficiency(means["acc"], means["len"])}


def _eval_model(
    model_name: str, benchmarks, problem_sets, settings: EvalSettings, output_dir: Path, pool, device, save_responses
) -> dict[str, dict]:
    """One model on every benchmark not done before: its engine is built at the first one that needs it, reused,
    and closed (its GPU memory freed) before the next model's."""
    slug = _slug(model_name)
    identity = {"settings": asdict(settings), "model": model_fingerprint(model_name)}
    results: dict[str, dict] = {}
    engine = tokenizer = None
    try:
        for bench in benchmarks:
            path = output_dir / "results" / slug / f"{_slug(bench)}.json"
            if path.is_file():
                saved = json.loads(path.read_text())
                if {k: saved.get(k) for k in identity} == identity:
                    results[bench] = saved["metrics"]
                    tqdm.write(f"{model_name} / {bench}: done before, skipped ({path})")
                    continue
            if engine is None:
                engine, tokenizer = _open_engine(model_name, device, settings)
            tqdm.write(f"{model_name} / {bench}: {len(problem_sets[bench])} problems x {settings.samples} samples")
            metrics, records = evaluate_one(engine, tokenizer, bench, problem_sets[bench], settings, pool)
            if save_responses:
                rpath = output_dir / "responses" / slug / f"{_slug(bench)}.jsonl"
                files.write_text(rpath, "".join(json.dumps(r) + "\n" for r in records))
            files.write_text(path, json.dumps({**identity, "metrics": metrics}, indent=1))
            results[bench] = metrics
    finally:
        if engine is not None:
            engine.close()
    return results


def model_fingerprint(name: str) -> str:
    """What a result was computed from: a local folder's config and weight files (size and time), or the hub id.
    A model retrained into the same folder is therefore evaluated again."""
    folder = Path(name)
    if not folder.is_dir():
        return name
    parts = [(folder / "config.json").read_text() if (folder / "config.json").is_file() else ""]
    for f in sorted(folder.glob("*.safetensors")):
        stat = f.stat()
        parts.append(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def markdown_table(report: dict) -> str:
    """One row per model: accuracy (%) and mean tokens per benchmark, then the means (over the paper's five math
    sets where they were evaluated), TE, non-thinking ratio and hack rate, as the TNT paper reports."""
    benches, averaged = report["benchmarks"], report["mean_over"]
    # the benchmarks averaged first, then the ones reported beside them
    benches = [b for b in benches if b in averaged] + [b for b in benches if b not in averaged]
    over = "the paper's five" if set(averaged) == set(PAPER_MEAN) else ", ".join(averaged)
    head = ["model", *[f"{b} acc / len" + ("" if b in averaged else " (not in the mean)") for b in benches],
            f"mean acc ({over})", "mean len", "TE", "non-thinking", "hack rate"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for model_name, per_bench in report["results"].items():
        mean = report["mean"][model_name]
        cells = [f"{per_bench[b]['acc']:.1f} / {per_bench[b]['len']:.0f}" for b in benches]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"`{model_name}`",
                    *cells,
                    f"{mean['acc']:.1f}",
                    f"{mean['len']:.0f}",
                    f"{mean['te']:.2f}",
                    f"{mean['non_thinking_ratio']:.2f}",
                    f"{mean['hack_rate']:.2f}",
                ]
            )
            + " |"
        )
    s = report["settings"]
    lines.append("")
    lines.append(
        f"{s['samples']} samples per problem (accuracy is their mean), mode {s['mode']}, temperature "
        f"{s['temperature']}, top-p {s['top_p']}, at most {s['max_new_tokens']} new tokens; TE = acc / sqrt(len)."
    )
    synthetic = [m for m, per in report["results"].items() if "by_level" in per.get(SYNTHETIC, {})]
    if synthetic:
        levels = sorted(report["results"][synthetic[0]][SYNTHETIC]["by_level"], key=int)
        lines += ["", "Synthetic task by level (digits per operand): accuracy % / non-thinking ratio", ""]
        lines.append("| model | " + " | ".join(f"level {lv}" for lv in levels) + " |")
        lines.append("|" + " --- |" * (len(levels) + 1))
        for m in synthetic:
            by = report["results"][m][SYNTHETIC]["by_level"]
            cells = [f"{by[lv]['acc']:.0f} / {by[lv]['non_thinking_ratio']:.2f}" for lv in levels]
            lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _label(model_name: str) -> str:
    """The last two path parts: ``runs/tnt/final`` -> ``tnt/final``."""
    return "/".join(Path(model_name).parts[-2:]) or model_name


def plot_eval(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    synthetic = [m for m, per in report["results"].items() if "by_level" in per.get(SYNTHETIC, {})]
    fig, axes = plt.subplots(1, 2 if synthetic else 1, figsize=(11 if synthetic else 6, 4.5), constrained_layout=True)
    axes = list(axes) if synthetic else [axes]
    ax = axes[0]
    for model_name, mean in report["mean"].items():
        ax.scatter(mean["len"], mean["acc"], s=60)
        ax.annotate(
            Path(model_name).name or model_name,
            (mean["len"], mean["acc"]),
            fontsize=8,
            xytext=(4, 4),
            textcoords="offset points",
        )
    ax.set_xlabel("mean tokens")
    ax.set_ylabel("accuracy (%)")
    ax.set_title(f"accuracy vs. tokens (mean over {', '.join(report['mean_over'])})")
    ax.grid(alpha=0.3)
    if synthetic:
        ax = axes[1]
        for m in synthetic:
            by = report["results"][m][SYNTHETIC]["by_level"]
            levels = sorted(by, key=int)
            ax.plot(
                [int(lv) for lv in levels],
                [by[lv]["non_thinking_ratio"] for lv in levels],
                marker="o",
                label=Path(m).name or m,
            )
        ax.set_xlabel("level (digits per operand)")
        ax.set_xticks([int(lv) for lv in levels])
        ax.set_ylabel("non-thinking ratio")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title("non-thinking ratio by difficulty (synthetic)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
