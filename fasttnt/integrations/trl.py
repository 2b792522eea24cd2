"""fasttnt's kernels inside TRL's ``GRPOTrainer`` (read against TRL 1.16.0), and the TNT reward as a TRL reward
function.

    from trl import GRPOConfig
    from fasttnt.integrations.trl import FastTNTGRPOTrainer, TNTReward

    trainer = FastTNTGRPOTrainer(
        model=model, processing_class=tokenizer, args=GRPOConfig(..., loss_type="dapo"),
        reward_funcs=[TNTReward(tokenizer, num_generations=8)],  # gold answers from the dataset's "answer" column
        train_dataset=dataset,
    )

``FastTNTGRPOTrainer`` is TRL's trainer with two methods replaced: ``_compute_loss`` runs the backbone and hands
its last hidden states and the lm_head weight to ``linear_policy_loss`` (the logits never exist; the loss's
gradient is formed in the same chunked pass), and ``_get_per_token_logps_and_entropies`` (the old and reference
log-probs) runs ``linear_token_logprobs``. Everything else (generation, rewards, advantages, logging, the
optimizer) is TRL's. The semantics are TRL's own ``_compute_loss``'s, option for option:

    loss_type     grpo (per-sequence token mean, batch mean), bnpo (token mean of the micro-batch), dr_grpo
                  (token sum / (sequences x max_completion_length)), dapo (token sum / the generation batch's
                  tokens); cispo (normalised as dapo: the weight min(r, epsilon_high), detached, times -A log pi,
                  which is fasttnt's policy_loss="cispo" with clip_low = 1 and clip_high = epsilon_high - 1; delta
                  does not apply), sapo (normalised as grpo: the soft gate at sapo_temperature_pos/_neg, fasttnt's
                  policy_loss="sapo"), luspo (per-sequence token sum, batch mean: fasttnt's seq-mean-token-sum-norm
                  at norm_length 1), vespo (normalised as dapo: each sequence's gamma weight of its summed
                  log-ratio, detached, times -A log pi, fasttnt's policy_loss="vespo" at vespo_k_pos,
                  vespo_lambda_pos, vespo_k_neg and vespo_lambda_neg; a lambda below 1e-4 is 1e-4, as TRL clamps it)
    importance_sampling_level   "sequence" (GSPO: one ratio per sequence from its mean log-ratio) with grpo,
                  bnpo, dr_grpo, dapo or luspo is fasttnt's policy_loss="gspo" under the loss type's aggregation
                  (TRL counts a sequence's one value on each of its tokens, as fasttnt's GSPO does); with cispo or
                  sapo, fasttnt's ratio_level="sequence" (CISPO's weight, SAPO's gate of the sequence's ratio, each
                  token's own gradient: TRL's derivative through the mean); vespo reads its own sequence weights
                  whatever the level (TRL's too)
    epsilon, epsilon_high   the clip range
    delta         TRL's two-sided clip, which caps the ratio at delta in both of its loss's branches. With
                  delta >= 1 + epsilon_high (what TRL recommends) that is fasttnt's dual clip at delta; with
                  1 < delta < 1 + epsilon_high TRL's loss caps positive advantages' ratios at delta and bounds
                  negative advantages' loss at (1 + epsilon_high) |A|, which is fasttnt's clip_high = delta - 1 with
                  a dual clip at 1 + epsilon_high. delta <= 1 is refused: fasttnt's limit, not TRL's
    beta          the k3 KL to TRL's reference model, per token, added after the clipped term (with
                  use_bias_correction_kl=False: TRL's default weights it by the ratio, which is refused)
    temperature   the sampling temperature the log-probs are taken at
    top_entropy_quantile   TRL's mask of the tokens of highest entropy ("Beyond the 80/20 rule", arXiv
                  2506.01939): the policy term only on tokens whose entropy is at least the (1 - q) quantile of all
                  processes' tokens of the micro-batch, the normalisers, the KL term and the metrics over every
                  token, as TRL's. The threshold is needed before the fused loss forms any gradient, so the
                  entropies come from a no-grad pass of their own (one lm_head matmul more per micro-batch);
                  fasttnt's ``token_mask`` (with a sequence-level ratio, folded into each sequence's mean weight)
    vLLM's importance-sampling correction (use_vllm with vllm_importance_sampling_correction): TRL's
                  ``importance_sampling_ratio`` as the per-token weight of the clipped term (at the sequence level,
                  except with cispo, each sequence's mean: TRL's gradient goes through the sequence's ratio); with
                  vespo, inside each sequence's weight (the completion's tokens': TRL makes a padded position's
                  ratio 1)

TRL's metrics are logged under its names: entropy, kl, clip_ratio/low_mean, low_min, high_mean, high_max and
region_mean, cispo_clip_ratio, vespo/phi_seq_mean, each computed as TRL computes it (low_min and high_max from
per-sequence means over all processes).

Importing this module imports TRL (>= 1.16.0, whose private methods it replaces; an older one is refused here);
``fasttnt.integrations`` itself does not.

Refused, with the option named: a negative vespo_k_pos or vespo_k_neg (phi = w^k e^(lambda (1 - w)) is then
unbounded as w falls, which TRL meets by zeroing the infinities its float32 exp makes: a weight that jumps from its
largest to 0), off_policy_mask_threshold, use_bias_correction_kl with beta > 0, an entropy
bonus, MoE auxiliary losses, tool masks inside a completion, a lm_head bias, logit scaling or soft-capping,
multimodal inputs to the loss.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Collection
from importlib.metadata import version

import torch
from packaging.version import Version
from trl import GRPOTrainer
from trl.trainer.utils import maybe_gather_lm_head_ctx, nanmax, nanmin

from fasttnt_kernels import (
    PolicyLossConfig,
    linear_policy_loss,
    linear_token_logprobs,
    sequence_log_ratios,
    vespo_weights,
)

from .. import scoring
from ..data import think_end_token_id
from ..engines.batch import cu_seqlens_of, eos_ids_of
from ..rewards import RewardConfig, refuse_mode_balance

# the TRL release whose GRPOTrainer._compute_loss and _get_per_token_logps_and_entropies this module replaces and
# is tested against; an older one is refused (its private methods differ)
TRL_VERSION = "1.16.0"
if Version(version("trl")) < Version(TRL_VERSION):
    raise ImportError(f"fasttnt.integrations.trl needs trl>={TRL_VERSION} (found {version('trl')})")

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(PolicyLossConfig))
SUPPORTED_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
# the loss types of the clipped surrogate (TRL's two-sided clip, delta, and its sequence-level ratios apply to these)
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")

# per loss_type: fasttnt's aggregation (the normalisers are set per call in _loss_normalisers)
_AGGREGATION = {"grpo": "seq-mean-token-mean", "bnpo": "token-mean", "dr_grpo": "seq-mean-token-sum-norm",
                "dapo": "token-mean", "luspo": "seq-mean-token-sum-norm", "cispo": "token-mean",
                "sapo": "seq-mean-token-mean", "vespo": "token-mean"}  # fmt: skip


def check_grpo_config(args) -> None:
    """Raise ValueError, naming the option, for a GRPOConfig whose loss fasttnt's kernels do not compute exactly."""
    if args.loss_type not in SUPPORTED_LOSS_TYPES:
        raise ValueError(
            f"loss_type={args.loss_type!r} is not supported by fasttnt's loss; use one of {SUPPORTED_LOSS_TYPES}"
        )
    option = functools.partial(getattr, args)  # options a TRL release may not have read as off
    refused = {
        "vespo_k_pos": args.loss_type == "vespo" and option("vespo_k_pos", 0.0) < 0.0,
        "vespo_k_neg": args.loss_type == "vespo" and option("vespo_k_neg", 0.0) < 0.0,
        "off_policy_mask_threshold": option("off_policy_mask_threshold", None) is not None,
        # TRL's default; it weights the KL term by the ratio (with its gradient), which fasttnt's loss does not
        "use_bias_correction_kl": args.beta != 0.0 and bool(option("use_bias_correction_kl", False)),
        "entropy_coef": option("entropy_coef", 0.0) != 0.0 or bool(option("use_adaptive_entropy", False)),
        "delta": args.delta is not None and args.delta <= 1.0 and args.loss_type in _CLIPPED,
    }
    for option, bad in refused.items():
        if bad:
            value = getattr(args, option, None)
            raise ValueError(
                f"GRPOConfig.{option}={value!r} is not supported by fasttnt's loss (see fasttnt.integrations.trl)"
                + ("; fasttnt's limit, not TRL's: delta must be > 1" if option == "delta" else "")
                + ("; set it to False with beta > 0" if option == "use_bias_correction_kl" else "")
                + ("; fasttnt's limit, not TRL's: it must be >= 0" if option.startswith("vespo_k") else "")
            )


def loss_options(loss_type: str, epsilon_low: float, epsilon_high: float, delta: float | None, args) -> dict:
    """TRL's loss_type, clip range, two-sided clip, SAPO temperatures and VESPO shapes as fasttnt's
    ``PolicyLossConfig`` fields (module docstring): the clipped surrogate's (``clip_options``), CISPO's cap, SAPO's
    gate, VESPO's weight."""
    level = getattr(args, "importance_sampling_level", "token")
    if loss_type == "cispo":  # TRL: clamp(r, max=epsilon_high), no bound below
        return {"policy_loss": "cispo", "clip_low": 1.0, "clip_high": epsilon_high - 1.0, "dual_clip": None,
                "ratio_level": level}  # fmt: skip
    if loss_type == "sapo":
        return {"policy_loss": "sapo", "clip_low": epsilon_low, "clip_high": epsilon_high, "dual_clip": None,
                "sapo_tau_pos": args.sapo_temperature_pos, "sapo_tau_neg": args.sapo_temperature_neg,
                "ratio_level": level}  # fmt: skip
    if loss_type == "vespo":  # TRL clamps each lambda at 1e-4 from below; the clip range is not read
        return {"policy_loss": "vespo", "dual_clip": None, "vespo_k_pos": args.vespo_k_pos,
                "vespo_lambda_pos": max(args.vespo_lambda_pos, 1e-4), "vespo_k_neg": args.vespo_k_neg,
                "vespo_lambda_neg": max(args.vespo_lambda_neg, 1e-4)}  # fmt: skip
    options = clip_options(epsilon_low, epsilon_high, delta)
    if level == "sequence":
        options["policy_loss"] = "gspo"
    return options


def clip_options(epsilon_low: float, epsilon_high: float, delta: float | None) -> dict:
    """TRL's clip range and two-sided clip as fasttnt's clip_low, clip_high and dual_clip (module docstring)."""
    if delta is None:
        return {"clip_low": epsilon_low, "clip_high": epsilon_high, "dual_clip": None}
    if delta >= 1.0 + epsilon_high:
        return {"clip_low": epsilon_low, "clip_high": epsilon_high, "dual_clip": delta}
    return {"clip_low": epsilon_low, "clip_high": delta - 1.0, "dual_clip": 1.0 + epsilon_high}


def _install_hidden_forward(model) -> None:
    """Let ``model(..., fasttnt=fn)`` run the backbone and return ``fn(model, last_hidden_state)``, inside the
    model's own forward: through DDP's or DeepSpeed's wrapper, so their hooks run, and under ZeRO-3 the lm_head
    weight can be gathered for the fused op (TRL's ``add_fused_lm_head`` does the same for its own). Any other call
    is the forward the model had."""
    if getattr(model, "_fasttnt_hidden_forward", False):
        return
    previous = model.forward

    @functools.wraps(type(model).forward)  # generate validates its kwargs against the signature
    def forward(self, *args, fasttnt: Callable | None = None, **kwargs):
        if fasttnt is None:
            return previous(*args, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state  # (B, T, H)
        return fasttnt(self, hidden)

    model.forward = types.MethodType(forward, model)
    model._fasttnt_hidden_forward = True


def _lm_head_weight(model) -> torch.Tensor:
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("fasttnt's fused ops take a lm_head without bias")
    return head.weight


def _check_plain_logits(model) -> None:
    config = model.config.get_text_config()
    for name in ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier", "logits_scaling"):
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(f"{type(model).__name__} scales its logits ({name}={value}): fasttnt's ops do not")


def packed_completions(completion_ids: torch.Tensor, completion_mask: torch.Tensor):
    """TRL's right-padded completions (B, C) as fasttnt's packed layout: ``valid`` (B, C) bool, ids (N,), cu_seqlens
    (B+1,). Each row's mask must be a prefix (tokens up to the first EOS), as TRL makes it."""
    lengths = completion_mask.sum(1)  # (B,)
    positions = torch.arange(completion_mask.shape[1], device=completion_mask.device)
    valid = positions[None, :] < lengths[:, None]  # (B, C)
    if not torch.equal(valid, completion_mask.bool()):
        raise ValueError("a completion mask with gaps inside a completion (tool masks) is not supported by fasttnt")
    return valid, completion_ids[valid], cu_seqlens_of(lengths)


class FastTNTGRPOTrainer(GRPOTrainer):
    """TRL's GRPOTrainer whose policy loss and log-probs are fasttnt's fused lm_head ops (module docstring)."""

    def __init__(self, model, reward_funcs, args=None, *rest, **kwargs) -> None:
        if args is not None:  # refused before any model loads
            check_grpo_config(args)
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        check_grpo_config(self.args)
        if self.aux_loss_enabled:
            raise ValueError("MoE auxiliary losses (output_router_logits) are not supported by fasttnt's loss")
        for model in (self.model, self.ref_model):
            if model is not None:
                base = model.get_base_model() if hasattr(model, "get_base_model") else model
                _check_plain_logits(base)
                _lm_head_weight(base)
                _install_hidden_forward(base)

    def _get_per_token_logps_and_entropies(
        self, model, input_ids, attention_mask, logits_to_keep, batch_size=None, compute_entropy=False,
        compute_aux_loss=False, **multimodal,
    ):  # fmt: skip
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, batch_size, compute_entropy, compute_aux_loss,
                **multimodal,
            )  # fmt: skip
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
            valid = mask[:, -logits_to_keep:].bool()  # (b, K): TRL scores the completion's unpadded tokens
            targets = ids[:, -logits_to_keep:][valid]  # (n,)

            def logprobs(model, hidden, valid=valid, targets=targets):
                weight = _lm_head_weight(model)
                states = hidden[:, -logits_to_keep - 1 : -1][valid]  # (n, H): each predicts the next token
                with maybe_gather_lm_head_ctx(weight):  # gathered under ZeRO-3 while the fused op reads it
                    return linear_token_logprobs(
                        states.to(weight.dtype), weight, targets, temperature=self.temperature,
                        with_entropy=compute_entropy,
                    )  # fmt: skip

            with self.accelerator.autocast():
                out = model(input_ids=ids, attention_mask=mask, fasttnt=logprobs)
            logp, entropy = out if compute_entropy else (out, None)
            logps.append(_unpack(logp, valid))
            if compute_entropy:
                entropies.append(_unpack(entropy, valid))
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    def _compute_loss(self, model, inputs):
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        if "tool_mask" in inputs:
            raise ValueError("tool masks inside a completion are not supported by fasttnt's loss")
        if any(inputs.get(k) is not None for k in ("pixel_values", "image_grid_thw", "token_type_ids")):
            raise ValueError("multimodal inputs are not supported by fasttnt's loss")
        advantages = inputs["advantages"]
        if advantages.dim() != 1:
            raise ValueError("per-token advantages (B, T) are not supported by fasttnt's loss: one per sequence")
        valid, targets, cu_seqlens = packed_completions(completion_ids, completion_mask)
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        is_ratio = None
        if self.use_vllm and self.vllm_importance_sampling_correction:
            is_ratio = inputs["importance_sampling_ratio"].expand_as(completion_mask)[valid]  # (N,)
        mode = "train" if self.model.training else "eval"
        loss_kwargs = dict(
            old_logp=None if old is None else old[valid],
            advantages=advantages,
            cu_seqlens=cu_seqlens,
            temperature=self.temperature,
            **loss_options(self.loss_type, self.epsilon_low, self.epsilon_high, self.args.delta, self.args),
            ref_logp=None if ref is None else ref[valid],
            kl_coef=self.beta,
            kl_max=None,  # TRL's k3 is uncapped (fasttnt's default caps it at 10, as verl)
            agg=_AGGREGATION[self.loss_type],
            **self._loss_normalisers(inputs, int(valid.sum()), len(advantages), mode),
        )
        P = prompt_ids.size(1)

        def loss_fn(model, hidden):
            weight = _lm_head_weight(model)
            states = hidden[:, P - 1 : -1][valid].to(weight.dtype)  # (N, H): the state before each completion token
            with maybe_gather_lm_head_ctx(weight):  # gathered under ZeRO-3 while the fused ops read it
                high = self._high_entropy_mask(states, weight, targets) if self.top_entropy_quantile < 1.0 else None
                is_weights, token_mask = self._token_factors(is_ratio, high, cu_seqlens)
                out = linear_policy_loss(states, weight, targets, return_logp=True, is_weights=is_weights,
                                         token_mask=token_mask, **loss_kwargs)  # fmt: skip
            return *out, is_weights

        with self.accelerator.autocast():  # as TRL's own forward for the loss
            loss, stats, logp, is_weights = model(
                input_ids=torch.cat([prompt_ids, completion_ids], 1),
                attention_mask=torch.cat([prompt_mask, completion_mask], 1),
                fasttnt=loss_fn,
            )
        old_logp = logp if old is None else old[valid].float()
        phi = None
        if self.loss_type == "vespo":  # TRL's vespo/phi_seq_mean: each sequence's weight, as the loss computed it
            config = PolicyLossConfig(**{k: v for k, v in loss_kwargs.items() if k in _CONFIG_FIELDS})
            log_w = sequence_log_ratios(config, logp, old_logp, cu_seqlens, is_weights)  # (B,)
            phi = vespo_weights(log_w, advantages.float(), config)
        self._log_loss_stats(stats, logp - old_logp, advantages, cu_seqlens, mode, phi)
        return loss

    def _high_entropy_mask(self, states: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """TRL's ``top_entropy_quantile`` mask (N,) float: 1 on the tokens whose entropy is at least the
        (1 - top_entropy_quantile) quantile of every process's tokens of this micro-batch, as TRL's
        ``get_high_entropy_mask``. The threshold must be known before the fused loss forms any gradient, so the
        entropies come from a pass of their own (no gradient: one lm_head matmul more) over the same states."""
        with torch.no_grad():
            _, entropy = linear_token_logprobs(
                states.detach(), weight.detach(), targets, temperature=self.temperature, with_entropy=True
            )  # (N,) float32
        # TRL's gather: each process's entropies padded to the longest with a sentinel no entropy (>= 0) can equal
        sentinel = -1e9
        gathered = self.accelerator.gather(self.accelerator.pad_across_processes(entropy, dim=0, pad_index=sentinel))
        gathered = gathered[gathered != sentinel]
        if gathered.numel() == 0:
            return torch.zeros_like(entropy)
        return (entropy >= torch.quantile(gathered, 1.0 - self.top_entropy_quantile)).float()

    def _token_factors(self, is_ratio, high_entropy, cu_seqlens) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """TRL's per-token factors of the policy term, vLLM's importance-sampling ratio and the high-entropy mask
        (N,) each or None, as fasttnt's ``is_weights`` and ``token_mask``. TRL differentiates a sequence-level
        ratio (but CISPO's weight and VESPO's, constants) through the mean of the sequence's log-ratios, so each
        token's gradient carries its sequence's mean factor, not its own, and the loss counts the factors' sum:
        that is fasttnt's GSPO (each token's own gradient) with every token's factor its sequence's mean. Otherwise
        the ratio is ``is_weights`` (VESPO's enters each sequence's weight) and the mask ``token_mask``."""
        if self.importance_sampling_level != "sequence" or self.loss_type in ("cispo", "vespo"):
            return is_ratio, high_entropy
        factors = [f for f in (is_ratio, high_entropy) if f is not None]
        if not factors:
            return None, None
        product = factors[0] if len(factors) == 1 else factors[0] * factors[1]  # (N,)
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (B,)
        # each sequence's sum by a float64 cumulative sum: deterministic on CUDA, where index_add_'s atomics are not
        ends = torch.cat([product.new_zeros(1, dtype=torch.float64), product.double().cumsum(0)])  # (N+1,)
        means = (ends[cu_seqlens[1:]] - ends[cu_seqlens[:-1]]) / lengths.clamp(min=1)  # (B,)
        return torch.repeat_interleave(means.to(product.dtype), lengths, output_size=product.numel()), None

    def _loss_normalisers(self, inputs, tokens: int, sequences: int, mode: str) -> dict:
        """TRL's normaliser of each loss_type as fasttnt's total_tokens / total_seqs (TRL divides every loss
        but dapo's, cispo's and vespo's by the gradient-accumulation steps; theirs counts the generation batch's
        tokens)."""
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        if self.loss_type in ("grpo", "sapo"):
            return {"total_seqs": sequences * accumulation}
        if self.loss_type == "luspo":  # each sequence's token sum, the mean over sequences
            return {"total_seqs": sequences * accumulation, "norm_length": 1.0}
        if self.loss_type == "bnpo":
            return {"total_tokens": max(tokens, 1) * accumulation}
        if self.loss_type == "dr_grpo":
            return {"total_seqs": sequences * accumulation, "norm_length": self.max_completion_length}
        normaliser = inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
        if mode == "train":
            normaliser = normaliser * self.current_gradient_accumulation_steps / self.args.steps_per_generation
        return {"total_tokens": float(normaliser)}

    def _log_loss_stats(self, stats: dict, log_ratio, advantages, cu_seqlens, mode: str, phi=None) -> None:
        """TRL's metrics under its names, computed as TRL computes them: token means over all processes (entropy,
        kl), the mean of VESPO's sequence weights ``phi`` (B,) over all processes, the clip ratios (from the ratio
        capped at delta) as means over tokens, or over sequences with importance_sampling_level="sequence" (one
        ratio each), and the extremes of per-sequence clip ratios."""
        lengths = cu_seqlens[1:] - cu_seqlens[:-1]  # (B,)
        index = torch.arange(len(lengths), device=advantages.device)
        seq = torch.repeat_interleave(index, lengths, output_size=log_ratio.numel())  # (N,) each token's sequence
        log_ratio = log_ratio.detach().float()
        if self.importance_sampling_level == "sequence":  # TRL's ratio: one per sequence, its metrics per sequence
            sums = torch.zeros(len(lengths), device=log_ratio.device).index_add_(0, seq, log_ratio)
            ratio, a = torch.exp(sums / lengths.clamp(min=1)), advantages  # (B,), (B,)
        else:
            ratio, a = torch.exp(log_ratio), advantages[seq]  # (N,), (N,)
        if self.args.delta is not None and self.loss_type in _CLIPPED:
            ratio = ratio.clamp(max=self.args.delta)
        low = ((ratio < 1 - self.epsilon_low) & (a < 0)).float()
        high = ((ratio > 1 + self.epsilon_high) & (a > 0)).float()
        tokens = torch.tensor(float(log_ratio.numel()), device=low.device)
        units = torch.tensor(float(low.numel()), device=low.device)  # tokens, or sequences
        token_sums = {"entropy": stats["entropy"].float() * tokens}
        if self.beta != 0.0:
            token_sums["kl"] = stats["kl_ref"].float() * tokens
        unit_sums = {}
        if self.loss_type in _CLIPPED:
            unit_sums = {"clip_ratio/low_mean": low.sum(), "clip_ratio/high_mean": high.sum(),
                         "clip_ratio/region_mean": torch.maximum(low, high).sum()}  # fmt: skip
        elif self.loss_type == "cispo":  # TRL's: the weight above its cap with A > 0 (sapo logs no clip)
            unit_sums = {"cispo_clip_ratio": ((ratio > self.epsilon_high) & (a > 0)).float().sum()}
        elif phi is not None:  # TRL's: a mean over sequences, empty ones included
            unit_sums, units = {"vespo/phi_seq_mean": phi.sum()}, torch.tensor(float(len(phi)), device=phi.device)
        totals = self.accelerator.reduce(
            torch.stack([*token_sums.values(), tokens, *unit_sums.values(), units]), reduction="sum"
        )
        n_token = len(token_sums)
        means = (totals[:n_token] / totals[n_token].clamp(min=1.0)).tolist()
        means += (totals[n_token + 1 : -1] / totals[-1].clamp(min=1.0)).tolist()
        for name, value in zip([*token_sums, *unit_sums], means, strict=True):
            self._metrics[mode][name].append(value)
        if self.loss_type not in _CLIPPED:
            return
        # per sequence (NaN for an empty one, as TRL's masked mean gives), over every process's sequences
        if self.importance_sampling_level == "sequence":
            low_seq, high_seq = low, high  # already one per sequence
        else:

            def per_sequence(flags):
                return torch.zeros(len(lengths), device=flags.device).index_add_(0, seq, flags) / lengths.float()

            low_seq, high_seq = per_sequence(low), per_sequence(high)
        self._metrics[mode]["clip_ratio/low_min"].append(nanmin(self.accelerator.gather(low_seq)).item())
        self._metrics[mode]["clip_ratio/high_max"].append(nanmax(self.accelerator.gather(high_seq)).item())


def _unpack(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Packed per-token values (n,) back to TRL's (b, K) layout, 0 where padded."""
    return values.new_zeros(valid.shape).masked_scatter(valid, values)


class TNTReward:
    """The TNT reward as a TRL reward function (``reward_funcs=[TNTReward(tokenizer, num_generations=K)]``).

    TRL calls it with the completions' token ids and the dataset's columns; the gold answers are read from
    ``answer_column``. A completion is correct when ``verify(texts, golds)`` says so (default: fasttnt's verifier,
    the final answer after ``</think>``) and it ended with EOS; the rewards are ``fasttnt.rewards.compute_rewards``
    under ``config`` (scheme tnt, or a baseline: no-limit, uniform-limit, binary), with each prompt's limit from its
    own group of K thinking responses. TRL lays a prompt's K completions out together; a process whose share does
    not hold whole groups is refused (the limit would be computed from part of a group): make
    ``per_device_train_batch_size * steps_per_generation`` a multiple of ``num_generations``. DAPO's overlong
    shaping (``config.overlong_buffer`` > 0) counts back from the length budget: pass ``max_completion_length`` (the
    same as GRPOConfig's).

    The EOS ids: ``eos_token_ids`` when given, else the tokenizer's EOS plus the generation config's of the folder
    the tokenizer was loaded from (``tokenizer.name_or_path``), when that is a local model folder. A reward function
    does not see the model, and TRL's generation (transformers' ``generate`` or vLLM) stops at every id of the
    model's generation config: pass them (``model.generation_config.eos_token_id``) for a tokenizer loaded from a
    hub id, or else a completion ended by another id (Qwen2.5-Instruct's ``<|endoftext|>`` beside the tokenizer's
    ``<|im_end|>``) counts as truncated.
    """

    __name__ = "tnt_reward"  # TRL names a reward function's metrics by it

    def __init__(
        self,
        tokenizer,
        num_generations: int,
        *,
        config: RewardConfig | None = None,
        answer_column: str = "answer",
        verify: scoring.Verify | None = None,
        max_completion_length: int | None = None,
        eos_token_ids: Collection[int] | None = None,
    ) -> None:
        if num_generations < 1:
            raise ValueError(f"num_generations must be >= 1, got {num_generations}")
        self.tokenizer, self.num_generations = tokenizer, num_generations
        self.config = config or RewardConfig()
        refuse_mode_balance(self.config, "TNTReward")
        if self.config.overlong_buffer > 0 and max_completion_length is None:
            raise ValueError(
                "TNTReward: config.overlong_buffer > 0 shapes rewards back from the length budget: pass "
                "max_completion_length (GRPOConfig.max_completion_length)"
            )
        self.max_completion_length = max_completion_length
        self.answer_column, self.verify = answer_column, verify
        self.think_end_id = think_end_token_id(tokenizer)
        self.eos_ids = frozenset(eos_token_ids) if eos_token_ids is not None else eos_ids_of(tokenizer)

    def __call__(self, prompts: list, completions: list, completion_ids: list[list[int]], **columns) -> list[float]:
        if self.answer_column not in columns:
            raise KeyError(
                f"TNTReward reads the gold answers from the dataset column {self.answer_column!r}; the columns are "
                f"{sorted(k for k in columns if k != 'trainer_state')}"
            )
        golds = [str(g) for g in columns[self.answer_column]]
        k, n = self.num_generations, len(completion_ids)
        whole_groups = n % k == 0 and all(prompts[i] == prompts[i - i % k] for i in range(n))
        if not whole_groups:
            raise ValueError(
                f"TNTReward got {n} completions that are not whole groups of num_generations={k} (a group split "
                "across processes or steps): its limit needs all of a prompt's responses. Make "
                "per_device_train_batch_size * steps_per_generation a multiple of num_generations"
            )
        batch = scoring.batch_of(completion_ids, group_size=k, eos_ids=self.eos_ids)
        scores = scoring.score(
            self.tokenizer, batch, golds, eos_ids=self.eos_ids, verify=self.verify, reward=self.config,
            think_end_id=self.think_end_id, max_new_tokens=self.max_completion_length,
        )  # fmt: skip
        return scores.rewards.rewards.tolist()
