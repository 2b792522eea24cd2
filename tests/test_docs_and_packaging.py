"""The READMEs' code runs as written, their commands and keys are the CLI's and the config's, the reference pages
cover every config key and logged metric, the CLI works, and the kernel library installs on its own. A theme file:
what a user reads and installs, checked against every module it describes."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import typing
import zipfile
from pathlib import Path
from unittest import mock

import pytest
import yaml
from support.small import SMALL

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


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
    # the suites with environments of their own: each README command, verbatim, in .ci/run
    environments = re.findall(r"```bash\n(python -m venv \.venv-.*?)\n```", readme)
    assert {re.match(r"python -m venv (\S+)", c).group(1) for c in environments} == {".venv-verl", ".venv-vllm"}
    for command in environments:
        assert command in ci, f".ci/run must run the README's command: {command}"


def test_cli_selfcheck_passes():
    result = subprocess.run(
        [sys.executable, "-m", "fasttnt", "selfcheck", "--quick"], capture_output=True, text=True, cwd=ROOT
    )
    assert result.returncode == 0, result.stdout + result.stderr
    from fasttnt_kernels.selfcheck import CHECKS

    assert f"{len(CHECKS)} passed, 0 failed" in result.stdout and len(CHECKS) == 6


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
    ops = ("token_logprobs", "linear_token_logprobs", "group_advantages", "mode_advantages", "clipped_policy_loss",
           "tnt_rewards")  # fmt: skip
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


def test_the_wheel_carries_every_package_of_the_trainer(tmp_path):
    # a package left out of pyproject's list installs from a checkout (editable) and is missing from the wheel. Built
    # from a copy: setuptools' build/ folder in the checkout would carry files from earlier builds
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("fasttnt", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "build"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(source)], check=True)  # fmt: skip
    (wheel,) = tmp_path.glob("fasttnt-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = [p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "fasttnt").rglob("__init__.py")]
    assert len(packages) >= 5
    for package in packages:
        modules = [m.relative_to(ROOT).as_posix() for m in (ROOT / package).glob("*.py")]
        assert all(m in names for m in modules), f"{package} is not in the wheel"


# -- the docs against the code ------------------------------------------------------------------------------------


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


@functools.cache
def cli_parser() -> argparse.ArgumentParser:
    """The ``fasttnt`` command's own parser, as ``fasttnt.cli.main`` builds it (captured at its ``parse_args``,
    so nothing runs)."""
    from fasttnt import cli

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        try:
            cli.main(["selfcheck"])
        except _Captured as got:
            return got.parser
    raise AssertionError("fasttnt.cli.main did not parse its arguments")


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = cli_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def config_defaults() -> dict[str, object]:
    """Every dotted config key and its default, from the dataclasses (tuples as lists, as YAML writes them)."""
    from fasttnt.config import TrainConfig

    def walk(cls, prefix=""):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], f"{prefix}{f.name}.")
            else:
                value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
                yield prefix + f.name, list(value) if isinstance(value, tuple) else value

    return dict(walk(TrainConfig))


def _code(path: Path) -> tuple[list[str], list[str]]:
    """The fenced code blocks of a markdown file (continued lines joined) and its inline code spans."""
    text = path.read_text()
    blocks = re.findall(r"^```[\w-]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[\w-]*\n.*?^```", "", text, flags=re.S | re.M)
    return [b.replace("\\\n", " ") for b in blocks], re.findall(r"`([^`\n]+)`", prose)


_INVOCATION = re.compile(r"(?<![\w./-])fasttnt\s+(train|eval|compare|selfcheck)\b(.*)")
_SHELL_ENDS = {"&&", "||", "|", ";", ">", ">>", "2>&1"}


def invocations(text: str) -> list[tuple[str, list[str]]]:
    """Every ``fasttnt COMMAND ARGS`` in ``text`` (launched through torchrun, deepspeed or ``python -m`` too), with
    its arguments as the shell would pass them."""
    found = []
    for line in text.splitlines():
        match = _INVOCATION.search(line)
        if not match:
            continue
        rest = match.group(2)
        for quote in "'\"":  # the command ends a quoted ``bash -c '...'`` string
            if rest.count(quote) % 2:
                rest = rest[::-1].replace(quote, "", 1)[::-1]
        tokens = shlex.split(rest, comments=True)
        ends = [i for i, t in enumerate(tokens) if t in _SHELL_ENDS]
        found.append((match.group(1), tokens[: ends[0]] if ends else tokens))
    return found


def _markdown_files() -> list[Path]:
    return [ROOT / "README.md", *DOCS]


def test_documented_commands_parse_with_the_cli_and_name_config_keys():
    from fasttnt.config import TrainConfig, with_overrides
    from fasttnt.variants import split_variants, variant_overrides

    parser, commands = cli_parser(), subcommands()
    seen = 0
    for path in _markdown_files():
        blocks, spans = _code(path)
        for command, tokens in (inv for block in blocks for inv in invocations(block)):
            where = f"{path.relative_to(ROOT)}: fasttnt {command} {' '.join(tokens)}"
            try:
                args = parser.parse_args([command, *tokens])
            except SystemExit:
                pytest.fail(f"{where}: the CLI rejects it")
            options = set(commands[command]._option_string_actions)
            for flag in (t.split("=", 1)[0] for t in tokens if t.startswith("--")):  # exactly, not a prefix of one
                assert flag in options, f"{where}: `fasttnt {command}` has no {flag}"
            for override in getattr(args, "overrides", []):
                with_overrides(TrainConfig(), [override])  # an unknown key or a wrong type raises ConfigError
            for variant in split_variants(getattr(args, "variants", None) or getattr(args, "variant", None) or ""):
                variant_overrides(variant, TrainConfig())
            seen += 1
        for command, tokens in (inv for span in spans for inv in invocations(span)):  # `fasttnt train --flag`
            options = set(commands[command]._option_string_actions)
            for flag in (t.split("=", 1)[0] for t in tokens if t.startswith("--")):
                assert flag in options, f"{path.relative_to(ROOT)}: `fasttnt {command}` has no {flag}"
            for override in (t for t in tokens if re.match(r"[a-z_][\w.]*=", t)):
                with_overrides(TrainConfig(), [override])
    assert seen >= 10, f"found only {seen} fasttnt commands in the docs' code blocks"


def test_config_reference_lists_every_key_with_its_default():
    rows = re.findall(r"^\| `([\w.]+)` \| `([^`]*)` \|", (ROOT / "docs" / "config.md").read_text(), flags=re.M)
    documented = {key: yaml.safe_load(default) for key, default in rows}
    defaults = config_defaults()
    assert len(rows) == len(documented), "a key is documented twice"
    assert set(documented) == set(defaults), (
        f"undocumented: {sorted(set(defaults) - set(documented))}; gone: {sorted(set(documented) - set(defaults))}"
    )
    wrong = {k: (documented[k], v) for k, v in defaults.items() if documented[k] != v}
    assert not wrong, f"docs/config.md defaults differ from the code (doc, code): {wrong}"


def test_embedded_default_is_configs_tiny_yaml():
    from fasttnt.config import load_config

    assert load_config(ROOT / "configs" / "tiny.yaml") == load_config(None)


def _glossary(section: str) -> set[str]:
    """Metric names in the first column of docs/metrics.md's tables under the heading ``section``."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    part = text.split(f"## {section}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(\w+)` \|", part, flags=re.M))


def test_metrics_glossary_covers_every_logged_metric(tmp_path):
    from fasttnt.config import load_config
    from fasttnt.step_metrics import RANK_METRICS, TOKEN_METRICS
    from fasttnt.trainer import Trainer

    # a 1-step run that logs everything: no skipped sequences (the token metrics), dynamic sampling (its counts),
    # mode-mixed rollouts (their shares)
    extra = ["loss.skip_zero_advantage=false", "rollout.dynamic_sampling=true", "rollout.max_draws=2",
             "rollout.forced_non_thinking=0.25", "rollout.forced_thinking=0.25"]  # fmt: skip
    overrides = [f"cache_dir={tmp_path / 'cache'}", *SMALL, "warmup.steps=3", "warmup.batch_size=8",
                 "rollout.max_new_tokens=16", "steps=1", *extra]  # fmt: skip
    Trainer(load_config(None, overrides), tmp_path / "run", progress=False).run()
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the accuracies by mode and the choice's numbers are also logged per level (acc_thinking_l2, reward_direct_l2,
    # ...), documented once; acc_free_direct only in a step where a free response chose </think>, which this model
    # need not do
    per_level = r"^((?:acc_|reward_|prefers_direct|think_end_prob|mode_floored|free_non_thinking_ratio)\w*?)_l\d+$"
    # the ranks' numbers only over several ranks: a 2-rank run logs them (tests/test_distributed.py)
    logged = {re.sub(per_level, r"\1", name) for name in row} | set(TOKEN_METRICS) | {"acc_free_direct"}
    logged |= set(RANK_METRICS)
    # precondition: the per-level names were logged (forced rows of both modes: a thinking and a direct accuracy)
    assert any(name.startswith("acc_thinking_l") for name in row) and "acc_forced_direct" in row
    assert any(name.startswith("reward_direct_l") for name in row)
    assert any(name.startswith("think_end_prob_l") for name in row)
    assert any(name.startswith("mode_floored_l") for name in row)
    assert any(name.startswith("free_non_thinking_ratio_l") for name in row)
    documented = _glossary("Training")
    assert logged <= documented, f"not in docs/metrics.md: {sorted(logged - documented)}"
    assert documented <= logged, f"docs/metrics.md names metrics no run logs: {sorted(documented - logged)}"


def test_metrics_glossary_covers_every_eval_metric():
    from fasttnt.evaluate import summarize

    record = {"correct": True, "non_thinking": False, "tokens": 12, "hacked": False, "truncated": False, "level": 1}
    written = set(summarize([record, {**record, "non_thinking": True, "correct": False}]))
    documented = _glossary("Evaluation")
    assert written <= documented, f"not in docs/metrics.md: {sorted(written - documented)}"
    assert documented <= written, f"docs/metrics.md names eval metrics summarize does not write: {documented - written}"


def test_readme_is_short_and_its_links_resolve():
    assert len((ROOT / "README.md").read_bytes()) < 15_000, "README.md must stay under 15 KB"
    for path in [*_markdown_files(), ROOT / "kernels" / "README.md", *sorted((ROOT / "benchmarks").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
            if not re.match(r"\w+://", target):
                assert (path.parent / target).exists(), f"{path.relative_to(ROOT)}: broken link {target}"


def test_docs_speak_of_the_project_not_of_how_it_was_made():
    header = "".join(
        line for line in (ROOT / "benchmarks" / "gpu_check.sh").read_text().splitlines(True) if line.startswith("#")
    )
    pages = [ROOT / "README.md", ROOT / "kernels" / "README.md", *DOCS, *sorted((ROOT / "benchmarks").glob("*.md"))]
    texts = {str(p.relative_to(ROOT)): p.read_text() for p in pages} | {"benchmarks/gpu_check.sh": header}
    pattern = re.compile(r"\bsessions?\b|\blent\b|\bworkplace\b|\bissue \d|\.git/info|later that day|in the evening")
    for name, text in texts.items():
        assert not pattern.search(text), f"{name}: {pattern.search(text).group(0)!r}"
