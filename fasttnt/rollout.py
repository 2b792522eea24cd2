"""Rollout engines: K sampled responses per prompt, returned packed.

``hf`` generates with transformers (CPU or GPU, KV cache, batched). ``vllm`` runs a colocated vLLM ``LLM`` on
the training GPU, asleep between rollouts, with weights pushed from the trained model in buckets. vLLM does not
install on CPU-only machines, so the ``vllm`` engine is written against vLLM's documented offline API and is
**not exercised by the test suite**.
"""

from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

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
    engine_logprobs: torch.Tensor | None = None  # (N,) the engine's own log-probs of the tokens, when it gives them

    @property
    def lengths(self) -> torch.Tensor:
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]  # (S,)

    @property
    def group_ids(self) -> torch.Tensor:
        """The prompt each response answers: responses g*K .. g*K+K-1 belong to prompt g."""
        return torch.arange(self.lengths.numel(), device=self.cu_seqlens.device) // self.group_size  # (S,)

    @functools.cached_property
    def responses(self) -> list[list[int]]:
        """The responses as token lists, read from the device once per batch (decoding and every packed forward
        of the step share it)."""
        bounds = self.cu_seqlens.tolist()  # sync: once per batch
        ids = self.response_ids.tolist()
        return [ids[a:b] for a, b in itertools.pairwise(bounds)]


def pack(sequences: list[list[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ids (N,) and cu_seqlens (S+1,) of token lists."""
    lengths = torch.tensor([len(s) for s in sequences], dtype=torch.int64)
    cu = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    return flat.to(device), cu.to(device)


def decode_responses(tokenizer, responses: list[list[int]]) -> list[str]:
    """Response texts without their final EOS/pad ids (kept in the ids, which count as tokens), so "the answer
    is 5<eos>" reads as 5; ``</think>`` stays, since it may be a special token."""
    stop = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
    trimmed = [r[:-1] if r and r[-1] in stop else r for r in responses]
    return tokenizer.batch_decode(trimmed, skip_special_tokens=False)


class RolloutEngine(Protocol):
    def generate(self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0) -> RolloutBatch:
        """K samples per prompt; ``first_row`` is the global index of the first response (ranks' shares)."""
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


class SeededSampler(LogitsProcessor):
    """Sampling by the Gumbel-max trick with per-row counter-based noise, for greedy decoding to apply.

    ``argmax(logits / T + Gumbel)`` is a draw from ``softmax(logits / T)`` (after the top-p cut); drawing the
    noise from each row's own seed makes a response depend only on its prompt, its seed and the model, not on
    the batch: a prompt's samples are the same whether one process generates the step's batch or N ranks
    generate a share each.
    """

    def __init__(self, row_seeds: torch.Tensor, prompt_width: int, temperature: float, top_p: float) -> None:
        self.row_seeds, self.prompt_width = row_seeds, prompt_width
        self.temperature, self.top_p = temperature, top_p

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        z = scores.float() / self.temperature
        if self.top_p < 1.0:  # keep the smallest set of tokens whose probability reaches top_p
            sorted_z, order = z.sort(dim=-1, descending=True)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop_sorted = cum - sorted_z.softmax(-1) >= self.top_p
            z = z.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), -float("inf"))
        u = _hash_uniform(self.row_seeds.to(z.device), input_ids.shape[1] - self.prompt_width, z.shape[-1])
        return z + (-torch.log(-torch.log(u))).to(z.dtype)


def row_seeds(seed: int, first_row: int, rows: int) -> torch.Tensor:
    """Seeds of rows ``first_row .. first_row + rows - 1`` of a step whose seed is ``seed``: a hash of both, so
    no two (seed, row) pairs share a stream (a linear mix would, once a step had as many rows as its factor)."""
    x = torch.arange(first_row, first_row + rows, dtype=torch.int64)
    x = x ^ (torch.tensor(seed, dtype=torch.int64) * _MIX[0])
    for shift, mult in ((30, _MIX[1]), (27, _MIX[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mult
    return x


class _ForbidFirst(LogitsProcessor):
    """Forced thinking: the first generated token may not be ``</think>``."""

    def __init__(self, prompt_width: int, token_id: int) -> None:
        self.prompt_width, self.token_id = prompt_width, token_id

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.shape[1] == self.prompt_width:
            scores[:, self.token_id] = -float("inf")
        return scores


@ENGINES.register("hf")
class HFEngine:
    """transformers ``generate`` on the training model itself (no weight copy, so syncing is free)."""

    def __init__(self, model, tokenizer, *, max_new_tokens: int, temperature: float, top_p: float, **_) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.think_end_id = tokenizer.convert_tokens_to_ids("</think>")

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0) -> RolloutBatch:
        """``first_row``: the global index of this batch's first response, when ranks generate shares of a step."""
        device = next(self.model.parameters()).device
        encoded = [self.tokenizer(p.text + p.response_prefix, add_special_tokens=False)["input_ids"] for p in prompts]
        prefixes = [
            self.tokenizer(p.response_prefix, add_special_tokens=False)["input_ids"] if p.response_prefix else []
            for p in prompts
        ]
        rows = [ids for ids in encoded for _ in range(group_size)]  # (S,) prompts, each K times
        width = max(len(r) for r in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's next token is generated at the same column
            input_ids[i, width - len(r) :] = torch.tensor(r)
            attention[i, width - len(r) :] = 1
        processors = LogitsProcessorList()
        if any(p.forbid_think_end_first for p in prompts):
            processors.append(_ForbidFirst(width, self.think_end_id))
        # sampling is ours (seeded per row), so generate decodes greedily over the perturbed scores
        processors.append(SeededSampler(row_seeds(seed, first_row, len(rows)), width, self.temperature, self.top_p))
        was_training = self.model.training
        self.model.eval()
        # the model's own generation_config (repetition penalty, n-gram bans, ...) would bend the distribution the
        # loss's log-probs assume: sample from the policy and nothing else (restored in the finally below)
        saved_config, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                max_new_tokens=self.max_new_tokens,
                eos_token_id=self.eos_id,
                pad_token_id=self.pad_id,
                logits_processor=processors,
            )
        finally:
            self.model.generation_config = saved_config
        self.model.train(was_training)
        generated = out[:, width:].tolist()  # sync: one per rollout
        responses, truncated = [], []
        for i, tokens in enumerate(generated):
            if self.eos_id in tokens:
                tokens = tokens[: tokens.index(self.eos_id) + 1]  # keep EOS: the policy learns to stop
                truncated.append(False)
            else:
                truncated.append(True)
            responses.append(prefixes[i // group_size] + tokens)
        prompt_ids = [
            ids[: len(ids) - len(prefixes[i // group_size])] for i, ids in enumerate(rows)
        ]  # the prompt proper: a pre-filled prefix belongs to the response
        ids, cu = pack(responses, device)
        return RolloutBatch(prompt_ids, ids, cu, torch.tensor(truncated, device=device), group_size)

    def sync_weights(self, model) -> None:
        pass  # generates with the trained model itself

    def close(self) -> None:
        pass


@ENGINES.register("vllm")
class VLLMEngine:
    """A colocated vLLM ``LLM`` (not exercised by the tests: vLLM needs a GPU and does not install here).

    Sleep mode frees its KV cache (level 1) between rollouts so the update has the GPU memory; after each update
    the trained weights are pushed into vLLM's model in buckets of ``weight_sync_bucket_mb`` through the model's
    ``load_weights`` (the colocated pattern TRL uses), with no disk round-trip, and the prefix cache is reset so
    no stale KV of the old weights is reused.
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
    ) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise RuntimeError("rollout.engine=vllm needs vLLM on a CUDA machine: pip install 'fasttnt[gpu]'") from err
        # sync_weights reaches the model through the engine's in-process executor (the colocated pattern TRL
        # uses); vLLM's V1 engine runs the model in a separate process unless this is 0
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        self._sampling_params = SamplingParams
        self.tokenizer = tokenizer
        self.max_new_tokens, self.temperature, self.top_p = max_new_tokens, temperature, top_p
        self.sleep_between_rollouts = sleep_between_rollouts
        self.bucket_bytes = weight_sync_bucket_mb * 2**20
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_between_rollouts,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            seed=seed,
        )
        self.asleep = False
        self.think_end_id = tokenizer.convert_tokens_to_ids("</think>")
        if sleep_between_rollouts:
            self.llm.sleep(level=1)
            self.asleep = True

    def generate(self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0) -> RolloutBatch:
        if self.asleep:
            self.llm.wake_up()
            self.asleep = False
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
                logprobs=0,  # the sampled token's own log-prob
                seed=s & 0x7FFFFFFF,
            )
            for s in seeds
        ]
        if any(p.forbid_think_end_first for p in prompts):
            raise NotImplementedError("forced thinking is not implemented for the vllm engine; use engine=hf")
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        responses, truncated, logprobs, rows = [], [], [], []
        for i, out in enumerate(outputs):
            for completion in out.outputs:
                tokens = list(completion.token_ids)
                responses.append(prefixes[i] + tokens)
                truncated.append(completion.finish_reason == "length")
                token_lp = [next(iter(lp.values())).logprob for lp in completion.logprobs or []]
                logprobs.extend([0.0] * len(prefixes[i]) + token_lp)
                rows.append(prompt_ids[i][: len(prompt_ids[i]) - len(prefixes[i])])
        if self.sleep_between_rollouts:
            self.llm.sleep(level=1)
            self.asleep = True
        ids, cu = pack(responses, "cuda")
        return RolloutBatch(
            rows,
            ids,
            cu,
            torch.tensor(truncated, device="cuda"),
            group_size,
            engine_logprobs=torch.tensor(logprobs, device="cuda"),
        )

    def sync_weights(self, model: torch.nn.Module) -> None:
        if self.asleep:
            self.llm.wake_up(tags=["weights"]) if _accepts_tags(self.llm.wake_up) else self.llm.wake_up()
            self.asleep = False
        target = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        for bucket in _parameter_buckets(model, self.bucket_bytes):
            # under ZeRO-3 each rank holds a shard: gather one bucket at a time, so the extra memory is one
            # bucket of full parameters (weight_sync_bucket_mb), never the whole model
            with _gathered([p for _, p in bucket]):
                target.load_weights([(name, p.detach()) for name, p in bucket])
        self.llm.reset_prefix_cache()
        if self.sleep_between_rollouts:
            self.llm.sleep(level=1)
            self.asleep = True

    def close(self) -> None:
        del self.llm


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


def _accepts_tags(fn) -> bool:
    import inspect

    return "tags" in inspect.signature(fn).parameters
