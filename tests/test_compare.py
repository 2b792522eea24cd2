"""fasttnt compare on a very small model: variants over two warm-ups, every output with its error bars, parallel
runs, and reruns that skip what is done."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch
from support.small import SMALL, warmups

import fasttnt.compare as compare
from fasttnt.cli import main as cli_main
from fasttnt.config import load_config
from fasttnt.runlog import read_jsonl


def _args(tmp_path, *extra):
    return [
        "compare",
        "--variants",
        "tnt,tnt:omega=1,tnt+dapo",
        "--seeds",
        "1",
        "--warmup-seeds",
        "2",
        "--steps",
        "3",
        "--samples",
        "1",
        "--eval-per-level",
        "4",
        "--output-dir",
        str(tmp_path / "cmp"),
        *extra,
        f"cache_dir={warmups(tmp_path)}",
        *SMALL,
        "warmup.steps=3",
        "warmup.batch_size=8",
    ]


def _two_seeds(tmp_path, *extra):
    """_args with one warm-up and two training seeds (the test below this one runs two warm-ups of one seed)."""
    args = _args(tmp_path, *extra)
    args[args.index("--seeds") + 1], args[args.index("--warmup-seeds") + 1] = "2", "1"
    return args


def test_compare_writes_the_table_the_json_and_the_figure(tmp_path, monkeypatch):
    assert cli_main(_two_seeds(tmp_path, "--jobs", "2", "--temperatures", "0.6,1.0")) == 0  # in 2 worker processes
    out = tmp_path / "cmp"
    summary = json.loads((out / "compare.json").read_text())
    # a report per evaluation temperature, from the same trained runs
    at_1 = json.loads((out / "compare_T1.json").read_text())
    assert summary["settings"]["eval"]["temperature"] == 0.6 and at_1["settings"]["eval"]["temperature"] == 1.0
    assert summary["settings"]["eval"]["synthetic_per_level"] == 4  # --eval-per-level
    assert (out / "compare_T1.md").is_file() and (out / "runs" / "w0-seed0" / "tnt" / "eval_T1" / "eval.json").is_file()
    assert list(at_1["variants"]) == list(summary["variants"])
    assert list(summary["variants"]) == ["tnt", "tnt:omega=1", "tnt+dapo"]
    assert set(summary["warmups"]) == {"0"}
    for wu in summary["warmups"].values():  # the warm-up forced into each mode
        assert set(wu["p_think"]) == set(wu["p_direct"]) == {"1", "2", "3", "4"}
        assert all(0 <= p <= 1 for p in [*wu["p_think"].values(), *wu["p_direct"].values()])
    for variant, data in summary["variants"].items():
        runs = data["runs"]
        assert [(r["warmup"], r["seed"]) for r in runs] == [(0, 0), (0, 1)]
        for key in ("acc", "len", "te", "non_thinking_ratio", "hack_rate", "len_non_thinking"):
            values = [r[key] for r in runs]
            stat = data["stats"][key]
            assert stat["mean"] == pytest.approx(statistics.fmean(values)) and stat["n"] == 2
            assert stat["se"] == pytest.approx(statistics.stdev(values) / math.sqrt(2))
        cfg = load_config(out / "runs" / "w0-seed0" / variant.replace(":", "_") / "config.yaml")
        for run in runs:
            wu = summary["warmups"][str(run["warmup"])]
            folder = out / "runs" / f"w{run['warmup']}-seed{run['seed']}" / variant.replace(":", "_")
            rows = read_jsonl(folder / "metrics.jsonl")
            for lv, b in run["by_level"].items():
                assert b["threshold"] == pytest.approx(compare.direct_threshold(cfg, wu["p_think"][lv]))
                assert b["direct_pays"] == (wu["p_direct"][lv] > b["threshold"])
                # the mode the table paid more for at the end, from the run's own rows, against what it chose
                assert b["preferred"] == compare.preferred_mode(rows, lv)
                chosen = "direct" if b["non_thinking_ratio"] >= 0.5 else "thinking"
                want = None if b["preferred"]["mode"] is None else b["preferred"]["mode"] in ("tie", chosen)
                assert b["in_preferred_mode"] == want
        assert runs[0]["train"]["step"] == [1, 2, 3]
        assert runs[0]["train_seconds"] > 0
    assert summary["variants"]["tnt+dapo"]["runs"][0]["train"]["draws"][0] >= 1
    # same warm-up and seed: the same prompts and the same first samples, whatever the reward
    first = {v: d["runs"][0]["train"]["len"][0] for v, d in summary["variants"].items() if "dapo" not in v}
    assert first["tnt"] == first["tnt:omega=1"]
    table = (out / "compare.md").read_text()
    assert "| tnt+dapo |" in table and " ± " in table and "p_t / p_d" in table and "Per run" in table
    assert "How each variant trained" in table and all(r["max_grad_norm"] > 0 for r in runs)
    assert (out / "compare.png").stat().st_size > 10_000

    # a rerun trains nothing again (inline, one job)
    real_trainer = compare.jobs.Trainer
    monkeypatch.setattr(compare.jobs, "Trainer", lambda *a, **k: pytest.fail("a finished run was trained again"))
    assert cli_main(_two_seeds(tmp_path, "--jobs", "1")) == 0
    # other settings are other runs: --steps 4 retrains them (tnt's, both seeds), and the evaluation follows
    trained = []

    def counted(cfg, out, **kw):
        trained.append(out)
        return real_trainer(cfg, out, **kw)

    monkeypatch.setattr(compare.jobs, "Trainer", counted)
    args = _two_seeds(tmp_path, "--jobs", "1")
    args[args.index("--steps") + 1] = "4"
    args[args.index("--variants") + 1] = "tnt"
    assert cli_main(args) == 0
    assert len(trained) == 2
    summary = json.loads((out / "compare.json").read_text())
    assert summary["variants"]["tnt"]["runs"][1]["train"]["step"] == [1, 2, 3, 4]


def test_a_late_mean_over_evaluated_steps_paired_with_the_first_variant(tmp_path):
    # seeds from --first-seed; each run evaluated at steps 2 and 3 (its checkpoint of step 2 kept, final/ for 3), its
    # numbers the mean of the two; the second variant paired with the first's run of the same warm-up and seed
    args = _args(tmp_path, "--jobs", "1", "--first-seed", "2", "--eval-steps", "2,3")
    args[args.index("--variants") + 1] = "tnt,tnt+mix"
    assert cli_main(args) == 0
    out = tmp_path / "cmp"
    summary = json.loads((out / "compare.json").read_text())
    assert summary["settings"]["eval_steps"] == [2, 3]
    by_variant = {}
    for variant, data in summary["variants"].items():
        assert [(r["warmup"], r["seed"]) for r in data["runs"]] == [(0, 2), (1, 2)]
        for r in data["runs"]:
            folder = out / "runs" / f"w{r['warmup']}-seed2" / variant
            assert (folder / "checkpoints" / "step-000002" / "config.json").is_file()
            steps = {s: json.loads((folder / "eval" / f"step-{s}" / "eval.json").read_text()) for s in (2, 3)}
            models = {2: folder / "checkpoints" / "step-000002", 3: folder / "final"}
            evals = {s: e["results"][str(models[s])]["synthetic"] for s, e in steps.items()}
            assert set(r["by_step"]) == {"2", "3"}
            for key in ("acc", "len", "non_thinking_ratio"):
                assert r[key] == pytest.approx((evals[2][key] + evals[3][key]) / 2)
                assert r["by_step"]["2"][key] == evals[2][key]
            for lv, b in r["by_level"].items():
                ratios = [evals[s]["by_level"][lv]["non_thinking_ratio"] for s in (2, 3)]
                assert b["non_thinking_ratio"] == pytest.approx(sum(ratios) / 2)
                assert b["most_non_thinking"] == max(ratios)
        by_variant[variant] = data
    assert "vs_first" not in by_variant["tnt"]["stats"]
    # the forced direct rows give the mode-mixed runs both modes at some level: a preference is read there
    assert any(
        b["preferred"]["mode"] is not None for r in by_variant["tnt+mix"]["runs"] for b in r["by_level"].values()
    )
    pairs = [(m["acc"] - t["acc"], m["len"] / t["len"]) for t, m in
             zip(by_variant["tnt"]["runs"], by_variant["tnt+mix"]["runs"], strict=True)]  # fmt: skip
    for run, (acc, length) in zip(by_variant["tnt+mix"]["runs"], pairs, strict=True):
        assert run["vs_first"] == {"acc": pytest.approx(acc), "len": pytest.approx(length)}
    assert by_variant["tnt+mix"]["stats"]["vs_first"]["acc"] == compare.mean_se([a for a, _ in pairs])
    table = (out / "compare.md").read_text()
    assert "at steps 2, 3, each number the mean" in table and "most non-thinking by level" in table


def test_the_mean_of_evaluations():
    from fasttnt.compare.jobs import mean_evaluation

    one = {"acc": 50.0, "len": 16.0, "te": 12.5, "acc_non_thinking": None,
           "by_level": {"1": {"acc": 10.0, "acc_thinking": None}}}  # fmt: skip
    two = {"acc": 70.0, "len": 36.0, "te": 70 / 6, "acc_non_thinking": 20.0,
           "by_level": {"1": {"acc": 30.0, "acc_thinking": None}}}  # fmt: skip
    assert mean_evaluation([one]) is one
    mean = mean_evaluation([one, two])
    # a number absent (None) from some evaluations: the mean of those that have it; from all: None; the token
    # efficiency that of the mean accuracy and length, 60 / sqrt(26), not the mean of the two
    assert mean.pop("te") == pytest.approx(60 / math.sqrt(26))
    assert mean == {"acc": 60.0, "len": 26.0, "acc_non_thinking": 20.0,
                    "by_level": {"1": {"acc": 20.0, "acc_thinking": None}}}  # fmt: skip


def test_the_checkpoints_of_the_evaluated_steps_are_kept():
    from fasttnt.compare.plan import checkpoint_overrides

    # a checkpoint every gcd of the steps, and all of them kept, the last step's too when it is no multiple
    settings = compare.CompareSettings(steps=80, eval_steps=(50,))
    assert checkpoint_overrides(settings) == ["save_every=50", "keep_checkpoints=2", "save_every_minutes=null"]
    assert checkpoint_overrides(compare.CompareSettings(steps=80, eval_steps=(50, 60, 70, 80)))[:2] == [
        "save_every=10", "keep_checkpoints=8"]  # fmt: skip
    assert checkpoint_overrides(compare.CompareSettings(steps=80, eval_steps=(30,)))[:2] == [
        "save_every=30", "keep_checkpoints=3"]  # saves at 30, 60 and 80  # fmt: skip
    assert checkpoint_overrides(compare.CompareSettings(steps=80))[:2] == ["save_every=80", "keep_checkpoints=1"]


def test_the_mode_the_table_paid_more_for_at_the_end():
    def rows(gaps, level="1"):  # a step's reward by mode at a level; None: no direct row that step
        return [{} if g is None else {f"reward_direct_l{level}": 1.0 + g, f"reward_thinking_l{level}": 1.0}
                for g in gaps]  # fmt: skip

    # the last 10 steps only: a margin of 0.05 every step (zero spread) is a clear preference for direct
    assert compare.preferred_mode(rows([-0.9] * 5 + [0.05] * 10), "1")["mode"] == "direct"
    clear = compare.preferred_mode(rows([-0.3, -0.2] * 5), "1")
    assert clear["mode"] == "thinking" and clear["gap"] == pytest.approx(-0.25)
    # within two standard errors of 0: a tie (mean 0.01, standard error 0.1 / sqrt(10))
    assert compare.preferred_mode(rows([0.11, -0.09] * 5), "1")["mode"] == "tie"
    # steps without both modes at the level are left out; fewer than two (no standard error): no preference
    assert compare.preferred_mode(rows([None] * 8 + [0.2, 0.3]), "1")["mode"] == "direct"
    assert compare.preferred_mode(rows([None] * 9 + [0.2]), "1") == {"mode": None, "gap": None, "se": None}
    assert compare.preferred_mode(rows([None] * 10), "1") == {"mode": None, "gap": None, "se": None}
    assert compare.preferred_mode(rows([0.2] * 10, level="2"), "1")["mode"] is None


def test_the_numbers_behind_the_report():
    assert compare.mean_se([1.0, 2.0, 3.0]) == {"mean": 2.0, "se": pytest.approx(1 / math.sqrt(3)), "n": 3}
    assert compare.mean_se([5.0, None]) == {"mean": 5.0, "se": 0.0, "n": 1}
    assert compare.mean_se([None])["mean"] is None
    # the paper's table: direct pays above (1 + p_t) / 3; a direct reward of 1.5: (1 + p_t) / 2.5; binary: p_t
    assert compare.direct_threshold(load_config(), 0.95) == pytest.approx(1.95 / 3)
    assert compare.direct_threshold(load_config(None, ["reward.direct_correct=1.5"]), 0.95) == pytest.approx(1.95 / 2.5)
    assert compare.direct_threshold(load_config(None, ["reward.scheme=binary"]), 0.7) == pytest.approx(0.7)
    assert compare.steps_to_solve([0.5] * 4 + [1.0] * 5) == 8  # steps 4-8: 0.5, 1, 1, 1, 1
    assert compare.steps_to_solve([0.88, 0.9, 0.92, 0.9, 0.9]) == 5
    assert compare.steps_to_solve([0.5] * 10) is None
    assert compare.seconds_to(2, [1.5, 2.0, 4.0]) == 3.5 and compare.seconds_to(None, [1.0]) is None
    # how a run trained: 12 steps, the first 10 and the last 10 overlapping; a step that trained nothing has no
    # token means (None), left out; the largest finite gradient norm, and the steps whose norm was not
    train = {"acc": [0.5] * 2 + [1.0] * 10, "entropy": [0.4] * 10 + [0.1, None], "kl": [None] * 11 + [0.02],
             "clip_frac": [0.0] * 11 + [0.5], "grad_norm": [0.3, 2.5, math.nan, math.inf, *[0.1] * 8]}  # fmt: skip
    assert compare.stability(train) == {
        "train_acc_last10": 1.0, "entropy_first10": pytest.approx(0.4),
        "entropy_last10": pytest.approx((8 * 0.4 + 0.1) / 9), "kl_last10": 0.02,
        "clip_frac_last10": pytest.approx(0.05), "max_grad_norm": 2.5, "nonfinite_grad_steps": 2,
    }  # fmt: skip


def test_bad_arguments_fail_before_training(tmp_path, capsys):
    assert cli_main(["compare", "--variants", "tnt,adaptive", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--variants: adaptive: unknown scheme or variant 'adaptive'" in capsys.readouterr().err
    assert cli_main(["compare", "--variants", "tnt:omega=-1", "--output-dir", str(tmp_path / "x")]) == 2
    assert "tnt:omega=-1: reward.omega: must be > 0" in capsys.readouterr().err
    assert cli_main(["compare", "--warmup-seeds", "0", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--warmup-seeds: must be >= 1" in capsys.readouterr().err
    assert cli_main(["compare", "--eval-per-level", "0", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--eval-per-level: must be >= 1, got 0" in capsys.readouterr().err
    assert cli_main(["compare", "--variants-file", str(tmp_path / "no.yaml"), "--output-dir", str(tmp_path / "x")]) == 2
    assert "--variants-file: " in capsys.readouterr().err
    assert cli_main(["compare", "--output-dir", str(tmp_path / "x"), "rollout.group_size=one"]) == 2
    assert "rollout.group_size: expected an int" in capsys.readouterr().err
    assert cli_main(["compare", "--temperatures", "0.6,x", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--temperatures: comma-separated numbers > 0, got '0.6,x'" in capsys.readouterr().err
    for steps in ("0", "81", "50,x"):  # --steps is 80
        assert cli_main(["compare", "--eval-steps", steps, "--output-dir", str(tmp_path / "x")]) == 2
        assert f"--eval-steps: comma-separated steps from 1 to --steps (80), got '{steps}'" in capsys.readouterr().err
    assert cli_main(["compare", "--first-seed", "-1", "--output-dir", str(tmp_path / "x")]) == 2
    assert "--first-seed: must be >= 0, got -1" in capsys.readouterr().err
    # the held-out split has levels 1-4: a mix of other levels cannot be its mix
    args = ["compare", "--output-dir", str(tmp_path / "x"), "data.levels=[1,2]", "data.level_weights=[3,1]"]
    assert cli_main(args) == 2
    assert "data.level_weights: the held-out split has levels 1-4, and data.levels is [1, 2]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_algorithms_combine_in_order():
    from fasttnt.variants import variant_overrides

    got = variant_overrides("tnt+mix+acc:direct_margin=0.1", load_config(None, []))
    assert got == ["reward.scheme=tnt", "rollout.forced_non_thinking=0.5", "reward.direct_margin=0.1"]
    assert load_config(None, got).reward.values.direct_correct == pytest.approx(1.1)


def test_a_variant_with_a_rollout_worker_is_launched_and_starts_where_the_colocated_one_does(tmp_path):
    # rollout.workers needs ranks of its own: compare launches that run as a world of 2 (compare.jobs.train). Its
    # first step samples the colocated run's prompts from the same weights with the same seeds (a worker at step 1
    # holds version 0 at any k), so both log the same first responses; the later steps trained on stale batches
    worker = "tnt:rollout.workers=1,rollout.max_staleness=1"
    args = _args(tmp_path, "--jobs", "1")
    args[args.index("--variants") + 1], args[args.index("--warmup-seeds") + 1] = f"tnt,{worker}", "1"
    # one thread in this process as in each launched one (compare gives each at least one): the same sums in the same
    # order, so the same first samples whatever the machine's cores
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert cli_main(args) == 0
    finally:
        torch.set_num_threads(threads)
    out = tmp_path / "cmp"
    summary = json.loads((out / "compare.json").read_text())
    (folder,) = (run for run in (out / "runs" / "w0-seed0").iterdir() if run.name != "tnt")
    assert (folder / "launch.log").is_file(), "precondition: the run was launched"
    rows = read_jsonl(folder / "metrics.jsonl")
    assert [r["staleness"] for r in rows] == [0, 1, 1]
    runs = {v: d["runs"][0]["train"] for v, d in summary["variants"].items()}
    assert runs[worker]["len"][0] == runs["tnt"]["len"][0] and runs[worker]["reward"][0] == runs["tnt"]["reward"][0]
