"""The hf engine's own decode loop (fasttnt.engines.hf.HFEngine) returns exactly what transformers ``generate`` returns
with the same seeded sampler as a logits processor: the same tokens, truncation flags and log-probs, while each
prompt is prefilled once and finished rows are compacted out of the batch. A row's response does not
depend on the rows it is generated with. A response ends at any of the run's EOS ids: the tokenizer's and every one
of the model's generation config (a folder's read as transformers and vLLM read it).

The models are tiny, randomly initialised and float64, so that no floating-point near-tie between two ways of
batching the same computation can flip a token on any machine; their seeds are fixed, so every run samples the
same responses and the coverage checks below (rows truncated, rows finished, compactions) hold by construction.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from support.small import TINY_4_HEADS, TINY_GQA, biased_lm_head, glibc_on_linux
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    LogitsProcessor,
)

from fasttnt.data import Prompt, PromptMode, build_prompt
from fasttnt.embedded.char_tokenizer import THINK_END, USER, build_char_tokenizer
from fasttnt.embedded.synthetic import held_out
from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model
from fasttnt.engines import EngineSettings, RolloutBatch, decode_responses, decode_step, pack_sequences
from fasttnt.engines.batch import eos_ids_of
from fasttnt.engines.hf import _COMPACT_SHARE, HFEngine
from fasttnt.engines.sampler import row_seeds, seeded_sample
from fasttnt.policy import PolicyHead

# -- the reference: transformers generate, sampling by the engine's rule through a logits processor ---------------


class _ReferenceSampler(LogitsProcessor):
    """The engine's sampling rule (``seeded_sample``, tested on its own in test_sampler.py) as a logits processor
    whose scores are 0 at the drawn token and -inf elsewhere, so that greedy decoding in ``generate`` samples: what
    is compared is the engine's decode loop (cache, padding, compaction, stops) against transformers'."""

    def __init__(self, row_seeds: torch.Tensor, prompt_width: int, temperature: float, top_p: float) -> None:
        self.row_seeds, self.prompt_width = row_seeds, prompt_width
        self.temperature, self.top_p = temperature, top_p
        self.logprobs: list[torch.Tensor] = []  # (B,) per generated position: the sampled tokens' log-probs

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        position = input_ids.shape[1] - self.prompt_width
        chosen, logp = seeded_sample(scores, self.row_seeds.to(scores.device), position,
                                     temperature=self.temperature, top_p=self.top_p)  # fmt: skip
        self.logprobs.append(logp)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter(-1, chosen[:, None], 0.0)


class _ReferenceForbidFirst(LogitsProcessor):
    def __init__(self, prompt_width: int, token_id: int) -> None:
        self.prompt_width, self.token_id = prompt_width, token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] == self.prompt_width:
            scores[:, self.token_id] = -float("inf")
        return scores


@torch.no_grad()
def _reference(engine: HFEngine, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0):
    """transformers ``generate`` over S = prompts x K left-padded rows, greedy over the seeded sampler's scores."""
    tok, model = engine.tokenizer, engine.model
    encoded = [tok(p.text + p.response_prefix, add_special_tokens=False)["input_ids"] for p in prompts]
    prefixes = [
        tok(p.response_prefix, add_special_tokens=False)["input_ids"] if p.response_prefix else [] for p in prompts
    ]
    rows = [ids for ids in encoded for _ in range(group_size)]
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), engine.pad_id, dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        input_ids[i, width - len(r) :] = torch.tensor(r)
        attention[i, width - len(r) :] = 1
    processors = []
    if any(p.forbid_think_end_first for p in prompts):
        processors.append(_ReferenceForbidFirst(width, engine.think_end_id))
    sampler = _ReferenceSampler(row_seeds(seed, first_row, len(rows)), width, engine.temperature, engine.top_p)
    processors.append(sampler)
    was_training = model.training
    model.eval()
    saved_config, model.generation_config = model.generation_config, GenerationConfig()
    try:
        out = model.generate(
            input_ids=input_ids, attention_mask=attention, do_sample=False, temperature=None, top_p=None, top_k=None,
            max_new_tokens=engine.max_new_tokens, eos_token_id=sorted(engine.eos_ids), pad_token_id=engine.pad_id,
            logits_processor=processors,
        )  # fmt: skip
    finally:
        model.generation_config = saved_config
    model.train(was_training)
    generated = out[:, width:].tolist()
    sampled_logp = torch.stack(sampler.logprobs, 1).tolist()
    responses, truncated, logprobs = [], [], []
    for i, tokens in enumerate(generated):
        ends = [j for j, t in enumerate(tokens) if t in engine.eos_ids]
        if ends:
            tokens = tokens[: ends[0] + 1]
            truncated.append(False)
        else:
            truncated.append(True)
        prefix = prefixes[i // group_size]
        responses.append(prefix + tokens)
        logprobs.extend([0.0] * len(prefix) + sampled_logp[i][: len(tokens)])
    prompt_ids = [ids[: len(ids) - len(prefixes[i // group_size])] for i, ids in enumerate(rows)]
    ids, cu = pack_sequences(responses)
    return RolloutBatch(prompt_ids, ids, cu, torch.tensor(truncated), group_size, torch.tensor(logprobs))


# -- models -------------------------------------------------------------------------------------------------------

EOS_BIAS = 1.2  # a random model gives EOS ~1/V per step (V = 103): +1.2 ends responses after ~30 tokens on average


def _model(arch: str, *, think_end_bias: float = 0.0, seed: int = 3):
    """A float64 Qwen2 (grouped-query attention) or Llama over the char tokenizer, with logit
    biases on EOS (responses of very different lengths) and on ``</think>``."""
    tok = build_char_tokenizer()
    if arch == "qwen2":
        cfg = TinyModelConfig(**TINY_GQA)
        model = build_tiny_model(tok, cfg, seed=seed)
    else:
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, bos_token_id=None)  # fmt: skip
        model = LlamaForCausalLM(config)
    model = model.double().eval()
    bias = torch.zeros(len(tok), dtype=torch.float64)  # (V,)
    bias[tok.eos_token_id] = EOS_BIAS
    bias[tok.convert_tokens_to_ids("</think>")] = think_end_bias
    model.lm_head.register_forward_hook(lambda _module, _args, logits: logits + bias)
    return tok, model


def _forward_shapes(model) -> tuple[list[tuple[int, ...]], object]:
    """The input_ids shape of every forward of ``model`` (transformers' or the written-out decode step: both embed
    the input ids through the model's embedding module), and the hook's handle."""
    shapes = []
    handle = model.get_input_embeddings().register_forward_pre_hook(
        lambda _module, args: shapes.append(tuple(args[0].shape))
    )
    return shapes, handle


def _expected_compactions(batch: RolloutBatch, prefix_lengths: list[int], max_new_tokens: int) -> list[int]:
    """The batch sizes each compaction keeps, by the engine's rule (compact once 1/_COMPACT_SHARE of the present rows
    have finished), from the reference's responses: row i sampled EOS at step lengths[i] - 1 unless truncated."""
    generated = [n - prefix_lengths[i // batch.group_size] for i, n in enumerate(batch.lengths.tolist())]
    finished = (~batch.truncated).tolist()
    present, kept = list(range(len(generated))), []
    for t in range(max_new_tokens):
        done = {i for i in present if finished[i] and generated[i] <= t + 1}
        if len(done) == len(present):
            break
        if len(done) * _COMPACT_SHARE >= len(present) and t + 1 < max_new_tokens:
            present = [i for i in present if i not in done]
            kept.append(len(present))
    return kept


def _counting(function, calls: list):
    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    return counted


# -- equality with the reference ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    arch: str
    group_size: int
    temperature: float
    top_p: float
    mode: PromptMode
    per_level: int  # synthetic problems per level (4 levels: prompts of 4 lengths, left-padded to the longest)
    first_row: int = 0
    packed: bool = False  # fasttnt's packed attention installed (generation runs its fallback)
    written_out: bool = True  # the decode step of engines.decode_step, else transformers' forward


# K=4 (one prefill per prompt for four rows) in free mode; K=1 with top-p and a low temperature under forced thinking
# (the first token may not be </think>, which is biased up here); Llama, K=3 with a pre-filled </think> (forced
# non-thinking), a high temperature and a rank's later share of the rows; the model with packed attention; and the
# first two through transformers' forward at each step
CASES = [
    Case("qwen2", 4, 1.0, 1.0, PromptMode.FREE, per_level=2),
    Case("qwen2", 1, 0.7, 0.9, PromptMode.THINKING, per_level=6),
    Case("llama", 3, 1.3, 0.8, PromptMode.NON_THINKING, per_level=3, first_row=7),
    Case("qwen2", 2, 1.0, 0.95, PromptMode.FREE, per_level=3, packed=True),
    Case("qwen2", 4, 1.0, 1.0, PromptMode.FREE, per_level=2, written_out=False),
    Case("llama", 3, 1.3, 0.8, PromptMode.NON_THINKING, per_level=3, first_row=7, written_out=False),
]


@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c.arch}-K{c.group_size}-{c.mode.value}-packed{c.packed}-written{c.written_out}"
)
def test_generation_equals_the_generate_reference(monkeypatch, case):
    tok, model = _model(case.arch, think_end_bias=2.0)
    if case.packed:
        PolicyHead(model)  # installs fasttnt's packed attention
    # the model's own generation settings must not bend sampling (the reference swaps them out, as the engine did)
    model.generation_config = GenerationConfig(repetition_penalty=3.0, no_repeat_ngram_size=2)
    max_new_tokens = 48
    engine = HFEngine(
        model, tok, EngineSettings(max_new_tokens=max_new_tokens, temperature=case.temperature, top_p=case.top_p)
    )
    assert engine.written_out_step, "precondition: Qwen2 and Llama take the written-out decode step"
    engine.written_out_step = case.written_out
    written_steps = []
    monkeypatch.setattr(decode_step, "step", _counting(decode_step.step, written_steps))
    prompts = [build_prompt(tok, p.problem, case.mode) for p in held_out(case.per_level)]
    expected = _reference(engine, prompts, case.group_size, seed=11, first_row=case.first_row)

    kept_sizes = []
    select = DynamicCache.batch_select_indices

    def recording_select(cache, indices):
        kept_sizes.append(len(indices))
        select(cache, indices)

    monkeypatch.setattr(DynamicCache, "batch_select_indices", recording_select)
    shapes, handle = _forward_shapes(model)
    model.train()  # as the trainer hands it over
    got = engine.generate(prompts, case.group_size, seed=11, first_row=case.first_row)
    handle.remove()

    assert kept_sizes[0] == len(prompts) * case.group_size  # the prefill's rows expanded to every sample's
    kept_sizes = kept_sizes[1:]  # then the compactions
    assert model.training  # restored after generating in eval mode
    assert got.prompt_ids == expected.prompt_ids
    assert got.responses == expected.responses
    assert got.truncated.tolist() == expected.truncated.tolist()
    assert got.cu_seqlens.tolist() == expected.cu_seqlens.tolist()
    torch.testing.assert_close(got.rollout_logp, expected.rollout_logp.float(), rtol=0, atol=1e-9)

    # prefilled once per prompt (P rows, not S), then one token per present row and step, never more rows
    encoded = [tok(p.text + p.response_prefix, add_special_tokens=False)["input_ids"] for p in prompts]
    assert shapes[0] == (len(prompts), max(len(ids) for ids in encoded))
    decode_rows = [rows for rows, width in shapes[1:] if width == 1]
    assert len(decode_rows) == len(shapes) - 1 <= max_new_tokens - 1
    assert len(written_steps) == (len(decode_rows) if case.written_out else 0)
    assert decode_rows[0] == len(prompts) * case.group_size
    assert decode_rows == sorted(decode_rows, reverse=True)
    # finished rows left the batch and the cache where the rule says, and stopped costing rows
    prefix_lengths = [len(tok(p.response_prefix, add_special_tokens=False)["input_ids"]) for p in prompts]
    assert kept_sizes == _expected_compactions(expected, prefix_lengths, max_new_tokens)
    assert sorted(set(decode_rows), reverse=True)[1:] == sorted(set(kept_sizes), reverse=True)

    # the construction covers what it claims (fixed seeds, float64: the same on every machine)
    assert len(kept_sizes) >= 2, "fewer than two compactions: the case does not test compaction"
    assert expected.truncated.any() and not expected.truncated.all(), "want both truncated and finished rows"
    assert len({len(ids) for ids in encoded}) > 1, "want prompts of different lengths (left padding)"
    if case.mode is PromptMode.THINKING:
        assert all(r[0] != engine.think_end_id for r in got.responses)
    if case.mode is PromptMode.NON_THINKING:
        assert all(r[0] == engine.think_end_id for r in got.responses)
        assert (got.rollout_logp[got.cu_seqlens[:-1]] == 0).all()  # the pre-filled prefix was not sampled


def test_the_written_out_step_only_where_it_is_the_models_forward():
    tok, model = _model("qwen2")
    assert decode_step.supports(model) and decode_step.supports(_model("llama")[1])  # precondition

    class Adapted(torch.nn.Linear):  # what a LoRA or quantised projection is to the check: not a plain nn.Linear
        pass

    attn = model.model.layers[-1].self_attn
    plain = attn.v_proj
    attn.v_proj = Adapted(plain.in_features, plain.out_features)
    assert not decode_step.supports(model)
    assert not HFEngine(model, tok, EngineSettings(max_new_tokens=4)).written_out_step
    attn.v_proj = plain
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *_: None)  # a hook the step would pass by
    assert not decode_step.supports(model)
    handle.remove()
    handle = model.model.layers[0].self_attn.register_forward_pre_hook(lambda *_: None)  # and a pre-hook
    assert not decode_step.supports(model)
    handle.remove()
    assert decode_step.supports(model)
    layers = model.config.num_hidden_layers
    assert len(model.model.layers) == layers >= 2, "precondition: a layer to leave out"
    model.config.num_hidden_layers = layers - 1  # transformers' forward runs the first num_hidden_layers alone
    assert not decode_step.supports(model)
    model.config.num_hidden_layers = layers
    assert decode_step.supports(model)
    model.config.layer_types = ["full_attention", "sliding_attention"]  # Qwen2's use_sliding_window
    assert not decode_step.supports(model)
    model.config.layer_types = ["full_attention"] * 2
    model.config.hidden_act = "gelu"
    assert not decode_step.supports(model)


@torch.no_grad()
def _teacher_forced_logits(model, written_out: bool, bf16: bool, ids, mask, fed) -> torch.Tensor:
    """The logits (T, B, V) of T decode steps after a prefill of ``ids`` (B, W) under ``mask``, each step fed the
    tokens ``fed[t]`` (B,): through the written-out step or transformers' forward, under bf16 autocast or not."""
    keyword = HFEngine(model, build_char_tokenizer(), EngineSettings(max_new_tokens=1)).cache_keyword
    cache = DynamicCache(config=model.config)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, W)
    logits = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, **{keyword: cache})
        weights, position = decode_step.Weights.of(model), positions[:, -1]
        for tokens in fed:
            mask, position = torch.cat([mask, torch.ones_like(mask[:, :1])], 1), position + 1
            if written_out:
                out = decode_step.step(model, weights, cache, tokens, position, mask)
            else:
                kwargs = {"attention_mask": mask, "position_ids": position[:, None], keyword: cache}
                out = model(input_ids=tokens[:, None], use_cache=True, **kwargs).logits[:, -1]
            logits.append(out.double())
    return torch.stack(logits)


def test_under_bf16_autocast_the_written_out_step_is_as_close_to_float64_as_transformers():
    # the hf engine decodes under bf16 autocast where the run trains in bfloat16 (on a GPU by default): the written-
    # out step must round no worse than transformers' forward does, against the same model in float64
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig(**TINY_GQA), seed=5).eval()
    ids = torch.randint(4, len(tok), (3, 9))  # (B, W)
    mask = torch.ones_like(ids)
    mask[0, :4], mask[2, :1] = 0, 0  # left padding
    fed = torch.randint(4, len(tok), (6, 3))  # (T, B)
    truth = _teacher_forced_logits(model.double(), False, False, ids, mask, fed)
    model.float()
    transformers_error = (_teacher_forced_logits(model, False, True, ids, mask, fed) - truth).abs().max()
    written_out_error = (_teacher_forced_logits(model, True, True, ids, mask, fed) - truth).abs().max()
    assert transformers_error > 1e-4, "precondition: autocast rounded the forward to bfloat16"
    # each path's error is bf16 rounding of the same products; twice transformers' leaves room for the order of them
    assert written_out_error <= 2 * transformers_error


# -- row independence -------------------------------------------------------------------------------------------------


def test_a_row_is_the_same_alone_and_in_a_batch():
    # </think> strongly biased (~80% of a free row's first tokens), and a batch mixing free and forced-thinking
    # prompts: forbidding </think> first is per row, so the free rows' responses are the ones they get alone
    tok, model = _model("qwen2", think_end_bias=6.0)
    engine = HFEngine(model, tok, EngineSettings(max_new_tokens=24, temperature=1.0, top_p=1.0))
    problems = held_out(1)
    modes = [PromptMode.FREE, PromptMode.THINKING, PromptMode.FREE, PromptMode.NON_THINKING]
    prompts = [build_prompt(tok, p.problem, m) for p, m in zip(problems, modes, strict=True)]
    k = 3
    batch = engine.generate(prompts, k, seed=5)
    for i, prompt in enumerate(prompts):
        alone = engine.generate([prompt], k, seed=5, first_row=i * k)  # the same global rows, hence the same seeds
        a, b = batch.bounds[i * k], batch.bounds[(i + 1) * k]
        assert alone.responses == batch.responses[i * k : (i + 1) * k]
        assert alone.truncated.tolist() == batch.truncated[i * k : (i + 1) * k].tolist()
        torch.testing.assert_close(alone.rollout_logp, batch.rollout_logp[a:b], rtol=0, atol=1e-9)
    thinking = batch.responses[k : 2 * k]
    assert all(r[0] != engine.think_end_id for r in thinking)
    free = batch.responses[:k] + batch.responses[2 * k : 3 * k]
    assert any(r[0] == engine.think_end_id for r in free), "the bias should make a free row start with </think>"


def test_training_mode_is_restored_when_generation_fails():
    tok, model = _model("qwen2")
    engine = HFEngine(model, tok, EngineSettings(max_new_tokens=8, temperature=1.0, top_p=1.0))
    calls = []

    def fail_on_the_third_forward(_module, _args):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory (simulated)")

    model.get_input_embeddings().register_forward_pre_hook(fail_on_the_third_forward)  # a forward of each step
    model.train()
    with pytest.raises(RuntimeError, match="simulated"):
        engine.generate([build_prompt(tok, p.problem) for p in held_out(1)], 2, seed=0)
    assert model.training


# glibc's thresholds are the process's and move with what it freed before (a freed mmapped block raises both): the
# test runs in a process of its own, so that no test before it in the suite decides its precondition
_HEAP_AFTER_A_ROLLOUT = """
import sys
import torch
from support.small import TINY_GQA, resident_mib
from fasttnt.embedded.char_tokenizer import build_char_tokenizer
from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model
from fasttnt.engines import EngineSettings
from fasttnt.engines.hf import HFEngine

give_back = sys.argv[1] == "1"
tok = build_char_tokenizer()
# without the setting, the default: no give-back (an engine made outside run_setup, as in a benchmark)
setting = {"give_back_heap": True} if give_back else {}
engine = HFEngine(build_tiny_model(tok, TinyModelConfig(**TINY_GQA)), tok,
                  EngineSettings(max_new_tokens=8, temperature=1.0, top_p=1.0, **setting))
# what a rollout leaves: many small freed blocks (KV caches and logits) in glibc's free lists, still resident.
# 64 KiB blocks are under glibc's mmap threshold (at least 128 KiB): they come from the heap, not from mmap
blocks = [torch.ones(16 * 1024) for _ in range(3200)]  # 3200 x 64 KiB = 200 MiB, touched
held = resident_mib()
del blocks
assert resident_mib() > held - 50, "precondition: glibc keeps the freed blocks until asked"
engine.end_rollout()
if give_back:
    assert resident_mib() < held - 100, "the 200 MiB freed were not given back"
else:  # a model too small for it to pay (host_memory.worth_it): the heap is left as it is
    assert resident_mib() > held - 50, "the heap was trimmed without give_back_heap"
print("heap checked")
"""


@pytest.mark.skipif(not glibc_on_linux(), reason="glibc's malloc on Linux")
@pytest.mark.parametrize("give_back", [True, False])
def test_the_end_of_a_rollout_gives_the_freed_heap_back(give_back):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", _HEAP_AFTER_A_ROLLOUT, "1" if give_back else "0"],
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "heap checked" in done.stdout, done.stdout[-2000:] + done.stderr[-3000:]


# -- the EOS ids: the tokenizer's and every one of the model's generation config ----------------------------------


def _saved_model(folder, eos_token_id, *, generation_config: bool = True):
    """A tiny model over the char tokenizer, both saved in ``folder``, whose config (and generation config, unless
    left out: a folder without generation_config.json) names ``eos_token_id`` (an int or a list)."""
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig(**TINY_4_HEADS))
    model.config.eos_token_id = model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    if not generation_config:
        (folder / "generation_config.json").unlink()
    return folder


def test_a_second_eos_id_of_the_generation_config_ends_a_response(tmp_path):
    # as Qwen2.5-Instruct's generation config lists <|im_end|> and <|endoftext|>: here <eos> and <|user|>
    tok = build_char_tokenizer()
    eos, second, think_end = tok.eos_token_id, tok.convert_tokens_to_ids(USER), tok.convert_tokens_to_ids(THINK_END)
    assert second not in (eos, tok.pad_token_id, tok.unk_token_id)  # a token of its own, which decoding would show
    folder = _saved_model(tmp_path / "model", [eos, second])
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == [eos, second]
    tok, model = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder)
    assert tok.eos_token_id == eos  # the tokenizer names one of them
    # the model, its folder, or the folder its tokenizer was loaded from: the same ids
    assert eos_ids_of(tok, model) == eos_ids_of(tok, folder) == eos_ids_of(tok) == {eos, second}
    biased_lm_head(model, second)  # every sampled token is the second id (the outcome is certain, not drawn)
    # forced non-thinking: the pre-filled </think> is the response's first token, text for the decoding to keep
    prompts = [build_prompt(tok, p.problem, PromptMode.NON_THINKING) for p in held_out(1)]
    engine = HFEngine(model, tok, EngineSettings(max_new_tokens=6))
    batch = engine.generate(prompts, 2, seed=0)
    assert batch.responses == [[think_end, second]] * 8 and not batch.truncated.any()
    assert decode_responses(tok, batch.responses, engine.eos_ids) == [THINK_END] * 8  # dropped, as <eos> is
    # the precondition: with the tokenizer's EOS alone (the model's generation config names no other), the same
    # model samples the second id to the length budget, truncated, and the text keeps it
    model.generation_config.eos_token_id = eos
    alone = HFEngine(model, tok, EngineSettings(max_new_tokens=6))
    assert alone.eos_ids == {eos}
    cut = alone.generate(prompts, 2, seed=0)
    assert cut.responses == [[think_end] + [second] * 6] * 8 and cut.truncated.all()
    assert decode_responses(tok, cut.responses, alone.eos_ids) == [THINK_END + USER * 6] * 8


def test_without_a_generation_config_the_eos_ids_are_the_model_configs(tmp_path):
    # no generation_config.json: transformers (a loaded model's generation_config) and vLLM 0.31
    # (try_get_generation_config) make one from config.json; the folder is read the same way
    tok = build_char_tokenizer()
    eos, second = tok.eos_token_id, tok.convert_tokens_to_ids(USER)
    plain = _saved_model(tmp_path / "plain", eos, generation_config=False)
    listed = _saved_model(tmp_path / "listed", [eos, second], generation_config=False)
    for folder, want in ((plain, {eos}), (listed, {eos, second})):
        assert not (folder / "generation_config.json").exists()
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert eos_ids_of(tok, folder) == eos_ids_of(tok, model) == want
    # a folder with neither (a run's saved tokenizer), and a tokenizer built in memory: the tokenizer's alone
    tok.save_pretrained(tmp_path / "tokenizer")
    assert eos_ids_of(tok, tmp_path / "tokenizer") == eos_ids_of(AutoTokenizer.from_pretrained(tmp_path / "tokenizer"))
    assert eos_ids_of(tok, tmp_path / "tokenizer") == eos_ids_of(tok) == {eos}


def test_a_tokenizer_without_eos_takes_the_models_ids_alone():
    # a base model's tokenizer may name no EOS token while its generation config does: the ids are the config's,
    # and a tokenizer and model that name none at all are refused in one line
    tok = build_char_tokenizer()
    eos, second = tok.eos_token_id, tok.convert_tokens_to_ids(USER)
    tok.eos_token = None
    assert tok.eos_token_id is None, "precondition: the tokenizer names no EOS"
    model = build_tiny_model(tok, TinyModelConfig(**TINY_4_HEADS))
    model.generation_config.eos_token_id = [eos, second]
    assert eos_ids_of(tok, model) == {eos, second}
    model.generation_config.eos_token_id = None
    with pytest.raises(ValueError, match="no EOS id"):
        eos_ids_of(tok, model)
