"""The READMEs' code runs as written, the CLI works, and the kernel library installs on its own."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def needs(code: str) -> str | None:
    """The package a README block needs beyond the test extra (its first line, ``# needs: <module>``)."""
    first = code.split("\n", 1)[0]
    return first.removeprefix("# needs:").strip() if first.startswith("# needs:") else None


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_kernel_readme_examples_run(tmp_path, backend):
    blocks = _python_blocks(ROOT / "kernels" / "README.md")
    assert len(blocks) >= 5 and [needs(b) for b in blocks[:2]] == ["trl", "verl"]  # it leads with TRL and verl
    env = dict(os.environ, FASTTNT_KERNELS=backend, TRITON_INTERPRET="1")
    for i, code in enumerate(blocks):
        module = needs(code)
        if module and importlib.util.find_spec(module) is None:
            continue  # verl: its own environment runs this block (tests/test_verl_integration.py)
        script = tmp_path / f"example_{i}.py"
        script.write_text(code)
        result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
        assert result.returncode == 0, f"kernels/README.md example {i} failed:\n{result.stderr[-2000:]}"


def test_readme_commands_match_ci():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```\n(pip install .*?)\n```", readme)
    assert len(commands) == 2, "the README starts with exactly two commands"
    main_job, tests = commands
    assert "fasttnt selfcheck" in main_job or "fasttnt train" in main_job
    ci = (ROOT / ".ci" / "run").read_text()
    assert tests in ci, ".ci/run must run exactly the README's test command"


def test_cli_selfcheck_passes():
    result = subprocess.run(
        [sys.executable, "-m", "fasttnt", "selfcheck", "--quick"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "5 passed, 0 failed" in result.stdout


def test_cli_without_a_command_is_a_usage_error():
    result = subprocess.run([sys.executable, "-m", "fasttnt"], capture_output=True, text=True)
    assert result.returncode == 2 and "COMMAND" in result.stderr


def test_kernel_library_builds_alone_with_torch_and_triton_only(tmp_path):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((ROOT / "kernels" / "pyproject.toml").read_text())["project"]
    assert meta["dependencies"] == ["torch>=2.6", "triton>=3.2"]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            str(ROOT / "kernels"),
        ],
        check=True,
    )
    (wheel,) = tmp_path.glob("fasttnt_kernels-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    ops = ("token_logprobs", "linear_token_logprobs", "group_advantages", "clipped_policy_loss", "tnt_rewards")
    for op in ops:
        assert f"fasttnt_kernels/{op}.py" in names
    assert not any(n.startswith("fasttnt/") for n in names), "the kernel wheel must not carry the trainer"
    # the wheel imports with nothing but its own files on the path (no fasttnt, no repo checkout)
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    code = "import fasttnt_kernels, sys; assert 'fasttnt' not in sys.modules; print(fasttnt_kernels.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(unpacked)),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        check=True,
    ).stdout
    assert out.startswith(str(unpacked))
