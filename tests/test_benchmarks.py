"""The benchmark scripts run end to end on tiny shapes (their numbers are measured elsewhere, never in tests)."""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import varied
from support.small import SEED, SMALL, deterministic, free_port, metric_rows, warmups

from fasttnt_kernels._lm_head import default_chunk_bytes

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str, env: dict | None = None, cwd: Path = ROOT) -> str:
    result = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=cwd, env={**os.environ, **(env or {})}
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def _module(name: str):
    """benchmarks/<name>.py as a module (benchmarks/ is no package), for the tests that run it in-process; its
    folder on the path, as when it runs as a script (the benchmarks import their shared modules by name)."""
    if str(ROOT / "benchmarks") not in sys.path:
        sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


def _csv_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_bench_kernels_smoke(tmp_path):
    # every op and every baseline that runs on the CPU: fasttnt's kernels under the interpreter; TRL's
    # selective_log_softmax (its eager fallback off CUDA) and ChunkedLogProbFunction (its torch tiles); the eager
    # per-sequence formulas. Liger's rows run where liger-kernel is installed and are skipped rows elsewhere.
    results = tmp_path / "results.csv"
    env = {"TRITON_INTERPRET": "1", "FASTTNT_KERNELS": "triton"}
    out = _run("benchmarks/bench_kernels.py", "--smoke", "--csv", str(results), env=env)
    rows = _csv_rows(results)
    assert f"{len(rows)} rows in" in out and "0 FAIL" in out  # every printed row reached the CSV
    ops = {r["op"] for r in rows}
    assert ops == {"token_logprobs", "linear_token_logprobs", "linear_policy_loss", "clipped_policy_loss",
                   "group_advantages", "mode_advantages", "tnt_rewards"}  # fmt: skip
    measured = [r for r in rows if r["fwd_ms"] or r["note"].startswith("not importable")]
    status = {(r["op"], r["provider"]): r for r in measured if not r["shape"].startswith("loss=")}
    # the other policy losses, each against TRL's loss of its loss_type and Liger's LigerFusedLinearGRPOLoss
    family = {(r["shape"].split()[0], r["provider"]): r for r in measured if r["shape"].startswith("loss=")}
    assert {loss for loss, _ in family} == {"loss=gspo", "loss=cispo", "loss=sapo", "loss=vespo"}
    for (loss, provider), row in family.items():
        module = {"fasttnt": "fasttnt_kernels", "trl": "trl", "liger": "liger_kernel"}[provider]
        installed = importlib.util.find_spec(module)
        assert row["status"] == ("ok" if installed else "skipped"), (loss, provider, row["note"])
        if row["status"] == "ok":
            assert float(row["out_err"]) < 1e-4 and float(row["grad_err"]) < 1e-4, (loss, provider)
    for op in ("token_logprobs", "linear_token_logprobs", "linear_policy_loss"):
        assert status[op, "fasttnt"]["status"] == "ok"
        assert float(status[op, "fasttnt"]["out_err"]) < 1e-4 and float(status[op, "fasttnt"]["grad_err"]) < 1e-4
        assert status[op, "trl"]["status"] == ("ok" if importlib.util.find_spec("trl") else "skipped")
    assert status["linear_policy_loss", "fasttnt (unfused)"]["status"] == "ok"
    assert status["mode_advantages", "fasttnt"]["status"] == "ok"
    assert status["linear_token_logprobs", "torch (materialised)"]["status"] == "ok"
    liger = "ok" if importlib.util.find_spec("liger_kernel") else "skipped"
    assert status["linear_token_logprobs", "liger"]["status"] == liger
    assert status["linear_policy_loss", "liger (fused linear CE)"]["status"] == liger
    memory = [r for r in rows if r["peak_mib"] and not r["fwd_ms"]]
    # at the trainer's own chunk on this device (the timed rows call the ops with the same default)
    mib = default_chunk_bytes(torch.device("cpu")) // 2**20
    assert mib != 128, "precondition: the trainer's chunk is not the script's former fixed 128 MiB"
    expected = {f"fasttnt ({mib} MiB chunks)", f"fasttnt linear_policy_loss ({mib} MiB chunks)", "torch (materialised)"}
    if importlib.util.find_spec("trl"):
        expected.add("trl (ChunkedLogProbFunction)")
    assert {r["provider"] for r in memory} == expected
    # the figure script reads what this one writes
    _run("benchmarks/plot_results.py", "--csv", str(results), "--out", str(tmp_path / "results.png"))
    assert (tmp_path / "results.png").stat().st_size > 0


def test_the_memory_rows_count_what_the_op_holds_and_not_what_was_freed_before_it(monkeypatch):
    # the materialised path holds the logits' gradient (N, V) while it forms the weight's (V, H): a floor on its
    # peak. The inputs' construction freed a (V, H) temporary (randn before the scaling) larger than the op's memory
    # beyond that floor (its logits and log-softmax, 2 N x V), which a peak since the process started would count as
    # room the op then reuses without a rise (measured that way, the rise here was 45-50 MiB)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # no per-thread BLAS scratch in the upper bound
    bench, proc_memory = _module("bench_kernels"), _module("proc_memory")
    assert proc_memory.available(), "precondition: /proc's high-water marks (Linux)"
    n, h, v = 256, 1024, 32768
    floor_mib, beyond_mib = 4 * (n * v + v * h) / 2**20, 4 * 2 * n * v / 2**20  # 160, 64 MiB
    assert 4 * v * h / 2**20 > beyond_mib, "precondition: the freed temporary outweighs the op's memory past the floor"
    rise = bench.child_peak_mib(bench.start_peak_child(n, h, v, "materialised", chunk_mib=128))
    assert floor_mib <= rise < floor_mib + beyond_mib + 4 * n * v / 2**20 + 64, rise


def test_bench_kernels_skips_what_does_not_fit_and_stops_at_its_deadline(tmp_path, capsys, monkeypatch):
    bench = _module("bench_kernels")
    made = []
    build = bench.build_cases

    def recording_build(args, device):
        cases = build(args, device)
        for case in cases:
            case.make = lambda make=case.make, op=case.op: made.append(op) or make()
        return cases

    monkeypatch.setattr(bench, "build_cases", recording_build)
    # a memory limit nothing fits: every case is a skipped row with its reason, and none of them made a tensor
    assert bench.main(["--smoke", "--memory-limit-gib", "0", "--csv", str(tmp_path / "small.csv")]) == 0
    rows = _csv_rows(tmp_path / "small.csv")
    assert len({r["op"] for r in rows}) == 7 and made == []
    assert all(r["status"] == "skipped" and "GiB free" in r["note"] and not r["fwd_ms"] for r in rows)
    # said as skipped, once per reason, so a summary never counts them as measured (gpu_check.sh)
    skipped_lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SKIPPED:")]
    assert skipped_lines and sum(int(line.split()[1]) for line in skipped_lines) == len(rows), skipped_lines
    # a deadline already past: nothing starts, and the run lists (and writes) what it did not run
    assert bench.main(["--smoke", "--max-seconds", "0", "--csv", str(tmp_path / "late.csv")]) == 0
    rows = _csv_rows(tmp_path / "late.csv")
    assert len({r["op"] for r in rows}) == 7 and made == []
    assert all(r["status"] == "not run" for r in rows)
    out = capsys.readouterr().out
    assert f"not run, past the 0 s deadline ({len(rows)} rows)" in out


def test_bench_kernels_fails_a_wrong_result_a_nan_and_a_missing_gradient():
    from fasttnt_kernels import clipped_policy_loss_reference

    bench = _module("bench_kernels")
    cpu = torch.device("cpu")
    case = bench.loss_case(3, 16, cpu)

    def loss(x):
        return clipped_policy_loss_reference(x["logp"], x["old"], x["adv"], x["cu"])[0]

    variants = {
        "right": loss,
        "1% off": lambda x: 1.01 * loss(x),
        "nan": lambda x: loss(x) * float("nan"),
        "no gradient": lambda x: loss(x).detach().requires_grad_(),
    }
    case.providers = [bench.Provider(name, lambda f=f: (f, "")) for name, f in variants.items()]
    rows = []
    bench.run_case(case, cpu, argparse.Namespace(memory_limit_gib=None), rows.append, math.inf)
    assert [r["status"] for r in rows] == ["ok", "FAIL", "FAIL", "FAIL"]
    assert rows[2]["out_err"] == math.inf and "no gradient reached logp" in rows[3]["note"]
    assert all(r["fwd_ms"] >= 0 for r in rows)  # a failing row is still timed


def test_bench_kernels_losses_only_runs_the_policy_losses_with_the_baselines_asked_for():
    bench = _module("bench_kernels")
    args = argparse.Namespace(providers="trl", losses_only=True, tokens=[24, 48], hidden=[16], vocab=300, smoke=True)
    cases = bench.build_cases(args, torch.device("cpu"))
    # per shape: the vanilla fused loss, then each loss of the family; fasttnt's rows always, then TRL's alone
    family = [f"loss={x}" for x in bench.FAMILY]
    assert [c.shape.split()[0] for c in cases] == ["N=24", *family, "N=48", *family]
    assert [p.name for p in cases[0].providers] == ["fasttnt", "fasttnt (unfused)", "trl"]
    assert all([p.name for p in c.providers] == ["fasttnt", "trl"] for c in cases if c.shape.startswith("loss="))


def test_bench_kernels_csv_is_written_row_by_row(tmp_path):
    bench = _module("bench_kernels")
    path = tmp_path / "results.csv"
    # a file from before the status columns: rewritten once under the new header, its rows kept
    path.write_text("date,device,op,shape,provider,fwd_ms\n2026-11-30,cpu,token_logprobs,N=1,fasttnt,1.5\n")
    log = bench.CsvLog(path, {"date": "2026-12-01", "device": "cpu"})
    assert path.read_text().splitlines()[0] == ",".join(bench.FIELDS)
    assert _csv_rows(path)[0]["fwd_ms"] == "1.5"
    # each row is on disk as soon as it is written: a run killed by a timeout keeps it
    for i in range(2):
        log.write({"op": "token_logprobs", "shape": "N=2", "provider": "fasttnt", "status": "ok", "fwd_ms": 2.0})
        rows = _csv_rows(path)
        assert len(rows) == 2 + i and rows[-1]["fwd_ms"] == "2" and rows[-1]["date"] == "2026-12-01"


def test_quickstart_spread_runs_each_seed_from_an_empty_cache_once(tmp_path):
    # a short run per seed, one thread: each trains its own warm-up (its cache folder starts empty), and the table
    # holds each run's last-5 means and their range; a second call runs nothing again
    overrides = [o for o in SMALL if not o.startswith("warmup.seed=")]
    overrides += ["warmup.steps=3", "warmup.batch_size=8", "steps=10", "save_every=10"]  # the first and last 5 steps
    args = ["benchmarks/quickstart_spread.py", "--seeds", "0", "1", "--out", str(tmp_path), *overrides]
    _run(*args)
    spread = json.loads((tmp_path / "spread.json").read_text())
    assert [r["run"] for r in spread["runs"]] == ["seed0-threads1", "seed1-threads1"]
    for seed in (0, 1):
        (entry,) = (tmp_path / f"seed{seed}-threads1" / "cache").iterdir()  # its own warm-up, trained here
        assert (entry / "warmup.json").is_file() and json.loads((entry / "warmup.json").read_text())["seed"] == seed
    last = [r["last"]["acc"] for r in spread["runs"]]
    assert spread["last_range"]["acc"] == [min(last), max(last)]
    walls = [json.loads((tmp_path / f"seed{s}-threads1" / "wall.json").read_text()) for s in (0, 1)]
    out = _run(*args)
    assert "exit 0 after" not in out  # nothing ran again
    assert walls == [json.loads((tmp_path / f"seed{s}-threads1" / "wall.json").read_text()) for s in (0, 1)]


def test_a_rollout_worker_on_policy_and_one_step_off(tmp_path):
    # benchmarks/pipeline_overlap.py's three layouts, 4 steps of the small model with rewards that vary by
    # construction (support/varied.py) and the entropy bonus, so every step moves the weights:
    # - k = 0: the worker generates step t + 1 with the weights step t made, which the trainer pushed: the same
    #   samples, rewards and updates as one process generating between its updates, every logged value alike, and
    #   the stale-weight guard checks the worker's copy;
    # - k = 1: step t's batch was generated (while step t - 1 updated) with step t - 2's weights, never older; the
    #   rollout correction (auto: token-truncate at k >= 1) weighs it, and the pushes of versions 1 and 2 are
    #   checked with the batches of steps 3 and 4 (the worker's log-probs of a probe under each, against the trainer's)
    overrides = [f"cache_dir={warmups(tmp_path)}", *SMALL, varied.OVERRIDE, "optim.lr=1e-2", "loss.entropy_coef=0.01"]
    env = {**os.environ, "PYTHONPATH": varied.PYTHONPATH}
    out = _run("benchmarks/pipeline_overlap.py", "--steps", "4", "--skip", "1", "--out", str(tmp_path / "runs"),
               "--json", str(tmp_path / "overlap.json"), "--port", str(free_port()), "--module", varied.MODULE,
               *overrides, env=env)  # fmt: skip
    result = json.loads((tmp_path / "overlap.json").read_text())
    assert set(result["median_step_s"]) == {"colocated", "worker_k0", "worker_k1"} and "k1_over_perfect_overlap" in out
    assert result["k0_generation_s"] > 0 and result["k0_update_s"] > 0
    single, k0, k1 = (metric_rows(tmp_path / "runs" / name) for name in ("colocated", "worker_k0", "worker_k1"))
    assert all(r["grad_norm"] > 0 for r in single), "precondition: every step moves the weights"
    assert [(r["weight_version"], r["staleness"]) for r in k0] == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert all(r["rollout_logp_diff"] < 1e-6 for r in k0)
    for a, b in zip(single, k0, strict=True):
        b = {k: v for k, v in deterministic(b).items() if k not in ("weight_version", "staleness")}
        assert deterministic(a) == {k: v for k, v in b.items() if not k.startswith("worker_")}
    assert [(r["weight_version"], r["staleness"]) for r in k1] == [(0, 0), (0, 1), (1, 1), (2, 1)]
    assert all(r["worker_time_idle"] >= 0 and r["time_wait"] >= 0 for r in k0 + k1), "each side's idle seconds"
    assert k1[0]["rollout_is_mean"] == pytest.approx(1.0, abs=1e-5), "step 1: the start's own weights"
    assert any(abs(r["rollout_is_mean"] - 1.0) > 1e-4 for r in k1[1:]), "precondition: the batches were stale"
    assert all(r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in k1)
    assert ["worker_logp_diff" in r for r in k1] == [False, False, True, True]
    assert all(r["worker_logp_diff"] < 1e-6 for r in k1[2:])


def test_train_throughput_smoke():
    out = _run("benchmarks/train_throughput.py", "--smoke")
    assert "tokens/s" in out and "MFU" in out
    # the update's own fused loss ran: its entropy, within a tenth of uniform's ln V at random weights
    entropy, uniform = (float(x) for x in re.search(r"token entropy ([\d.]+) \(ln V ([\d.]+)", out).groups())
    assert abs(entropy - uniform) < 0.1 * uniform, out


def test_decode_step_ab_smoke(tmp_path):
    # this checkout's written-out step, transformers' forward and (in a git checkout) the first commit that had one
    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model

    tok = build_char_tokenizer()
    build_tiny_model(
        tok, TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=0
    ).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    against = ["--against", "86124f2"] if (ROOT / ".git").exists() else []
    shape = ["--rounds", "1", "--prompts", "2", "--samples", "2", "--max-new-tokens", "6"]
    out = _run("benchmarks/decode_step_ab.py", str(tmp_path), *shape, *against)
    lines = out.splitlines()
    assert lines[1].startswith("this checkout ") and lines[2].startswith("transformers ")
    assert "this checkout / it" in lines[2] and lines[-1].startswith("the same tokens every round: ")
    if against:
        assert lines[3].startswith("86124f2 ")


def test_rollout_engines_smoke(tmp_path):
    # the hf engine with and without its written-out decode step (the vllm one needs vLLM: the README's vLLM
    # environment runs the full comparison)
    overrides = [*SMALL, "warmup.steps=3", "warmup.batch_size=8", f"cache_dir={tmp_path}"]
    out = _run("benchmarks/rollout_engines.py", "--engines", "hf,hf-transformers", "--rounds", "1", *overrides)
    lines = out.splitlines()
    assert "tokens/s median" in out and lines[-4].startswith("hf ") and lines[-3].startswith("hf-transformers ")
    assert lines[-2].startswith("hf: forwards ") and "generate / forward" in lines[-2]  # the hf engine's time split
    assert lines[-1].startswith("ratio hf-transformers / hf: ")


def test_lm_head_floor_smoke(tmp_path):
    shape = ["--vocab", "512", "--hidden", "32", "--decode-steps", "3", "--train-tokens", "100", "--chunk-rows", "40"]
    out = _run("benchmarks/lm_head_floor.py", *shape, "--repeats", "1", "--json", str(tmp_path / "f.json"))
    result = json.loads((tmp_path / "f.json").read_text())
    assert [r["calls"] for r in result["ops"]] == [3, 2.5, 2.5, 2.5]  # per step: 3 decode steps, 100 / 40 chunks
    assert result["floor_seconds"] == pytest.approx(sum(r["seconds"] for r in result["ops"]))
    assert out.splitlines()[-1].startswith("the lm_head alone, per step")


def test_packed_attention_check_smoke():
    out = _run("benchmarks/packed_attention_check.py", "--smoke")
    assert "packed attention sdpa_padded" in out and out.rstrip().endswith("OK")
    assert "SKIPPED: flash-attn's varlen kernel (the CPU runs no FlashAttention)" in out  # said, not passed as checked


def test_cpu_packed_attention_smoke():
    out = _run("benchmarks/cpu_packed_attention.py", "--reps", "1")
    assert "this checkout" in out and "one chunk" in out


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
    assert len(numbers["fasttnt"]["steps_s"]) == len(numbers["trl"]["steps_s"]) == 3  # turn by turn, every step
    # the order reversed every other step: over 3 steps one trainer went first twice, the other once
    assert sorted([numbers["fasttnt"]["went_first"], numbers["trl"]["went_first"]]) == [1, 2]
    assert numbers["ratio_steps_per_s"] > 0
    assert "fasttnt steps/s / TRL steps/s" in out


def test_e2e_commits_runs_two_checkouts_side_by_side(tmp_path):
    # HEAD against the working tree: each worker imports fasttnt from its own export (e2e.use_checkout refuses
    # another), both start from the model this checkout warmed up, and the ratio pairs their steps
    if not (ROOT / ".git").exists():
        pytest.skip("e2e_commits.py exports commits of a git checkout")
    overrides = [*SMALL, "warmup.steps=3", "warmup.batch_size=8"]
    out = _run(
        str(ROOT / "benchmarks" / "e2e_commits.py"), "HEAD", "WORKTREE", "--runs", "1", "--steps", "2",
        "--warmup-steps", "1", "--prompts", "4", "--samples", "4", "--max-new-tokens", "16",
        "--cache-dir", str(tmp_path / "cache"), "--json", str(tmp_path / "commits.json"), "--override", *overrides,
        cwd=tmp_path,
    )  # fmt: skip
    numbers = json.loads((tmp_path / "commits.json").read_text())
    (run,) = numbers["runs"]
    base, change = numbers["base"], numbers["change"]
    assert base.startswith("base ") and change == "change worktree"
    for name in (base, change):
        assert len(run[name]["steps_s"]) == 3 and "update" in run[name]["phases_s"], name
    paired = sorted(b / c for b, c in zip(run[base]["steps_s"][1:], run[change]["steps_s"][1:], strict=True))
    assert numbers["summary"]["change_over_base"] == run["change_over_base"] == (paired[0] + paired[1]) / 2
    assert f"{change} steps/s / {base} steps/s" in out
    assert list((tmp_path / "cache").iterdir()), "the start model was warmed up in --cache-dir"


def test_e2e_against_trl_on_a_model_folder_at_the_real_vocabulary(tmp_path):
    # --model and --prompt-file: the stand-in's real BPE and V = 151,936 at hidden 64, through both trainers
    pytest.importorskip("trl")
    standin = _module("qwen_standin")
    folder = standin.build(tmp_path / "model", "test")
    sums = standin.write_sums(tmp_path / "sums.jsonl", 8)
    out = _run(
        str(ROOT / "benchmarks" / "e2e.py"), "--model", str(folder), "--prompt-file", str(sums), "--steps", "1",
        "--warmup-steps", "1", "--prompts", "2", "--samples", "2", "--max-new-tokens", "6",
        "--json", str(tmp_path / "e2e.json"), "--override", "verify_workers=1", cwd=tmp_path,
    )  # fmt: skip
    numbers = json.loads((tmp_path / "e2e.json").read_text())
    for name in ("fasttnt", "trl"):
        r = numbers[name]
        assert len(r["steps_s"]) == 2 and r["generated_tokens"] > 0, name
        # the update's window lies within the run, and the memory of its own process (a model of 9.8M parameters
        # and the 151,936-row embedding's gradient and Adam states are resident: far above an empty interpreter's)
        assert 0 < r["update_peak_mib"] <= r["peak_rss_mib"] and r["update_rise_mib"] >= 0, name
    assert "fasttnt / TRL peak memory: during the update" in out and str(folder) in out


PEAKS_SCRIPT = """
import json, sys
sys.path.insert(0, sys.argv[1])
import proc_memory
peaks = proc_memory.Peaks()
before = bytearray(256 << 20)  # zero-filled: resident
del before
peaks.start_window()
inside = bytearray(64 << 20)
del inside
window = peaks.end_window()
print(json.dumps({**window, "run_peak_mib": peaks.run_peak()}))
"""


def test_the_peak_window_sees_an_allocation_inside_it_and_not_one_before():
    # in a fresh interpreter, whose allocator returns a freed 256 MiB block to the system (a long-lived process
    # may keep freed blocks resident and serve the next allocation from them, which no window could see)
    got = json.loads(_run("-c", PEAKS_SCRIPT, str(ROOT / "benchmarks")))
    # the 64 MiB inside counted, the 256 MiB before not (the mark was reset to the resident set at the start)
    assert 60 <= got["rise_mib"] < 200, got
    assert got["run_peak_mib"] >= got["peak_mib"] + 120, got  # the run's peak kept the 256 MiB


def test_trl_loss_smoke(tmp_path):
    pytest.importorskip("trl")
    overrides = [*SMALL, "warmup.steps=3", "warmup.batch_size=8"]
    out = _run(
        str(ROOT / "benchmarks" / "trl_loss.py"), "--rounds", "1", "--json", str(tmp_path / "trl.json"),
        "--steps", "1", "--warmup-steps", "1", "--prompts", "4", "--samples", "4", "--max-new-tokens", "16",
        "--cache-dir", str(tmp_path / "cache"), "--override", *overrides, cwd=tmp_path,
    )  # fmt: skip
    numbers = json.loads((tmp_path / "trl.json").read_text())
    assert numbers["trl"]["step_s"] > 0 and numbers["fasttnt"]["step_s"] > 0
    assert numbers["fasttnt"]["peak_rss_mib"] > 0 and "steps/s with fasttnt's loss" in out


# a stand-in for the interpreter gpu_check.sh runs each part with (its PYTHON): each part's outcome chosen by the
# script it is given, so that the check's own verdicts are tested here; the parts themselves run for real in the
# tests around this one (their --smoke runs)
_PARTS = """#!/bin/sh
case "$*" in
  "-m pytest "*) echo "3 passed, 1 skipped"; echo "SKIPPED [1] tests/kernels/test_dispatch.py:51: needs CUDA" ;;
  *bench_kernels.py*) echo "SKIPPED: 4 rows: not importable: No module named 'liger_kernel'" ;;
  *packed_attention_check.py*) echo "OK" ;;
  *train_throughput.py*) echo "step median 1 ms" ;;
  *gpu_loop.py*) echo "embedded default: loss finite at every step: False"; exit 1 ;;
  *) exit 0 ;;  # the versions printed, pytest-xdist looked for
esac
"""


def test_gpu_check_says_ok_skipped_or_failed_per_part(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(_PARTS)
    fake.chmod(0o755)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake)}
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke", str(out)],
                            capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert result.returncode == 1, result.stdout  # a part failed
    verdicts = dict(
        line.split(": ", 1) for line in (out / "summary.txt").read_text().splitlines() if line.startswith(
            ("kernel_tests:", "bench_kernels:", "packed_attention:", "train_throughput:", "gpu_loop:"))
    )  # fmt: skip
    assert verdicts["kernel_tests"].startswith("SKIPPED in part: SKIPPED [1] tests/kernels/test_dispatch.py:51")
    assert verdicts["bench_kernels"].startswith("SKIPPED in part: SKIPPED: 4 rows: not importable")
    assert verdicts["packed_attention"].startswith("OK") and verdicts["train_throughput"].startswith("OK")
    assert verdicts["gpu_loop"].startswith("FAILED (exit 1)")
    assert "FAILED: gpu_loop; skipped in part: kernel_tests bench_kernels" in (out / "summary.txt").read_text()
    # each part's output kept as it came, and nothing else: a handful of small files to copy back
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["summary.txt", "kernel_tests.txt", "bench_kernels.txt", "packed_attention.txt", "train_throughput.txt",
         "gpu_loop.txt"])  # fmt: skip


def test_gpu_loop_keeps_each_finished_run_when_a_later_one_fails(tmp_path, monkeypatch):
    # as a run stopped at its time limit: the JSON holds every run that ended before it
    gpu_loop = _module("gpu_loop")
    train = gpu_loop.train

    def second_fails(name, *args):
        if name == "real vocabulary":
            raise KeyboardInterrupt("stopped at the limit")
        return train(name, *args)

    monkeypatch.setattr(gpu_loop, "train", second_fails)
    with pytest.raises(KeyboardInterrupt):
        gpu_loop.main(["--smoke", "--out", str(tmp_path)])
    runs = json.loads((tmp_path / "gpu_loop.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["embedded default"] and runs[0]["loss_finite"]


def test_gpu_loop_smoke(tmp_path):
    # the GPU check's loop script, run on the CPU with its --smoke shapes, so its own code has run before a GPU does
    out = _run("benchmarks/gpu_loop.py", "--smoke", "--out", str(tmp_path))
    assert "embedded default: 1 steps, loss finite at every step: True" in out and out.rstrip().endswith("OK")
    assert "SKIPPED: DeepSpeed's autocast section (--smoke)" in out  # said, never passed as checked
    runs = json.loads((tmp_path / "gpu_loop.json").read_text())["runs"]
    assert [r["run"] for r in runs] == ["embedded default", "real vocabulary"]
    assert all(r["update_ran"] and r["skipped_seq_frac"] == [0.0] for r in runs)  # every sequence trained
    # the runs' folders (the stand-in model, checkpoints: GBs at the real shape) went to a temporary folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_loop.json"]
    assert all(0 <= r["rollout_logp_diff_max"] < 1e-4 for r in runs)  # float32 on the CPU: the same weights


def test_choice_probes_statistics():
    # auroc: the share of (positive, negative) pairs ranked right, ties counted half, against the pairs counted;
    # the probe: a level planted as a one-hot (margin 1 against noise of 0.01) is read perfectly out of fold,
    # and features that say nothing of it (constant) give scores that tie: AUROC exactly 1/2
    probe = _module("choice_probe")
    gen = torch.Generator().manual_seed(SEED)
    scores = torch.randint(0, 5, (40,), generator=gen).double()  # many ties
    positive = torch.arange(40) % 3 == 0
    pairs = [(s > t) + 0.5 * (s == t) for s in scores[positive] for t in scores[~positive]]
    assert probe.auroc(scores, positive) == pytest.approx(float(sum(pairs)) / len(pairs), abs=1e-12)
    with pytest.raises(ValueError, match="both classes"):
        probe.auroc(scores, torch.zeros(40, dtype=torch.bool))
    levels = torch.arange(80) % 4 + 1  # (n,) levels 1-4
    states = torch.nn.functional.one_hot(levels - 1, 4).float() + 0.01 * torch.randn(80, 4, generator=gen)  # (n, H)
    logp = torch.randn(80, generator=gen)  # a choice that ignores the level
    row = probe.choice_probe(states, logp, levels)
    assert row["probe_auroc"] == 1.0 and row["probe_accuracy"] == 1.0
    assert row["choice_auroc"] == pytest.approx(probe.auroc(logp, levels == 1))
    assert row["think_end_logp_l2"] == pytest.approx(logp[levels == 2].mean().item(), rel=1e-6)
    flat = probe.choice_probe(torch.ones(80, 4), logp, levels)
    assert flat["probe_auroc"] == 0.5


def test_choice_probe_reads_each_prompts_first_position_and_a_runs_models_in_order(tmp_path):
    # the batched, right-padded pass gives each prompt's own state and log pi(</think>) (a pass of the prompt alone);
    # --run finds a run's warm-up (step 0), its checkpoints and final/, and writes one row each
    from support.small import run_overrides, train
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fasttnt.data import build_prompt, think_end_token_id

    _, rows = train(tmp_path, "run", *run_overrides(tmp_path, steps=4)[1:])
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    probe = _module("choice_probe")
    final = tmp_path / "run" / "final"
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    problems = probe.synthetic_problems(3, (1, 2, 4))
    assert len(problems) == 106 and len({len(p) for p, _ in problems}) > 1  # prompts of several lengths: padding
    prompts = [build_prompt(tokenizer, text).text for text, _ in problems]
    end = think_end_token_id(tokenizer)
    states, logp = probe.first_position(model, tokenizer, prompts, end, 0.6, batch=32)
    for i in (0, 50, 105):
        ids = torch.tensor([tokenizer(prompts[i], add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            out = model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(states[i], out.hidden_states[-1][0, -1], rtol=1e-4, atol=1e-5)
        alone = torch.log_softmax(out.logits[0, -1] / 0.6, -1)[end]
        assert abs(logp[i].item() - alone.item()) < 1e-4
    out = tmp_path / "probe.jsonl"
    _run("benchmarks/choice_probe.py", "--run", str(tmp_path / "run"), "--per-level", "20", "--out", str(out))
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in written] == [0, 2, 4]  # the warm-up, checkpoints/step-2, final/ (step 4)
    assert all(0 <= r["probe_auroc"] <= 1 and 0 <= r["choice_auroc"] <= 1 for r in written)
    assert written[0]["model"] != written[1]["model"]


def test_choice_grid_holds_each_run_against_free_tnts_run_of_its_seed():
    # a summary as fasttnt compare writes it (the keys choice_grid reads), two seeds of free TNT and of a recipe: one
    # recipe run meets every target, the other misses each in turn where its numbers cross the bound
    grid = _module("choice_grid")

    def run(seed, acc, length, direct, most, acc_l=(100, 100, 100, 100), hack=0.0, pays2=False):
        by = {lv: {"acc": a, "non_thinking_ratio": d, "most_non_thinking": m,
                   "direct_pays": pays2 if lv == "2" else False}
              for lv, a, d, m in zip("1234", acc_l, direct, most, strict=True)}  # fmt: skip
        return {"warmup": 0, "seed": seed, "acc": acc, "len": length, "hack_rate": hack, "by_level": by}

    free = [run(3, 90.0, 40.0, (0, 0, 0, 0), (0, 0, 0, 0)), run(4, 90.0, 40.0, (0, 0, 0, 0), (0, 0, 0, 0))]
    recipe = [
        run(3, 88.0, 38.0, (0.95, 0.0, 0.0, 0.0), (1.0, 0.2, 0.01, 0.0)),
        run(4, 87.0, 41.0, (0.85, 0.6, 0.0, 0.0), (1.0, 0.7, 0.02, 0.0), hack=0.03),
    ]
    summary = {"settings": {"eval": {"temperature": 0.6}},
               "variants": {"tnt": {"runs": free}, "recipe": {"runs": recipe}}}  # fmt: skip
    args = argparse.Namespace(easy_direct=0.9, hard_direct=0.01, acc_within=2.5, hack=0.02, tokens_over_opt=None)
    rows = {(r["variant"], r["seed"]): r for r in grid.run_rows(summary, "tnt", args, {})}
    assert rows[("recipe", 3)]["misses"] == [] and rows[("recipe", 3)]["tokens"] == pytest.approx(0.95)
    assert rows[("recipe", 4)]["misses"] == ["l1", "l3-4", "l2", "acc", "tok", "hack"]
    assert rows[("recipe", 4)]["d_acc"] == pytest.approx(-3.0)
    assert rows[("tnt", 3)]["d_acc"] is None and rows[("tnt", 3)]["misses"] is None  # the baseline: not judged
    table = grid.markdown(list(rows.values()))
    assert "| 0.6 | recipe | 4 | 87.0 | -3.0 | 1.02 |" in table
    assert "| 0.6 | recipe | 2 | 87.5 ± 0.5 | -2.5 ± 0.5 | 0.99 |" in grid.means(list(rows.values()))
    with pytest.raises(SystemExit, match="no variant 'free'"):
        grid.run_rows(summary, "free", args, {})
    # T_opt from the warm-up's forced-mode lengths, each level in the mode its table pays for (level 2 direct here),
    # weighted by the split's responses: (10 * 30 + 50 * 12 + 50 * 50 + 50 * 60) / 160 = 40.0 against free TNT's 40
    summary["warmups"] = {"0": {"len_think": {"1": 30, "2": 40, "3": 50, "4": 60},
                                "len_direct": {"1": 11, "2": 12, "3": 13, "4": 14},
                                "responses": {"1": 10, "2": 50, "3": 50, "4": 50}}}  # fmt: skip
    recipe[0]["by_level"]["2"]["direct_pays"] = True
    args.tokens_over_opt = 0.1
    rows = {(r["variant"], r["seed"]): r for r in grid.run_rows(summary, "tnt", args, {})}
    assert rows[("recipe", 3)]["t_opt"] == pytest.approx((10 * 30 + 50 * 12 + 50 * 50 + 50 * 60) / 160)
    assert rows[("recipe", 3)]["misses"] == ["l2"]  # 38 tokens <= T_opt + 0.1 * 40; level 2 should be direct now


def test_choice_attribution_runs_and_summarises_the_spill(tmp_path):
    # two steps of a mode-mixed run on the suite's tiny model: a row per step whose pushes on each level's choice are
    # finite and, where a level's forced rows pushed its own choice, summarised as each level's spill
    from support.small import short_run

    out = tmp_path / "attr"
    args = ["benchmarks/choice_attribution.py", str(out), "--variant", "tnt+mix+acc", "--steps", "2",
            f"cache_dir={warmups(tmp_path)}", *short_run(steps=2)]  # fmt: skip
    _run(*args, env={"OMP_NUM_THREADS": "1"})
    rows = [json.loads(line) for line in (out / "attribution.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    pushes = [v for r in rows for k, v in r.items() if k.startswith("push_")]
    assert pushes and all(math.isfinite(v) for v in pushes) and any(v != 0 for v in pushes)
    summary = _run("benchmarks/choice_attribution.py", "--summary", str(out / "attribution.jsonl"))
    assert "the direct rows' other tokens push, median per step" in summary
    synthetic = [{"step": 1, "push_forced_first_l1->l1": 2.0, "push_forced_first_l1->l2": 0.5},
                 {"step": 2, "push_forced_first_l1->l1": 4.0, "push_forced_first_l1->l2": 0.4}]  # fmt: skip
    spill = _module("choice_attribution").spill_summary(synthetic)
    assert spill[0] == "  level 1's push (2 steps) spills onto l2 +0.175 (+0.100..+0.250)"
