"""fasttnt's kernels inside TRL's GRPOTrainer (fasttnt.integrations.trl): the loss and its gradients equal TRL's own
``_compute_loss`` for every supported loss_type, with and without the KL term, TRL's two-sided clip and vLLM's
importance-sampling ratio; the old/reference log-probs equal TRL's; a few real GRPOTrainer steps run with the TNT
reward; the reward equals fasttnt's own on the same packed responses."""

from __future__ import annotations

import json
import os

import pytest
import torch

trl = pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from support.small import TINY_4_HEADS, weights_apart  # noqa: E402
from transformers import set_seed  # noqa: E402

from fasttnt.data import build_prompt  # noqa: E402
from fasttnt.embedded.char_tokenizer import build_char_tokenizer  # noqa: E402
from fasttnt.embedded.synthetic import held_out  # noqa: E402
from fasttnt.embedded.tiny import TinyModelConfig, build_tiny_model  # noqa: E402
from fasttnt.engines import pack_sequences  # noqa: E402
from fasttnt.engines.batch import RolloutBatch  # noqa: E402
from fasttnt.integrations.trl import SUPPORTED_LOSS_TYPES, FastTNTGRPOTrainer, TNTReward  # noqa: E402
from fasttnt.rewards import RewardConfig, compute_rewards, overlong_shaping  # noqa: E402

SHAPE = TinyModelConfig(**TINY_4_HEADS)
K = 4  # completions per prompt


def _config(tmp_path, **overrides):
    options = dict(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=K, max_completion_length=12,
        temperature=0.7, learning_rate=1e-3, max_steps=2, logging_steps=1, report_to="none", save_strategy="no",
        use_cpu=True, bf16=False, seed=0, disable_tqdm=True, beta=0.0,
    )  # fmt: skip
    options.update(overrides)
    return trl.GRPOConfig(**options)


def _trainers(tmp_path, extra_rewards=(), **overrides):
    """TRL's own trainer and fasttnt's, each loading one float32 tiny model from disk (TRL loads its reference
    model from the same path when beta > 0)."""
    tok = build_char_tokenizer()
    tok.padding_side = "left"
    path = tmp_path / "tiny"
    if not path.exists():
        build_tiny_model(tok, SHAPE, seed=3).float().save_pretrained(path)
        tok.save_pretrained(path)
    rows = [{"prompt": build_prompt(tok, p.problem).text, "answer": p.answer} for p in held_out(4)]
    rewards = [TNTReward(tok, K), *extra_rewards]
    made = [
        cls(
            model=str(path),
            processing_class=tok,
            reward_funcs=rewards,
            args=_config(tmp_path, **overrides),
            train_dataset=Dataset.from_list(rows),
        )
        for cls in (trl.GRPOTrainer, FastTNTGRPOTrainer)
    ]
    return tok, made


def _inputs(trainer, *, old: bool, beta: float, is_ratio: bool, seed: int = 0) -> dict:
    """A batch as TRL's _generate_and_score_completions hands it to the loss: 2 prompts x K completions, prompts
    left-padded, completions right-padded with uneven lengths (1-token ones included), advantages per sequence."""
    g = torch.Generator().manual_seed(seed)
    vocab, b, p, c = trainer.model.config.vocab_size, 2 * K, 7, 12
    prompt_lengths = torch.tensor([7, 7, 7, 7, 4, 4, 4, 4])
    completion_lengths = torch.tensor([12, 3, 1, 9, 5, 12, 2, 7])
    prompt_mask = (torch.arange(p)[None, :] >= p - prompt_lengths[:, None]).long()  # (B, P) left padding
    completion_mask = (torch.arange(c)[None, :] < completion_lengths[:, None]).long()  # (B, C)
    inputs = {
        "prompt_ids": torch.randint(7, vocab, (b, p), generator=g) * prompt_mask,
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(7, vocab, (b, c), generator=g) * completion_mask,
        "completion_mask": completion_mask,
        "advantages": torch.randn(b, generator=g),
        "num_items_in_batch": completion_mask.sum().float(),
    }
    with torch.no_grad():
        logps, _, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([prompt_mask, completion_mask], 1), c,
        )  # fmt: skip
    if old:  # a policy that moved: ratios far enough from 1 that both clip bounds bind
        inputs["old_per_token_logps"] = logps + 0.4 * torch.randn(b, c, generator=g)
    if beta:
        inputs["ref_per_token_logps"] = logps + 0.3 * torch.randn(b, c, generator=g)
    if is_ratio:  # 1 where padded, as TRL makes it (exp of a masked difference; VESPO's sum would read it)
        ratio = torch.rand(b, c, generator=g) + 0.5
        inputs["importance_sampling_ratio"] = torch.where(completion_mask.bool(), ratio, 1.0)
    return inputs


def _loss_and_grads(trainer, inputs, compute):
    trainer.model.zero_grad(set_to_none=True)
    loss = compute(trainer, trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


CASES = [
    *[dict(loss_type=t, beta=0.0) for t in SUPPORTED_LOSS_TYPES],
    *[dict(loss_type=t, beta=0.04) for t in SUPPORTED_LOSS_TYPES],
    dict(loss_type="dapo", beta=0.0, delta=1.5),  # TRL's two-sided clip = fasttnt's dual clip
    # dapo's normaliser counts the generation batch's tokens, spread over steps_per_generation optimizer steps
    dict(loss_type="dapo", beta=0.0, steps_per_generation=2),
    dict(loss_type="grpo", beta=0.0, delta=1.1),  # below 1 + epsilon_high: clip_high 0.1 and a dual clip at 1.28
    dict(loss_type="grpo", beta=0.04, is_ratio=True),  # vLLM's importance-sampling correction
    dict(loss_type="bnpo", beta=0.0, on_policy=True),  # no old log-probs: TRL uses the detached current ones
    # CISPO's cap: TRL's default (epsilon_high = epsilon: weights capped at 0.2), and one in the ratios' range
    dict(loss_type="cispo", beta=0.0, epsilon_high=0.2),
    dict(loss_type="cispo", beta=0.04, epsilon_high=1.1, steps_per_generation=2, is_ratio=True),
    dict(loss_type="sapo", beta=0.04, sapo_temperature_pos=0.5, sapo_temperature_neg=2.0, is_ratio=True),
    # GSPO: one ratio per sequence, under the paper's aggregation (grpo) and token-summing ones, with TRL's clip
    dict(loss_type="grpo", beta=0.0, importance_sampling_level="sequence"),
    dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence", delta=1.5, is_ratio=True),
    dict(loss_type="luspo", beta=0.0, importance_sampling_level="sequence", steps_per_generation=2),
    # CISPO's weight and SAPO's gate of each sequence's ratio, with the vLLM ratios (per token, and the mean)
    dict(loss_type="cispo", beta=0.04, epsilon_high=1.1, importance_sampling_level="sequence", is_ratio=True),
    dict(loss_type="sapo", beta=0.0, importance_sampling_level="sequence", is_ratio=True, steps_per_generation=2),
    # VESPO: the rollout ratios inside each sequence's weight; its shapes; the level, which its loss does not read
    dict(loss_type="vespo", beta=0.04, is_ratio=True, steps_per_generation=2),
    dict(
        loss_type="vespo",
        beta=0.0,
        vespo_k_pos=0.5,
        vespo_lambda_pos=0.0,
        vespo_k_neg=1.0,
        vespo_lambda_neg=4.0,
        importance_sampling_level="sequence",
        is_ratio=True,
    ),
    # top_entropy_quantile: the policy term on the tokens of highest entropy only; with a sequence-level ratio (GSPO,
    # SAPO's gate, luspo) the mask times vLLM's ratio folded into each sequence's mean weight; CISPO's and VESPO's a
    # per-token factor (VESPO's sequence weights do not read it)
    dict(loss_type="dapo", beta=0.04, top_entropy_quantile=0.2),
    dict(loss_type="grpo", beta=0.0, top_entropy_quantile=0.55, is_ratio=True, delta=1.5),
    dict(loss_type="bnpo", beta=0.0, top_entropy_quantile=0.35, on_policy=True),
    dict(loss_type="dr_grpo", beta=0.04, top_entropy_quantile=0.2),
    dict(loss_type="grpo", beta=0.04, importance_sampling_level="sequence", top_entropy_quantile=0.4, is_ratio=True),
    dict(loss_type="luspo", beta=0.0, importance_sampling_level="sequence", top_entropy_quantile=0.7),
    dict(
        loss_type="cispo",
        beta=0.04,
        epsilon_high=1.1,
        importance_sampling_level="sequence",
        is_ratio=True,
        top_entropy_quantile=0.2,
    ),
    dict(loss_type="sapo", beta=0.0, importance_sampling_level="sequence", top_entropy_quantile=0.35, is_ratio=True),
    dict(loss_type="vespo", beta=0.04, top_entropy_quantile=0.2, is_ratio=True, steps_per_generation=2),
]


# a float32 entropy of a ~100-word vocabulary is ~log 100 = 4.6, whose float32 spacing is 4.8e-7: the kernels' and
# TRL's entropies (the same logits, sums in another order) agree to a few of those; 20 of them apart is safe
ENTROPY_MARGIN = 1e-5


def _high_entropy_margin(trainer, inputs, quantile: float) -> tuple[int, int, float]:
    """TRL's high-entropy mask on ``inputs``: the tokens it keeps, the completion's tokens, and how far the nearest
    other token's entropy is from the threshold (the kernels' entropies differ from TRL's by float rounding: a
    token that close could fall on the other side)."""
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        _, entropies, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, inputs["completion_ids"].size(1), compute_entropy=True
        )
    values = entropies[inputs["completion_mask"].bool()].float()
    threshold = torch.quantile(values, 1.0 - quantile)
    kept = int(trainer.get_high_entropy_mask(entropies, inputs["completion_mask"], 1.0 - quantile).sum())
    others = values[values != threshold]
    return kept, values.numel(), float((others - threshold).abs().min())


# the metrics TRL's loss logs beside entropy and kl, by loss type
_CLIP_METRICS = {"cispo": ["cispo_clip_ratio"], "sapo": [], "vespo": ["vespo/phi_seq_mean"]}
_SURROGATE_METRICS = ["clip_ratio/low_mean", "clip_ratio/low_min", "clip_ratio/high_mean", "clip_ratio/high_max",
                      "clip_ratio/region_mean"]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_loss_and_its_gradients_equal_trls_own(tmp_path, case):
    case = dict(case)
    is_ratio, on_policy = case.pop("is_ratio", False), case.pop("on_policy", False)
    _, (stock, fast) = _trainers(tmp_path, **{"epsilon": 0.2, "epsilon_high": 0.28, "use_bias_correction_kl": False,
                                              **case})  # fmt: skip
    for trainer in (stock, fast):
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 2  # set by Trainer.train; 2 exercises the normalisers
        trainer.use_vllm = trainer.vllm_importance_sampling_correction = is_ratio  # the vLLM path, without vLLM
    inputs = _inputs(stock, old=not on_policy, beta=case["beta"], is_ratio=is_ratio)
    if "top_entropy_quantile" in case:  # the mask keeps some tokens, not all, and none sits at its threshold
        kept, tokens, margin = _high_entropy_margin(stock, inputs, case["top_entropy_quantile"])
        assert 0 < kept < tokens and margin > ENTROPY_MARGIN, (kept, tokens, margin)
    want, want_grads = _loss_and_grads(stock, inputs, trl.GRPOTrainer._compute_loss)
    got, got_grads = _loss_and_grads(fast, inputs, FastTNTGRPOTrainer._compute_loss)
    assert torch.isfinite(got) and want.abs() > 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():
        atol = 1e-5 * float(g.abs().max()) + 1e-9
        torch.testing.assert_close(got_grads[name], g, rtol=1e-5, atol=atol, msg=lambda m, n=name: f"{n}: {m}")
    clip_metrics = _CLIP_METRICS.get(case["loss_type"], _SURROGATE_METRICS)
    if not on_policy and clip_metrics:  # the case clips: TRL's clip metrics see it too
        assert fast._metrics["train"][clip_metrics[-1]][-1] > 0
    # every metric TRL's loss logs, logged by fasttnt's with TRL's value
    names = ["entropy", *clip_metrics, *(["kl"] if case["beta"] else [])]
    assert set(stock._metrics["train"]) <= {*names, "num_tokens"} | set(fast._metrics["train"])
    for name in names:
        want_metric, got_metric = stock._metrics["train"][name][-1], fast._metrics["train"][name][-1]
        assert got_metric == pytest.approx(want_metric, rel=1e-5, abs=1e-6), name


def test_old_and_reference_logprobs_equal_trls(tmp_path):
    _, (stock, fast) = _trainers(tmp_path)
    inputs = _inputs(stock, old=False, beta=0.0, is_ratio=False)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    with torch.no_grad():
        want, want_entropy, _ = stock._get_per_token_logps_and_entropies(stock.model, ids, mask, 12, 3, True)
        got, got_entropy, _ = fast._get_per_token_logps_and_entropies(fast.model, ids, mask, 12, 3, True)
    assert got.shape == want.shape == (8, 12)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_entropy, want_entropy, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (dict(loss_type="gspo"), "loss_type='gspo' is not supported.*'luspo', 'cispo', 'sapo', 'vespo'"),
        (dict(loss_type="vespo", vespo_k_neg=-1.0), "vespo_k_neg=-1.0 .*not TRL's: it must be >= 0"),
        (dict(entropy_coef=0.01), "entropy_coef"),
        (dict(beta=0.04), "use_bias_correction_kl=True .*set it to False"),
        (dict(delta=1.0, epsilon_high=0.28), "fasttnt's limit, not TRL's: delta must be > 1"),
    ],
)
def test_unsupported_options_are_refused_by_name(tmp_path, option, message):
    tok = build_char_tokenizer()
    dataset = Dataset.from_list([{"prompt": "a", "answer": "1"}] * 4)
    with pytest.raises(ValueError, match=message):
        FastTNTGRPOTrainer(
            model=build_tiny_model(tok, SHAPE, seed=0), processing_class=tok, reward_funcs=[TNTReward(tok, K)],
            args=_config(tmp_path, **option), train_dataset=dataset,
        )  # fmt: skip


def _alternating(completions, **_):
    """Rewards 0, 1, 0, 1, ... whatever was sampled: every group has nonzero advantages, so the step must move."""
    return [float(i % 2) for i in range(len(completions))]


def test_a_few_grpo_trainer_steps_with_the_tnt_reward(tmp_path):
    _, (_, fast) = _trainers(tmp_path, extra_rewards=[_alternating], max_steps=2)
    before = {n: p.detach().clone() for n, p in fast.model.named_parameters()}
    fast.train()
    logs = [log for log in fast.state.log_history if "loss" in log]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(log["loss"])) for log in logs)
    assert all("rewards/tnt_reward/mean" in log and "entropy" in log for log in logs)
    moved = [n for n, p in fast.model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert moved  # the optimizer stepped on fasttnt's gradients


# the loss types past TRL's clipped family, each in real GRPOTrainer steps (steps_per_generation 2: an old policy that
# differs from the current one at the second optimizer step, so each loss's ratio is not 1 everywhere)
REAL_STEP_CASES = [
    dict(loss_type="cispo", epsilon_high=1.1),
    dict(loss_type="sapo"),
    dict(loss_type="luspo", importance_sampling_level="sequence"),
    dict(loss_type="grpo", importance_sampling_level="sequence"),  # GSPO
    dict(loss_type="vespo"),
    dict(loss_type="cispo", epsilon_high=1.1, importance_sampling_level="sequence"),
    # the high-entropy mask off-policy (the second step) and on-policy (no old log-probs: one step per generation)
    dict(loss_type="dapo", top_entropy_quantile=0.2),
    dict(loss_type="grpo", top_entropy_quantile=0.35, importance_sampling_level="sequence"),
    dict(loss_type="dapo", top_entropy_quantile=0.2, steps_per_generation=1),
]


@pytest.mark.parametrize("case", REAL_STEP_CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_real_grpo_trainer_steps_train_as_stock_trl(tmp_path, case):
    # the same seed samples the same completions in both trainers; fasttnt's loss then moves
    # the weights as TRL's does: float rounding apart (the losses' sums in another order, ~1e-7 relative, which
    # Adam's normalised step passes on as the same relative error of each step), bounded at 1e-4 of the movement
    # as in tests/test_distributed.py; a wrong loss or gradient is off by a whole step's worth
    sampled = []

    def alternating_and_recorded(completions, **kwargs):
        sampled.append(list(completions))
        return _alternating(completions, **kwargs)

    options = {"max_steps": 2, "steps_per_generation": 2, "per_device_train_batch_size": 4, **case}
    _, trainers = _trainers(tmp_path, extra_rewards=[alternating_and_recorded], **options)
    margins = []
    if "top_entropy_quantile" in case:  # record how far TRL's entropies fall from its thresholds

        def recorded_mask(entropies, mask, threshold):
            values = entropies[mask.bool()].float()
            cut = torch.quantile(values, threshold)
            others = values[values != cut]
            margins.append(float((others - cut).abs().min()))
            return trl.GRPOTrainer.get_high_entropy_mask(trainers[0], entropies, mask, threshold)

        trainers[0].get_high_entropy_mask = recorded_mask
    start = {n: p.detach().clone() for n, p in trainers[0].model.named_parameters()}
    set_seed(0)
    trainers[0].train()
    stock_sampled = list(sampled)
    set_seed(0)  # the same draws again (generate samples from the global generator, which train() does not seed)
    trainers[1].train()
    assert stock_sampled and sampled[len(stock_sampled) :] == stock_sampled  # the same completions
    stock, fast = ({n: p.detach() for n, p in t.model.named_parameters()} for t in trainers)
    diff, moved = weights_apart(fast, stock, start)
    assert moved > 0, "stock TRL did not move the weights: the comparison would be vacuous"
    if "top_entropy_quantile" in case:  # every step masked, no token within float rounding of a threshold
        assert len(margins) == 2 and min(margins) > ENTROPY_MARGIN, margins
    assert diff <= 1e-4 * moved, f"the weights differ by {diff / moved:.2e} of the distance TRL moved them"


def _completion(tok, text: str, eos: bool = True) -> list[int]:
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return [*ids, tok.eos_token_id] if eos else ids


def test_the_tnt_reward_equals_fasttnts_on_the_same_responses():
    tok = build_char_tokenizer()
    # 2 prompts x 4: thinking right/wrong, direct right, direct but long (over the limit), truncated
    texts = [
        ("<think>3+4=7</think> \\boxed{7}", True), ("<think>3+4=8</think> \\boxed{8}", True),
        ("</think> \\boxed{7}", True), ("</think> 3+4 is 7, as 3+3 is 6 and one more: \\boxed{7}", True),
        ("<think>9-2=7, so</think> \\boxed{7}", True), ("</think> \\boxed{7}", True), ("</think> \\boxed{6}", True),
        ("<think>9-2=", False),
    ]  # fmt: skip
    completion_ids = [_completion(tok, t, eos) for t, eos in texts]
    prompts = ["p1"] * 4 + ["p2"] * 4
    golds = ["7"] * 8
    reward = TNTReward(tok, 4)
    got = reward(prompts, [t for t, _ in texts], completion_ids, answer=golds, trainer_state=None)
    from fasttnt.verify import verify_batch

    ids, cu = pack_sequences(completion_ids)
    truncated = torch.tensor([not eos for _, eos in texts])
    correct = torch.tensor(list(verify_batch([t for t, _ in texts], golds, require_think_end=True))) & ~truncated
    want = compute_rewards(RolloutBatch.of_packed(ids, cu, 4), correct, tok.convert_tokens_to_ids("</think>"),
                           RewardConfig()).rewards.tolist()  # fmt: skip
    assert got == want
    assert got[:4] == [1.0, 0.0, 2.0, -2.0] and got[7] == 0.0  # over the limit; truncated is wrong
    binary = TNTReward(tok, 4, config=RewardConfig(scheme="binary"))
    assert binary(prompts, [], completion_ids, answer=golds) == [1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    # DAPO's overlong shaping on top, counted back from TRL's max_completion_length
    budget, shaping = max(len(c) for c in completion_ids), RewardConfig(overlong_buffer=20)
    shaped = TNTReward(tok, 4, config=shaping, max_completion_length=budget)
    lengths = torch.tensor([len(c) for c in completion_ids])
    expected = torch.tensor(want) + overlong_shaping(lengths, budget, 20, 1.0)
    assert shaped(prompts, [], completion_ids, answer=golds) == pytest.approx(expected.tolist())
    assert (expected < torch.tensor(want)).any()  # some response is long enough to be shaped
    with pytest.raises(ValueError, match="pass max_completion_length"):
        TNTReward(tok, 4, config=shaping)
    # AutoThink's balance counts a draw's free rows over the trainer's ranks: refused for one batch of TRL's
    with pytest.raises(ValueError, match=r"TNTReward: reward.mode_balance=True is the fasttnt trainer's"):
        TNTReward(tok, 4, config=RewardConfig(mode_balance=True))


def test_the_tnt_reward_counts_a_completion_ended_by_a_second_eos_id_as_ended(tmp_path):
    # a model folder whose generation config lists a second EOS id beside the tokenizer's (<|user|> here, as
    # Qwen2.5-Instruct's lists <|endoftext|> beside <|im_end|>): TRL's generation stops at either
    from transformers import AutoTokenizer, GenerationConfig

    from fasttnt import scoring

    tok = build_char_tokenizer()
    eos, second = tok.eos_token_id, tok.convert_tokens_to_ids("<|user|>")
    assert second not in (eos, tok.pad_token_id)
    tok.save_pretrained(tmp_path / "model")
    GenerationConfig(eos_token_id=[eos, second]).save_pretrained(tmp_path / "model")
    texts = ["<think>3+4=7</think> \\boxed{7}", "<think>3+4=8</think> \\boxed{8}", "</think> \\boxed{7}",
             "</think> \\boxed{6}"]  # fmt: skip
    by_eos = [_completion(tok, t) for t in texts]
    by_second = [[*ids[:-1], second] for ids in by_eos]
    prompts, golds = ["p"] * 4, ["7"] * 4
    want = TNTReward(tok, 4)(prompts, [], by_eos, answer=golds)
    assert want == [1.0, 0.0, 2.0, -1.0]  # the construction: right and wrong in both modes, none truncated
    # the tokenizer loaded from the folder: its generation config's ids too; or the ids given
    from_folder = TNTReward(AutoTokenizer.from_pretrained(tmp_path / "model"), 4)
    given = TNTReward(tok, 4, eos_token_ids=[eos, second])
    assert from_folder.eos_ids == given.eos_ids == {eos, second}
    assert from_folder(prompts, [], by_second, answer=golds) == given(prompts, [], by_second, answer=golds) == want
    batch = scoring.batch_of(by_second, group_size=4, eos_ids=given.eos_ids)
    assert not batch.truncated.any()
    assert scoring.judge(tok, batch, golds, eos_ids=given.eos_ids).texts == texts  # the second id dropped
    # a tokenizer built in memory (no folder) names <eos> alone: the same completions were cut by the budget
    alone = TNTReward(tok, 4)
    assert alone.eos_ids == {eos}
    assert scoring.batch_of(by_second, group_size=4, eos_ids=alone.eos_ids).truncated.all()
    assert alone(prompts, [], by_second, answer=golds) != want


def test_the_tnt_reward_refuses_a_split_group_and_names_a_missing_column():
    tok = build_char_tokenizer()
    reward = TNTReward(tok, 4)
    ids = [_completion(tok, "</think> 1")] * 6
    with pytest.raises(ValueError, match="not whole groups of num_generations=4"):
        reward(["p"] * 6, [], ids, answer=["1"] * 6)
    with pytest.raises(ValueError, match="not whole groups"):  # 8 completions, but a group boundary inside a prompt
        reward(["a"] * 2 + ["b"] * 6, [], ids + ids[:2], answer=["1"] * 8)
    with pytest.raises(KeyError, match=r"column 'answer'.*'solution'"):
        reward(["p"] * 4, [], ids[:4], solution=["1"] * 4)


def test_the_high_entropy_threshold_spans_every_process_as_trls(tmp_path):
    # two ranks in a real gloo group with 37 and 50 tokens: fasttnt's mask equals TRL's get_high_entropy_mask on
    # each (the same pad-and-gather, the same quantile), and differs from each rank's own quantile's mask
    from support import small, varied

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": varied.PYTHONPATH}
    ranks = small.run_ranks("trl_entropy_ranks", env=env, timeout=300)
    results = []
    for rank in ranks:
        assert rank.returncode == 0, rank.stderr[-2000:]
        results.append(json.loads(rank.stdout.strip().splitlines()[-1]))
    assert [r["tokens"] for r in results] == [37, 50]
    assert any(r["local_differs"] for r in results), "precondition: the gathered threshold is not a rank's own"
    assert all(r["equal"] for r in results), results
    assert 0 < sum(r["kept"] for r in results) < 87
