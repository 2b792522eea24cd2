"""``fasttnt compare``'s work: each job a typed unit (build a warm-up, evaluate a warm-up forced to one mode,
train and evaluate one run), run inline or in worker processes with one thread count each. A run with rollout
workers is launched as a world of its own (``train``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path

from tqdm.auto import tqdm

from .. import distributed
from ..checkpoint import checkpoint_paths
from ..config import TrainConfig, dump_config
from ..evaluate import SYNTHETIC, EvalSettings, run_eval
from ..metrics import token_efficiency
from ..trainer import Trainer
from .plan import Run, fingerprint, trained_before


def warmup_model(cfg: TrainConfig) -> str:
    """The warm-up a run starts from, built (and cached) if needed; its folder, or the model name for hub models."""
    if cfg.model.name != "tiny":
        return cfg.model.name
    from ..embedded.tiny import warmed_up_model

    _, _, path = warmed_up_model(Path(cfg.cache_dir).expanduser(), cfg.model.tiny, cfg.warmup)
    return str(path)


@dataclass(frozen=True)
class BuildWarmup:
    """Train (and cache) one warm-up."""

    cfg: TrainConfig
    label: str

    def __call__(self, progress: bool) -> str:
        return warmup_model(self.cfg)


@dataclass(frozen=True)
class EvaluateWarmup:
    """Warm-up ``warmup``'s synthetic evaluation forced to one mode ("thinking" or "non-thinking")."""

    warmup: int
    mode: str
    cfg: TrainConfig
    eval: EvalSettings
    out: Path

    @property
    def label(self) -> str:
        return f"warm-up {self.warmup}, {self.mode}"

    def __call__(self, progress: bool) -> dict:
        model = warmup_model(self.cfg)
        report = run_eval([model], [SYNTHETIC], replace(self.eval, mode=self.mode), self.out / self.mode)
        return report["results"][model][SYNTHETIC]


@dataclass(frozen=True)
class TrainAndEvaluate:
    """One run: trained (unless its ``final/`` was trained with this config before), then evaluated on the
    synthetic split at each of ``steps`` (its checkpoints; the last step's model is ``final/``; an evaluation done
    before is kept); its evaluation (the mean over the steps, ``mean_evaluation``), each step's, and the seconds
    it took."""

    run: Run
    eval: EvalSettings
    eval_dir: str = "eval"  # under the run's folder: one per evaluation temperature
    steps: tuple[int, ...] = ()  # (): the final model alone

    @property
    def label(self) -> str:
        return self.run.name

    def __call__(self, progress: bool) -> dict:
        run, start = self.run, time.perf_counter()
        if trained_before(run):
            tqdm.write(f"{run.name}: trained before with this config, kept ({run.out})")
        else:
            shutil.rmtree(run.out, ignore_errors=True)  # interrupted, or trained with other settings: start over
            train(run, progress)
            (run.out / "compare_run.json").write_text(json.dumps({"config_sha256": fingerprint(run.cfg)}))
        by_step = {}
        for step in self.steps or (run.cfg.steps,):
            model = run.out / "final" if step == run.cfg.steps else checkpoint_paths(run.out / "checkpoints", step)[0]
            if not (model / "config.json").is_file():
                raise FileNotFoundError(f"{run.name}: no model of step {step} to evaluate at {model}")
            out = run.out / self.eval_dir if not self.steps else run.out / self.eval_dir / f"step-{step}"
            by_step[step] = run_eval([str(model)], [SYNTHETIC], self.eval, out)["results"][str(model)][SYNTHETIC]
        metrics = mean_evaluation(list(by_step.values()))
        return {"metrics": metrics, "by_step": by_step, "seconds": time.perf_counter() - start}


def train(run: Run, progress: bool) -> None:
    """Train one run: in this process, or, with rollout workers (ranks of their own: ``rollout.workers``), as a
    world of its own launched by torchrun, the job's threads shared among its processes (at least one each); its
    output in ``launch.log`` beside its metrics."""
    if not run.cfg.rollout.workers:
        Trainer(run.cfg, run.out, progress=progress).run()
        return
    import torch

    run.out.mkdir(parents=True)
    config, log = run.out / "launch.yaml", run.out / "launch.log"
    dump_config(run.cfg, config)
    port = distributed.free_port()  # a launch that loses it to another process fails, named below
    ranks = run.cfg.rollout.workers + 1
    launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", f"--master-port={port}"]
    command = [*launcher, "-m", "fasttnt.cli", "train", "--config", str(config), "--output-dir", str(run.out)]
    threads = max(1, torch.get_num_threads() // ranks)
    with open(log, "w") as out:
        code = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=out,
                              stderr=subprocess.STDOUT).returncode  # fmt: skip
    if code != 0:
        raise RuntimeError(f"{run.name}: its launched training failed (exit {code}); its output: {log}")


def mean_evaluation(evaluations: list[dict]) -> dict:
    """The mean of evaluations (``evaluate.summarize``'s dicts): each number the mean of the evaluations that have
    it (None where none does), nested dicts (``by_level``) key by key, and the token efficiency that of the mean
    accuracy and length; one evaluation is itself."""
    if len(evaluations) == 1:
        return evaluations[0]
    out = {}
    for key, first in evaluations[0].items():
        values = [e.get(key) for e in evaluations]
        if isinstance(first, dict):
            out[key] = mean_evaluation(values)
        elif isinstance(first, bool) or not all(v is None or isinstance(v, int | float) for v in values):
            out[key] = first  # a label or a count of the split, the same in each
        else:
            numbers = [v for v in values if v is not None]
            out[key] = sum(numbers) / len(numbers) if numbers else None
    if "te" in out and out.get("acc") is not None and out.get("len") is not None:
        out["te"] = token_efficiency(out["acc"], out["len"])
    return out


def _in_worker(job, threads: int | None):
    """A job in a worker process, with its share of the cores (one thread count per job, so jobs share them)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    return job(progress=threads is None)


def run_jobs(jobs: list, n_jobs: int, desc: str) -> list:
    """The jobs' results, in order: inline when ``n_jobs`` is 1, else in worker processes."""
    results: list = [None] * len(jobs)
    bar = tqdm(total=len(jobs), desc=desc, unit="job")
    try:
        if n_jobs <= 1 or len(jobs) <= 1:
            for i, job in enumerate(jobs):
                results[i] = _in_worker(job, None)
                bar.update(1)
            return results
        workers = min(n_jobs, len(jobs))
        threads = max(1, (os.cpu_count() or 1) // workers)
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"))
        try:
            futures = {pool.submit(_in_worker, job, threads): i for i, job in enumerate(jobs)}
            for future in as_completed(futures):
                i = futures[future]
                results[i] = future.result()  # a failed job raises here, naming its traceback
                bar.update(1)
                tqdm.write(f"{jobs[i].label}: done")
        except BaseException:
            # a failed run (or Ctrl-C) ends the command now, not after every queued run; finished runs are kept
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return results
    finally:
        bar.close()
