"""The vllm engine's sleep/wake order, driven through the trainer and the evaluator against a stand-in that
enforces vLLM's sleep-mode rules (support/vllm_standin.py): three steps, a resume, dynamic sampling's draws and
evaluation of two models; a second EOS id of the generation config. Sleep mode needs CUDA; everything else runs
against real vLLM (tests/test_vllm_real.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from support import vllm_standin
from support.small import LAUNCHER_ENV, SMALL, TINY_4_HEADS, biased_lm_head, deterministic, metric_rows, train
from transformers import AutoModelForCausalLM

from fasttnt.checkpoint import list_checkpoints
from fasttnt.config import load_config
from fasttnt.embedded.synthetic import held_out
from fasttnt.evaluate import EvalSettings, run_eval
from fasttnt.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]

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


def test_three_steps_follow_vllms_sleep_rules(tmp_path, standin):
    trainer, rows = train(tmp_path, "run", *OVERRIDES)
    built = standin.LLM.built
    assert len(built) == 1
    assert built[0]["distributed_executor_backend"] == "external_launcher" and built[0]["tensor_parallel_size"] == 1
    assert built[0]["logprobs_mode"] == "processed_logprobs" and built[0]["enable_sleep_mode"] is True
    assert not hasattr(trainer.parts.engine, "llm")  # closed at the end of the run: its memory released
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
    _, straight = train(tmp_path, "straight", *OVERRIDES)
    train(tmp_path, "resumed", *OVERRIDES, "steps=2")
    cfg = load_config(None, [f"cache_dir={tmp_path / 'cache'}", *OVERRIDES])
    trainer = Trainer(cfg, tmp_path / "resumed", resume=True)
    # vLLM reseeds the global RNGs when it starts: the checkpoint's state must be the one in force after it
    saved = torch.load(list_checkpoints(tmp_path / "resumed" / "checkpoints")[-1] / "rng.pt", weights_only=True)
    assert torch.equal(torch.get_rng_state(), saved["torch"])
    # what the engine returns lives on the trainer's device (each rank's own, not an index-less "cuda")
    batch = trainer.parts.engine.generate([trainer.parts.prompt(p) for p in held_out(2)], 2, seed=0)
    for t in (batch.response_ids, batch.cu_seqlens, batch.truncated, batch.rollout_logp):
        assert t.device == trainer.parts.device
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
    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model

    tok = build_char_tokenizer()
    models = []
    for seed in (0, 1):
        folder = tmp_path / f"model{seed}"
        build_tiny_model(tok, TinyModelConfig(**TINY_4_HEADS), seed=seed)\
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
    _, rows = train(tmp_path, "run", *OVERRIDES, *extra)
    assert [(r["draws"], r["filled_groups"]) for r in rows] == [(3, 4), (3, 4)]
    log = standin.LLM.logs[0]
    assert "sleep-ignored" not in log
    assert log.count("generate") == sum(r["draws"] for r in rows)
    # one push per step (the first rollout's, then the one after each update, as without dynamic sampling)
    assert log.count("wake(weights)") == log.count("reset_prefix_cache") == len(rows) + 1, " ".join(log)
    assert log.count("sleep(2)") == len(rows) + 1  # at the start, and before each step's update
    for row in rows:  # every draw sampled from the current weights
        assert row["rollout_logp_diff"] < 1e-4, row


# -- the stale-weight guard's stop path ------------------------------------------------------------------------
# awake between rollouts (a level-2 sleep would discard the engine's weights, which the stand-in turns into NaN and
# refuses to sample from): a push that does not arrive leaves the engine on the previous step's weights


def _guarded(tmp_path: Path, capsys, *extra: str) -> tuple[int, list[dict], str]:
    """``fasttnt train`` through the CLI with the stand-in: (exit code, the metrics rows, stderr's last line)."""
    from fasttnt.cli import main as cli_main

    out = tmp_path / "run"
    args = ["train", "--output-dir", str(out), f"cache_dir={tmp_path / 'cache'}", *OVERRIDES,
            "rollout.sleep_between_rollouts=false", *extra]  # fmt: skip
    capsys.readouterr()
    code = cli_main(args)
    err = capsys.readouterr().err.strip().splitlines()
    return code, metric_rows(out), err[-1] if err else ""


def test_a_push_that_does_not_arrive_stops_the_run(tmp_path, standin, monkeypatch, capsys):
    # at one mini-batch and one epoch no pass of old log-probs runs: the guard judges the update's own pass
    from fasttnt.actor import Actor

    pushed, passes = [], []
    monkeypatch.setattr(vllm_standin._EngineModel, "load_weights", lambda self, w: pushed.append(len(list(w))))
    real = Actor.logprobs
    monkeypatch.setattr(Actor, "logprobs", lambda self, *a, **kw: passes.append(1) or real(self, *a, **kw))
    code, rows, err = _guarded(tmp_path, capsys, "rollout.max_logp_diff=1e-3")
    assert not passes, "a separate pass of log-probs ran"
    # step 1 sampled from the weights the engine was built with, the trainer's: within float32 rounding
    assert [r["step"] for r in rows] == [1] and rows[0]["rollout_logp_diff"] < 1e-5 and rows[0]["grad_norm"] > 0
    assert pushed, "no push was attempted: the guard would have nothing to catch"
    # AdamW's first step moves every weight by ~lr (1e-2): step 2's samples come from weights a step behind
    assert code == 1
    assert "step 2: the vllm engine's log-probs differ from the trainer's by" in err and "max_logp_diff=0.001" in err


def test_nan_log_probs_from_the_engine_stop_the_run(tmp_path, standin, monkeypatch, capsys):
    # an engine whose weights a push broke (a bf16 overflow, a discarded buffer) reports NaN: NaN is not <= any limit
    real = vllm_standin.Logprob
    monkeypatch.setattr(vllm_standin, "Logprob", lambda value: real(float("nan")))
    code, rows, err = _guarded(tmp_path, capsys)
    assert code == 1 and rows == []
    assert "step 1: the vllm engine's log-probs differ from the trainer's by nan per token" in err


def test_the_guard_is_off_and_says_so_under_top_p(tmp_path, standin, capsys):
    # under top-p the engine's log-probs are renormalised over the nucleus: they differ from the trainer's by design,
    # so the guard (however tight) must not stop the run, and a warning says nothing checks the weights
    with pytest.warns(UserWarning, match="the stale-weight guard is off at rollout.top_p=0.5"):
        code, rows, _ = _guarded(tmp_path, capsys, "rollout.top_p=0.5", "rollout.max_logp_diff=1e-6", "steps=2")
    assert code == 0 and [r["step"] for r in rows] == [1, 2]
    assert min(r["rollout_logp_diff"] for r in rows) > 1e-6  # what the guard, left on, would have stopped


# -- the CUDA branches, on the CPU ------------------------------------------------------------------------------


def _engine_folder(tmp_path: Path):
    from fasttnt.embedded.char_tokenizer import build_char_tokenizer
    from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model

    tok = build_char_tokenizer()
    shape = TinyModelConfig(**TINY_4_HEADS)
    build_tiny_model(tok, shape).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    return tok, str(tmp_path / "model")


def test_an_index_less_cuda_device_gets_its_index(tmp_path, standin, monkeypatch):
    # an index-less torch.device("cuda"), which torch.cuda.set_device refuses (distributed.local_device adds the index)
    # ("Expected a torch.device with a specified index"); the recorded set_device checks its argument as PyTorch does
    from torch.cuda._utils import _get_device_index

    from fasttnt import distributed
    from fasttnt.engines import EngineSettings
    from fasttnt.engines.vllm import VLLMEngine

    calls = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(_get_device_index(device)))
    assert distributed.local_device("cuda") == torch.device("cuda", 0)
    assert distributed.local_device("cpu") == torch.device("cpu")
    tok, folder = _engine_folder(tmp_path)
    engine = VLLMEngine(None, tok, EngineSettings(max_new_tokens=4, model_path=folder, device="cuda"))
    assert engine.device == torch.device("cuda", 0) and calls == [0]
    assert standin.LLM.built[0]["gpu_memory_utilization"] == 0.5  # the CUDA branch of the build was taken


def test_the_engine_runs_vllms_v1_model_runner(tmp_path, standin, monkeypatch):
    from fasttnt.engines import EngineSettings
    from fasttnt.engines.vllm import VLLMEngine

    tok, folder = _engine_folder(tmp_path)
    settings = EngineSettings(max_new_tokens=4, model_path=folder)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(RuntimeError, match="VLLM_USE_V2_MODEL_RUNNER=1 asks for vLLM's V2 model runner"):
        VLLMEngine(None, tok, settings)
    assert standin.LLM.built == []  # refused before vLLM started
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    engine = VLLMEngine(None, tok, settings)  # the stand-in, as vLLM on CUDA, runs V2 unless told 0
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "0"
    assert not engine.llm.llm_engine.vllm_config.use_v2_model_runner
    engine.close()
    # an environment vLLM read before fasttnt's engine set it (an engine built earlier in the process): V2 anyway
    real_init = standin.LLM.__init__

    def cached_env(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.llm_engine.vllm_config.use_v2_model_runner = True

    monkeypatch.setattr(standin.LLM, "__init__", cached_env)
    with pytest.raises(RuntimeError, match="built this engine on its V2 model runner"):
        VLLMEngine(None, tok, settings)


def test_the_rollout_benchmark_builds_the_vllm_engine_awake(tmp_path, standin):
    # the benchmark builds the vllm engine without the model; with the config's sleep_between_rollouts on (the
    # stand-in, as CUDA, has sleep mode) the engine refused: "sleep_between_rollouts discards the weights"
    import importlib.util

    spec = importlib.util.spec_from_file_location("rollout_engines", ROOT / "benchmarks" / "rollout_engines.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = ["--engines", "vllm", "--rounds", "1", f"cache_dir={tmp_path / 'cache'}", *OVERRIDES]
    assert load_config(None, args[4:]).rollout.sleep_between_rollouts, "the construction: sleep asked for"
    assert bench.main(args) == 0
    assert "sleep(2)" not in standin.LLM.logs[0] and standin.LLM.logs[0].count("generate") == 2


def test_under_bf16_the_guard_calibrates_at_step_1_and_stops_a_missed_push(tmp_path, standin, monkeypatch, capsys):
    # the trainer under bf16 autocast (model.dtype=bfloat16, on the CPU too), the engine in float32: their log-probs
    # differ by bf16 rounding on the same weights, far past a limit of 1e-4, which uncalibrated stopped step 1
    from fasttnt.actor import Actor
    from fasttnt.checkpoint import read_trainer_state

    tight = ("model.dtype=bfloat16", "rollout.max_logp_diff=1e-4")
    passes, real = [], Actor.logprobs
    monkeypatch.setattr(Actor, "logprobs", lambda self, *a, **kw: passes.append(1) or real(self, *a, **kw))
    code, rows, err = _guarded(tmp_path, capsys, *tight)
    assert code == 0, err
    # step 1 runs a pass of old log-probs for the floor (the whole batch), the later steps none: the update's pass
    assert len(rows) == 3 and len(passes) == 1
    floor = read_trainer_state(list_checkpoints(tmp_path / "run" / "checkpoints")[-1]).logp_diff_floor
    assert rows[0]["rollout_logp_diff"] == pytest.approx(floor) and floor > 1e-4  # bf16's, not float32's 1e-7
    assert all(r["rollout_logp_diff"] <= 3 * floor for r in rows) and all(r["grad_norm"] > 0 for r in rows)
    # the same run with the push lost after step 1: the drift of AdamW's first step is past 3x the floor
    monkeypatch.setattr(vllm_standin._EngineModel, "load_weights", lambda self, w: list(w))
    code, rows, err = _guarded(tmp_path / "missed", capsys, *tight)
    assert code == 1 and [r["step"] for r in rows] == [1]
    assert "step 2: the vllm engine's log-probs differ" in err and "step 1's bf16 floor" in err, err


def test_a_prefix_cache_that_was_not_reset_stops_the_push(tmp_path, standin, monkeypatch):
    # vLLM returns False (and only warns) when blocks are still in use: the old weights' KV would be served
    from fasttnt.engines import EngineSettings
    from fasttnt.engines.vllm import VLLMEngine

    tok, folder = _engine_folder(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    engine = VLLMEngine(model, tok, EngineSettings(max_new_tokens=4, model_path=folder))
    engine.sync_weights(model)  # reset: True
    assert engine.llm.calls[-1] == "reset_prefix_cache"
    monkeypatch.setattr(standin.LLM, "reset_prefix_cache", lambda self: False)
    with pytest.raises(RuntimeError, match="did not reset its prefix cache after the weight push"):
        engine.sync_weights(model)
    engine.close()


# -- the EOS ids -----------------------------------------------------------------------------------------------


def test_a_second_eos_id_of_the_generation_config_ends_a_response(tmp_path, standin):
    # the generation config lists <|user|> beside the tokenizer's <eos>: the engine asks vLLM to stop at both, and
    # its truncation flags and the texts count either as the end, as the hf engine's (test_hf_engine.py)
    from transformers import GenerationConfig

    from fasttnt.data import PromptMode, build_prompt
    from fasttnt.engines import EngineSettings, decode_responses
    from fasttnt.engines.vllm import VLLMEngine

    tok, folder = _engine_folder(tmp_path)
    eos, second = tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")
    assert second not in (eos, tok.pad_token_id)
    GenerationConfig(eos_token_id=[eos, second]).save_pretrained(folder)
    engine = VLLMEngine(None, tok, EngineSettings(max_new_tokens=4, model_path=folder))
    assert engine.eos_ids == {eos, second}
    biased_lm_head(engine.llm.model.hf, second)  # every sampled token is the second id
    prompts = [build_prompt(tok, p.problem, PromptMode.NON_THINKING) for p in held_out(1)[:2]]
    batch = engine.generate(prompts, 2, seed=0)
    think_end = tok.convert_tokens_to_ids("</think>")
    assert batch.responses == [[think_end, second]] * 4 and not batch.truncated.any()
    assert decode_responses(tok, batch.responses, engine.eos_ids) == ["</think>"] * 4
    engine.close()
