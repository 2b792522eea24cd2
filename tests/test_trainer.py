"""The GRPO trainer end to end on a very small tiny model: outputs, packing, resume equality, mini-batches, epochs
and KL, the run's one-line errors, the engine guard and the learning-rate schedule (the update itself, the config and
the checkpoints: test_actor.py, test_config.py, test_checkpoint.py). Real runs, seconds each. Tests of what the
update does run with rewards that vary by construction (support/varied.py) and first assert that their steps had a
gradient."""

from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import varied
from support.small import TINY_4_HEADS, deterministic, metric_rows, run_overrides, short_run, train
from transformers import AutoModelForCausalLM, AutoTokenizer

from fasttnt.checkpoint import list_checkpoints
from fasttnt.cli import main as cli_main
from fasttnt.config import load_config
from fasttnt.embedded.tiny import TinyModelConfig
from fasttnt.guard import stale_weights
from fasttnt.step_metrics import TOKEN_METRICS
from fasttnt.trainer import Trainer


def test_a_run_writes_every_output(tmp_path):
    _, rows = train(tmp_path, "run", *short_run())
    out = tmp_path / "run"
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    needed = {
        "step",
        "reward",
        "acc",
        "non_thinking_ratio",
        "len",
        "len_thinking",
        "len_non_thinking",
        "limit_mean",
        "hack_rate",
        "loss",
        "grad_norm",
        "skipped_seq_frac",
        "micro_batches",
        "lr",
        "generated_tokens_per_s",
        "trained_tokens_per_s",
        "time_generate",
        "time_verify",
        "time_reward",
        "time_logprobs",
        "time_update",
    }
    for row in rows:
        assert needed <= set(row), needed - set(row)
        # the token means are measured on the sequences trained on: absent (never NaN) when all were skipped
        assert (set(TOKEN_METRICS) <= set(row)) == (row["skipped_seq_frac"] < 1), row
    assert all(v == v for r in rows for v in r.values()), "NaN in the metrics"
    # the resolved config, reloadable
    assert load_config(out / "config.yaml") == load_config(None, run_overrides(tmp_path))
    assert [p.name for p in list_checkpoints(out / "checkpoints")] == ["step-000002", "step-000004"]
    model = AutoModelForCausalLM.from_pretrained(out / "final")  # Hugging Face format, safetensors
    assert (out / "final" / "model.safetensors").is_file()
    assert model.config.model_type == "qwen2"
    assert (out / "curves.png").stat().st_size > 10_000
    # the tokenizer is saved once (out/tokenizer) and its files copied byte for byte where a model folder needs it
    saved = {f.name: f.read_bytes() for f in (out / "tokenizer").iterdir()}
    assert "tokenizer_config.json" in saved  # precondition: a saved tokenizer
    for folder in (out / "final", out / "checkpoints" / "step-000004"):
        assert {name: (folder / name).read_bytes() for name in saved} == saved
        assert AutoTokenizer.from_pretrained(folder)("12+3").input_ids  # and it loads from there


def _draw_after_each_step(monkeypatch) -> list[tuple]:
    """Every step followed by one draw from each global RNG (torch, random, numpy), recorded: nothing in the
    trainer draws from them today, so this is what shows that a resume restores their states (and a checkpoint
    saved after a step then holds the state after its draws, not the seed's)."""
    draws: list[tuple] = []
    real_step = Trainer.step

    def step(self):
        values = real_step(self)
        draws.append((values["step"], torch.rand(1).item(), random.random(), float(np.random.rand())))
        return values

    monkeypatch.setattr(Trainer, "step", step)
    return draws


def _scramble_global_rngs() -> None:
    """What a new process would hold: the resumed run must not inherit the state the first part left behind."""
    torch.manual_seed(987654321)
    random.seed(987654321)
    np.random.seed(98765)


def test_resume_reproduces_the_uninterrupted_run(tmp_path, monkeypatch):
    # rewards that vary by construction: every step before the resume point moves the weights and AdamW's moments,
    # so a resume that skips any restored piece (model, optimizer, the step that sets the learning rate, the data
    # position, the RNG states) changes the metrics of steps 3 and 4, or the draws after them
    draws = _draw_after_each_step(monkeypatch)
    _, straight = train(tmp_path, "straight", *short_run(varied.OVERRIDE))
    assert all(r["grad_norm"] > 0 and r["skipped_seq_frac"] < 1 for r in straight), "a step without a gradient"
    straight_draws = list(draws)
    draws.clear()
    train(tmp_path, "resumed", *short_run(varied.OVERRIDE, "steps=2"))
    _scramble_global_rngs()
    _, resumed = train(tmp_path, "resumed", *short_run(varied.OVERRIDE), resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]
    assert draws == straight_draws, "the global RNG states after a resume are not the uninterrupted run's"
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["data_position"] == 4 * 4  # 4 steps of 4 prompts (support/small.py)


def test_cli_train_runs(tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "fasttnt", "train", "--output-dir", str(out), *run_overrides(tmp_path, "steps=2")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "first" in result.stdout and "generate" in result.stdout  # the summary table
    assert (out / "final" / "config.json").is_file()


def test_mini_batches_epochs_and_kl_run(tmp_path):
    # several optimizer steps per rollout, old log-probs, a reference model, and the entropy bonus
    _, rows = train(
        tmp_path, "run", *short_run(varied.OVERRIDE, "loss.mini_batches=2", "loss.ppo_epochs=2", "loss.kl_coef=0.05",
        "steps=2", "loss.entropy_coef=0.01", "optim.lr=1e-2", "optim.warmup_steps=0"),
    )  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert rows[1]["kl_ref"] > 0  # the policy moved away from the reference
    assert all(r["loss"] == r["loss"] for r in rows)


@pytest.mark.parametrize("policy_loss", ["gspo", "cispo", "sapo", "vespo"])
def test_each_policy_loss_trains_through_the_loop(tmp_path, policy_loss):
    # the other policy-gradient terms through the trainer's fused update, with old log-probs (2 epochs) and the KL
    _, rows = train(
        tmp_path, "run", *short_run(varied.OVERRIDE, f"loss.policy_loss={policy_loss}", "loss.ppo_epochs=2",
        "loss.kl_coef=0.05", "steps=2", "loss.agg=seq-mean-token-mean"),
    )  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 and math.isfinite(r["loss"]) for r in rows)
    if policy_loss in ("sapo", "vespo"):
        assert all(r["clip_frac"] == 0 for r in rows)  # a soft gate, a smooth weight: nothing is clipped


def test_resume_from_a_dataset_file(tmp_path):
    # a file-backed problem stream: the position after a resume continues the seeded epoch order
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a + 1}", "answer": str(2 * a + 1)}) + "\n" for a in range(7)))
    extra = (f"data.train={data}", "data.hack_markers=synthetic", "data.instruction=", varied.OVERRIDE)
    _, straight = train(tmp_path, "straight", *short_run(*extra))
    assert all(r["grad_norm"] > 0 for r in straight), "a step without a gradient"
    train(tmp_path, "resumed", *short_run(*extra, "steps=2"))
    _, resumed = train(tmp_path, "resumed", *short_run(*extra), resume=True)
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]


def test_a_fresh_run_will_not_overwrite_another_runs_checkpoints(tmp_path, capsys):
    train(tmp_path, "run", *short_run("steps=2"))
    args = ["train", "--output-dir", str(tmp_path / "run"), *run_overrides(tmp_path, "steps=2")]
    assert cli_main(args) == 2
    assert "holds checkpoints of an earlier run (step-000002): pass --resume" in capsys.readouterr().err


def test_bad_data_is_reported_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1"}\n')
    own_cache = f"cache_dir={tmp_path / 'cache'}"
    args = ["train", "--output-dir", str(tmp_path / "out"), *run_overrides(tmp_path, f"data.train={bad}", own_cache)]
    assert cli_main(args) == 2
    assert "bad.jsonl: row 1: missing field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists(), "the model was built before the data was checked"


def test_rollout_correction_metrics_are_logged(tmp_path):
    # the hf engine reports what it sampled with; on the CPU the trainer's log-probs differ from it by float noise.
    # At one mini-batch the correction is formed in the update's own pass, over the tokens trained on: the varied
    # rewards give every step some (a step that trains none logs no rollout metric)
    overrides = short_run(varied.OVERRIDE, "loss.rollout_correction=token-truncate", "steps=2")
    _, rows = train(tmp_path, "run", *overrides)
    assert all(row["skipped_seq_frac"] < 1 for row in rows), "precondition: every step trained some sequences"
    for row in rows:
        assert 0 <= row["rollout_logp_diff"] < 1e-3, row["rollout_logp_diff"]
        assert row["rollout_is_mean"] == pytest.approx(1.0, abs=1e-3)
        assert row["rollout_is_clipped_frac"] == 0.0


def test_the_warm_up_leaves_no_gradients_behind(tmp_path):
    # a model that carries the warm-up's last gradients adds them to DeepSpeed's first step (it accumulates into
    # .grad): a 2-rank run whose rank 0 had just warmed up logged a grad norm of 0.50 instead of 0.00024
    from fasttnt.embedded.tiny import WarmupConfig, warmed_up_model

    model, _, _ = warmed_up_model(
        tmp_path,
        TinyModelConfig(**TINY_4_HEADS),
        WarmupConfig(steps=2, batch_size=4),
    )
    assert all(p.grad is None for p in model.parameters())


def test_the_warm_up_loss_in_one_packed_forward_is_each_examples_own(tmp_path):
    # the warm-up's packed loss (every example in one row, attention within each) against each example through the
    # model alone (its own causal forward), in float64: the token mean of the response tokens' cross-entropy and
    # its gradients, equal up to float64 rounding (1e-10 of a loss of ~4.6); the batch mixes both modes' lengths
    from fasttnt.attention import use_packed_attention
    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.embedded.tiny import WarmupConfig, _examples, _token_mean_loss, build_tiny_model

    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig(**TINY_4_HEADS), seed=5).double()
    pairs = list(itertools.islice(_examples(tok, WarmupConfig(seed=3)), 12))
    lengths = {len(r) for _, r in pairs}
    assert min(lengths) < 15 < max(lengths), "precondition: direct answers and traces in one batch"
    params = dict(model.named_parameters())
    use_packed_attention(model)
    packed = _token_mean_loss(model, pairs)
    want_grads = torch.autograd.grad(packed, list(params.values()))
    total, tokens = torch.zeros((), dtype=torch.float64), sum(len(r) for _, r in pairs)
    for p, r in pairs:  # each alone: the model's own attention, no packing
        logits = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : -1]  # (len(r), V)
        total = total + torch.nn.functional.cross_entropy(logits, torch.tensor(r), reduction="sum")
    alone = total / tokens
    got_grads = torch.autograd.grad(alone, list(params.values()))
    assert abs(packed.item() - alone.item()) <= 1e-10 * alone.item()
    for name, want, got in zip(params, want_grads, got_grads, strict=True):
        assert got.abs().max() > 0, f"precondition: {name} has a gradient"
        torch.testing.assert_close(want, got, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def test_the_warm_up_cache_key_follows_the_code(tmp_path):
    # a copy of the package's warm-up sources keys alike; one byte changed in any of them (here the prompts' module)
    # gives another key, so a warm-up trained by other code is never taken for this code's
    from fasttnt.embedded import tiny

    package = Path(tiny.__file__).resolve().parents[1]
    for name in tiny.WARMUP_CODE:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes((package / name).read_bytes())
    assert tiny.warmup_code_key(tmp_path) == tiny.warmup_code_key()
    (tmp_path / "data.py").write_bytes((package / "data.py").read_bytes() + b"\n")
    assert tiny.warmup_code_key(tmp_path) != tiny.warmup_code_key()
    # and the cache entry's name carries it: the same configs under other code name another folder
    path = tiny.warmup_cache_path(tmp_path, TinyModelConfig(**TINY_4_HEADS), tiny.WarmupConfig())
    assert path.name.endswith("-" + tiny.warmup_code_key()) and path.parent == tmp_path


def test_a_warm_up_cached_by_other_code_is_trained_again_and_said(tmp_path, capsys):
    from fasttnt.embedded.tiny import WarmupConfig, warmed_up_model, warmup_cache_path

    model_cfg, warmup_cfg = TinyModelConfig(**TINY_4_HEADS), WarmupConfig(steps=2, batch_size=4)
    path = warmup_cache_path(tmp_path, model_cfg, warmup_cfg)
    stale = path.with_name(path.name.rsplit("-", 1)[0])  # the same configs, keyed before the code was
    stale.mkdir()
    (stale / "config.json").write_text("{}")  # never read: not this code's
    interrupted = path.with_name(path.name + ".tmp")  # this code's warm-up, cut short before its rename: no entry
    interrupted.mkdir()
    (interrupted / "config.json").write_text("{}")
    # a folder of the same configs holding no model (left by hand, say): no entry either; named to sort last, so
    # that a listing which counted it would name it
    empty = path.with_name(path.name.rsplit("-", 1)[0] + "-zzzzzzzzzzzz")
    empty.mkdir()
    assert sorted([stale, empty, path])[-1] == empty, "precondition: the empty folder sorts after the stale entry"
    _, _, got = warmed_up_model(tmp_path, model_cfg, warmup_cfg)
    assert got == path and (path / "config.json").is_file() and (path / "warmup.json").is_file()
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fasttnt:")]
    assert len(said) == 1 and f"the cached warm-up {stale} was trained by other code" in said[0], said
    warmed_up_model(tmp_path, model_cfg, warmup_cfg)
    assert "fasttnt:" not in capsys.readouterr().err, "the entry of this code is used as it is, silently"


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_main(["train", "--output-dir", str(blocker / "run"), *run_overrides(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"--output-dir {blocker / 'run'}: cannot create it (Not a directory)" in err and err.count("\n") == 1


def test_a_step_whose_verification_crashes_stops_the_run(tmp_path, monkeypatch, capsys):
    # every answer's verification crashes (a real pool whose workers die on it): the run stops with one line,
    # exit 1, before training on rewards that the verifier made up
    from test_verify import _crashing_pool

    import fasttnt.scoring as scoring

    pool = _crashing_pool(monkeypatch)
    real = scoring.verify_batch
    monkeypatch.setattr(
        scoring,
        "verify_batch",
        lambda texts, golds, **kw: real(["</think>\\boxed{crash}"] * len(texts), golds, **{**kw, "pool": pool}),
    )
    code = cli_main(["train", "--output-dir", str(tmp_path / "run"), *run_overrides(tmp_path)])
    pool.close()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "step 1: the verification of 16 of 16 answers crashed" in err
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()  # no step was logged, none trained


def test_the_hf_engine_is_not_guarded(tmp_path):
    # the hf engine samples from the trainer's model itself: no copy of the weights to go stale. Its log-probs differ
    # from the packed forward's by float rounding (~3e-8), which a limit of 1e-12 would take for stale weights. The
    # guard's stop path and its top-p rule: tests/test_vllm_engine.py
    cfg = load_config(None, run_overrides(tmp_path, varied.OVERRIDE, "loss.mini_batches=2",
                                          "rollout.max_logp_diff=1e-12", "steps=2"))  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run")
    assert not trainer.guard.active
    trainer.run()
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all("rollout_logp_diff" in r for r in rows)


def test_the_guard_stops_past_its_limit_and_at_nan():
    limit = 0.1
    assert not stale_weights(limit, limit) and not stale_weights(0.0, limit)  # at the limit: still the same weights
    assert stale_weights(math.nextafter(limit, 1.0), limit) and stale_weights(math.inf, limit)
    assert stale_weights(math.nan, limit)


def test_the_learning_rate_schedule_by_hand():
    # 3 warm-up steps rise linearly to the full rate (never 0, the first step trains); then constant, or a cosine or
    # linear decay from 1 to min_lr_ratio over the remaining 8 steps
    def factors(schedule: str) -> list[float]:
        cfg = load_config(None, ["steps=11", "optim.warmup_steps=3", f"optim.schedule={schedule}",
                                 "optim.min_lr_ratio=0.2", "optim.lr=2.0"])  # fmt: skip
        return [cfg.optim.lr_at(step, cfg.steps) / 2.0 for step in range(11)]

    warm = [0.25, 0.5, 0.75]
    assert factors("constant") == pytest.approx([*warm, *[1.0] * 8])
    assert factors("linear") == pytest.approx([*warm, *[0.2 + 0.8 * (1 - i / 8) for i in range(8)]])
    cosine = [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in range(8)]
    assert factors("cosine") == pytest.approx([*warm, *cosine])
