"""Preemption and resume: SIGTERM finishes the step, saves and exits with a resumable code, and --resume then
reproduces the uninterrupted run exactly, in one process and in two ranks; time-based checkpoints; a resume under a
config that changes what the checkpoint means is refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import varied
from support.small import SMALL, deterministic, launch_command, warmups

from fasttnt.checkpoint import list_checkpoints
from fasttnt.cli import main as cli_main
from fasttnt.preemption import EXIT_PREEMPTED

# 16 steps of a run of seconds: the signal comes within 0.05 s of the first step's row, the run stops after the step
# it is in, and 14 more steps (seconds, even on loaded cores) lie between that and the end
RUN = [*SMALL, varied.OVERRIDE, "warmup.steps=3", "warmup.batch_size=8", "rollout.max_new_tokens=12", "steps=16",
       "save_every=1000", "loss.entropy_coef=0.01", "optim.lr=1e-2"]  # fmt: skip
# one thread everywhere: runs in different processes must compute bit for bit the same
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": varied.PYTHONPATH}


def _args(out: Path, cache: Path, *extra: str) -> list[str]:
    return ["train", "--output-dir", str(out), f"cache_dir={cache}", *RUN, *extra]


def _metrics(out: Path) -> list[dict]:
    # not small.metric_rows: [] before the run writes its first row, for the polling below
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _signal_after_first_step(cmd: list[str], out: Path, sig: int = signal.SIGTERM) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 240
    while not _metrics(out) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("launcher", ["single", "torchrun"])
def test_sigterm_saves_and_resume_reproduces_the_run(tmp_path, launcher):
    cache = warmups(tmp_path)
    straight = subprocess.run(
        launch_command(launcher, varied.MODULE, *_args(tmp_path / "straight", cache)),
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert all(r["grad_norm"] > 0 for r in _metrics(tmp_path / "straight")), "a step without a gradient"
    out = tmp_path / "stopped"
    # torchrun passes the SIGTERM on to its ranks, which agree on the step to stop at
    stopped = _signal_after_first_step(launch_command(launcher, varied.MODULE, *_args(out, cache)), out)
    if launcher == "single":
        assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
        assert "stopped by SIGTERM after step" in stopped.stderr and "fasttnt train --resume" in stopped.stderr
    else:  # torchrun reports that its workers were signalled; what matters is what they left
        assert stopped.returncode != 0
    done = _metrics(out)
    assert 1 <= len(done) < 16, "stopped after a step, before the end"
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-{len(done):06d}"]
    resumed = subprocess.run(
        launch_command(launcher, varied.MODULE, *_args(out, cache), "--resume"),
        capture_output=True, text=True, env=ENV, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected = [deterministic(r) for r in _metrics(tmp_path / "straight")]
    assert [deterministic(r) for r in _metrics(out)] == expected


def test_a_second_sigint_stops_at_once(tmp_path):
    out = tmp_path / "run"
    cmd = launch_command("single", varied.MODULE, *_args(out, warmups(tmp_path), "steps=100000"))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + 240
    while not _metrics(out) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode in (130, EXIT_PREEMPTED), stderr[-2000:]  # the second may land after the step's save
    assert "Traceback" not in stderr


def test_time_based_checkpoints(tmp_path):
    out = tmp_path / "run"
    args = _args(out, warmups(tmp_path), "steps=3", "save_every_minutes=1e-6", "keep_checkpoints=5")
    assert cli_main(args) == 0
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == [f"step-{s:06d}" for s in (1, 2, 3)]


def test_resume_refuses_a_config_that_changes_the_checkpoints_meaning(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli_main(_args(out, warmups(tmp_path), "steps=2")) == 0
    capsys.readouterr()
    changed = _args(out, warmups(tmp_path), "steps=3", "rollout.group_size=2", "reward.scheme=binary")
    assert cli_main([*changed, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "the config differs from step-000002's in reward.scheme, rollout.group_size;" in err
    assert "--resume-with-new-config" in err and err.count("\n") == 1
    # the steps, the save cadence, the verifier's workers may change
    assert cli_main([*_args(out, warmups(tmp_path), "steps=3", "save_every=1", "verify_workers=2"), "--resume"]) == 0
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3]
    # and the user may insist
    assert cli_main([*changed[:-1], "steps=4", "--resume-with-new-config"]) == 0
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
