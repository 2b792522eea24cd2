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
from support.small import TINY_GQA

from fasttnt.attention import Packing, varlen_attention
from fasttnt.data import build_prompt
from fasttnt.embedded.char_tokenizer import build_char_tokenizer
from fasttnt.embedded.synthetic import held_out
from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model
from fasttnt.engines import EngineSettings, RolloutBatch, pack_sequences
from fasttnt.engines.hf import HFEngine
from fasttnt.policy import PolicyHead, plan_micro_batches, response_logprobs

TEMPERATURE = 0.7
# grouped-query attention (4 query heads share 2 key/value heads), as the Qwen2 models
GQA = TinyModelConfig(**TINY_GQA)


def _model(seed: int = 1):
    tok = build_char_tokenizer()
    return tok, build_tiny_model(tok, GQA, seed=seed).float()


def _batch(vocab: int, prompt_lengths: list[int], response_lengths: list[int]) -> RolloutBatch:
    """A batch of random token sequences (no model call): uneven prompts and responses, 1-token ones included."""
    prompts = [torch.randint(7, vocab, (n,)).tolist() for n in prompt_lengths]
    responses = [torch.randint(7, vocab, (n,)).tolist() for n in response_lengths]
    ids, cu = pack_sequences(responses)
    return RolloutBatch(prompts, ids, cu, torch.zeros(len(responses), dtype=torch.bool), 1)


def _per_sequence(model, batch: RolloutBatch) -> torch.Tensor:
    """The truth: each sequence through the model alone, unpadded, logits materialised (N,)."""
    out = []
    for prompt, response in zip(batch.prompt_ids, batch.responses, strict=True):
        ids = torch.tensor([prompt + response])
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]  # (len(response), V)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / TEMPERATURE
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
    packed = pack_sequences([*crowded.responses, alone.responses[0]])
    crowded = RolloutBatch(crowded.prompt_ids, *packed, torch.zeros(4, dtype=torch.bool), 1)
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


def _block_causal_attention(q, k, v, lengths, scale):
    """The truth: one SDPA over the whole row with a mask allowing each token its own sequence, causally."""
    t, groups = q.shape[0], q.shape[1] // k.shape[1]
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(t)
    allowed = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])  # same sequence, causal
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=scale
    )
    return out.transpose(0, 1)


def _qkv(t: int) -> list[torch.Tensor]:
    """q (t, 4, 16), k and v (t, 2, 16): GQA, 2 query heads per key/value head; float64, requiring grad."""
    return [torch.randn(t, h, 16, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2)]


# the padded path's chunks: by default (sorted by length, up to _PADDED_CHUNKS), one chunk of all, and a score budget
# small enough that the sequences go in several chunks (30 tokens alone exceed it: a chunk of its own)
@pytest.mark.parametrize(("chunks", "score_elements", "expected_chunks"), [(4, 2**24, 4), (1, 2**24, 1), (4, 200, 6)])
def test_varlen_attention_on_the_cpu_equals_a_block_diagonal_mask(monkeypatch, chunks, score_elements, expected_chunks):
    import fasttnt.attention as attention

    monkeypatch.setattr(attention, "_PADDED_CHUNKS", chunks)
    monkeypatch.setattr(attention, "_PADDED_SCORE_ELEMENTS", score_elements)
    lengths = [1, 7, 30, 2, 0, 19, 5, 11, 3]
    q, k, v = _qkv(sum(lengths))
    packing = Packing.of(lengths, "cpu")
    assert len(packing.padded_layout[0]) == expected_chunks
    upstream = torch.randn(sum(lengths), 4, 16, dtype=torch.float64)
    out = varlen_attention(q, k, v, packing, scale=0.3)  # (T, 4, 16)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    assert not any(torch.isnan(g).any() for g in grads)  # no NaN from padding
    expected = _block_causal_attention(q, k, v, lengths, 0.3)
    expected_grads = torch.autograd.grad(expected, (q, k, v), upstream)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_varlen_attention_over_shared_prompts_equals_each_sequence_with_its_own_copy():
    # a row holding a 6-token prompt once for 3 responses, then a 4-token prompt for 1, then a 2-token one for 2:
    # the same outputs and gradients as the unshared row (each response after its own copy of its prompt)
    groups = [(6, [5, 1, 9]), (4, [3]), (2, [7, 2])]
    lengths = [p + r for p, responses in groups for r in responses]
    row, virtual, expand, keep = 0, 0, [], []
    for p, responses in groups:
        keep += range(virtual, virtual + p)
        prompt_at, row = row, row + p
        for r in responses:
            expand += [*range(prompt_at, prompt_at + p), *range(row, row + r)]
            keep += range(virtual + p, virtual + p + r)
            row, virtual = row + r, virtual + p + r
    packing = Packing.of(lengths, "cpu", expand=torch.tensor(expand), keep=torch.tensor(keep))
    assert packing.tokens == row == sum(lengths) - 6 * 2 - 2 * 1
    q, k, v = _qkv(row)
    upstream = torch.randn(row, 4, 16, dtype=torch.float64)
    out = varlen_attention(q, k, v, packing, scale=0.25)  # (row tokens, 4, 16)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    # the truth: the unshared row (prompt copies made by expand), its outputs read back at keep
    index = torch.tensor(expand)
    unshared = _block_causal_attention(q[index], k[index], v[index], lengths, 0.25)[torch.tensor(keep)]
    expected_grads = torch.autograd.grad(unshared, (q, k, v), upstream)
    torch.testing.assert_close(out, unshared, rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    assert k.grad is None and expected_grads[1][:6].abs().sum() > 0  # the shared prompt's keys get every response's


def test_a_shared_packing_needs_both_maps():
    with pytest.raises(ValueError, match="both expand and keep"):
        Packing.of([3, 4], "cpu", expand=torch.arange(7))
    with pytest.raises(ValueError, match="expand has 5 entries for 7 virtual tokens"):
        Packing.of([3, 4], "cpu", expand=torch.arange(5), keep=torch.arange(5))


def test_packing_boundaries_are_host_side():
    p = Packing.of([3, 1, 5], "cpu")
    assert p.bounds == (0, 3, 4, 9) and p.max_len == 5
    assert p.cu_seqlens.dtype == torch.int32 and p.cu_seqlens.tolist() == [0, 3, 4, 9]


def test_generation_is_unchanged_by_packed_attention_and_the_name_is_not_saved(tmp_path):
    # the trainer's model serves the rollout engine (padded batches, a KV cache) and the packed forwards
    tok, model = _model()
    engine = HFEngine(model.eval(), tok, EngineSettings(max_new_tokens=20, temperature=1.0, top_p=1.0))
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
    # a micro-batch that fills its budget exactly still takes the sequence: 13 + 4 + 3 = 20 tokens of 20
    exact = _batch(len(tok), [3, 2, 1], [10, 2, 2])
    assert [(mb.first, mb.last) for mb in plan_micro_batches(exact, 20)] == [(0, 3)]
    assert all(mb.tokens <= 20 or mb.last - mb.first == 1 for mb in plan)
    for mb in plan:  # distinct prompts: nothing shared; positions restart at every sequence, back to back
        assert mb.expand is None and mb.keep is None
        starts = list(itertools.accumulate(mb.lengths, initial=0))
        assert mb.position_ids[0, starts[:-1]].tolist() == [0] * len(mb.lengths)
        assert mb.input_ids.shape == (1, starts[-1])


def _grouped_batch(vocab: int, prompt_lengths: list[int], response_lengths: list[int], k: int) -> RolloutBatch:
    """K responses to each prompt, as a rollout gives them (the prompt repeated per sequence)."""
    batch = _batch(vocab, prompt_lengths, response_lengths)
    prompts = [batch.prompt_ids[i // k * k] for i in range(len(response_lengths))]
    return RolloutBatch(prompts, batch.response_ids, batch.cu_seqlens, batch.truncated, k)


def test_a_group_shares_its_prompt_in_the_row():
    tok, _ = _model()
    batch = _grouped_batch(len(tok), [5, 0, 0, 3, 0, 0], [2, 4, 1, 6, 3, 2], k=3)
    (mb,) = plan_micro_batches(batch, 1000)
    prompt_a, prompt_b = batch.prompt_ids[0], batch.prompt_ids[3]
    responses = batch.responses
    row = prompt_a + responses[0] + responses[1] + responses[2] + prompt_b + responses[3] + responses[4] + responses[5]
    assert mb.input_ids[0].tolist() == row  # each prompt once
    assert mb.position_ids[0].tolist() == [*range(7), *range(5, 9), 5, *range(9), *range(3, 6), 3, 4]
    assert mb.tokens == sum(mb.lengths) == 5 * 3 + 3 * 3 + 18  # the budget counts the prompt per sequence
    assert mb.expand is not None and mb.expand.numel() == sum(mb.lengths) and mb.keep.numel() == len(row)
    assert mb.input_ids[0, mb.expand][7 : 7 + 9].tolist() == prompt_a + responses[1]  # virtual sequence 1
    # response token 0 is predicted by the prompt's last state, the rest by the previous response token
    assert mb.hidden_index.tolist()[:7] == [4, 5, 4, 7, 8, 9, 4]


# K samples of 4 prompts: all in one micro-batch, and a budget that splits a group across micro-batches (its
# prompt then in each)
@pytest.mark.parametrize("budget", [100_000, 30])
def test_shared_prompt_logprobs_and_gradients_equal_per_sequence_forwards(budget):
    tok, model = _model()
    model = model.double()  # a shared prompt sums its K gradients in another order: float64 keeps the check tight
    batch = _grouped_batch(len(tok), [6, 0, 0, 9, 0, 0, 1, 0, 0, 12, 0, 0], [3, 1, 17, 8, 8, 2, 5, 1, 4, 1, 20, 6], 3)
    plan = plan_micro_batches(batch, budget)
    assert any(mb.expand is not None for mb in plan) and (len(plan) == 1) == (budget == 100_000)
    upstream = torch.randn(batch.response_ids.numel(), dtype=torch.float64)
    truth = _per_sequence(model, batch)
    truth_grads = _grads(model, truth, upstream)
    logp, entropy = response_logprobs(model, batch, plan, temperature=TEMPERATURE, with_entropy=True)
    assert not torch.isnan(logp).any() and not torch.isnan(entropy).any()
    # the op returns float32 log-probs; the model's own sums stay float64
    torch.testing.assert_close(logp.double(), truth, rtol=1e-6, atol=1e-6)
    grads = _grads(model, logp.double(), upstream)
    for name, g in truth_grads.items():
        atol = 1e-6 * float(g.abs().max())
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_a_flash_attention_model_packs_and_generates_through_sdpa():
    # transformers takes any implementation named "*flash*" for FlashAttention and would look ours up as a hub
    # kernel: a model loaded with flash_attention_2 (the GPU default) must still pack, and generate through SDPA
    tok, model = _model()
    engine = HFEngine(model.eval(), tok, EngineSettings(max_new_tokens=12, temperature=1.0, top_p=1.0))
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


def test_varlen_options_follow_the_pytorch_release():
    # PyTorch's varlen_attn (CUDA only) changed its keywords across releases; the options are ours, so checked here
    # against each release's parameter names: 2.9-2.10 (is_causal, no window), 2.13 (window_size, enable_gqa, scale)
    from fasttnt.attention import varlen_options

    torch_2_13 = {"query", "key", "value", "window_size", "enable_gqa", "scale", "return_aux"}
    assert varlen_options(torch_2_13, scale=0.125, head_dim=64, gqa=True) == {
        "window_size": (-1, 0), "enable_gqa": True, "scale": 0.125}  # fmt: skip
    older = {"query", "key", "value", "is_causal"}
    assert varlen_options(older, scale=64**-0.5, head_dim=64, gqa=True) == {"is_causal": True}  # GQA by repeating
    with pytest.raises(ValueError, match=r"takes no scale, and the model.s attention scale 0\.1 is not 1/sqrt"):
        varlen_options(older, scale=0.1, head_dim=64, gqa=False)


def test_the_update_backward_is_reproducible_at_two_threads():
    # a shared prompt's last state predicts the first token of each of its K responses: its gradient sums K repeats,
    # which advanced indexing's backward added with atomics on the CPU (run-to-run differences at 2 threads); the
    # gather is an index_select, whose backward adds them in index order. Two groups of K = 64 at the default width:
    # each prompt's repeats spread over the whole index, so both threads reach them
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig(), seed=0).float()
    batch = _grouped_batch(len(tok), [40, *[0] * 63] * 2, torch.randint(20, 60, (128,)).tolist(), 64)
    plan = plan_micro_batches(batch, 100_000)
    (mb,) = plan
    assert mb.hidden_index.numel() > mb.hidden_index.unique().numel()  # the repeats this is about
    upstream = torch.randn(batch.response_ids.numel())
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [_grads(model, response_logprobs(model, batch, plan, temperature=1.0)[0], upstream) for _ in range(4)]
    finally:
        torch.set_num_threads(threads)
    assert any(g.abs().max() > 0 for g in runs[0].values())
    for run in runs[1:]:
        assert all(torch.equal(run[name], g) for name, g in runs[0].items())
