"""Weights & Biases logging (``logging.wandb``): a run's metrics, config, curves and eval table, from the main rank.

The run's W&B id is kept in ``<output dir>/wandb_run_id``: ``--resume`` continues that W&B run, and ``fasttnt eval``
of the run's ``final/`` (or a checkpoint) puts its table in that run's summary. ``wandb`` is imported only when
asked for (the ``wandb`` extra); ``WANDB_MODE=offline`` writes the run under ``<output dir>/wandb`` for
``wandb sync``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import files
from .config import LoggingConfig, TrainConfig, to_dict
from .typed_yaml import build, read_yaml_mapping

RUN_ID_FILE = "wandb_run_id"


class WandbMissing(RuntimeError):
    """``logging.wandb`` is on and the ``wandb`` package is not installed."""


def import_wandb():
    """The wandb module, imported here so that a run without ``logging.wandb`` never loads it."""
    try:
        import wandb
    except ImportError:
        raise WandbMissing("logging.wandb=true needs the wandb package: pip install 'fasttnt[wandb]'") from None
    return wandb


class WandbRun:
    """One W&B run of a training run's output directory."""

    def __init__(self, run, wandb) -> None:
        self.run, self._wandb = run, wandb

    @classmethod
    def start(cls, cfg: TrainConfig, out: Path, *, resume: bool) -> WandbRun:
        """The W&B run of ``out``: a new one (its id written to ``out/wandb_run_id``), or on ``resume`` the one
        whose id that file holds; the resolved config as its config."""
        wandb = import_wandb()
        id_file = out / RUN_ID_FILE
        run_id = id_file.read_text().strip() if resume and id_file.is_file() else None  # None: wandb makes one
        run = _init(wandb, cfg.logging, out, run_id, name=cfg.logging.name or out.resolve().name, config=to_dict(cfg))
        files.write_text(id_file, run.id + "\n")
        return cls(run, wandb)

    @classmethod
    def of_run_dir(cls, out: Path) -> WandbRun | None:
        """The W&B run a training run logged to (its config.yaml with ``logging.wandb`` on, and its id file),
        continued; None when that run did not log to W&B. Only config.yaml's ``logging`` section is read: the
        run's data and model files need not be where they were."""
        id_file, config = out / RUN_ID_FILE, out / "config.yaml"
        if not (id_file.is_file() and config.is_file()):
            return None
        tree = read_yaml_mapping(config, str(config), "the run's resolved config")
        settings = build(LoggingConfig, tree.get("logging") or {}, "logging.")
        if not settings.wandb:
            return None
        wandb = import_wandb()
        run = _init(wandb, settings, out, id_file.read_text().strip(), name=settings.name or out.resolve().name)
        return cls(run, wandb)

    def log_row(self, row: dict[str, float]) -> None:
        """One metrics.jsonl row, under its own names, at its step."""
        self.run.log(dict(row), step=int(row["step"]))

    def log_image(self, key: str, path: Path, step: int) -> None:
        self.run.log({key: self._wandb.Image(str(path))}, step=step)

    def set_summary(self, values: dict[str, Any]) -> None:
        """Values of the run as a whole (its summary, not its step history: a run continued offline does not know
        the step it had reached); a ``(columns, rows)`` pair becomes a table."""
        for key, value in values.items():
            is_table = isinstance(value, tuple)
            self.run.summary[key] = self._wandb.Table(columns=value[0], data=value[1]) if is_table else value

    def finish(self) -> None:
        self.run.finish()


def _init(wandb, settings: LoggingConfig, out: Path, run_id: str | None, *, name: str, config: dict | None = None):
    return wandb.init(
        project=settings.project,
        entity=settings.entity,
        name=name,
        group=settings.group,
        tags=list(settings.tags),
        config=config,
        id=run_id,
        resume="allow",  # the id's run continued when it exists, else started under it
        # the user's WANDB_DIR where set (clusters point it at a disk with room, as for TRL's and verl's runs),
        # else the run's output folder; passed, not left to wandb, whose settings outlive a run in its process
        dir=os.environ.get("WANDB_DIR") or str(out),
    )


def training_run_of(model: str) -> Path | None:
    """The output directory of the training run a model folder comes from (its ``final/`` or a checkpoint under
    ``checkpoints/``), when that run has a W&B id; else None."""
    folder = Path(model).expanduser()
    for run_dir in (folder.parent, folder.parent.parent):
        if (run_dir / RUN_ID_FILE).is_file():
            return run_dir
    return None


def eval_table(report: dict, model: str) -> tuple[list[str], list[list[Any]]]:
    """``model``'s rows of a ``fasttnt eval`` report (``fasttnt.evaluate.run_eval``): one per benchmark and one for
    the mean, every metric a column (None where a benchmark has no value)."""
    per_bench = {**report["results"][model], "mean": report["mean"][model]}
    metrics = list(dict.fromkeys(key for values in per_bench.values() for key in values))
    rows = [[model, bench, *(values.get(key) for key in metrics)] for bench, values in per_bench.items()]
    return ["model", "benchmark", *metrics], rows


def log_eval(report: dict) -> list[str]:
    """Each evaluated model that a W&B-logged training run made gets the report in that run's summary: the table
    (key ``eval``) and each number as ``eval/<benchmark>/<metric>``; returns those runs' output directories."""
    logged = []
    for model in report["results"]:
        run_dir = training_run_of(model)
        run = WandbRun.of_run_dir(run_dir) if run_dir is not None else None
        if run is None:
            continue
        columns, rows = eval_table(report, model)
        numbers = {
            f"eval/{row[1]}/{name}": value
            for row in rows
            for name, value in zip(columns[2:], row[2:], strict=True)
            if isinstance(value, (int, float))
        }
        run.set_summary({"eval": (columns, rows), **numbers})
        run.finish()
        logged.append(str(run_dir))
    return logged
