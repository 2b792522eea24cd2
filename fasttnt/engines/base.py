"""The rollout-engine interface, the registry the config's ``rollout.engine`` names, and ``build_engine``."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..data import Prompt
from ..registry import Registry
from .batch import RolloutBatch, truncated_without_eos


@dataclass(frozen=True)
class EngineSettings:
    """What an engine is built with: the sampling, the model it serves and, for vLLM, its memory and weight push."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    model_path: str = ""  # where the engine's own copy loads from (vLLM); the hf engine uses the model it is given
    max_model_len: int | None = None  # prompt + response tokens of the longest sequence; None: the model's limit
    seed: int = 0
    dtype: str = "float32"  # "bfloat16" (bf16 autocast on CUDA) or "float32"
    device: torch.device | str = "cpu"
    trust_remote_code: bool = False
    gpu_memory_utilization: float = 0.5
    sleep_between_rollouts: bool = False
    weight_sync_bucket_mb: int = 512
    # vllm: pushes arrive through vLLM's weight-transfer calls (receive_weights), by this backend of
    # fasttnt.pipeline.vllm_transfer's (BACKEND, NCCL_BACKEND); None: through reload_weights (sync_weights)
    weight_transfer: str | None = None
    zero3_engine: Any = None  # DeepSpeed's engine when the model is ZeRO-3 sharded (the hf engine gathers it)
    forbid_think_end_first: bool = False  # some prompts will be forced to think (the vllm engine's processor)
    give_back_heap: bool = False  # the hf engine on the CPU: the heap a rollout freed back to the system at its end


@dataclass(frozen=True)
class Requests:
    """A rollout's rows as an engine serves them: each row's prompt (in its mode), and the runs of consecutive rows
    of one group with the same prompt, each run one prefill (hf) or one request of n samples (vllm)."""

    rows: list[Prompt]  # (S,)
    runs: list[tuple[int, int]]  # (first row, rows) per run, in order, never across a group

    @classmethod
    def of(cls, prompts: list[Prompt], group_size: int, rows: list[Prompt] | None = None) -> Requests:
        """``prompts`` (P,) with K = ``group_size`` rows each; ``rows`` (P*K,): each row's own prompt, in place of
        its prompt's K copies (a mode-mixed group's rows differ: ``fasttnt.modes``)."""
        if rows is None:
            rows = [p for p in prompts for _ in range(group_size)]
        elif len(rows) != len(prompts) * group_size:
            raise ValueError(f"{len(rows)} rows for {len(prompts)} prompts x {group_size}")
        runs = []
        for i, prompt in enumerate(rows):
            if runs and i % group_size and prompt == rows[i - 1]:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        return cls(rows, runs)

    def tokenized_runs(self, tokenizer) -> TokenizedRuns:
        """Each run's prompt ids and its pre-filled response prefix (empty when none), tokenised apart: a BPE merge
        across the two would make the engines' prompts differ, and the pre-fill is the start of the response."""
        prompts = [self.rows[start] for start, _ in self.runs]
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        prefixes = [
            tokenizer(p.response_prefix, add_special_tokens=False)["input_ids"] if p.response_prefix else []
            for p in prompts
        ]
        run_of_row = [r for r, (_, n) in enumerate(self.runs) for _ in range(n)]
        return TokenizedRuns(ids, prefixes, run_of_row)


@dataclass(frozen=True)
class TokenizedRuns:
    """A rollout's runs as token ids, and how an engine's samples become the batch: both engines feed each run its
    prompt and then its pre-fill (a forced mode's ``</think>``), and hand the pre-fill back as the start of each of
    the run's responses (``rollout_batch``)."""

    prompt_ids: list[list[int]]  # per run: the prompt proper
    prefixes: list[list[int]]  # per run: the pre-filled start of its responses, empty when none
    run_of_row: list[int]  # (S,) each row's run

    @property
    def inputs(self) -> list[list[int]]:
        """What each run's prefill (hf) or request (vllm) takes: the prompt, then the pre-fill."""
        return [ids + prefix for ids, prefix in zip(self.prompt_ids, self.prefixes, strict=True)]

    def rollout_batch(
        self,
        sampled: list[list[int]],
        sampled_logp: list[list[float]],
        group_size: int,
        *,
        eos_ids: Collection[int],
        device: torch.device | str,
    ) -> RolloutBatch:
        """Each row's sampled tokens (S,), EOS last where one was sampled, and their log-probs as the rollout batch:
        the run's pre-fill back at the start of its response (log-prob 0: it was not sampled) and the prompt proper
        as its prompt; truncated where no EOS id ends it."""
        responses, logprobs = [], []
        for run, tokens, logp in zip(self.run_of_row, sampled, sampled_logp, strict=True):
            prefix = self.prefixes[run]
            responses.append(prefix + tokens)  # EOS is kept: the policy learns to stop
            logprobs.extend([0.0] * len(prefix) + logp)
        truncated = truncated_without_eos(responses, eos_ids)
        prompt_ids = [self.prompt_ids[run] for run in self.run_of_row]  # (S,) a pre-filled prefix is the response's
        return RolloutBatch.of_responses(prompt_ids, responses, truncated, group_size, device=device,
                                         rollout_logp=logprobs)  # fmt: skip


class RolloutEngine(Protocol):
    """A step's life cycle: ``generate`` once per draw, ``end_rollout`` before the update (an engine that holds
    memory of its own releases it), ``sync_weights`` after it, ``close`` at the end. ``separate_weights``: it
    samples from its own copy of the weights (pushed by ``sync_weights``), not from the training model itself.
    ``eos_ids``: the ids a response stops at (``batch.eos_ids_of``), which its scoring reads too."""

    separate_weights: bool
    eos_ids: frozenset[int]

    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, rows=None
    ) -> RolloutBatch:
        """K samples per prompt, seeded per response; ``first_row`` is the global index of the first response (a
        rank's share of the step); ``rows`` (P*K,) each row's own prompt (``Requests.of``)."""
        ...

    def end_rollout(self) -> None: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


ENGINES: Registry[type] = Registry("rollout engine")


def build_engine(name: str, model, tokenizer, settings: EngineSettings) -> RolloutEngine:
    """The registered engine ``name`` (``rollout.engine``, ``fasttnt eval --engine``) over ``model``."""
    return ENGINES.get(name)(model, tokenizer, settings)
