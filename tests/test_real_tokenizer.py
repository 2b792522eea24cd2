# ruff: noqa: RUF001  (R1-Distill's token names are spelt with fullwidth bars, on purpose)
"""At the real vocabulary: R1-Distill-Qwen's tokenizer rebuilt from Qwen's BPE ranks, V = 151,936, a narrow model
(benchmarks/qwen_standin.py, shape "test"): the prompt, </think>, EOS, truncation, the solution length in BPE
tokens, a run on a local file, its export and an eval of it. A theme file: the one vocabulary through data, rewards,
the hf engine, the trainer and evaluation, which the module files test at the char tokenizer."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from support.small import RUN_SEED, biased_lm_head, metric_rows
from transformers import AutoTokenizer

from fasttnt import scoring
from fasttnt.config import load_config
from fasttnt.data import build_prompt, think_end_token_id
from fasttnt.engines import EngineSettings, RolloutBatch
from fasttnt.engines.hf import HFEngine
from fasttnt.evaluate import EvalSettings, run_eval
from fasttnt.rewards import RewardConfig
from fasttnt.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
THINK_END, EOS = 151_649, 151_643


def _standin():
    spec = importlib.util.spec_from_file_location("qwen_standin", ROOT / "benchmarks" / "qwen_standin.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return _standin().build(tmp_path_factory.mktemp("standin") / "model", "test", seed=RUN_SEED)


@pytest.fixture(scope="module")
def tok(folder):
    return AutoTokenizer.from_pretrained(folder)


def test_the_tokenizer_is_r1_distills(tok, folder):
    assert len(tok) == 151_665 and json.loads((folder / "config.json").read_text())["vocab_size"] == 151_936
    assert think_end_token_id(tok) == THINK_END and tok.convert_tokens_to_ids("<think>") == 151_648
    assert tok.eos_token_id == EOS and tok.pad_token_id == EOS and tok.unk_token is None
    # byte-level BPE: digits one token each, words with their leading space, </think> one added token
    ids = tok("12 + 3 = 15</think> The answer is 15.", add_special_tokens=False).input_ids
    assert ids.count(THINK_END) == 1 and len(ids) == 17
    assert tok.decode(ids) == "12 + 3 = 15</think> The answer is 15."
    # the template opens the think block: a free prompt ends with <think>\n, a forced direct one with </think>
    prompt = build_prompt(tok, "What is 2+3?", instruction="")
    assert prompt.text.endswith("<｜User｜>What is 2+3?<｜Assistant｜><think>\n") and prompt.response_prefix == ""
    direct = build_prompt(tok, "What is 2+3?", "non-thinking", instruction="")
    assert tok(direct.response_prefix, add_special_tokens=False).input_ids == [THINK_END]


def test_the_solution_length_is_counted_in_bpe_tokens(tok):
    # a thinking response and a direct one of one query: the solution part is every token after </think>, EOS
    # included; TNT's limit is omega (2) times the thinking responses' mean solution length
    texts = ["Let me add 12 and 3: 15.</think> So the answer is 15.", "</think> The answer is 15."]
    responses = [[*tok(t, add_special_tokens=False).input_ids, EOS] for t in texts]
    solution = [len(r) - r.index(THINK_END) - 1 for r in responses]
    # precondition: BPE counts, not characters: " So", " the", " answer", " is", " ", "1", "5", "." and EOS; the
    # same without " So" (Qwen's pattern splits digits one by one, the space before them a token of its own)
    assert solution == [9, 8]
    batch = RolloutBatch.of_responses([[1], [1]], responses, [False, False], 2)
    judged = scoring.judge(tok, batch, ["15", "15"], eos_ids={EOS})
    assert judged.correct.tolist() == [True, True]
    scores = scoring.add_rewards(judged, batch, reward=RewardConfig(), think_end_id=THINK_END, max_new_tokens=64)
    assert scores.rewards.solution_len.tolist() == solution
    assert scores.rewards.limit.tolist() == [2.0 * solution[0]]
    assert scores.rewards.non_thinking.tolist() == [False, True]


def test_generation_stops_at_eos_and_flags_the_budget(tok, folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    prompts = [build_prompt(tok, p, instruction="") for p in ("1+2", "30+4")]
    # an lm_head with a bias on EOS: +50 ends every response at its first token, -50 never ends one
    head = biased_lm_head(model, EOS, 0.0)
    for bias, want in ((50.0, [EOS]), (-50.0, None)):
        with torch.no_grad():
            head.bias[EOS] = bias
        batch = HFEngine(model, tok, EngineSettings(max_new_tokens=6)).generate(prompts, 4, seed=RUN_SEED)
        if want:
            assert batch.responses == [want] * 8 and not batch.truncated.any()
        else:
            assert all(len(r) == 6 and EOS not in r for r in batch.responses) and batch.truncated.all()
        assert not torch.isnan(batch.rollout_logp).any() and (batch.rollout_logp <= 0).all()
        assert all(0 <= t < 151_936 for r in batch.responses for t in r)


def test_a_run_on_a_local_file_exports_a_model_that_evaluates(tmp_path, folder, tok):
    data = tmp_path / "sums.jsonl"
    rows = [{"problem": f"What is {a}+{a + 7}?", "answer": str(2 * a + 7)} for a in range(6)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cfg = load_config(None, [f"seed={RUN_SEED}", f"model.name={folder}", f"data.train={data}", "data.instruction=",
                             "steps=2", "save_every=1", "rollout.prompts_per_step=2", "rollout.group_size=2",
                             "rollout.max_new_tokens=12", "verify_workers=1"])  # fmt: skip
    history = Trainer(cfg, out).run()
    assert [r["step"] for r in history] == [1, 2] and len(metric_rows(out)) == 2
    assert all(r["len"] > 0 for r in history)
    final = AutoTokenizer.from_pretrained(out / "final")
    assert len(final) == len(tok) and final.chat_template == tok.chat_template
    assert (out / "checkpoints" / "step-000002" / "tokenizer.json").is_file()
    settings = EvalSettings(samples=1, max_new_tokens=8, limit=3)
    report = run_eval([str(out / "final")], [str(data)], settings, tmp_path / "eval")
    metrics = report["results"][str(out / "final")][str(data)]
    assert metrics["responses"] == 3 and 0 <= metrics["acc"] <= 1
