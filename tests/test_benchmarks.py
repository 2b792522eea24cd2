"""The benchmark scripts run end to end on tiny shapes (their numbers are measured elsewhere, never in tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from small import SMALL

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict | None = None, cwd: Path = ROOT) -> str:
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_bench_kernels_smoke():
    out = _run("benchmarks/bench_kernels.py", "--smoke", env={"TRITON_INTERPRET": "1", "FASTTNT_KERNELS": "triton"})
    for op in ("token_logprobs", "linear_token_logprobs", "group_advantages", "clipped_policy_loss", "tnt_rewards"):
        assert op in out
    assert "torch (materialised)" in out and "peak +" in out


def test_train_throughput_smoke():
    out = _run("benchmarks/train_throughput.py", "--smoke")
    assert "tokens/s" in out and "MFU" in out


def test_packed_attention_check_smoke():
    out = _run("benchmarks/packed_attention_check.py", "--smoke")
    assert "packed attention sdpa_padded" in out and out.rstrip().endswith("OK")


def test_e2e_against_trl_smoke(tmp_path):
    pytest.importorskip("trl")
    overrides = [*SMALL, "warmup.steps=3", "warmup.batch_size=8"]
    out = _run(
        str(ROOT / "benchmarks" / "e2e.py"),
        "--steps",
        "2",
        "--warmup-steps",
        "1",
        "--prompts",
        "4",
        "--samples",
        "4",
        "--max-new-tokens",
        "16",
        "--cache-dir",
        str(tmp_path / "cache"),
        "--json",
        str(tmp_path / "e2e.json"),
        "--override",
        *overrides,
        cwd=tmp_path,
    )
    numbers = json.loads((tmp_path / "e2e.json").read_text())
    assert numbers["fasttnt"]["step_s"] > 0 and numbers["trl"]["step_s"] > 0
    assert "fasttnt steps/s / TRL steps/s" in out
