"""The vllm engine's sleep/wake order, driven through the trainer and the evaluator against a stand-in that
enforces vLLM's sleep-mode rules (tests/vllm_standin.py): three steps, a resume, dynamic sampling's draws and
evaluation of two models. Sleep mode needs CUDA; everything else runs against real vLLM (tests/test_vllm_real.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import vllm_standin
from small import LAUNCHER_ENV, SMALL, deterministic, metric_rows

from fasttnt.checkpoint import list_checkpoints
from fasttnt.config import load_config
from fasttnt.evaluate import EvalSettings, run_eval
from fasttnt.synthetic import held_out
from fasttnt.trainer import Trainer

# the entropy bonus moves the policy at every step whatever the rewards, so stale weights in the engine would show
OVERRIDES = [*SMALL, "warmup.steps=3", "warmup.batch_size=8", "rollout.max_new_tokens=12", "rollout.engine=vllm",
             "loss.entropy_coef=0.01", "optim.lr=1e-2", "optim.warmup_steps=0", "steps=3", "save_every=2"]  # fmt: skip
STEP = ["wake(weights)", "reload_weights", "reset_prefix_cache", "wake(kv_cache)", "generate", "sleep(2)"]


@pytest.fixture
def standin(monkeypatch):
    for key in LAUNCHER_ENV:  # a single process without a launcher; restored after the test
        monkeypatch.setenv(key, "unset")
        monkeypatch.delenv(key)
    return vllm_standin.install(monkeypatch)


def _train(tmp_path: Path, out: str, *extra: str, resume: bool = False) -> tuple[Trainer, list[dict]]:
    cfg = load_config(None, [f"cache_dir={tmp_path / 'cache'}", *OVERRIDES, *extra])
    trainer = Trainer(cfg, tmp_path / out, resume=resume)
    trainer.run()
    rows = metric_rows(tmp_path / out)
    return trainer, rows


def test_three_steps_follow_vllms_sleep_rules(tmp_path, standin):
    trainer, rows = _train(tmp_path, "run")
    built = standin.LLM.built
    assert len(built) == 1
    assert built[0]["distributed_executor_backend"] == "external_launcher" and built[0]["tensor_parallel_size"] == 1
    assert built[0]["logprobs_mode"] == "processed_logprobs" and built[0]["enable_sleep_mode"] is True
    assert not hasattr(trainer.engine, "llm")  # closed at the end of the run: its memory released
    log = standin.LLM.logs[0]
    # asleep from the start; every rollout: weights awake and pushed, KV cache awake, generate, both asleep again
    expected = ["sleep(2)"] + 3 * STEP  # one reload per push
    assert log[: len(expected)] == expected
    assert "sleep-ignored" not in log
    for row in rows:  # the engine sampled from the trainer's current weights at every step (pushed after updates)
        assert row["rollout_logp_diff"] < 1e-4, row
        assert row["grad_norm"] > 0
    assert all(k in os.environ for k in LAUNCHER_ENV)  # what the external launcher reads, for a single process


def test_resume_pushes_the_checkpoint_and_restores_the_rng(tmp_path, standin):
    _, straight = _train(tmp_path, "straight")
    _train(tmp_path, "resumed", "steps=2")
    cfg = load_config(None, [f"cache_dir={tmp_path / 'cache'}", *OVERRIDES])
    trainer = Trainer(cfg, tmp_path / "resumed", resume=True)
    # vLLM reseeds the global RNGs when it starts: the checkpoint's state must be the one in force after it
    saved = torch.load(list_checkpoints(tmp_path / "resumed" / "checkpoints")[-1] / "rng.pt", weights_only=True)
    assert torch.equal(torch.get_rng_state(), saved["torch"])
    # what the engine returns lives on the trainer's device (the old engine put it on "cuda", whatever the rank)
    batch = trainer.engine.generate([trainer.parts.prompt(p) for p in held_out(2)], 2, seed=0)
    for t in (batch.response_ids, batch.cu_seqlens, batch.truncated, batch.rollout_logp):
        assert t.device == trainer.device
    assert batch.rollout_logp.shape == batch.response_ids.shape and (batch.rollout_logp <= 0).all()
    trainer.run()
    resumed = metric_rows(tmp_path / "resumed")
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]


def test_the_standin_catches_the_old_call_order(standin, tmp_path):
    # the order the first vllm engine used: sleep(1) between rollouts, and after the update only the weights woken
    # before sleep(1) again, which vLLM ignores while the KV cache is asleep; the next rollout's wake_up() then
    # maps the weights a second time
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    for key, value in zip(LAUNCHER_ENV, ("0", "0", "1", "127.0.0.1", "29500"), strict=True):
        os.environ[key] = value
    llm = standin.LLM(str(tmp_path), enable_sleep_mode=True)
    llm.sleep(level=1)
    llm.wake_up()  # rollout 1
    llm.sleep(level=1)
    llm.wake_up(tags=["weights"])  # weight sync
    llm.sleep(level=1)
    assert llm.calls[-1] == "sleep-ignored"
    with pytest.raises(RuntimeError, match="mapped twice"):
        llm.wake_up()  # rollout 2


def test_evaluation_builds_one_engine_per_model_and_frees_it(tmp_path, standin):
    from fasttnt.char_tokenizer import build_char_tokenizer
    from fasttnt.tiny import TinyModelConfig, build_tiny_model

    tok = build_char_tokenizer()
    models = []
    for seed in (0, 1):
        folder = tmp_path / f"model{seed}"
        build_tiny_model(tok, TinyModelConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1), seed=seed)\
            .save_pretrained(folder)  # fmt: skip
        tok.save_pretrained(folder)
        models.append(str(folder))
    bench = tmp_path / "sums.jsonl"
    bench.write_text("".join(json.dumps({"problem": f"{a}+1", "answer": str(a + 1)}) + "\n" for a in range(3)))
    settings = EvalSettings(samples=2, max_new_tokens=8, engine="vllm", synthetic_per_level=2)
    report = run_eval(models, ["synthetic", str(bench)], settings, tmp_path / "eval", device=torch.device("cpu"))
    # two models x two benchmarks: two engines, each reused for both benchmarks (a second live engine would have
    # failed the stand-in's memory check)
    assert [b["model"] for b in standin.LLM.built] == models
    assert set(report["results"][models[1]]) == {"synthetic", str(bench)}


def test_dynamic_sampling_pushes_the_weights_once_per_step(tmp_path, standin):
    # the engine stays awake across a step's draws and sleeps before the update: a level-2 sleep after every draw
    # would push the same weights again for each. Every reward is 0 by construction (binary, a right answer pays
    # 0), so no group's rewards differ and every step takes all 3 draws
    extra = ("rollout.dynamic_sampling=true", "rollout.max_draws=3", "steps=2", "reward.scheme=binary",
             "reward.think_correct=0")  # fmt: skip
    _, rows = _train(tmp_path, "run", *extra)
    assert [(r["draws"], r["filled_groups"]) for r in rows] == [(3, 4), (3, 4)]
    log = standin.LLM.logs[0]
    assert "sleep-ignored" not in log
    assert log.count("generate") == sum(r["draws"] for r in rows)
    # one push per step (the first rollout's, then the one after each update, as without dynamic sampling)
    assert log.count("wake(weights)") == log.count("reset_prefix_cache") == len(rows) + 1, " ".join(log)
    assert log.count("sleep(2)") == len(rows) + 1  # at the start, and before each step's update
    for row in rows:  # every draw sampled from the current weights
        assert row["rollout_logp_diff"] < 1e-4, row
