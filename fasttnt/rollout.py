"""Rollout engines: K sampled responses per prompt, returned packed.

``hf`` generates with fasttnt's own decode loop over the transformers model (CPU or GPU, KV cache, batched),
which prefills each prompt once for its K samples and drops finished rows from the batch (``generate`` can do
neither). ``vllm`` runs a colocated vLLM ``LLM`` on each rank's GPU, asleep between rollouts, with weights pushed
from the trained model in buckets. vLLM does not install on CPU-only machines: the ``vllm`` engine follows TRL's
tested colocate code and is tested here against a stand-in that enforces vLLM's rules, never against vLLM itself.
Both engines return the log-prob each token was sampled with, for the rollout correction
(``loss.rollout_correction``).
"""

from __future__ import annotations

import functools
import gc
import inspect
import itertools
import os
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import DynamicCache

from .data import Prompt
from .registry import Registry


@dataclass
class RolloutBatch:
    """S = prompts x K responses, the K samples of a prompt adjacent."""

    prompt_ids: list[list[int]]  # (S,) the prompt of each response (repeated K times)
    response_ids: torch.Tensor  # (N,) packed response tokens, EOS included when generated
    cu_seqlens: torch.Tensor  # (S+1,) int64
    truncated: torch.Tensor  # (S,) bool: the length budget ran out before EOS
    group_size: int
    # (N,) float32: the log-prob of each token under the distribution the engine sampled it from (after temperature
    # and top-p); 0 for a pre-filled prefix, which was not sampled (forced modes, evaluation only)
    rollout_logp: torch.Tensor | None = None

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]  # (S,)

    @property
    def group_ids(self) -> torch.Tensor:
        """The prompt each response answers: responses g*K .. g*K+K-1 belong to prompt g."""
        return torch.arange(self.lengths.numel(), device=self.cu_seqlens.device) // self.group_size  # (S,)

    @functools.cached_property
    def bounds(self) -> list[int]:
        """``cu_seqlens`` on the host, read once per batch."""
        return self.cu_seqlens.tolist()  # sync: once per batch

    @functools.cached_property
    def responses(self) -> list[list[int]]:
        """The responses as token lists, read from the device once per batch (decoding and every packed forward
        of the step share it)."""
        ids = self.response_ids.tolist()
        return [ids[a:b] for a, b in itertools.pairwise(self.bounds)]


def pack(sequences: list[list[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ids (N,) and cu_seqlens (S+1,) of token lists."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    return flat.to(device), cu.to(device)


def select_sequences(batch: RolloutBatch, keep: list[int]) -> tuple[RolloutBatch, torch.Tensor]:
    """Sequences ``keep`` (ascending) of a batch, repacked from 0, and the index (n,) of their tokens in the batch's
    packed tensors (to take the per-token inputs that go with them)."""
    device = batch.cu_seqlens.device
    bounds = batch.bounds
    lengths = [bounds[i + 1] - bounds[i] for i in keep]
    new_bounds = [0, *itertools.accumulate(lengths)]
    keep_t = torch.tensor(keep, dtype=torch.long, device=device)
    cu = torch.tensor(new_bounds, dtype=batch.cu_seqlens.dtype, device=device)  # (s+1,)
    # token j of the repacked batch comes from start(seq) + (j - new_start(seq))
    shift = batch.cu_seqlens[keep_t] - cu[:-1]  # (s,)
    index = torch.arange(new_bounds[-1], device=device) + torch.repeat_interleave(
        shift, batch.lengths[keep_t], output_size=new_bounds[-1]
    )  # (n,)
    kept = RolloutBatch(
        [batch.prompt_ids[i] for i in keep],
        batch.response_ids[index],
        cu,
        batch.truncated[keep_t],
        batch.group_size,
        rollout_logp=batch.rollout_logp[index] if batch.rollout_logp is not None else None,
    )
    kept.responses = [batch.responses[i] for i in keep]  # already on the host: no second read from the device
    kept.bounds = new_bounds
    return kept, index


def decode_responses(tokenizer, responses: list[list[int]]) -> list[str]:
    """Response texts without their final EOS/pad ids (kept in the ids, which count as tokens), so "the answer
    is 5<eos>" reads as 5; ``</think>`` stays, since it may be a special token."""
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    trimmed = [r[:-1] if r and r[-1] in stop else r for r in responses]
    return tokenizer.batch_decode(trimmed, skip_special_tokens=False)


class RolloutEngine(Protocol):
    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, keep_awake: bool = False
    ) -> RolloutBatch:
        """K samples per prompt; ``first_row`` is the global index of the first response (ranks' shares).
        ``keep_awake``: more rollouts follow before the update (dynamic sampling's draws), so an engine that
        releases its memory after a rollout keeps it until ``rest``."""
        ...

    def rest(self) -> None:
        """Release the rollout's memory for the update, as ``generate`` does unless told to keep awake."""
        ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


ENGINES: Registry[type] = Registry("rollout engine")


_MIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # splitmix64's odd constants, signed


def _hash_uniform(row_seeds: torch.Tensor, position: int, vocab: int) -> torch.Tensor:
    """(B, V) uniforms in (0, 1), a pure function of (row seed, position, token id): counter-based, so a row's
    draws do not depend on which other rows share its batch (or its rank). int64 arithmetic wraps, as hashes want."""
    v = torch.arange(vocab, device=row_seeds.device, dtype=torch.int64)
    pos = torch.full((), position + 1, dtype=torch.int64, device=row_seeds.device)
    x = row_seeds[:, None] * _MIX[0] + pos * _MIX[1] + v[None, :] * _MIX[2]
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    # 52 random bits and a half: strictly inside (0, 1), since 2^52 - 0.5 is exact in float64 (with 53 bits the
    # top value rounds to 1.0, and -log(-log(1)) is +inf)
    return (((x >> 12) & ((1 << 52) - 1)).double() + 0.5) / float(1 << 52)


def seeded_sample(
    scores: torch.Tensor, row_seeds: torch.Tensor, position: int, *, temperature: float, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row (B,), and its log-prob (B,) under the distribution it was drawn from (after temperature
    and top-p), which the rollout correction compares with. ``position``: the tokens the rows generated before.

    Sampling by the Gumbel-max trick with per-row counter-based noise: ``argmax(logits / T + Gumbel)`` is a draw
    from ``softmax(logits / T)`` (after the top-p cut). Drawing the noise from each row's own seed makes a response
    depend only on its prompt, its seed and the model, not on the batch: a prompt's samples are the same whether
    one process generates the step's batch or N ranks generate a share each, and whichever rows are still decoding.
    """
    z = scores.float() / temperature  # (B, V)
    if top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_z.softmax(-1) >= top_p
        z = z.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -float("inf"))
    u = _hash_uniform(row_seeds.to(z.device), position, z.shape[-1])  # (B, V) float64
    chosen = (z + (-torch.log(-torch.log(u))).to(z.dtype)).argmax(-1, keepdim=True)  # (B, 1)
    return chosen[:, 0], torch.log_softmax(z, -1).gather(-1, chosen)[:, 0]


def row_seeds(seed: int, first_row: int, rows: int) -> torch.Tensor:
    """Seeds of rows ``first_row .. first_row + rows - 1`` of a step whose seed is ``seed``: a hash of both, so
    no two (seed, row) pairs share a stream (a linear mix would, once a step had as many rows as its factor)."""
    x = torch.arange(first_row, first_row + rows, dtype=torch.int64)
    x = x ^ (torch.tensor(seed, dtype=torch.int64) * _MIX[0])
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    return x


# compact once this share of the decode batch has finished: a compaction copies the KV cache once, and rows left in
# cost a wasted row each per step. At 1/8 a step wastes less than 1/8 of its rows, and the copies add up to at
# most 8 first batches' worth of rows (the batch shrinks to 7/8 or less each time: a geometric series)
_COMPACT_SHARE = 8


@dataclass
class _DecodeRows:
    """The rows of the decode batch (B of them, on the model's device): the S responses after the prefill, the
    unfinished ones after each compaction."""

    cache: DynamicCache  # per layer: keys and values (B, kv heads, W + t, head dim)
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
    and the cache (``_DecodeRows.compact``). The model's ``generation_config`` (repetition penalty, n-gram bans,
    ...) is never read: it would bend the distribution the loss's log-probs assume.
    """

    def __init__(
        self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float, dtype: str = "float32", **_
    ) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.bf16_autocast = dtype == "bfloat16"  # on CUDA, as the training forwards
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.think_end_id = tokenizer.convert_tokens_to_ids("</think>")
        forward = inspect.signature(model.forward).parameters
        # transformers 5 renamed the forward's past_key_values to cache (5.24 takes both, warning on the old name)
        self.cache_keyword = "cache" if "cache" in forward else "past_key_values"
        # the prefill needs the last position's logits only, not (P, W, V): generate asks the same where it can
        self.last_logits_only = {"logits_to_keep": 1} if "logits_to_keep" in forward else {}

    @torch.no_grad()
    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, keep_awake: bool = False
    ) -> RolloutBatch:
        """``first_row``: the global index of this batch's first response, when ranks generate shares of a step.
        ``keep_awake``: nothing to keep (the engine is the training model)."""
        device = next(self.model.parameters()).device
        encoded = [self.tokenizer(p.text + p.response_prefix, add_special_tokens=False)["input_ids"] for p in prompts]
        prefixes = [
            self.tokenizer(p.response_prefix, add_special_tokens=False)["input_ids"] if p.response_prefix else []
            for p in prompts
        ]
        seeds = row_seeds(seed, first_row, len(prompts) * group_size).to(device)  # (S,): row i answers prompt i // K
        forbid = torch.tensor([p.forbid_think_end_first for p in prompts], device=device)  # (P,)
        was_training = self.model.training
        self.model.eval()
        # on CUDA, the same bf16 autocast as the training forwards (FlashAttention rejects float32 inputs)
        autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda" and self.bf16_autocast)
        try:
            with autocast:
                sampled, sampled_logp = self._decode(encoded, group_size, seeds, forbid.repeat_interleave(group_size))
        finally:
            self.model.train(was_training)
        responses, truncated, logprobs = [], [], []
        for i, (tokens, logp) in enumerate(zip(sampled, sampled_logp, strict=True)):
            truncated.append(not tokens or tokens[-1] != self.eos_id)  # EOS is kept: the policy learns to stop
            prefix = prefixes[i // group_size]
            responses.append(prefix + tokens)
            logprobs.extend([0.0] * len(prefix) + logp)
        # the prompt proper, K times: a pre-filled prefix belongs to the response
        prompt_ids = [ids[: len(ids) - len(pre)] for ids, pre in zip(encoded, prefixes, strict=True)]
        prompt_ids = [ids for ids in prompt_ids for _ in range(group_size)]  # (S,)
        ids, cu = pack(responses, device)
        return RolloutBatch(
            prompt_ids,
            ids,
            cu,
            torch.tensor(truncated, device=device),
            group_size,
            rollout_logp=torch.tensor(logprobs, dtype=torch.float32, device=device),
        )

    def _decode(
        self, encoded: list[list[int]], group_size: int, seeds: torch.Tensor, forbid: torch.Tensor
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Each row's sampled tokens (EOS last when it was sampled) and their log-probs, on the host. ``forbid``
        (S,): rows whose first token may not be ``</think>`` (forced thinking), row by row, so that a free prompt
        batched with a forced one samples as it would alone (``generate``'s logits processor forbade it for every row
        of a batch in which any prompt asked)."""
        steps, device = self.max_new_tokens, seeds.device
        rows, logits = self._prefill(encoded, group_size, seeds)
        sampled = torch.full((len(seeds), steps), self.pad_id, dtype=torch.int64, device=device)  # (S, T)
        sampled_logp = torch.zeros((len(seeds), steps), dtype=torch.float32, device=device)  # (S, T)
        lengths = torch.full((len(seeds),), steps, dtype=torch.int64, device=device)  # (S,) the budget, unless EOS
        for t in range(steps):
            if t > 0:
                logits = self._step(rows)
            elif self.think_end_id is not None:
                logits[:, self.think_end_id].masked_fill_(forbid, -float("inf"))
            tokens, logp = seeded_sample(logits, rows.seeds, t, temperature=self.temperature, top_p=self.top_p)
            # a row kept after finishing writes past its length, where nothing reads
            sampled[rows.index, t], sampled_logp[rows.index, t] = tokens, logp
            stops = (tokens == self.eos_id) & ~rows.done  # (B,)
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
        self, encoded: list[list[int]], group_size: int, seeds: torch.Tensor
    ) -> tuple[_DecodeRows, torch.Tensor]:
        """Each distinct prompt through the model once (P rows, left-padded to the widest, W), then its KV cache,
        mask, position and last logits repeated for its K samples. Returns the S rows and their logits (S, V)."""
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
        logits = out.logits[:, -1].float().repeat_interleave(group_size, 0)  # (S, V)
        cache.batch_repeat_interleave(group_size)  # transformers 5.24: every layer's keys and values, on dim 0
        rows = _DecodeRows(
            cache=cache,
            mask=mask.repeat_interleave(group_size, 0),  # (S, W)
            positions=positions[:, -1].repeat_interleave(group_size),  # (S,)
            seeds=seeds,
            index=torch.arange(len(seeds), device=device),
            tokens=torch.full((len(seeds),), self.pad_id, dtype=torch.int64, device=device),  # none sampled yet
            done=torch.zeros(len(seeds), dtype=torch.bool, device=device),
        )
        return rows, logits

    def _step(self, rows: _DecodeRows) -> torch.Tensor:
        """Feed each row its last token (the pad token once finished) and return the next logits (B, V)."""
        rows.mask = torch.cat([rows.mask, rows.mask.new_ones((len(rows.mask), 1))], 1)  # (B, W + t)
        rows.positions = rows.positions + 1  # (B,)
        out = self.model(
            input_ids=rows.tokens.masked_fill(rows.done, self.pad_id)[:, None],  # (B, 1)
            attention_mask=rows.mask,
            position_ids=rows.positions[:, None],
            use_cache=True,
            **{self.cache_keyword: rows.cache},
        )
        return out.logits[:, -1].float()  # (B, V)

    def rest(self) -> None:
        pass  # holds no memory of its own between rollouts

    def sync_weights(self, model) -> None:
        pass  # generates with the trained model itself

    def close(self) -> None:
        pass


@ENGINES.register("vllm")
class VLLMEngine:
    """A colocated vLLM ``LLM``, one per rank on the rank's own GPU. **Never run by the test suite against vLLM
    itself** (it needs a GPU and does not install here); ``tests/test_vllm_engine.py`` drives it against a
    stand-in that enforces vLLM's sleep/wake rules.

    The call sequence follows TRL 1.16's colocate mode (``trl/generation/vllm_generation.py``), read against vLLM
    0.22.0 and 0.31.0, the range TRL 1.16 supports and the ``gpu`` extra pins:

    * ``distributed_executor_backend="external_launcher"``, tensor parallel 1: each rank's engine lives in the
      rank's process on ``cuda:LOCAL_RANK``. (vLLM's default single-process executor puts every rank's engine on
      GPU 0.) The launcher's RANK/LOCAL_RANK/MASTER_* variables are what it reads; a single process gets its own.
      This backend also runs the engine in-process (vLLM sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for it), which
      ``apply_model`` relies on to hand the engine's model our tensors without a copy.
    * ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled token under the distribution it was
      drawn from (after temperature and top-p; vLLM >= 0.10.2), for the rollout correction.
    * Asleep at level 2 during the update (level 1 would copy every weight to host memory each step; level 2
      discards them, and they are pushed again anyway). After each update (``sync_weights``, and before the first
      rollout): free the trainer's cached blocks (``torch.cuda.empty_cache()``), wake the weights, push them
      (``LLM.apply_model``, a public call; the weights of a ZeRO-3 model gathered one bucket at a time), reset the
      prefix cache. The weights then stay mapped through logging and checkpointing. Each rollout: wake the KV
      cache, generate, sleep. vLLM's state machine allows no other order: a ``sleep`` while any part is asleep is
      ignored (0.22), waking memory that is mapped fails (0.22's allocator maps it twice), and 0.31 schedules
      nothing until every part is awake.
    """

    def __init__(
        self,
        model,
        tokenizer,
        *,
        model_path: str,
        max_new_tokens: int,
        temperature: float,
        top_p: float,
        gpu_memory_utilization: float,
        sleep_between_rollouts: bool,
        weight_sync_bucket_mb: int,
        max_model_len: int,
        seed: int,
        dtype: str,
        device: torch.device | str | None = None,
        trust_remote_code: bool = False,
    ) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise RuntimeError("rollout.engine=vllm needs vLLM on a CUDA machine: pip install 'fasttnt[gpu]'") from err
        self._sampling_params = SamplingParams
        self.model, self.tokenizer = model, tokenizer
        if device is None:
            device = next(model.parameters()).device if model is not None else "cuda"
        self.device = torch.device(device)
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.sleep_between_rollouts = sleep_between_rollouts
        self.bucket_bytes = weight_sync_bucket_mb * 2**20
        _external_launcher_env()
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_between_rollouts,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            seed=seed,
            logprobs_mode="processed_logprobs",
            trust_remote_code=trust_remote_code,
        )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # vLLM made cuda:LOCAL_RANK current; the trainer's device stays so
        self.asleep: set[str] = set()  # the parts of the engine's memory that are unmapped
        # the engine's weights are the checkpoint it loaded, not necessarily the trainer's (a resumed run): the
        # first rollout pushes the trainer's. Without a model (evaluation) the loaded checkpoint is the model, and
        # the engine never sleeps
        self.weights_current = model is None
        if model is None and sleep_between_rollouts:
            raise ValueError("sleep_between_rollouts discards the weights: it needs the model to push them back")
        if sleep_between_rollouts:
            self._sleep()

    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, keep_awake: bool = False
    ) -> RolloutBatch:
        """``keep_awake``: stay awake after this rollout (more draws follow); ``rest`` puts the engine to sleep."""
        if any(p.forbid_think_end_first for p in prompts):
            raise NotImplementedError("forced thinking is not implemented for the vllm engine; use engine=hf")
        if not self.weights_current:  # the first rollout, and every one after a level-2 sleep
            self.sync_weights(self.model)
        self._wake("kv_cache")
        prefixes = [
            self.tokenizer(p.response_prefix, add_special_tokens=False)["input_ids"] if p.response_prefix else []
            for p in prompts
        ]
        prompt_ids = [
            self.tokenizer(p.text, add_special_tokens=False)["input_ids"] + prefix
            for p, prefix in zip(prompts, prefixes, strict=True)
        ]
        # one seed per prompt, from its global row: a prompt's samples do not depend on the rank that draws them
        seeds = row_seeds(seed, first_row, len(prompts) * group_size)[::group_size].tolist()
        params = [
            self._sampling_params(
                n=group_size,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=self.max_new_tokens,
                logprobs=0,  # the sampled token's own log-prob (processed: after temperature and top-p)
                seed=s & 0x7FFFFFFF,
            )
            for s in seeds
        ]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        responses, truncated, logprobs, rows = [], [], [], []
        for i, out in enumerate(outputs):
            for completion in out.outputs:
                tokens = list(completion.token_ids)
                responses.append(prefixes[i] + tokens)
                truncated.append(completion.finish_reason == "length")
                # each position's dict holds the sampled token (and, were logprobs > 0, the top ones: look it up)
                token_lp = [lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)]
                logprobs.extend([0.0] * len(prefixes[i]) + token_lp)
                rows.append(prompt_ids[i][: len(prompt_ids[i]) - len(prefixes[i])])
        if self.sleep_between_rollouts and not keep_awake:
            self._sleep()
        ids, cu = pack(responses, self.device)
        return RolloutBatch(
            rows,
            ids,
            cu,
            torch.tensor(truncated, device=self.device),
            group_size,
            rollout_logp=torch.tensor(logprobs, dtype=torch.float32, device=self.device),
        )

    def rest(self) -> None:
        """Asleep for the update after rollouts that kept the engine awake (a level-2 sleep discards the weights, so
        draws that each slept would push the same weights again)."""
        if self.sleep_between_rollouts and not self.asleep:
            self._sleep()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights into the engine (every rank at once: under ZeRO-3 the gathers are collective)."""
        self.model = model
        if "weights" in self.asleep:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the update's cached blocks go back to the driver for the engine to map
            self._wake("weights")
        for bucket in _parameter_buckets(model, self.bucket_bytes):
            # under ZeRO-3 each rank holds a shard: gather one bucket at a time, so the extra memory is one
            # bucket of full parameters (weight_sync_bucket_mb), never the whole model
            with _gathered([p for _, p in bucket]):
                weights = [(name, p.detach()) for name, p in bucket]
                self.llm.apply_model(functools.partial(_load_weights_into, weights))
        self.llm.reset_prefix_cache()  # no KV of the old weights may be reused
        self.weights_current = True

    def close(self) -> None:
        """Free the engine's GPU memory, so that another engine can be built in this process (evaluation builds
        one per model): its memory mapped again first (vLLM frees mapped memory), then released."""
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep))
            self.asleep.clear()
        del self.llm
        gc.collect()
        try:
            from vllm.distributed.parallel_state import destroy_model_parallel
        except ImportError:
            pass
        else:
            destroy_model_parallel()  # its tensor-parallel groups; the trainer's process group stays
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _sleep(self) -> None:
        if self.asleep:  # vLLM ignores a sleep while any part is asleep: never leave a part awake by mistake
            raise RuntimeError(f"the vllm engine is partly asleep ({sorted(self.asleep)}); wake it before sleeping")
        self.llm.sleep(level=2)
        self.asleep = {"weights", "kv_cache"}
        self.weights_current = False  # level 2 discards the weights

    def _wake(self, tag: str) -> None:
        if tag in self.asleep:
            self.llm.wake_up(tags=[tag])
            self.asleep.discard(tag)


def _load_weights_into(weights: list[tuple[str, torch.Tensor]], model: torch.nn.Module) -> None:
    """Run by ``LLM.apply_model`` on the engine's model: its own loader maps Hugging Face names and dtypes."""
    model.load_weights(weights)


def _external_launcher_env() -> None:
    """The variables vLLM's external launcher reads; a launcher sets them, a single process gets rank 0 of 1 (as
    TRL's ``ensure_master_addr_port``)."""
    if "RANK" in os.environ:
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _parameter_buckets(model: torch.nn.Module, bucket_bytes: int):
    """Named parameters in groups of about ``bucket_bytes`` (counted at their full, unsharded size)."""
    bucket, size = [], 0
    for name, param in model.named_parameters():
        bucket.append((name, param))
        size += getattr(param, "ds_numel", param.numel()) * param.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _gathered(params):
    """Full parameters for the duration (ZeRO-3 shards carry ``ds_id``); nothing to do otherwise."""
    import contextlib

    if any(hasattr(p, "ds_id") for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None)
    return contextlib.nullcontext()
