"""What a rollout engine returns: K sampled responses per prompt, packed, with the flags and log-probs the rest of
the step needs, and the ways a step cuts and joins such batches (each keeps the host copies it already read); the
EOS ids that end a response, and what follows from them (the truncation flags, the decoded texts)."""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Collection
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
from transformers import GenerationConfig, PretrainedConfig

from ..data import PromptMode

FORCED_CODES = {PromptMode.FREE: 0, PromptMode.NON_THINKING: 1, PromptMode.THINKING: 2}
"""How ``RolloutBatch.forced`` codes each row's mode: free, or forced to answer directly or to think."""


# The metadata of a RolloutBatch field of one entry per sequence or per token, which every cut and join of a batch
# carries (RolloutBatch._cut, concat). "missing_code": a join of batches some of which lack the field fills theirs
# with this int8 code (without one the joined field is None)
PER_SEQUENCE = {"per": "sequence"}
PER_TOKEN = {"per": "token"}


@dataclass
class RolloutBatch:
    """S = prompts x K responses, the K samples of a prompt adjacent. The fields of one entry per sequence or per
    token are declared so (``PER_SEQUENCE``, ``PER_TOKEN``): ``select``, ``group_slice`` and ``concat`` carry
    each of them."""

    prompt_ids: list[list[int]] = field(metadata=PER_SEQUENCE)  # (S,) the prompt of each response (repeated K times)
    response_ids: torch.Tensor = field(metadata=PER_TOKEN)  # (N,) packed response tokens, EOS included when generated
    cu_seqlens: torch.Tensor  # (S+1,) int64
    truncated: torch.Tensor = field(metadata=PER_SEQUENCE)  # (S,) bool: the length budget ran out before EOS
    group_size: int
    # (N,) float32: the log-prob of each token under the distribution the engine sampled it from (after temperature
    # and top-p); 0 for a pre-filled prefix, which was not sampled (forced modes)
    rollout_logp: torch.Tensor | None = field(default=None, metadata=PER_TOKEN)
    # (S,) int8: each row's mode as FORCED_CODES codes it, when any row was forced; None when every row was free
    forced: torch.Tensor | None = field(
        default=None, metadata={**PER_SEQUENCE, "missing_code": FORCED_CODES[PromptMode.FREE]}
    )
    # mode-mixed rows sampled by a rollout worker at rollout.max_staleness >= 1 (fasttnt.modes.behaviour_logprobs),
    # under the weights that sampled them: (S,) float32 each row's first token's log-prob, and its group's
    # log pi(</think> | x) on each of the group's rows; None where the trainer's own weights sampled the batch
    behaviour_first_logp: torch.Tensor | None = field(default=None, metadata=PER_SEQUENCE)
    behaviour_think_end_logp: torch.Tensor | None = field(default=None, metadata=PER_SEQUENCE)

    @classmethod
    def of_responses(
        cls,
        prompt_ids: list[list[int]],
        responses: list[list[int]],
        truncated: list[bool],
        group_size: int,
        *,
        device: torch.device | str = "cpu",
        rollout_logp: list[float] | None = None,
        forced: torch.Tensor | None = None,
    ) -> RolloutBatch:
        """Token lists (S,) packed on ``device``, with their flags and (N,) log-probs; the lists stay the batch's host
        copies, so nothing is read back from the device."""
        ids, cu = pack_sequences(responses, device)
        logp = None if rollout_logp is None else torch.tensor(rollout_logp, dtype=torch.float32, device=device)
        batch = cls(prompt_ids, ids, cu, torch.tensor(truncated, dtype=torch.bool, device=device), group_size,
                    rollout_logp=logp, forced=forced)  # fmt: skip
        return batch._with_host_copies([0, *itertools.accumulate(map(len, responses))], responses)

    @classmethod
    def of_packed(cls, response_ids: torch.Tensor, cu_seqlens: torch.Tensor, group_size: int) -> RolloutBatch:
        """Packed responses alone (another framework's, or a test's), as a reward reads them: no prompts, none
        marked truncated (a verdict that a truncation makes wrong is the caller's)."""
        s = len(cu_seqlens) - 1
        truncated = torch.zeros(s, dtype=torch.bool, device=response_ids.device)
        return cls([[] for _ in range(s)], response_ids, cu_seqlens, truncated, group_size)

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

    def _with_host_copies(self, bounds: list[int], responses: list[list[int]]) -> RolloutBatch:
        """This batch with its host copies given (already read from another batch: no second device read)."""
        self.bounds, self.responses = bounds, responses
        return self

    def _cut(
        self, sequences: slice | list[int], tokens: slice | torch.Tensor, cu_seqlens: torch.Tensor
    ) -> RolloutBatch:
        """The batch of ``sequences`` (a slice, or indices in the order kept) whose tokens are ``tokens`` (a slice, or
        the index of each in this batch), with boundaries ``cu_seqlens``: every per-sequence and per-token field cut."""
        seq_index = sequences
        if not isinstance(sequences, slice):
            seq_index = torch.tensor(sequences, dtype=torch.long, device=self.cu_seqlens.device)
        cut = {}
        for f in fields(self):
            value, per = getattr(self, f.name), f.metadata.get("per")
            if per is None or value is None:
                continue
            if isinstance(value, list):
                cut[f.name] = value[sequences] if isinstance(sequences, slice) else [value[i] for i in sequences]
            else:
                cut[f.name] = value[seq_index if per == PER_SEQUENCE["per"] else tokens]
        return replace(self, cu_seqlens=cu_seqlens, **cut)

    def select(self, keep: list[int]) -> tuple[RolloutBatch, torch.Tensor]:
        """Sequences ``keep`` repacked from 0 in that order, and the index (n,) of their tokens in this batch's
        packed tensors (to take the per-token inputs that go with them). The kept rows' host copy of the responses
        comes from this batch's where it was read, else from the kept rows' own tensors when first asked."""
        device = self.cu_seqlens.device
        bounds = self.bounds
        lengths = [bounds[i + 1] - bounds[i] for i in keep]
        new_bounds = [0, *itertools.accumulate(lengths)]
        keep_t = torch.tensor(keep, dtype=torch.long, device=device)
        cu = torch.tensor(new_bounds, dtype=self.cu_seqlens.dtype, device=device)  # (s+1,)
        # token j of the repacked batch comes from start(seq) + (j - new_start(seq))
        shift = self.cu_seqlens[keep_t] - cu[:-1]  # (s,)
        index = torch.arange(new_bounds[-1], device=device) + torch.repeat_interleave(
            shift, self.lengths[keep_t], output_size=new_bounds[-1]
        )  # (n,)
        kept = self._cut(keep, index, cu)
        if "responses" not in self.__dict__:  # not read: the kept rows alone are, if ever asked for
            kept.bounds = new_bounds
            return kept, index
        return kept._with_host_copies(new_bounds, [self.responses[i] for i in keep]), index

    def group_slice(self, first: int, last: int) -> RolloutBatch:
        """Prompts ``first .. last - 1`` (all K samples of each), repacked from 0: a contiguous cut, no gather."""
        k = self.group_size
        a, b = first * k, last * k
        lo, hi = self.bounds[a], self.bounds[b]
        part = self._cut(slice(a, b), slice(lo, hi), self.cu_seqlens[a : b + 1] - lo)
        return part._with_host_copies([x - lo for x in self.bounds[a : b + 1]], self.responses[a:b])

    def filled(self, name: str) -> torch.Tensor | None:
        """Field ``name``; where this batch lacks it and the field has a ``missing_code``, that code on each of its
        sequences (int8): how a join with batches that hold it fills this one's."""
        value = getattr(self, name)
        code = missing_code(name)
        if value is not None or code is None:
            return value
        return torch.full(self.truncated.shape, code, dtype=torch.int8, device=self.truncated.device)

    @classmethod
    def concat(cls, batches: list[RolloutBatch]) -> RolloutBatch:
        """The batches as one, in order (the groups of the first first)."""
        if len(batches) == 1:
            return batches[0]
        offsets = [0, *itertools.accumulate(b.bounds[-1] for b in batches)]
        shifted = [b.cu_seqlens[1:] + off for b, off in zip(batches, offsets, strict=False)]
        joined = {}
        for f in fields(cls):
            if f.metadata.get("per") is None:
                continue
            values, code = [getattr(b, f.name) for b in batches], f.metadata.get("missing_code")
            if isinstance(values[0], list):
                joined[f.name] = [x for v in values for x in v]
            elif all(v is not None for v in values):
                joined[f.name] = torch.cat(values)
            elif code is not None and any(v is not None for v in values):  # a batch without the field: the code's
                joined[f.name] = torch.cat([b.filled(f.name) for b in batches])
            else:
                joined[f.name] = None
        batch = replace(batches[0], cu_seqlens=torch.cat([batches[0].cu_seqlens[:1], *shifted]), **joined)  # (S+1,)
        bounds = [0] + [x + off for b, off in zip(batches, offsets, strict=False) for x in b.bounds[1:]]
        return batch._with_host_copies(bounds, [r for b in batches for r in b.responses])


def missing_code(name: str) -> int | None:
    """The code a ``RolloutBatch`` field is filled with where a batch lacks it (its ``missing_code``), else None."""
    return next((f.metadata.get("missing_code") for f in fields(RolloutBatch) if f.name == name), None)


def pack_sequences(sequences: list[list[int]], device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Packed ids (N,) and cu_seqlens (S+1,) of token lists."""
    cu = cu_seqlens_of(torch.tensor([len(s) for s in sequences], dtype=torch.int64))
    flat = torch.tensor([t for s in sequences for t in s], dtype=torch.int64)
    return flat.to(device), cu.to(device)


def cu_seqlens_of(lengths: torch.Tensor) -> torch.Tensor:
    """(S+1,) int64 on the lengths' device: the boundaries of sequences of ``lengths`` (S,) packed back to back."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=lengths.device)
    cu[1:] = lengths.cumsum(0)
    return cu


def eos_ids_of(tokenizer, model: torch.nn.Module | str | os.PathLike | None = None) -> frozenset[int]:
    """The ids that end a response: the tokenizer's EOS and every id of the model's generation config
    ``eos_token_id``, an int or a list (Qwen2.5-Instruct lists ``<|im_end|>`` and ``<|endoftext|>``, Llama 3
    Instruct three ids, while the tokenizer names one); transformers' ``generate`` and vLLM stop at each of them.

    ``model``: the model itself (its ``generation_config``), or its folder or hub id, read as transformers and vLLM
    read it (``_generation_config``); None: the tokenizer's own folder (``name_or_path``) when that is a local
    folder (a model's, saved with its tokenizer), else the tokenizer's id alone."""
    if model is None and tokenizer.name_or_path and Path(tokenizer.name_or_path).is_dir():
        model = tokenizer.name_or_path
    if isinstance(model, (str, os.PathLike)):
        config = _generation_config(model)
    else:
        config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None)  # None, an int or a list of ints
    listed = [eos] if isinstance(eos, int) else eos or []
    ids = {tokenizer.eos_token_id, *listed} - {None}
    if not ids:
        raise ValueError("no EOS id: neither the tokenizer nor the model's generation config names one")
    return frozenset(ids)


def _generation_config(path: str | os.PathLike) -> GenerationConfig | None:
    """A model's generation config as transformers' ``from_pretrained`` and vLLM 0.31 (``try_get_generation_config``)
    read it: its ``generation_config.json``, else one made from its ``config.json`` (whose ``eos_token_id`` a loaded
    model stops at); None without either (a tokenizer's own folder)."""
    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        pass
    try:
        return GenerationConfig.from_model_config(PretrainedConfig.get_config_dict(path)[0])
    except OSError:  # no config.json either
        return None


def truncated_without_eos(responses: list[list[int]], eos_ids: Collection[int]) -> list[bool]:
    """A response that does not end with one of the EOS ids was cut by the length budget (EOS is kept in the ids)."""
    return [not ids or ids[-1] not in eos_ids for ids in responses]


def decode_responses(tokenizer, responses: list[list[int]], eos_ids: Collection[int]) -> list[str]:
    """Response texts without their final EOS/pad ids (kept in the ids, which count as tokens), so "the answer
    is 5<eos>" reads as 5; ``</think>`` stays, since it may be a special token."""
    stop = {*eos_ids, tokenizer.pad_token_id} - {None}
    trimmed = [r[:-1] if r and r[-1] in stop else r for r in responses]
    return tokenizer.batch_decode(trimmed, skip_special_tokens=False)
