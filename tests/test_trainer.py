"""The GRPO trainer end to end on a very small tiny model: outputs, packing, the update's direction, configs,
resume equality and a crash during a checkpoint save. Real runs, seconds each. Tests of what the update does run
with rewards that vary by construction (tests/varied.py) and first assert that their steps had a gradient."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import varied
from small import SMALL, deterministic, metric_rows
from transformers import AutoModelForCausalLM, AutoTokenizer

from fasttnt.actor import Actor
from fasttnt.checkpoint import list_checkpoints
from fasttnt.cli import main as cli_main
from fasttnt.config import TrainConfig, load_config
from fasttnt.data import build_prompt
from fasttnt.embedded.synthetic import held_out
from fasttnt.embedded.tiny import TinyModelConfig
from fasttnt.policy import plan_micro_batches
from fasttnt.step_metrics import TOKEN_METRICS
from fasttnt.trainer import Trainer, stale_weights

ROOT = Path(__file__).resolve().parents[1]


def small(tmp_path: Path, *extra: str) -> list[str]:
    """Overrides for a run of seconds (tests/small.py), with its own cache and 4 steps."""
    return [
        f"cache_dir={tmp_path / 'cache'}",
        *SMALL,
        "warmup.steps=3",
        "warmup.batch_size=8",
        "rollout.max_new_tokens=16",
        "steps=4",
        "save_every=2",
        *extra,
    ]


def _run(tmp_path: Path, out: str, *extra: str, resume: bool = False) -> list[dict]:
    cfg = load_config(None, small(tmp_path, *extra))
    Trainer(cfg, tmp_path / out, resume=resume).run()
    return metric_rows(tmp_path / out)


def test_a_run_writes_every_output(tmp_path):
    rows = _run(tmp_path, "run")
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
    assert load_config(out / "config.yaml") == load_config(None, small(tmp_path))  # the resolved config, reloadable
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


def test_one_update_lowers_the_loss_on_its_batch(tmp_path):
    # a small step (AdamW moves each weight by ~lr): the first-order decrease dominates on any machine
    cfg = load_config(None, small(tmp_path, "optim.lr=1e-3", "optim.warmup_steps=0"))
    trainer = Trainer(cfg, tmp_path / "run")
    batch = trainer.engine.generate([build_prompt(trainer.tokenizer, p.problem) for p in held_out(2)], 4, seed=0)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5]).repeat(batch.lengths.numel() // 4)  # (S,)
    old = trainer.actor.logprobs(trainer.model, batch, zero3_collectives=False)

    def loss_now():
        from fasttnt_kernels import clipped_policy_loss

        logp = trainer.actor.logprobs(trainer.model, batch, zero3_collectives=False)
        return clipped_policy_loss(logp, old, advantages, batch.cu_seqlens)[0].item()

    before = loss_now()
    trainer.actor.update(batch, advantages, old, None)
    after = loss_now()
    assert after < before, f"loss {before:.5f} -> {after:.5f}"
    trainer.verifier.close()


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
    straight = _run(tmp_path, "straight", varied.OVERRIDE)
    assert all(r["grad_norm"] > 0 and r["skipped_seq_frac"] < 1 for r in straight), "a step without a gradient"
    straight_draws = list(draws)
    draws.clear()
    _run(tmp_path, "resumed", varied.OVERRIDE, "steps=2")
    _scramble_global_rngs()
    resumed = _run(tmp_path, "resumed", varied.OVERRIDE, resume=True)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]
    assert draws == straight_draws, "the global RNG states after a resume are not the uninterrupted run's"
    state = json.loads((tmp_path / "resumed" / "checkpoints" / "step-000004" / "trainer_state.json").read_text())
    assert state["data_position"] == 4 * 4  # 4 steps of 4 prompts (tests/small.py)


def test_a_crash_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    import fasttnt.checkpoint as ckpt

    real_save = torch.save
    calls = {"n": 0}

    def dying_save(obj, path, *a, **kw):  # the process dies half-way through the second checkpoint
        calls["n"] += 1
        if calls["n"] == 4:  # 3 files per checkpoint: the 4th write is inside the second one
            raise KeyboardInterrupt("killed during save")
        return real_save(obj, path, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", dying_save)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "run")
    root = tmp_path / "run" / "checkpoints"
    assert [p.name for p in list_checkpoints(root)] == ["step-000002"]
    assert (root / "step-000002" / "optimizer.pt").is_file()
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    rows = _run(tmp_path, "run", resume=True)  # resumes from step 2, the half-written folder is discarded
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [p.name for p in list_checkpoints(root)] == ["step-000002", "step-000004"]
    assert not list(root.glob("*.tmp"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["rollout.group_size=eight"], "rollout.group_size: expected an int, got 'eight'"),
        (["rollout.gruop_size=4"], "rollout.gruop_size: unknown key"),
        (["rollout.group_size=1"], "rollout.group_size: 1 sample per prompt has no group std"),
        (["loss.mini_batches=3"], "loss.mini_batches: 3 mini-batches do not divide rollout.prompts_per_step=32"),
        (["data.train=/no/such/file.jsonl"], "data.train: /no/such/file.jsonl does not exist"),
        (["reward.scheme=adaptive"], "reward.scheme: unknown"),
        (["--config", "/no/such.yaml"], "--config: /no/such.yaml does not exist"),
        (["steps"], "steps: overrides are key=value"),
        (["model.name=/no/such/model"], "model.name: /no/such/model is not a folder"),
        (["loss.rollout_correction=tokens"], "loss.rollout_correction: 'tokens' is not one of"),
    ],
)
def test_config_errors_name_the_key_and_exit_2(capsys, tmp_path, args, message):
    assert cli_main(["train", "--output-dir", str(tmp_path / "never"), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "never").exists(), "nothing may start before the config is valid"


def test_shipped_configs_load_and_validate():
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert {p.name for p in configs} >= {
        "tiny.yaml",
        "r1-distill-qwen-1.5b.yaml",
        "deepscaler-1.5b.yaml",
        "r1-distill-qwen-7b.yaml",
    }
    for path in configs:
        load_config(path)
    assert load_config(ROOT / "configs" / "tiny.yaml") == TrainConfig(), "tiny.yaml must be the embedded default"
    real = load_config(ROOT / "configs" / "r1-distill-qwen-1.5b.yaml")
    assert real.rollout.prompts_per_step == 128 and real.optim.lr == 1e-6 and real.loss.kl_coef == 0.0


def test_cli_train_runs(tmp_path):
    out = tmp_path / "cli"
    result = subprocess.run(
        [sys.executable, "-m", "fasttnt", "train", "--output-dir", str(out), *small(tmp_path, "steps=2")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "first" in result.stdout and "generate" in result.stdout  # the summary table
    assert (out / "final" / "config.json").is_file()


def test_mini_batches_epochs_and_kl_run(tmp_path):
    # several optimizer steps per rollout, old log-probs, a reference model, and the entropy bonus
    rows = _run(
        tmp_path, "run", varied.OVERRIDE, "loss.mini_batches=2", "loss.ppo_epochs=2", "loss.kl_coef=0.05",
        "steps=2", "loss.entropy_coef=0.01", "optim.lr=1e-2", "optim.warmup_steps=0",
    )  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert rows[1]["kl_ref"] > 0  # the policy moved away from the reference
    assert all(r["loss"] == r["loss"] for r in rows)


def test_the_real_configs_mini_batches_train_against_the_old_log_probs(tmp_path, monkeypatch):
    # configs/r1-distill-qwen-*.yaml: 4 mini-batches, one epoch. After the first mini-batch's optimizer step the
    # policy has moved, so the later mini-batches are off-policy: their ratio against the old log-probs (computed
    # once, before the update) must move off 1. Were the old log-probs not computed, each mini-batch would take its
    # own detached log-probs as old: ratio exactly 1, no clipping, approx_kl exactly 0
    passes = []
    real_logprobs = Actor.logprobs

    def logprobs(self, model, batch, **kw):
        passes.append(batch.lengths.numel())
        return real_logprobs(self, model, batch, **kw)

    monkeypatch.setattr(Actor, "logprobs", logprobs)
    rows = _run(
        tmp_path, "run", varied.OVERRIDE, "loss.mini_batches=2", "loss.ppo_epochs=1", "optim.lr=0.05",
        "optim.warmup_steps=0", "steps=2",
    )  # fmt: skip
    assert all(r["grad_norm"] > 0 for r in rows), "a step without a gradient"
    assert passes == [16, 16], "the old log-probs of each step's whole batch (4 prompts x 4 samples)"
    for row in rows:
        assert row["kl"] > 0 and row["clip_frac"] > 0, row


def test_resume_from_a_dataset_file(tmp_path):
    # a file-backed problem stream: the position after a resume continues the seeded epoch order
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{a}+{a + 1}", "answer": str(2 * a + 1)}) + "\n" for a in range(7)))
    extra = (f"data.train={data}", "data.hack_markers=synthetic", "data.instruction=", varied.OVERRIDE)
    straight = _run(tmp_path, "straight", *extra)
    assert all(r["grad_norm"] > 0 for r in straight), "a step without a gradient"
    _run(tmp_path, "resumed", *extra, "steps=2")
    resumed = _run(tmp_path, "resumed", *extra, resume=True)
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]


def test_a_fresh_run_will_not_overwrite_another_runs_checkpoints(tmp_path, capsys):
    _run(tmp_path, "run", "steps=2")
    args = ["train", "--output-dir", str(tmp_path / "run"), *small(tmp_path, "steps=2")]
    assert cli_main(args) == 2
    assert "holds checkpoints of an earlier run (step-000002): pass --resume" in capsys.readouterr().err


def test_bad_data_is_reported_before_the_model_loads(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1+1"}\n')
    args = ["train", "--output-dir", str(tmp_path / "out"), *small(tmp_path, f"data.train={bad}")]
    assert cli_main(args) == 2
    assert "bad.jsonl: row 1: missing field 'answer'" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists(), "the model was built before the data was checked"


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batched_update_equals_the_one_forward_update(tmp_path, agg):
    # the same mini-batch through one forward and through micro-batches of <= 40 tokens (several per mini-batch,
    # some holding one sequence): loss, gradient norm and the weights after the step agree. AdamW's first step moves
    # a weight by lr g / (|g| + eps): at eps = 1e-8 a gradient element that cancels to ~1e-9 turns the summation
    # order's rounding into a visible step (seeds 2 and 3 moved one weight by 1e-4 relative); at eps = 1 the step is
    # ~lr g, linear in the gradient, so the weights compare the gradients themselves
    results = []
    for budget in (100_000, 64):
        cfg = load_config(
            None, small(tmp_path, f"micro_batch_tokens={budget}", f"loss.agg={agg}", "optim.warmup_steps=0",
                        "loss.entropy_coef=0.01", "loss.rollout_correction=token-truncate", "optim.eps=1.0",
                        "optim.lr=1.0"),
        )  # fmt: skip
        trainer = Trainer(cfg, tmp_path / f"run-{budget}")
        prompts = [build_prompt(trainer.tokenizer, p.problem) for p in held_out(2)]
        batch = trainer.engine.generate(prompts, 4, seed=3)
        advantages = torch.linspace(-1.5, 1.5, batch.lengths.numel())  # (S,) all different: every token moves
        n_micro = len(plan_micro_batches(batch, budget))
        # the rollout correction needs the old log-probs
        old_logp = trainer.actor.logprobs(trainer.actor.policy, batch, zero3_collectives=False)
        before = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        metrics = trainer.actor.update(batch, advantages, old_logp, None)
        after = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        results.append((n_micro, {k: float(v) for k, v in metrics.items()}, before, after))
        trainer.verifier.close()
    (n_one, one, w0, w_one), (n_many, many, _, w_many) = results
    assert n_one == 1 and n_many >= 3
    assert one["grad_norm"] > 0 and one["clip_frac"] == 0  # a gradient to compare; on-policy, nothing clipped
    for name in ("loss", "grad_norm", "entropy", "clip_frac", "rollout_logp_diff", "rollout_is_mean"):
        assert one[name] == pytest.approx(many[name], rel=1e-5, abs=1e-7), name
    # the gradients' float32 sums in another order: ~1e-6 of the largest step; each weight's own float32 rounding
    # after the step: half an ulp of it in each run
    step = (w_one - w0).abs().max()
    assert step > 0
    tolerance = 1e-5 * step + 2 * 2**-24 * w_one.abs()
    assert ((w_many - w_one).abs() <= tolerance).all(), ((w_many - w_one).abs() / tolerance).max()


@pytest.mark.parametrize(
    "agg, extra",
    [
        ("token-mean", ()),
        ("seq-mean-token-mean", ("loss.rollout_correction=token-truncate",)),
        ("seq-mean-token-sum-norm", ("loss.norm_length=64", "loss.ppo_epochs=2", "loss.dual_clip=3")),
    ],
)
def test_skipping_zero_advantage_sequences_leaves_the_update_unchanged(tmp_path, agg, extra):
    # the same batch through the update with and without the skip: half the sequences (whole groups and single
    # ones) have an advantage of exactly 0; the normalisers count them either way, so the loss, the gradient and
    # the weights after the step agree. AdamW at eps = 1, where its step is linear in the gradient: with two epochs
    # the second gradient is taken at the weights the first step left (test_micro_batched_update_equals_...)
    results = []
    for skip in (False, True):
        cfg = load_config(
            None, small(tmp_path, f"loss.agg={agg}", "optim.warmup_steps=0", "micro_batch_tokens=64",
                        f"loss.skip_zero_advantage={skip}", "optim.eps=1.0", *extra),
        )  # fmt: skip
        trainer = Trainer(cfg, tmp_path / f"run-{skip}")
        prompts = [build_prompt(trainer.tokenizer, p.problem) for p in held_out(3)]
        batch = trainer.engine.generate(prompts, 4, seed=3)
        advantages = torch.linspace(-1.5, 1.5, batch.lengths.numel())  # (S,)
        advantages[4:8] = 0.0  # a whole group
        advantages[[0, 9, 11]] = 0.0  # single sequences
        old_logp = None
        if trainer.correction != "none" or cfg.loss.ppo_epochs > 1:
            old_logp = trainer.actor.logprobs(trainer.actor.policy, batch, zero3_collectives=False)
        metrics = {k: float(v) for k, v in trainer.actor.update(batch, advantages, old_logp, None).items()}
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])  # the last optimizer step's
        results.append((metrics, grads))
        trainer.verifier.close()
    (straight, g_straight), (skipped, g_skipped) = results
    assert straight["skipped_seq_frac"] == 0.0
    assert skipped["skipped_seq_frac"] == pytest.approx(7 / batch.lengths.numel())
    assert skipped["micro_batches"] < straight["micro_batches"]
    for name in ("loss", "grad_norm"):
        assert skipped[name] == pytest.approx(straight[name], rel=1e-5, abs=1e-7), name
    if old_logp is not None:  # the rollout diagnostics then cover every token, skipped or not
        for name in ("rollout_logp_diff", "rollout_is_mean", "rollout_is_clipped_frac"):
            assert skipped[name] == pytest.approx(straight[name], rel=1e-5, abs=1e-9), name
    # the same sums in another order (fewer, differently packed micro-batches): float32 rounding apart
    torch.testing.assert_close(g_skipped, g_straight, rtol=1e-6, atol=1e-6 * float(g_straight.abs().max()))


@pytest.mark.parametrize("term", ["entropy", "kl"])
def test_the_skip_keeps_zero_advantage_sequences_that_still_have_a_gradient(tmp_path, term):
    # with the entropy bonus or the KL term on, a sequence whose advantage is 0 still pulls on the weights: the skip
    # must leave it in, and the update equals the unskipped one
    extra = ("loss.entropy_coef=0.01",) if term == "entropy" else ("loss.kl_coef=0.1",)
    results = []
    for skip in (False, True):
        cfg = load_config(
            None, small(tmp_path, "optim.warmup_steps=0", f"loss.skip_zero_advantage={skip}", *extra),
        )  # fmt: skip
        trainer = Trainer(cfg, tmp_path / f"run-{skip}")
        prompts = [build_prompt(trainer.tokenizer, p.problem) for p in held_out(3)]
        batch = trainer.engine.generate(prompts, 4, seed=3)
        ref_logp = None
        if term == "kl":  # a reference the policy has moved away from: the k3 term has a gradient on every token
            logp = trainer.actor.logprobs(trainer.model, batch, zero3_collectives=False)
            ref_logp = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
        zeros = torch.zeros(batch.lengths.numel())
        only_the_term = trainer.actor.update(batch, zeros, None, ref_logp)  # every advantage 0: the term alone
        if not skip:
            assert float(only_the_term["grad_norm"]) > 0, "the term must have a gradient of its own"
        advantages = torch.linspace(-1.5, 1.5, batch.lengths.numel())  # (S,)
        advantages[4:8] = 0.0  # a whole group
        advantages[[0, 9, 11]] = 0.0  # single sequences
        metrics = {k: float(v) for k, v in trainer.actor.update(batch, advantages, None, ref_logp).items()}
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
        results.append((metrics, grads))
        trainer.verifier.close()
    (straight, g_straight), (skipped, g_skipped) = results
    assert skipped["skipped_seq_frac"] == straight["skipped_seq_frac"] == 0.0
    for name in ("loss", "grad_norm"):
        assert skipped[name] == pytest.approx(straight[name], rel=1e-5, abs=1e-7), name
    torch.testing.assert_close(g_skipped, g_straight, rtol=1e-6, atol=1e-6 * float(g_straight.abs().max()))


def test_a_step_with_every_sequence_skipped_still_steps(tmp_path):
    # all advantages 0: nothing runs but one dummy forward, and the optimizer steps on zero gradients exactly as
    # the unskipped update does (AdamW's weight decay still applies)
    results = []
    for skip in (False, True):
        cfg = load_config(None, small(tmp_path, f"loss.skip_zero_advantage={skip}", "optim.weight_decay=0.1"))
        trainer = Trainer(cfg, tmp_path / f"run-{skip}")
        batch = trainer.engine.generate([build_prompt(trainer.tokenizer, p.problem) for p in held_out(2)], 4, seed=1)
        metrics = trainer.actor.update(batch, torch.zeros(batch.lengths.numel()), None, None)
        results.append((metrics, torch.cat([p.detach().flatten() for p in trainer.model.parameters()])))
        trainer.verifier.close()
    (straight, w_straight), (skipped, w_skipped) = results
    assert float(skipped["skipped_seq_frac"]) == 1.0 and float(skipped["micro_batches"]) == 0
    assert float(skipped["grad_norm"]) == float(straight["grad_norm"]) == 0.0
    assert torch.isnan(skipped["entropy"])  # measured on no token
    torch.testing.assert_close(w_skipped, w_straight, rtol=0, atol=0)


def test_rollout_correction_metrics_are_logged(tmp_path):
    # the hf engine reports what it sampled with; on the CPU the trainer's log-probs differ from it by float noise
    rows = _run(tmp_path, "run", "loss.rollout_correction=token-truncate", "steps=2")
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
        TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1),
        WarmupConfig(steps=2, batch_size=4),
    )
    assert all(p.grad is None for p in model.parameters())


def test_a_yaml_syntax_error_names_the_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\nrollout:\n  group_size: [1, 2\n")
    assert cli_main(["train", "--config", str(bad), "--output-dir", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert f"--config: {bad}:4:1: not valid YAML: while parsing a flow sequence" in err and err.count("\n") == 1


def test_an_output_dir_that_cannot_be_made_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert cli_main(["train", "--output-dir", str(blocker / "run"), *small(tmp_path)]) == 2
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
    code = cli_main(["train", "--output-dir", str(tmp_path / "run"), *small(tmp_path)])
    pool.close()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and "step 1: the verification of 16 of 16 answers crashed" in err
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()  # no step was logged, none trained


def test_the_hf_engine_is_not_guarded(tmp_path):
    # the hf engine samples from the trainer's model itself: no copy of the weights to go stale. Its log-probs differ
    # from the packed forward's by float rounding (~3e-8), which a limit of 1e-12 would take for stale weights. The
    # guard's stop path and its top-p rule: tests/test_vllm_engine.py
    cfg = load_config(None, small(tmp_path, varied.OVERRIDE, "loss.mini_batches=2", "rollout.max_logp_diff=1e-12",
                                  "steps=2"))  # fmt: skip
    trainer = Trainer(cfg, tmp_path / "run")
    assert not trainer.actor.guards_engine
    trainer.run()
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and all("rollout_logp_diff" in r for r in rows)


def test_the_guard_stops_past_its_limit_and_at_nan():
    limit = 0.1
    assert not stale_weights(limit, limit) and not stale_weights(0.0, limit)  # at the limit: still the same weights
    assert stale_weights(math.nextafter(limit, 1.0), limit) and stale_weights(math.inf, limit)
    assert stale_weights(math.nan, limit)


def test_the_guards_number_is_a_mean_over_tokens(tmp_path):
    # two sequences of 1 and 3 tokens, the first off by 4 and the others by 0: (4 + 0 + 0 + 0) / 4 = 1 per token,
    # where a mean per sequence would give (4 + 0) / 2 = 2, and a mean of signed differences (4 - 0 - 0 - 0) / 4 the
    # same 1 only by accident of signs: the third token is off by -2 and the fourth by +2 in the second case
    from fasttnt.engines import RolloutBatch

    trainer = Trainer(load_config(None, small(tmp_path)), tmp_path / "run")
    trainer.verifier.close()
    batch = RolloutBatch.of_responses([[1], [1]], [[5], [6, 7, 8]], [False, False], 2, rollout_logp=[-1.0] * 4)
    assert trainer.actor.engine_logp_diff(batch, torch.tensor([-5.0, -1.0, -1.0, -1.0])) == 1.0
    assert trainer.actor.engine_logp_diff(batch, torch.tensor([-1.0, -1.0, -3.0, 1.0])) == 1.0


def test_a_checkpoint_without_numpys_rng_state_is_refused_in_one_line(tmp_path, capsys):
    _run(tmp_path, "run", "steps=2")
    rng = tmp_path / "run" / "checkpoints" / "step-000002" / "rng.pt"
    state = torch.load(rng, weights_only=True)
    del state["numpy"]
    torch.save(state, rng)
    capsys.readouterr()
    assert cli_main(["train", "--output-dir", str(tmp_path / "run"), "--resume", *small(tmp_path, "steps=3")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "rng.pt holds no numpy RNG state (written by an earlier version)" in err[-1]
    assert err[-1].startswith("fasttnt train: --resume: ")


def test_restore_puts_back_what_save_wrote(tmp_path):
    # checkpoint.save, then checkpoint.restore into a model and optimizer built afresh (other weights, no AdamW state)
    # while the RNGs moved on: the saved weights, AdamW state, RNG states and trainer state, the weights copied into
    # the model's own parameters (the ones the optimizer steps and the hf engine samples from)
    from fasttnt import checkpoint
    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.embedded.tiny import build_tiny_model

    tok = build_char_tokenizer()
    shape = TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1)

    def built(seed: int):
        model = build_tiny_model(tok, shape, seed=seed)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = built(0)
    ids = torch.tensor([tok("12+34", add_special_tokens=False)["input_ids"]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()  # an AdamW state to save
    state = checkpoint.TrainerState(step=3, data_position=96, world=1, logp_diff_floor=0.25)
    checkpoint.save(tmp_path / "checkpoints", load_config(None, small(tmp_path)), state, model, optimizer)
    saved_rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    fresh, fresh_optimizer = built(1)
    params = list(fresh.parameters())
    assert not torch.equal(params[0], next(model.parameters()))  # precondition: other weights
    torch.manual_seed(99)  # the RNGs move on after the save
    random.seed(99)
    np.random.seed(99)
    folder = checkpoint.checkpoint_paths(tmp_path / "checkpoints", 3)[0]
    assert checkpoint.restore(folder, fresh, fresh_optimizer) == state
    assert all(a is b for a, b in zip(fresh.parameters(), params, strict=True))
    want = model.state_dict()
    assert all(torch.equal(value, want[name]) for name, value in fresh.state_dict().items())
    got_opt, want_opt = fresh_optimizer.state_dict(), optimizer.state_dict()
    assert got_opt["param_groups"] == want_opt["param_groups"] and got_opt["state"].keys() == want_opt["state"].keys()
    for index, per_param in want_opt["state"].items():
        assert all(torch.equal(got_opt["state"][index][key], value) for key, value in per_param.items())
    assert torch.equal(torch.get_rng_state(), saved_rngs[0]) and random.getstate() == saved_rngs[1]
    assert (np.random.get_state()[1] == saved_rngs[2]).all()


def test_the_learning_rate_schedule_by_hand():
    # 3 warm-up steps rise linearly to the full rate (never 0, the first step trains); then constant, or a cosine or
    # linear decay from 1 to min_lr_ratio over the remaining 8 steps
    from fasttnt.run_setup import lr_factor

    def factors(schedule: str) -> list[float]:
        cfg = load_config(None, ["steps=11", "optim.warmup_steps=3", f"optim.schedule={schedule}",
                                 "optim.min_lr_ratio=0.2"])  # fmt: skip
        return [lr_factor(cfg, step) for step in range(11)]

    warm = [0.25, 0.5, 0.75]
    assert factors("constant") == pytest.approx([*warm, *[1.0] * 8])
    assert factors("linear") == pytest.approx([*warm, *[0.2 + 0.8 * (1 - i / 8) for i in range(8)]])
    cosine = [0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * i / 8)) for i in range(8)]
    assert factors("cosine") == pytest.approx([*warm, *cosine])


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    _run(tmp_path, "run", "save_every=1", "keep_checkpoints=2")  # four saves, two kept
    assert [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == ["step-000003", "step-000004"]
