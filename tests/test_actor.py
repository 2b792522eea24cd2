"""fasttnt/actor.py: the update on one batch (it lowers the loss; micro-batched equals one forward; skipping
zero-advantage sequences changes nothing, keeps the ones the entropy or KL term still pulls on, and an all-skipped
step still steps); the old log-probs the mini-batches train against; the engine guard's per-token mean. Real tiny
models, seconds each."""

from __future__ import annotations

import pytest
import torch
from support import varied
from support.small import SEED, run_overrides, short_run, train

from fasttnt import host_memory
from fasttnt.actor import Actor
from fasttnt.config import load_config
from fasttnt.data import build_prompt
from fasttnt.embedded.synthetic import held_out
from fasttnt.policy import UpdateInputs, _RowsIntoGrad, plan_micro_batches, tied_rows_into_grad
from fasttnt.trainer import Trainer
from fasttnt_kernels import linear_policy_loss


def test_one_update_lowers_the_loss_on_its_batch(tmp_path):
    # a small step (AdamW moves each weight by ~lr): the first-order decrease dominates on any machine
    cfg = load_config(None, run_overrides(tmp_path, "optim.lr=1e-3", "optim.warmup_steps=0"))
    trainer = Trainer(cfg, tmp_path / "run")
    batch = trainer.parts.engine.generate(
        [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(2)], 4, seed=0
    )
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5]).repeat(batch.lengths.numel() // 4)  # (S,)
    old = trainer.actor.logprobs(trainer.parts.model, batch, zero3_collectives=False)

    def loss_now():
        from fasttnt_kernels import clipped_policy_loss

        logp = trainer.actor.logprobs(trainer.parts.model, batch, zero3_collectives=False)
        return clipped_policy_loss(logp, old, advantages, batch.cu_seqlens)[0].item()

    before = loss_now()
    trainer.actor.update(UpdateInputs(batch, advantages, old_logp=old))
    after = loss_now()
    assert after < before, f"loss {before:.5f} -> {after:.5f}"
    trainer.verifier.close()


@pytest.mark.parametrize("separate_pass", [True, False])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batched_update_equals_the_one_forward_update(tmp_path, agg, separate_pass):
    # the same mini-batch through one forward and through micro-batches of <= 40 tokens (several per mini-batch,
    # some holding one sequence): loss, gradient norm and the weights after the step agree. AdamW's first step moves
    # a weight by lr g / (|g| + eps): at eps = 1e-8 a gradient element that cancels to ~1e-9 turns the summation
    # order's rounding into a visible step (seeds 2 and 3 moved one weight by 1e-4 relative); at eps = 1 the step is
    # ~lr g, linear in the gradient, so the weights compare the gradients themselves. The rollout correction's
    # weights from a separate pass of old log-probs, or formed in the update's own pass (Actor.corrects_in_the_pass)
    results = []
    for budget in (100_000, 64):
        cfg = load_config(
            None, run_overrides(tmp_path, f"micro_batch_tokens={budget}", f"loss.agg={agg}", "optim.warmup_steps=0",
                                "loss.entropy_coef=0.01", "loss.rollout_correction=token-truncate", "optim.eps=1.0",
                                "optim.lr=1.0"),
        )  # fmt: skip
        trainer = Trainer(cfg, tmp_path / f"run-{budget}")
        prompts = [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(2)]
        batch = trainer.parts.engine.generate(prompts, 4, seed=3)
        advantages = torch.linspace(-1.5, 1.5, batch.lengths.numel())  # (S,) all different: every token moves
        n_micro = len(plan_micro_batches(batch, budget))
        old_logp = None
        if separate_pass:
            old_logp = trainer.actor.logprobs(trainer.actor.policy, batch, zero3_collectives=False)
        inputs = UpdateInputs(batch, advantages, old_logp=old_logp)
        assert trainer.actor.corrects_in_the_pass(inputs) != separate_pass, "precondition: the path under test"
        before = torch.cat([p.detach().flatten() for p in trainer.parts.model.parameters()])
        metrics = trainer.actor.update(inputs)
        after = torch.cat([p.detach().flatten() for p in trainer.parts.model.parameters()])
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


@pytest.mark.parametrize("option", ["loss.ppo_epochs=2", "loss.mini_batches=2"])
def test_several_optimizer_steps_without_old_logprobs_are_refused(tmp_path, option):
    # past the first optimizer step the policy's own log-probs are no longer the old ones: the update refuses to
    # take them as such (the trainer computes the old ones first whenever it runs several)
    cfg = load_config(None, run_overrides(tmp_path, option))
    trainer = Trainer(cfg, tmp_path / "run")
    prompts = [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(2)]
    batch = trainer.parts.engine.generate(prompts, 4, seed=3)
    with pytest.raises(ValueError, match="several mini-batches or epochs need the old log-probs"):
        trainer.actor.update(UpdateInputs(batch, torch.linspace(-1.0, 1.0, batch.lengths.numel())))
    trainer.verifier.close()


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
            None, run_overrides(tmp_path, f"loss.agg={agg}", "optim.warmup_steps=0", "micro_batch_tokens=64",
                                f"loss.skip_zero_advantage={skip}", "optim.eps=1.0", *extra),
        )  # fmt: skip
        trainer = Trainer(cfg, tmp_path / f"run-{skip}")
        prompts = [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(3)]
        batch = trainer.parts.engine.generate(prompts, 4, seed=3)
        advantages = torch.linspace(-1.5, 1.5, batch.lengths.numel())  # (S,)
        advantages[4:8] = 0.0  # a whole group
        advantages[[0, 9, 11]] = 0.0  # single sequences
        old_logp = None
        if trainer.correction != "none" or cfg.loss.ppo_epochs > 1:
            old_logp = trainer.actor.logprobs(trainer.actor.policy, batch, zero3_collectives=False)
        inputs = UpdateInputs(batch, advantages, old_logp=old_logp)
        metrics = {k: float(v) for k, v in trainer.actor.update(inputs).items()}
        grads = torch.cat([p.grad.flatten() for p in trainer.parts.model.parameters()])  # the last optimizer step's
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
            None, run_overrides(tmp_path, "optim.warmup_steps=0", f"loss.skip_zero_advantage={skip}", *extra),
        )  # fmt: skip
        trainer = Trainer(cfg, tmp_path / f"run-{skip}")
        prompts = [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(3)]
        batch = trainer.parts.engine.generate(prompts, 4, seed=3)
        ref_logp = None
        if term == "kl":  # a reference the policy has moved away from: the k3 term has a gradient on every token
            logp = trainer.actor.logprobs(trainer.parts.model, batch, zero3_collectives=False)
            ref_logp = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(0))
        zeros = torch.zeros(batch.lengths.numel())
        # every advantage 0: the term alone
        only_the_term = trainer.actor.update(UpdateInputs(batch, zeros, ref_logp=ref_logp))
        if not skip:
            assert float(only_the_term["grad_norm"]) > 0, "the term must have a gradient of its own"
        advantages = torch.linspace(-1.5, 1.5, batch.lengths.numel())  # (S,)
        advantages[4:8] = 0.0  # a whole group
        advantages[[0, 9, 11]] = 0.0  # single sequences
        inputs = UpdateInputs(batch, advantages, ref_logp=ref_logp)
        metrics = {k: float(v) for k, v in trainer.actor.update(inputs).items()}
        grads = torch.cat([p.grad.flatten() for p in trainer.parts.model.parameters()])
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
        cfg = load_config(None, run_overrides(tmp_path, f"loss.skip_zero_advantage={skip}", "optim.weight_decay=0.1"))
        trainer = Trainer(cfg, tmp_path / f"run-{skip}")
        batch = trainer.parts.engine.generate(
            [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(2)], 4, seed=1
        )
        metrics = trainer.actor.update(UpdateInputs(batch, torch.zeros(batch.lengths.numel())))
        results.append((metrics, torch.cat([p.detach().flatten() for p in trainer.parts.model.parameters()])))
        trainer.verifier.close()
    (straight, w_straight), (skipped, w_skipped) = results
    assert float(skipped["skipped_seq_frac"]) == 1.0 and float(skipped["micro_batches"]) == 0
    assert float(skipped["grad_norm"]) == float(straight["grad_norm"]) == 0.0
    assert torch.isnan(skipped["entropy"])  # measured on no token
    torch.testing.assert_close(w_skipped, w_straight, rtol=0, atol=0)


def _tiny_qwen2(*, tied: bool):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = Qwen2Config(vocab_size=64, num_key_value_heads=1, tie_word_embeddings=tied, pad_token_id=3, **shape)
    return Qwen2ForCausalLM(config).double()


def _count_rows_calls(monkeypatch) -> dict[str, list[int]]:
    """The rows of each call of ``_RowsIntoGrad``'s forward and backward, from now on."""
    calls = {"forward": [], "backward": []}
    forward, backward = _RowsIntoGrad.forward, _RowsIntoGrad.backward

    def counted_forward(ctx, ids, embedding, anchor):
        calls["forward"].append(ids.numel())
        return forward(ctx, ids, embedding, anchor)

    def counted_backward(ctx, grad_rows):
        calls["backward"].append(grad_rows.shape[0])
        return backward(ctx, grad_rows)

    monkeypatch.setattr(_RowsIntoGrad, "forward", staticmethod(counted_forward))
    monkeypatch.setattr(_RowsIntoGrad, "backward", staticmethod(counted_backward))
    return calls


def test_a_tied_embeddings_rows_go_into_the_gradient_as_autograd_would_sum_them(monkeypatch):
    # policy.tied_rows_into_grad, in float64 against autograd's own sum: two micro-batches accumulated, a repeated
    # token, the padding token (no gradient for its row), and a lookup under no_grad left alone
    ids = [torch.tensor([[1, 3, 5, 5, 7, 3, 9, 11]]), torch.tensor([[5, 2, 3, 13, 1, 1]])]  # (1, T) each
    grads, calls = [], _count_rows_calls(monkeypatch)
    for route in (False, True):
        torch.manual_seed(0)
        model = _tiny_qwen2(tied=True)
        handle = tied_rows_into_grad(model) if route else None
        assert (handle is not None) == route
        for row in ids:
            hidden = model.model(input_ids=row).last_hidden_state[0]  # (T, H)
            targets = torch.roll(row[0], -1)
            loss, _ = linear_policy_loss(hidden, model.lm_head.weight, targets, advantages=torch.tensor([1.0]),
                                         cu_seqlens=torch.tensor([0, len(targets)]))  # fmt: skip
            loss.backward()
        assert len(calls["backward"]) == (2 if route else 0), "one call per backward, when routed"
        with torch.no_grad():
            model.get_input_embeddings()(ids[0])
        assert len(calls["forward"]) == (2 if route else 0), "the embedding's own lookup under no_grad"
        grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
    plain, routed = grads
    assert plain["model.embed_tokens.weight"][3].abs().sum() > 0, "the padding row has the lm_head side's gradient"
    for name, grad in plain.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(routed[name], grad, rtol=1e-12, atol=1e-15, msg=name)


@pytest.mark.parametrize("keyword", [False, True])
def test_the_routed_lookup_may_be_changed_in_place(monkeypatch, keyword):
    # a model may scale its embeddings in place; the routed rows are a tensor of their own, not a view. The lookup
    # is routed whether the model passes the ids by position or as input=
    calls = _count_rows_calls(monkeypatch)
    model = _tiny_qwen2(tied=True)
    tied_rows_into_grad(model)
    ids = torch.tensor([[1, 2, 2]])
    embedding = model.get_input_embeddings()
    (embedding(input=ids) if keyword else embedding(ids)).mul_(2.0).sum().backward()
    assert len(calls["backward"]) == 1, "the lookup was not routed"
    weight = model.get_input_embeddings().weight
    expected = torch.zeros_like(weight)
    expected[1], expected[2] = 2.0, 4.0
    torch.testing.assert_close(weight.grad, expected, rtol=0, atol=0)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")  # torch's note on .grad cycles
def test_a_graph_of_the_routed_gradient_is_refused():
    model = _tiny_qwen2(tied=True)
    tied_rows_into_grad(model)
    loss = model.get_input_embeddings()(torch.tensor([[1, 2]])).pow(2).sum()
    with pytest.raises(RuntimeError, match="no differentiable gradient"):
        loss.backward(create_graph=True)


def test_an_untied_or_own_lookup_embedding_is_left_alone():
    assert tied_rows_into_grad(_tiny_qwen2(tied=False)) is None
    model = _tiny_qwen2(tied=True)
    model.get_input_embeddings().scale_grad_by_freq = True
    assert tied_rows_into_grad(model) is None
    assert tied_rows_into_grad(_tiny_qwen2(tied=True)) is not None  # precondition: the same model, plain, is routed


@pytest.mark.parametrize("large", [True, False])
def test_the_update_routes_a_tied_embeddings_rows(tmp_path, monkeypatch, large):
    # run_setup installs the routing for a tied model outside DeepSpeed, large enough for it to pay
    # (host_memory.worth_it); the update's gradient passes through it. The mmap threshold, process-wide, is not set
    calls = _count_rows_calls(monkeypatch)
    monkeypatch.setattr(host_memory, "serve_large_blocks_from_mmap", lambda: True)
    if large:
        monkeypatch.setattr(host_memory, "WORTH_IT_FROM_PARAMETER_BYTES", 1)
    overrides = run_overrides(tmp_path, "micro_batch_tokens=64", "model.tiny.tie_word_embeddings=true")
    trainer = Trainer(load_config(None, overrides), tmp_path / "run")
    model = trainer.parts.model
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight, "the tiny model is tied"
    batch = trainer.parts.engine.generate(
        [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(3)], 4, seed=3
    )
    assert not calls["forward"], "a rollout (no_grad) looks up through the embedding's own forward"
    metrics = trainer.actor.update(UpdateInputs(batch, torch.linspace(-1.5, 1.5, batch.lengths.numel())))
    trainer.verifier.close()
    assert float(metrics["micro_batches"]) > 1, "precondition: several micro-batches"
    routed = float(metrics["micro_batches"]) if large else 0  # a small model: the embedding's own backward
    assert len(calls["backward"]) == len(calls["forward"]) == routed, "per micro-batch"
    assert torch.isfinite(model.get_input_embeddings().weight.grad).all() and float(metrics["grad_norm"]) > 0


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
    _, rows = train(
        tmp_path, "run", *short_run(varied.OVERRIDE, "loss.mini_batches=2", "loss.ppo_epochs=1", "optim.lr=0.05",
        "optim.warmup_steps=0", "steps=2"),
    )  # fmt: skip
    assert all(r["grad_norm"] > 0 for r in rows), "a step without a gradient"
    assert passes == [16, 16], "the old log-probs of each step's whole batch (4 prompts x 4 samples)"
    for row in rows:
        assert row["kl"] > 0 and row["clip_frac"] > 0, row


def test_the_guards_number_is_a_mean_over_tokens(tmp_path):
    # two sequences of 1 and 3 tokens, the first off by 4 and the others by 0: (4 + 0 + 0 + 0) / 4 = 1 per token,
    # where a mean per sequence would give (4 + 0) / 2 = 2, and a mean of signed differences (4 - 0 - 0 - 0) / 4 the
    # same 1 only by accident of signs: the third token is off by -2 and the fourth by +2 in the second case
    from fasttnt.engines import RolloutBatch

    trainer = Trainer(load_config(None, run_overrides(tmp_path)), tmp_path / "run")
    trainer.verifier.close()
    batch = RolloutBatch.of_responses([[1], [1]], [[5], [6, 7, 8]], [False, False], 2, rollout_logp=[-1.0] * 4)
    assert trainer.guard.engine_logp_diff(batch, torch.tensor([-5.0, -1.0, -1.0, -1.0])) == 1.0
    assert trainer.guard.engine_logp_diff(batch, torch.tensor([-1.0, -1.0, -3.0, 1.0])) == 1.0


def test_without_old_logprobs_the_update_is_judged_on_its_own_pass_before_it_steps(tmp_path):
    # the stale-weight guard's number formed in the update's pass: the mean |pi - rollout| over the tokens trained
    # on, over all ranks, handed to the judge before the optimizer step; a judge that raises leaves every weight as
    # it was (the gradient was formed, nothing applied); a step that trains no token is not judged
    from fasttnt.guard import StaleWeightsError

    cfg = load_config(None, run_overrides(tmp_path, "optim.warmup_steps=0"))
    trainer = Trainer(cfg, tmp_path / "run")
    prompts = [build_prompt(trainer.parts.tokenizer, p.problem) for p in held_out(2)]
    batch = trainer.parts.engine.generate(prompts, 4, seed=3)
    assert batch.rollout_logp is not None, "precondition: the engine said what it sampled with"
    s, first = batch.lengths.numel(), batch.bounds[4]
    # the first group's advantages 0 (skipped), the others' moving: the judged tokens are the others'. The engine's
    # log-probs are moved off the policy's by a known 0.1-0.3 per token (5 on the skipped group's, which a judge
    # over every token would count), so the mean is known to the float32 rounding of the two passes (~1e-7)
    advantages = torch.cat([torch.zeros(4), torch.linspace(-1.0, 1.0, s - 4)])  # (S,)
    ours = trainer.actor.logprobs(trainer.actor.policy, batch, zero3_collectives=False)  # (N,) before the step
    offset = 0.1 + 0.2 * torch.rand(ours.numel(), generator=torch.Generator().manual_seed(SEED))  # (N,)
    offset[:first] = 5.0
    batch.rollout_logp = ours - offset
    judged = []
    metrics = trainer.actor.update(UpdateInputs(batch, advantages), judge=judged.append)
    assert float(metrics["skipped_seq_frac"]) == pytest.approx(4 / s), "precondition: a group was skipped"
    assert len(judged) == 1 and judged[0] == pytest.approx(float(offset[first:].mean()), abs=1e-6)

    def stop(diff: float) -> None:
        raise StaleWeightsError(f"stale by {diff}")

    before = [p.detach().clone() for p in trainer.parts.model.parameters()]
    with pytest.raises(StaleWeightsError, match="stale by"):
        trainer.actor.update(UpdateInputs(batch, advantages), judge=stop)
    grads = [p.grad for p in trainer.parts.model.parameters() if p.grad is not None]
    assert any(g.abs().sum() > 0 for g in grads), "precondition: the pass formed a gradient"
    assert all(torch.equal(a, p) for a, p in zip(before, trainer.parts.model.parameters(), strict=True))
    # every sequence skipped: nothing is trained, nothing judged
    trainer.actor.update(UpdateInputs(batch, torch.zeros(s)), judge=stop)
    trainer.verifier.close()
