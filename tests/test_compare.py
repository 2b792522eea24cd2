"""fasttnt compare on a very small model: one scheme pair, a few steps, every output, and reruns that skip."""

from __future__ import annotations

import json

import pytest
from small import SMALL

import fasttnt.compare as compare
from fasttnt.cli import main as cli_main


def _args(tmp_path, *extra):
    return [
        "compare",
        "--schemes",
        "tnt,no-limit",
        "--seeds",
        "2",
        "--steps",
        "3",
        "--samples",
        "1",
        "--output-dir",
        str(tmp_path / "cmp"),
        *extra,
        f"cache_dir={tmp_path / 'cache'}",
        *SMALL,
    ]


def test_compare_writes_the_table_the_json_and_the_figure(tmp_path, monkeypatch):
    assert cli_main(_args(tmp_path)) == 0
    out = tmp_path / "cmp"
    summary = json.loads((out / "compare.json").read_text())
    assert list(summary["schemes"]) == ["tnt", "no-limit"]
    for data in summary["schemes"].values():
        assert [s["seed"] for s in data["seeds"]] == [0, 1]
        for key in ("acc", "len", "te", "non_thinking_ratio", "hack_rate", "len_non_thinking"):
            values = [s[key] for s in data["seeds"]]
            assert data["mean"][key] == pytest.approx(sum(values) / 2)
        assert set(data["mean"]["non_thinking_ratio_by_level"]) == {"1", "2", "3", "4"}
        assert data["seeds"][0]["train"]["step"] == [1, 2, 3]
    table = (out / "compare.md").read_text()
    assert "| tnt |" in table and "| no-limit |" in table and "Per seed" in table
    assert (out / "compare.png").stat().st_size > 10_000
    # the schemes differ only in the reward: same prompts, so the first step's samples are the same
    first = {s: d["seeds"][0]["train"]["len"][0] for s, d in summary["schemes"].items()}
    assert first["tnt"] == first["no-limit"]

    # a rerun trains nothing again
    real_trainer = compare.Trainer
    monkeypatch.setattr(compare, "Trainer", lambda *a, **k: pytest.fail("a finished run was trained again"))
    assert cli_main(_args(tmp_path)) == 0
    # other settings are other runs: --steps 4 retrains all of them, and the evaluation follows the new models
    trained = []
    monkeypatch.setattr(compare, "Trainer", lambda cfg, out: trained.append(out) or real_trainer(cfg, out))
    args = _args(tmp_path)
    args[args.index("--steps") + 1] = "4"
    assert cli_main(args) == 0
    assert len(trained) == 4
    summary = json.loads((out / "compare.json").read_text())
    assert summary["schemes"]["tnt"]["seeds"][0]["train"]["step"] == [1, 2, 3, 4]


def test_bad_arguments_fail_before_training(tmp_path, capsys):
    assert cli_main(["compare", "--schemes", "tnt,adaptive", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--schemes: unknown adaptive" in capsys.readouterr().err
    assert cli_main(["compare", "--output-dir", str(tmp_path / "x"), "rollout.group_size=one"]) == 2
    assert "rollout.group_size: expected an int" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
