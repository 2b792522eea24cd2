"""``fasttnt compare``: the TNT paper in miniature, and what it left open. The embedded model is trained from
shared warm-ups with each variant (a reward scheme, optionally DAPO or Dr. GRPO, optionally other parameters:
``fasttnt.variants``), over several warm-up seeds and training seeds; every run is evaluated on the synthetic
held-out split, and every number is reported as a mean with its standard error over the runs.

Why several warm-ups: the warm-up decides how well the model can answer each level directly, and the reward table
decides when a direct answer pays. With the paper's table (thinking 1/0, direct 2/-1) a direct answer is worth
more on average when its accuracy p_d exceeds (1 + p_t) / 3, p_t the thinking accuracy; TNT stops the hack (a
"direct" answer that thinks anyway), not that trade. Each warm-up is therefore also evaluated forced to think and
forced to answer directly, and the report shows the threshold beside what each variant chose.

Runs are independent processes (``--jobs``); each run and each evaluation is kept under the output directory when
it finishes, so a rerun skips them.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

from ..config import TrainConfig
from .jobs import BuildWarmup, EvaluateWarmup, TrainAndEvaluate, run_jobs
from .plan import RUN_KEYS, SCHEME_ORDER, CompareSettings, Run, default_jobs, plan_runs, warmup_path
from .report import (
    direct_threshold,
    markdown,
    mean_se,
    plot,
    preferred_mode,
    seconds_to,
    stability,
    steps_to_solve,
    summarize_runs,
)

__all__ = ["RUN_KEYS", "SCHEME_ORDER", "CompareSettings", "Run", "default_jobs", "direct_threshold", "mean_se",
           "plan_runs", "preferred_mode", "run_compare", "seconds_to", "stability", "steps_to_solve"]  # fmt: skip


def run_compare(
    settings: CompareSettings, output_dir: Path, overrides: list[str] = (), user_variants: dict | None = None
) -> dict:
    """Train every run once, evaluate them at ``settings.eval``'s temperature (compare.json, .md, .png) and at each
    of ``settings.temperatures`` (compare_T<t>.json, .md, .png; the runs' evaluations in eval_T<t>/); returns the
    first report."""
    output_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    runs = plan_runs(settings, output_dir, list(overrides), user_variants)
    # every distinct warm-up not cached yet first (one job each; a variant may change the warm-up), so parallel runs
    # never build the same one at once
    missing: dict[Path, TrainConfig] = {}
    for run in runs:
        path = warmup_path(run.cfg)
        if path is not None and not (path / "config.json").is_file():
            missing.setdefault(path, run.cfg)
    if missing:
        run_jobs([BuildWarmup(cfg, f"warm-up {p.name}") for p, cfg in missing.items()], settings.jobs, "warm-ups")
    first = None
    for i, temperature in enumerate(dict.fromkeys((settings.eval.temperature, *settings.temperatures))):
        at = replace(settings, eval=replace(settings.eval, temperature=temperature))
        suffix = "" if i == 0 else f"_T{temperature:g}"
        summary = _train_and_evaluate(at, runs, output_dir, suffix)
        summary["wall_seconds"] = time.perf_counter() - start
        (output_dir / f"compare{suffix}.json").write_text(json.dumps(summary, indent=1))
        (output_dir / f"compare{suffix}.md").write_text(markdown(summary))
        plot(summary, output_dir / f"compare{suffix}.png")
        first = first or summary
    return first


def _train_and_evaluate(settings: CompareSettings, runs: list[Run], output_dir: Path, suffix: str) -> dict:
    """The runs trained (those trained before with their config kept) and evaluated at ``settings.eval``, and each
    warm-up forced into each mode, as the variants without warm-up settings of their own see it; the summary."""
    first_of_warmup: dict[int, TrainConfig] = {}
    for run in runs:
        first_of_warmup.setdefault(run.warmup, run.cfg)
    warmup_jobs = [
        EvaluateWarmup(w, mode, cfg, settings.eval, output_dir / f"warmups{suffix}" / f"w{w}")
        for w, cfg in first_of_warmup.items()
        if cfg.model.name == "tiny"
        for mode in ("thinking", "non-thinking")
    ]
    steps = settings.eval_steps and settings.evaluated_steps  # (): the final model alone, in eval{suffix}/ itself
    training = [TrainAndEvaluate(run, settings.eval, f"eval{suffix}", steps) for run in runs]
    results = run_jobs([*warmup_jobs, *training], settings.jobs, "compare" + (f" ({suffix[1:]})" if suffix else ""))
    warmups: dict[int, dict[str, dict]] = {}
    for job, result in zip(warmup_jobs, results[: len(warmup_jobs)], strict=True):
        warmups.setdefault(job.warmup, {})[job.mode] = result
    return summarize_runs(settings, runs, results[len(warmup_jobs) :], warmups)
