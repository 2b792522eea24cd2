"""Weights & Biases logging (``logging.wandb``, fasttnt.wandb_log) with the real wandb package in offline mode, each
run read back from its offline transaction log by wandb's own reader (``wandb leet inspect --json``)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.small import launch_command, metric_rows, run_job, run_overrides, train

pytest.importorskip("wandb")

WANDB_ENV = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONSOLE": "off"}


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline, its config, cache and data folders in the test's own tmp_path."""
    for key, value in {**WANDB_ENV, **_wandb_dirs(tmp_path)}.items():
        monkeypatch.setenv(key, value)


def _wandb_dirs(root: Path) -> dict[str, str]:
    return {f"WANDB_{name}_DIR": str(root / f"wandb-{name.lower()}") for name in ("CONFIG", "CACHE", "DATA")}


def _offline_runs(out: Path) -> list[Path]:
    """The offline run folders a run wrote under ``out/wandb``, oldest first."""
    return sorted((out / "wandb").glob("offline-run-*"))


def _records(run_dir: Path) -> list[dict]:
    """Every record of an offline run's transaction log, through wandb's own reader."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def _summary(run_dir: Path) -> dict:
    """The run's summary, through wandb's own reader."""
    cmd = [sys.executable, "-m", "wandb", "leet", "inspect", "--summary", "--json", str(run_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    return json.loads(done.stdout)["summary"]


def _history(records: list[dict]) -> dict[int, dict]:
    """The logged rows by step (W&B's own keys, starting with _, left out)."""
    rows = {}
    for r in records:
        if r["type"] == "history":
            item = {k: v for k, v in r["history"]["item"].items() if not k.startswith("_")}
            rows.setdefault(r["history"]["step"]["num"], {}).update(item)
    return rows


def _run_record(records: list[dict]) -> dict:
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    return run


def _same(a, b) -> bool:
    return (isinstance(a, float) and math.isnan(a) and b in ("NaN", None)) or a == b


def _assert_rows_logged(rows: list[dict], history: dict[int, dict]) -> None:
    """Every metrics.jsonl row, under its own names, at its step."""
    assert rows, "the run logged no metrics rows"
    for row in rows:
        logged = history[row["step"]]
        for key, value in row.items():
            assert _same(value, logged[key]), (row["step"], key, value, logged.get(key))


def test_a_run_logs_its_rows_config_and_curves(tmp_path, offline):
    out = tmp_path / "run"
    overrides = run_overrides(tmp_path, "logging.wandb=true", "logging.group=g", "logging.tags=[tnt,tiny]",
                              steps=2)  # fmt: skip
    _, rows = train(tmp_path, "run", *overrides[1:])
    (run_dir,) = _offline_runs(out)
    records = _records(run_dir)
    history = _history(records)
    assert sorted(history) == [1, 2]
    _assert_rows_logged(rows, history)
    run = _run_record(records)
    assert run["run_id"] == (out / "wandb_run_id").read_text().strip()
    assert run["display_name"] == "run" and run["project"] == "fasttnt"  # the output dir's name; the default project
    assert run["run_group"] == "g" and run["tags"] == ["tnt", "tiny"]
    config = {k: v for k, v in json.loads(json.dumps(run["config"]["update"])).items() if k != "_wandb"}
    assert config == yaml.safe_load((out / "config.yaml").read_text())  # the resolved config
    # a logged object's fields come back flattened under its key
    assert history[2]["curves._type"] == "image-file" and history[2]["curves.path"].endswith(".png")
    assert (run_dir / "files" / history[2]["curves.path"]).is_file()


def test_wandb_dir_is_honoured_where_set(tmp_path, offline, monkeypatch):
    # a cluster's WANDB_DIR (a disk with room) takes the run's files; without it they go under the output folder
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    train(tmp_path, "run", *run_overrides(tmp_path, "logging.wandb=true", steps=1)[1:])
    assert not _offline_runs(tmp_path / "run"), "the run's files went under the output folder"
    (run_dir,) = _offline_runs(tmp_path / "elsewhere")
    assert _history(_records(run_dir))[1], "the step's row is in the run under WANDB_DIR"


def test_resume_continues_the_same_run(tmp_path, offline):
    out = tmp_path / "run"
    train(tmp_path, "run", *run_overrides(tmp_path, "logging.wandb=true", steps=2)[1:])
    run_id = (out / "wandb_run_id").read_text().strip()
    _, rows = train(tmp_path, "run", *run_overrides(tmp_path, "logging.wandb=true", steps=4)[1:], resume=True)
    first, second = _offline_runs(out)
    assert (out / "wandb_run_id").read_text().strip() == run_id
    assert _run_record(_records(first))["run_id"] == run_id
    resumed = _records(second)
    assert _run_record(resumed)["run_id"] == run_id and _run_record(resumed)["resume"] is True
    history = _history(resumed)
    assert sorted(history) == [3, 4]  # the steps after the checkpoint, continuing the run's history
    _assert_rows_logged([row for row in rows if row["step"] > 2], history)


def test_a_new_run_in_the_same_folder_gets_a_new_id(tmp_path, offline):
    # only --resume continues a W&B run: a run started afresh is a new one
    from fasttnt.wandb_log import RUN_ID_FILE

    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_ID_FILE).write_text("oldrun123\n")
    train(tmp_path, "run", *run_overrides(tmp_path, "logging.wandb=true", steps=1)[1:])
    new_id = (out / RUN_ID_FILE).read_text().strip()
    assert new_id != "oldrun123"
    assert _run_record(_records(_offline_runs(out)[0]))["run_id"] == new_id


def test_only_rank_zero_logs_under_two_ranks(tmp_path):
    pytest.importorskip("deepspeed")
    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), *run_overrides(tmp_path, "logging.wandb=true", steps=2)]
    env = {**os.environ, **WANDB_ENV, **_wandb_dirs(tmp_path), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    done = run_job(launch_command("torchrun", "fasttnt", *args), env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((out / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    assert state["world"] == 2, "the job did not run on 2 ranks"
    rows = metric_rows(out)
    (run_dir,) = _offline_runs(out)  # one W&B run, not one per rank
    history = _history(_records(run_dir))
    assert sorted(history) == [1, 2]
    _assert_rows_logged(rows, history)


def test_eval_logs_its_table_into_the_training_run(tmp_path, offline):
    from fasttnt.cli import main

    out = tmp_path / "run"
    train(tmp_path, "run", *run_overrides(tmp_path, "logging.wandb=true", steps=1)[1:])
    run_id = (out / "wandb_run_id").read_text().strip()
    evaluate = ["eval", "--model", str(out / "final"), "--benchmarks", "synthetic", "--samples", "1",
                "--synthetic-per-level", "1", "--max-new-tokens", "16",
                "--output-dir", str(tmp_path / "eval")]  # fmt: skip
    status = main(evaluate)
    assert status == 0
    runs = _offline_runs(out)
    assert len(runs) == 2, "eval did not continue the training run's W&B run"
    records = _records(runs[1])
    assert _run_record(records)["run_id"] == run_id
    summary = _summary(runs[1])
    assert summary["eval"]["_type"] == "table-file" and summary["eval"]["nrows"] == 2  # synthetic and the mean
    data = json.loads((runs[1] / "files" / summary["eval"]["path"]).read_text())
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())
    acc = report["results"][str(out / "final")]["synthetic"]["acc"]
    assert data["columns"][:3] == ["model", "benchmark", "acc"]
    (synthetic,) = [row for row in data["data"] if row[1] == "synthetic"]
    assert synthetic[2] == acc and summary["eval/synthetic/acc"] == acc


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    from fasttnt.cli import main

    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    out = tmp_path / "run"
    status = main(["train", "--output-dir", str(out), *run_overrides(tmp_path, "logging.wandb=true", steps=1)])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert err == "fasttnt train: logging.wandb=true needs the wandb package: pip install 'fasttnt[wandb]'"
    assert not (out / "metrics.jsonl").exists()  # refused before any work


def test_wandb_is_imported_only_when_asked_for():
    code = "import sys, fasttnt.cli, fasttnt.trainer, fasttnt.runlog; assert 'wandb' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_training_run_of_a_model_folder(tmp_path):
    # fasttnt eval of a run's final/ or of one of its checkpoints logs into that run: the folder's parent, or the
    # parent of checkpoints/; a folder of no run with an id (another run's, or none) has none
    from fasttnt.wandb_log import RUN_ID_FILE, training_run_of

    run = tmp_path / "run"
    (run / "checkpoints" / "step-000004").mkdir(parents=True)
    (run / "final").mkdir()
    (tmp_path / "elsewhere").mkdir()
    assert training_run_of(str(run / "final")) is None, "precondition: no id file yet"
    (run / RUN_ID_FILE).write_text("abc\n")
    assert training_run_of(str(run / "final")) == run
    assert training_run_of(str(run / "checkpoints" / "step-000004")) == run
    assert training_run_of(str(tmp_path / "elsewhere")) is None
