"""fasttnt eval on tiny models: two models side by side, forced modes, metrics from saved responses, resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.small import TINY

import fasttnt.evaluate as evaluate
from fasttnt.cli import main as cli_main
from fasttnt.embedded.char_tokenizer import THINK_END, build_char_tokenizer
from fasttnt.embedded.tiny import TinyModelConfig, WarmupConfig, build_tiny_model, warmup
from fasttnt.evaluate import EvalSettings, run_eval, summarize

SETTINGS = EvalSettings(samples=2, max_new_tokens=24, synthetic_per_level=3, temperature=1.0)


def _tiny(tmp_path: Path, name: str, seed: int) -> str:
    """A width-32 model with a few warm-up steps, saved as a Hugging Face folder."""
    tok = build_char_tokenizer()
    model = build_tiny_model(
        tok,
        TinyModelConfig(**TINY),
        seed=seed,
    )
    warmup(model, tok, WarmupConfig(steps=5, batch_size=16, seed=seed))
    path = tmp_path / name
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return _tiny(root, "a", 0), _tiny(root, "b", 1)


def test_two_models_side_by_side(tmp_path, models):
    report = run_eval(list(models), ["synthetic"], SETTINGS, tmp_path, save_responses=True)
    assert set(report["results"]) == set(models)
    for m in models:
        metrics = report["results"][m]["synthetic"]
        assert metrics["responses"] == 4 * 3 * 2  # 4 levels x 3 problems x 2 samples
        assert set(metrics["by_level"]) == {"1", "2", "3", "4"}
        for key in (
            "acc",
            "len",
            "te",
            "non_thinking_ratio",
            "hack_rate",
            "len_thinking",
            "len_non_thinking",
            "truncated_ratio",
        ):
            assert key in metrics and metrics[key] == metrics[key]
    table = (tmp_path / "eval.md").read_text()
    assert all(f"`{m}`" in table for m in models) and "level 4" in table
    assert (tmp_path / "eval.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert saved["settings"]["samples"] == 2 and saved["mean"][models[0]]["acc"] == report["mean"][models[0]]["acc"]


def test_metrics_recomputed_from_saved_responses_agree(tmp_path, models):
    report = run_eval([models[0]], ["synthetic"], SETTINGS, tmp_path, save_responses=True)
    path = next((tmp_path / "responses").rglob("synthetic.jsonl"))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 24
    recomputed = summarize(records)
    assert recomputed == report["results"][models[0]]["synthetic"]
    # and by hand, from the records alone
    acc = 100 * sum(r["correct"] for r in records) / len(records)
    assert abs(recomputed["acc"] - acc) < 1e-4
    assert all(r["non_thinking"] == r["response"].startswith(THINK_END) for r in records)


@pytest.mark.parametrize("mode", ["non-thinking", "thinking"])
def test_forced_modes_force(tmp_path, models, mode):
    settings = EvalSettings(**{**SETTINGS.__dict__, "mode": mode})
    run_eval([models[1]], ["synthetic"], settings, tmp_path, save_responses=True)
    records = [json.loads(line) for line in next((tmp_path / "responses").rglob("*.jsonl")).read_text().splitlines()]
    starts = [r["response"].startswith(THINK_END) for r in records]
    assert all(starts) if mode == "non-thinking" else not any(starts)


def test_rerun_skips_finished_benchmarks(tmp_path, models, monkeypatch):
    run_eval([models[0]], ["synthetic"], SETTINGS, tmp_path)
    first = (tmp_path / "eval.json").read_text()

    def no_generation(*args, **kwargs):
        raise AssertionError("a finished benchmark was evaluated again")

    monkeypatch.setattr(evaluate, "evaluate_one", no_generation)
    run_eval([models[0]], ["synthetic"], SETTINGS, tmp_path)
    assert json.loads((tmp_path / "eval.json").read_text())["results"] == json.loads(first)["results"]
    # other settings are another evaluation: not skipped
    with pytest.raises(AssertionError, match="evaluated again"):
        run_eval([models[0]], ["synthetic"], EvalSettings(**{**SETTINGS.__dict__, "samples": 3}), tmp_path)


def test_a_crash_in_one_benchmark_keeps_the_others(tmp_path, models, monkeypatch):
    bad = tmp_path / "second.jsonl"
    bad.write_text('{"problem": "1+1", "answer": "2"}\n')
    real = evaluate.evaluate_one

    def crash_on_second(engine, tokenizer, name, *rest):
        if name == str(bad):
            raise RuntimeError("out of memory")
        return real(engine, tokenizer, name, *rest)

    monkeypatch.setattr(evaluate, "evaluate_one", crash_on_second)
    with pytest.raises(RuntimeError):
        run_eval([models[0]], ["synthetic", str(bad)], SETTINGS, tmp_path)
    assert list((tmp_path / "results").rglob("synthetic.json")), "the finished benchmark was lost"


def test_missing_or_malformed_benchmark_fails_before_generation(tmp_path, models, monkeypatch, capsys):
    monkeypatch.setattr(evaluate, "evaluate_one", lambda *a: (_ for _ in ()).throw(AssertionError("generated")))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"problem": "x"}\n')
    code = cli_main(
        ["eval", "--model", models[0], "--benchmarks", f"synthetic,{broken}", "--output-dir", str(tmp_path / "out")]
    )
    assert code == 2
    assert "broken.jsonl: row 1: missing field 'answer'" in capsys.readouterr().err
    code = cli_main(
        ["eval", "--model", models[0], "--benchmarks", "synthetic,nosuchbench", "--output-dir", str(tmp_path / "out")]
    )
    assert code == 2
    assert "nosuchbench: not a benchmark" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "/nonexistent"], "--model /nonexistent: no such folder"),
        (["--model", "{empty}"], "no config.json in the folder"),
        (["--top-p", "2"], "--top-p: must be in (0, 1], got 2.0"),
        (["--samples", "0"], "--samples: must be >= 1, got 0"),
        (["--temperature", "0"], "--temperature: must be > 0"),
        (["--level-weights", "1,1"], "--level-weights: 4 comma-separated weights >= 0, not all 0; got '1,1'"),
    ],
)
def test_bad_eval_arguments_are_one_line(tmp_path, models, capsys, args, message):
    args = [a.replace("{empty}", str(tmp_path)) for a in args]
    if "--model" not in args:
        args = ["--model", models[0], *args]
    code = cli_main(["eval", *args, "--benchmarks", "synthetic", "--output-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_a_model_that_cannot_load_is_one_line(tmp_path, capsys, monkeypatch):
    # a hub id, with no hub to reach (or no such repository): transformers' OSError becomes one line. Offline, so
    # the test does not wait on network retries (47 s here) and says the same on a machine with a network
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code = cli_main(["eval", "--model", "fasttnt-tests/no-such-model", "--benchmarks", "synthetic",
                     "--output-dir", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "--model fasttnt-tests/no-such-model: cannot load it" in err
    assert "Traceback" not in err


def test_the_synthetic_split_takes_the_level_mix():
    # fasttnt eval --level-weights (and fasttnt compare, from data.level_weights): the split's problems per level
    uniform = evaluate.load_benchmark("synthetic", EvalSettings(synthetic_per_level=5))
    mixed = evaluate.load_benchmark(
        "synthetic", EvalSettings(synthetic_per_level=5, synthetic_level_weights=(2, 1, 1, 0))
    )
    assert [sum(p.level == lv for p in uniform) for lv in (1, 2, 3, 4)] == [5, 5, 5, 5]
    assert [sum(p.level == lv for p in mixed) for lv in (1, 2, 3, 4)] == [10, 5, 5, 0]


def test_accuracy_by_mode_counts_each_modes_own_responses():
    def record(level, non_thinking, correct):
        return {"level": level, "non_thinking": non_thinking, "correct": correct, "tokens": 10, "hacked": False,
                "truncated": False}  # fmt: skip

    rows = [record(1, True, True), record(1, True, False), record(1, False, True), record(2, False, False)]
    out = summarize(rows)
    assert out["acc_thinking"] == 50.0 and out["acc_non_thinking"] == 50.0
    assert out["by_level"]["1"]["acc_non_thinking"] == 50.0 and out["by_level"]["1"]["acc_thinking"] == 100.0
    assert out["by_level"]["2"]["acc_non_thinking"] is None  # no direct answer at that level: no accuracy, not 0


def test_the_mean_is_over_the_papers_five_math_sets():
    # MATH-500 and GPQA-Diamond are reported beside the mean, not averaged in; without the five, the mean is over all
    from fasttnt.evaluate import PAPER_MEAN, benchmark_mean, markdown_table, mean_over

    benches = ["aime24", "math500", "aime25", "amc23", "minerva", "olympiad", "gpqa"]
    assert mean_over(benches) == ["aime24", "aime25", "amc23", "minerva", "olympiad"] == list(PAPER_MEAN)
    assert mean_over(["synthetic", "mine.jsonl"]) == ["synthetic", "mine.jsonl"]
    per = {b: {"acc": 10.0 * i, "len": 100.0 * i, "non_thinking_ratio": 0.1, "hack_rate": 0.0, "responses": 4}
           for i, b in enumerate(benches, start=1)}  # fmt: skip
    mean = benchmark_mean(per, mean_over(benches))
    assert mean["acc"] == pytest.approx((10 + 30 + 40 + 50 + 60) / 5) and mean["len"] == pytest.approx(1900 / 5)
    settings = {"samples": 4, "mode": "free", "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 9}
    report = {"benchmarks": benches, "mean_over": mean_over(benches), "results": {"m": per}, "mean": {"m": mean},
              "settings": settings}  # fmt: skip
    head = markdown_table(report).splitlines()[0]
    assert "mean acc (the paper's five)" in head and "math500 acc / len (not in the mean)" in head
    assert head.index("olympiad") < head.index("math500")  # the averaged sets first


def test_run_eval_averages_the_papers_sets_it_evaluated(tmp_path, models, monkeypatch):
    # AIME24 stands for the paper's five (its hub copy is out of reach here; its problems are local ones) beside the
    # synthetic set, which is not one of them: the mean is AIME24's alone, not the two sets' average
    from fasttnt.data import Problem

    real = evaluate.load_problems
    local = [Problem(f"{a}+2", str(a + 2)) for a in range(3)]
    monkeypatch.setattr(evaluate, "load_problems", lambda name: local if name == "aime24" else real(name))
    report = run_eval([models[0]], ["aime24", "synthetic"], SETTINGS, tmp_path)
    per = report["results"][models[0]]
    assert per["aime24"]["responses"] == 3 * SETTINGS.samples and per["synthetic"]["responses"] > 0
    assert report["mean_over"] == ["aime24"]
    for key in ("acc", "len", "non_thinking_ratio", "hack_rate"):
        assert report["mean"][models[0]][key] == per["aime24"][key], key


def test_a_checkpoint_evaluates_as_a_model(tmp_path):
    # every checkpoint folder holds the tokenizer beside the weights: `fasttnt eval --model run/checkpoints/step-N`
    from support.small import SMALL

    run = tmp_path / "run"
    args = ["train", "--output-dir", str(run), f"cache_dir={tmp_path / 'cache'}", *SMALL, "warmup.steps=3",
            "warmup.batch_size=8", "rollout.max_new_tokens=8", "steps=2", "save_every=1"]  # fmt: skip
    assert cli_main(args) == 0
    step = run / "checkpoints" / "step-000001"
    assert (step / "tokenizer_config.json").is_file() and (step / "model.safetensors").is_file()
    out = tmp_path / "eval"
    assert cli_main(["eval", "--model", str(step), "--benchmarks", "synthetic", "--synthetic-per-level", "1",
                     "--samples", "1", "--max-new-tokens", "4", "--output-dir", str(out)]) == 0  # fmt: skip
    report = json.loads((out / "eval.json").read_text())
    assert report["results"][str(step)]["synthetic"]["responses"] > 0
