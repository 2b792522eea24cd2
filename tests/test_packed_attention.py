"""Packed attention (fasttnt.attention) and the micro-batched packed forward (fasttnt.policy): sequences never see
each other, and log-probs and gradients equal one unpadded forward per sequence. On the CPU the same attention
function and boundaries run as on a GPU; only the final kernel call (padded SDPA over the boundaries instead of
FlashAttention's varlen kernel) differs, and benchmarks/gpu_check.sh compares that one on a GPU."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
import torch.nn.functional as F

from fasttnt.attention import Packing, varlen_attention
from fasttnt.char_tokenizer import build_char_tokenizer
from fasttnt.data import build_prompt
from fasttnt.policy import PolicyHead, plan_micro_batches, response_logprobs
from fasttnt.rollout import HFEngine, RolloutBatch, pack
from fasttnt.synthetic import held_out
from fasttnt.tiny import TinyModelConfig, build_tiny_model

TEMPERATURE = 0.7
# grouped-query attention (4 query heads share 2 key/value heads), as the Qwen2 models
GQA = TinyModelConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2)  # fmt: skip


def _model(seed: int = 1):
    tok = build_char_tokenizer()
    return tok, build_tiny_model(tok, GQA, seed=seed).float()


def _batch(vocab: int, prompt_lengths: list[int], response_lengths: list[int]) -> RolloutBatch:
    """A batch of random token sequences (no model call): uneven prompts and responses, 1-token ones included."""
    prompts = [torch.randint(7, vocab, (n,)).tolist() for n in prompt_lengths]
    responses = [torch.randint(7, vocab, (n,)).tolist() for n in response_lengths]
    ids, cu = pack(responses)
    return RolloutBatch(prompts, ids, cu, torch.zeros(len(responses), dtype=torch.bool), 1)


def _per_sequence(model, batch: RolloutBatch) -> torch.Tensor:
    """The truth: each sequence through the model alone, unpadded, logits materialised (N,)."""
    out = []
    for prompt, response in zip(batch.prompt_ids, batch.responses, strict=True):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE  # (len(response), V)
        out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0])
    return torch.cat(out)


def _grads(model, logp: torch.Tensor, upstream: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (logp * upstream).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


# budgets: everything in one micro-batch; several micro-batches of several sequences; one sequence each (a budget
# below every sequence's length)
@pytest.mark.parametrize("budget", [100_000, 50, 1])
def test_packed_logprobs_and_gradients_equal_per_sequence_forwards(budget):
    tok, model = _model()
    batch = _batch(len(tok), [5, 9, 1, 14, 3, 7, 11], [1, 23, 6, 1, 40, 2, 17])
    plan = plan_micro_batches(batch, budget)
    assert len(plan) == {100_000: 1, 50: 4, 1: 7}[budget]
    upstream = torch.randn(batch.response_ids.numel())
    truth = _per_sequence(model, batch)
    truth_grads = _grads(model, truth, upstream)
    logp, entropy = response_logprobs(model, batch, plan, temperature=TEMPERATURE, with_entropy=True)
    assert not torch.isnan(logp).any() and not torch.isnan(entropy).any()
    torch.testing.assert_close(logp, truth, rtol=1e-5, atol=1e-5)
    grads = _grads(model, logp, upstream)
    for name, g in truth_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_sequence_does_not_see_the_ones_packed_before_it():
    tok, model = _model()
    alone = _batch(len(tok), [6], [12])
    crowded = _batch(len(tok), [9, 4, 13], [30, 1, 8])
    crowded.prompt_ids.append(alone.prompt_ids[0])
    crowded = RolloutBatch(
        crowded.prompt_ids, *pack([*crowded.responses, alone.responses[0]]), torch.zeros(4, dtype=torch.bool), 1
    )
    with torch.no_grad():
        a, _ = response_logprobs(model, alone, plan_micro_batches(alone, 10_000), temperature=TEMPERATURE)
        c, _ = response_logprobs(model, crowded, plan_micro_batches(crowded, 10_000), temperature=TEMPERATURE)
    assert len(plan_micro_batches(crowded, 10_000)) == 1  # all four in one row
    torch.testing.assert_close(c[-12:], a, rtol=1e-6, atol=1e-6)
    # the same row without the boundaries (one causal sequence) differs: the test can see mixing
    mb = plan_micro_batches(crowded, 10_000)[0]
    with torch.no_grad():
        mask = torch.ones_like(mb.input_ids)  # a plain causal mask over the whole row
        mixed = model(input_ids=mb.input_ids, attention_mask=mask, position_ids=mb.position_ids).logits[0]
        mixed = mixed.float() / TEMPERATURE
    last = mb.hidden_index[-12:]
    mixed_logp = torch.log_softmax(mixed[last], -1).gather(1, torch.tensor(alone.responses[0])[:, None])[:, 0]
    assert (mixed_logp - a).abs().max() > 1e-3


# the mask budget of one padded SDPA call: the default (one chunk here), and small enough that the sequences go
# in several chunks (30 tokens alone exceed it: a chunk of its own)
@pytest.mark.parametrize("mask_elements", [None, 200])
def test_varlen_attention_on_the_cpu_equals_a_block_diagonal_mask(monkeypatch, mask_elements):
    import fasttnt.attention as attention

    if mask_elements:
        monkeypatch.setattr(attention, "_PADDED_MASK_ELEMENTS", mask_elements)
    lengths = [1, 7, 30, 2, 0, 19]
    t = sum(lengths)
    q = torch.randn(t, 4, 16, dtype=torch.float64)
    k, v = torch.randn(t, 2, 16, dtype=torch.float64), torch.randn(t, 2, 16, dtype=torch.float64)  # GQA: 2 kv heads
    packing = Packing.of(lengths, "cpu")
    assert len(packing.padded_chunks) == (1 if mask_elements is None else 4)
    q.requires_grad_()
    out = varlen_attention(q, k, v, packing, scale=0.3)  # (T, 4, 16)
    out.sum().backward()
    assert not torch.isnan(q.grad).any()  # the empty sequence's padded row adds no NaN
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # same sequence, causal
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1), v.repeat_interleave(2, 1).transpose(0, 1),
        attn_mask=allowed, scale=0.3,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(out.detach(), expected, rtol=1e-10, atol=1e-10)


def test_packing_boundaries_are_host_side():
    p = Packing.of([3, 1, 5], "cpu")
    assert p.bounds == (0, 3, 4, 9) and p.max_len == 5
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 4, 9]


def test_generation_is_unchanged_by_packed_attention_and_the_name_is_not_saved(tmp_path):
    # the trainer's model serves the rollout engine (padded batches, a KV cache) and the packed forwards
    tok, model = _model()
    engine = HFEngine(model.eval(), tok, max_new_tokens=20, temperature=1.0, top_p=1.0)
    prompts = [build_prompt(tok, p.problem) for p in held_out(3)]
    before = engine.generate(prompts, 2, seed=5)
    PolicyHead(model)  # installs the packed attention
    assert model.config._attn_implementation.startswith("fasttnt_packed:")
    after = engine.generate(prompts, 2, seed=5)
    assert after.responses == before.responses
    torch.testing.assert_close(after.rollout_logp, before.rollout_logp)
    model.save_pretrained(tmp_path)
    assert "fasttnt" not in json.dumps(json.loads((tmp_path / "config.json").read_text()))


def test_micro_batch_plan_keeps_order_and_budget():
    tok, _ = _model()
    lengths = [(3, 10), (2, 2), (5, 60), (1, 1), (4, 4), (2, 30)]
    batch = _batch(len(tok), [p for p, _ in lengths], [r for _, r in lengths])
    plan = plan_micro_batches(batch, 20)
    assert [(mb.first, mb.last) for mb in plan] == [(0, 2), (2, 3), (3, 5), (5, 6)]  # 65 > 20 alone; 32 alone
    assert all(mb.tokens <= 20 or mb.last - mb.first == 1 for mb in plan)
    for mb in plan:  # positions restart at every sequence; each row is the sequences back to back
        starts = list(itertools.accumulate(mb.lengths, initial=0))
        assert mb.position_ids[0, starts[:-1]].tolist() == [0] * len(mb.lengths)
        assert mb.input_ids.shape == (1, starts[-1])


def test_a_flash_attention_model_packs_and_generates_through_sdpa():
    # transformers takes any implementation named "*flash*" for FlashAttention and would look ours up as a hub
    # kernel: a model loaded with flash_attention_2 (the GPU default) must still pack, and generate through SDPA
    tok, model = _model()
    engine = HFEngine(model.eval(), tok, max_new_tokens=12, temperature=1.0, top_p=1.0)
    prompts = [build_prompt(tok, p.problem) for p in held_out(2)]
    before = engine.generate(prompts, 2, seed=1)
    model.config._attn_implementation = "flash_attention_2"  # as loaded on a GPU with flash-attn (not run here)
    head = PolicyHead(model)
    assert head.attention == "fasttnt_packed:sdpa"
    assert engine.generate(prompts, 2, seed=1).responses == before.responses
    batch = _batch(len(tok), [4, 6], [3, 9])
    with torch.no_grad():
        logp, _ = response_logprobs(head, batch, plan_micro_batches(batch, 1000), temperature=TEMPERATURE)
        torch.testing.assert_close(logp, _per_sequence(model, batch), rtol=1e-5, atol=1e-5)


def test_models_without_a_mask_mapping_pack_too():
    # Llama's forward builds its masks itself (no per-layer-type mapping): it gets no mask while packed
    from transformers import LlamaConfig, LlamaForCausalLM

    from fasttnt.attention import takes_mask_mapping

    config = LlamaConfig(vocab_size=120, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).float()
    assert not takes_mask_mapping(type(model.model)) and takes_mask_mapping(type(_model()[1].model))
    batch = _batch(120, [5, 2, 8], [7, 1, 12])
    with torch.no_grad():
        logp, _ = response_logprobs(model, batch, plan_micro_batches(batch, 1000), temperature=TEMPERATURE)
        torch.testing.assert_close(logp, _per_sequence(model, batch), rtol=1e-5, atol=1e-5)


def test_a_model_that_drops_the_packing_raises():
    # layers that do not pass keyword arguments on would run their attention without the boundaries: an error,
    # never attention across sequences
    tok, model = _model()
    head = PolicyHead(model)
    for layer in model.model.layers:
        attention = layer.self_attn
        forward = attention.forward
        attention.forward = lambda *a, _f=forward, packing=None, **kw: _f(*a, **kw)  # drops `packing`
    batch = _batch(len(tok), [4], [3])
    with pytest.raises(RuntimeError, match="was called without the packing"):
        response_logprobs(head, batch, plan_micro_batches(batch, 1000), temperature=TEMPERATURE)
