"""The ``hf`` engine: fasttnt's own decode loop over the training model itself (CPU or GPU, KV cache, batched).

It prefills each distinct prompt once for its K samples and drops finished rows from the batch (transformers'
``generate`` can do neither), and samples with the counter-based sampler (``engines.sampler``).
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from .. import distributed
from ..data import Prompt, think_end_token_id
from ..host_memory import give_back_freed_heap
from . import decode_step
from .base import ENGINES, EngineSettings, Requests
from .batch import RolloutBatch, eos_ids_of
from .sampler import row_seeds, seeded_sample

# compact once this share of the decode batch has finished: a compaction copies the KV cache once, and rows left in
# cost a wasted row each per step. At 1/8 a step wastes less than 1/8 of its rows, and the copies add up to at
# most 8 first batches' worth of rows (the batch shrinks to 7/8 or less each time: a geometric series)
_COMPACT_SHARE = 8


@dataclass
class _DecodeRows:
    """The rows of the decode batch (B of them, on the model's device): the S responses after the prefill, the
    unfinished ones after each compaction."""

    # per layer: keys and values (B, kv heads, W + t, head dim); under decode_step, buffers with room past W + t
    cache: DynamicCache
    mask: torch.Tensor  # (B, W + t) int64: 0 on the prompts' left padding
    positions: torch.Tensor  # (B,) int64: the position of each row's last token
    seeds: torch.Tensor  # (B,) int64
    index: torch.Tensor  # (B,) int64: each row's index among the S responses
    tokens: torch.Tensor  # (B,) int64: each row's last sampled token, fed next
    done: torch.Tensor  # (B,) bool: sampled EOS; fed the pad token, its outputs ignored, until the next compaction

    def compact(self) -> None:
        """Drop the finished rows from the batch and the KV cache (one copy of the cache)."""
        keep = (~self.done).nonzero()[:, 0]  # (B',) sync: the number of rows kept
        self.cache.batch_select_indices(keep)  # transformers 5.24: every layer's keys and values indexed on dim 0
        self.mask, self.positions, self.seeds, self.index, self.tokens, self.done = (
            t[keep] for t in (self.mask, self.positions, self.seeds, self.index, self.tokens, self.done)
        )


@ENGINES.register("hf")
class HFEngine:
    """fasttnt's own decode loop over the training model itself (no weight copy, so syncing is free).

    Not transformers ``generate``: it prefills a prompt once per sample and computes every row until the longest
    finishes (a step whose responses run 11 to 60 tokens computes 60 positions for each), and it cannot drop rows.
    Here each distinct prompt is prefilled once and its KV cache repeated K times, and finished rows leave the batch
    and the cache (``_DecodeRows.compact``). The model's ``generation_config`` is read for its EOS ids alone
    (``eos_ids_of``), never for its repetition penalty, n-gram bans, ...: they would bend the distribution the
    loss's log-probs assume.
    """

    separate_weights = False

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens = settings.max_new_tokens
        self.temperature, self.top_p = settings.temperature, settings.top_p
        self.bf16_autocast = settings.dtype == "bfloat16"  # as the training forwards (run_setup.bf16_autocast)
        self.zero3_engine = settings.zero3_engine
        self.give_back_heap = settings.give_back_heap
        self.eos_ids = eos_ids_of(tokenizer, model)  # a row stops at any of them
        # fed to finished rows and as the prompts' (masked) left padding, so any id does: without a pad token, an
        # EOS id (the tokenizer's, where it is the only one)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)
        self.think_end_id = think_end_token_id(tokenizer, required=False)  # forced thinking needs it, free mode not
        forward = inspect.signature(model.forward).parameters
        # transformers 5 renamed the forward's past_key_values to cache (5.24 takes both, warning on the old name)
        self.cache_keyword = "cache" if "cache" in forward else "past_key_values"
        # the prefill needs the last position's logits only, not (P, W, V): generate asks the same where it can
        self.last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}
        # a decode step written out for Qwen2 and Llama (engines.decode_step) where it supports the model, asked again
        # at each rollout; transformers' forward otherwise, and always once this is set False
        self.written_out_step = decode_step.supports(model)

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, rows=None
    ) -> RolloutBatch:
        """``first_row``: the global index of this batch's first response, when ranks generate shares of a step;
        ``rows`` (P*K,): each row's own prompt, for a mode-mixed group (``Requests.of``)."""
        with self._whole_model():
            return self._generate(Requests.of(prompts, group_size, rows), group_size, seed, first_row)

    def _whole_model(self):
        """Under ZeRO-3, the whole model without ZeRO's hooks while it decodes (``distributed.zero3_full_model``)."""
        if self.zero3_engine is None:
            return contextlib.nullcontext()
        return distributed.zero3_full_model(self.zero3_engine, self.model)

    def _generate(self, requests: Requests, group_size: int, seed: int, first_row: int) -> RolloutBatch:
        device = next(self.model.parameters()).device
        runs = requests.tokenized_runs(self.tokenizer)  # the prompt proper, the pre-fill apart
        counts = [n for _, n in requests.runs]
        seeds = row_seeds(seed, first_row, len(requests.rows)).to(device)  # (S,)
        forbid = torch.tensor([p.forbid_think_end_first for p in requests.rows], device=device)  # (S,)
        was_training = self.model.training
        self.model.eval()
        # the same bf16 autocast as the training forwards (on CUDA FlashAttention rejects float32 inputs)
        autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.bf16_autocast)
        try:
            with autocast:
                sampled, sampled_logp = self._decode(runs.inputs, counts, seeds, forbid)
        finally:
            self.model.train(was_training)
        return runs.rollout_batch(sampled, sampled_logp, group_size, eos_ids=self.eos_ids, device=device)

    def _decode(
        self, encoded: list[list[int]], counts: list[int], seeds: torch.Tensor, forbid: torch.Tensor
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's sampled tokens (EOS last when it was sampled) and their log-probs, on the host, for ``counts``
        rows of each encoded prompt. ``forbid`` (S,): rows whose first token may not be ``</think>`` (forced
        thinking), row by row, so that a free prompt batched with a forced one samples as it would alone
        (``generate``'s logits processor forbade it for every row of a batch in which any prompt asked)."""
        steps, device = self.max_new_tokens, seeds.device
        rows, logits = self._prefill(encoded, counts, seeds)
        written_out = self.written_out_step and decode_step.supports(self.model)
        weights = decode_step.Weights.of(self.model) if written_out else None
        sampled = torch.full((len(seeds), steps), self.pad_id, dtype=torch.int64, device=device)  # (S, T)
        sampled_logp = torch.zeros((len(seeds), steps), dtype=torch.float32, device=device)  # (S, T)
        lengths = torch.full((len(seeds),), steps, dtype=torch.int64, device=device)  # (S,) the budget, unless EOS
        eos_ids = torch.tensor(sorted(self.eos_ids), device=device)  # (E,)
        for t in range(steps):
            if t > 0:
                logits = self._step(rows, weights)
            elif self.think_end_id is not None:
                logits[:, self.think_end_id].masked_fill_(forbid, -float("inf"))
            tokens, logp = seeded_sample(logits, rows.seeds, t, temperature=self.temperature, top_p=self.top_p)
            # a row kept after finishing writes past its length, where nothing reads
            sampled[rows.index, t], sampled_logp[rows.index, t] = tokens, logp
            stops = torch.isin(tokens, eos_ids) & ~rows.done  # (B,)
            lengths[rows.index] = torch.where(stops, t + 1, lengths[rows.index])
            rows.tokens, rows.done = tokens, rows.done | stops
            finished = int(rows.done.sum())  # sync: one per decode step, for the stop and compaction decisions
            if finished == len(rows.done):
                break
            if finished * _COMPACT_SHARE >= len(rows.done) and t + 1 < steps:  # none after the last step
                rows.compact()
        lengths_host = lengths.tolist()  # sync: once per rollout, with the two below
        return (
            [r[:n] for r, n in zip(sampled.tolist(), lengths_host, strict=True)],
            [r[:n] for r, n in zip(sampled_logp.tolist(), lengths_host, strict=True)],
        )

    def _prefill(
        self, encoded: list[list[int]], counts: list[int], seeds: torch.Tensor
    ) -> tuple[_DecodeRows, torch.Tensor]:
        """Each distinct prompt through the model once (P rows, left-padded to the widest, W), then its KV cache,
        mask, position and last logits repeated for its ``counts`` samples. Returns the S rows and their logits
        (S, V)."""
        device = seeds.device
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.int64)  # (P, W)
        mask = torch.zeros((len(encoded), width), dtype=torch.int64)  # (P, W)
        for i, ids in enumerate(encoded):  # left padding: every row's next token is generated at the same column
            input_ids[i, width - len(ids) :] = torch.tensor(ids)
            mask[i, width - len(ids) :] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        # positions count each prompt's own tokens; padding gets 0, as generate gives it (transformers 5.24,
        # _prepare_position_ids_for_generation), which no real token sees (it is masked)
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # (P, W)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            **{self.cache_keyword: cache},
            **self.last_logits_only,
        )
        expand = torch.repeat_interleave(torch.arange(len(counts), device=device), torch.tensor(counts, device=device))
        logits = out.logits[:, -1].float()[expand]  # (S, V)
        cache.batch_select_indices(expand)  # transformers 5.24: every layer's keys and values indexed on dim 0
        rows = _DecodeRows(
            cache=cache,
            mask=mask[expand],  # (S, W)
            positions=positions[expand, -1],  # (S,)
            seeds=seeds,
            index=torch.arange(len(seeds), device=device),
            tokens=torch.full((len(seeds),), self.pad_id, dtype=torch.int64, device=device),  # none sampled yet
            done=torch.zeros(len(seeds), dtype=torch.bool, device=device),
        )
        return rows, logits

    def _step(self, rows: _DecodeRows, weights: decode_step.Weights | None) -> torch.Tensor:
        """Feed each row its last token (the pad token once finished) and return the next logits (B, V): through
        ``decode_step`` given its ``weights``, else through transformers' forward."""
        rows.mask = torch.cat([rows.mask, rows.mask.new_ones((len(rows.mask), 1))], 1)  # (B, W + t)
        rows.positions = rows.positions + 1  # (B,)
        tokens = rows.tokens.masked_fill(rows.done, self.pad_id)  # (B,)
        if weights is not None:
            return decode_step.step(self.model, weights, rows.cache, tokens, rows.positions, rows.mask).float()
        out = self.model(
            input_ids=tokens[:, None],  # (B, 1)
            attention_mask=rows.mask,
            position_ids=rows.positions[:, None],
            use_cache=True,
            **{self.cache_keyword: rows.cache},
        )
        return out.logits[:, -1].float()  # (B, V)

    def end_rollout(self) -> None:
        """Holds no memory of its own between rollouts; with ``give_back_heap`` (the CPU, a model large enough for it
        to pay: ``host_memory.worth_it``) the heap the decode loop freed goes back to the system
        (``host_memory.give_back_freed_heap``) before the update allocates."""
        if self.give_back_heap:
            give_back_freed_heap()

    def sync_weights(self, model) -> None:
        pass  # generates with the trained model itself

    def close(self) -> None:
        pass
