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
from pathlib import Path

from ..config import TrainConfig
from .jobs import BuildWarmup, EvaluateWarmup, TrainAndEvaluate, run_jobs
from .plan import RUN_KEYS, SCHEME_ORDER, CompareSettings, Run, default_jobs, plan_runs, warmup_path
from .report import direct_threshold, markdown, mean_se, plot, seconds_to, steps_to_solve, summarize_runs

__all__ = ["RUN_KEYS", "SCHEME_ORDER", "CompareSettings", "Run", "default_jobs", "direct_threshold", "mean_se",
           "plan_runs", "run_compare", "seconds_to", "steps_to_solve"]  # fmt: skip


def run_compare(
    settings: CompareSettings, output_dir: Path, overrides: list[str] = (), user_variants: dict | None = None
) -> dict:
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
    # each warm-up seed's model forced into each mode, as the variants without warm-up settings of their own see it
    first_of_warmup: dict[int, TrainConfig] = {}
    for run in runs:
        first_of_warmup.setdefault(run.warmup, run.cfg)
    warmup_jobs = [
        EvaluateWarmup(w, mode, cfg, settings.eval, output_dir / "warmups" / f"w{w}")
        for w, cfg in first_of_warmup.items()
        if cfg.model.name == "tiny"
        for mode in ("thinking", "non-thinking")
    ]
    training = [TrainAndEvaluate(run, settings.eval) for run in runs]
    results = run_jobs([*warmup_jobs, *training], settings.jobs, "compare")
    warmups: dict[int, dict[str, dict]] = {}
    for job, result in zip(warmup_jobs, results[: len(warmup_jobs)], strict=True):
        warmups.setdefault(job.warmup, {})[job.mode] = result
    summary = summarize_runs(settings, runs, results[len(warmup_jobs) :], warmups)
    summary["wall_seconds"] = time.perf_counter() - start
    (output_dir / "compare.json").write_text(json.dumps(summary, indent=1))
    (output_dir / "compare.md").write_text(markdown(summary))
    plot(summary, output_dir / "compare.png")
    return summary
