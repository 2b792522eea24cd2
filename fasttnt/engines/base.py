"""The rollout-engine interface, the registry the config's ``rollout.engine`` names, and ``build_engine``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..data import Prompt, PromptMode
from ..registry import Registry
from .batch import FORCED_CODES, RolloutBatch


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
    zero3_engine: Any = None  # DeepSpeed's engine when the model is ZeRO-3 sharded (the hf engine gathers it)
    forbid_think_end_first: bool = False  # some prompts will be forced to think (the vllm engine's processor)


@dataclass(frozen=True)
class Requests:
    """A rollout's rows as an engine serves them: each row's prompt (in its mode), and the runs of consecutive rows
    of one group with the same prompt, each run one prefill (hf) or one request of n samples (vllm)."""

    rows: list[Prompt]  # (S,)
    runs: list[tuple[int, int]]  # (first row, rows) per run, in order, never across a group

    @classmethod
    def of(cls, prompts: list[Prompt], group_size: int, modes: list[PromptMode] | None = None) -> Requests:
        """``prompts`` (P,) with K = ``group_size`` rows each; ``modes`` (P*K,): each row's mode, which then
        replaces its prompt's own (a mode-mixed group)."""
        rows = [p for p in prompts for _ in range(group_size)]
        if modes is not None:
            if len(modes) != len(rows):
                raise ValueError(f"{len(modes)} modes for {len(rows)} rows ({len(prompts)} prompts x {group_size})")
            rows = [p.in_mode(m) for p, m in zip(rows, modes, strict=True)]
        runs = []
        for i, prompt in enumerate(rows):
            if runs and i % group_size and prompt == rows[i - 1]:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        return cls(rows, runs)

    def tokenized_runs(self, tokenizer) -> tuple[list[list[int]], list[list[int]]]:
        """Each run's prompt ids and its pre-filled response prefix (empty when none), tokenised apart: a BPE merge
        across the two would make the engines' prompts differ, and the pre-fill is the start of the response."""
        prompts = [self.rows[start] for start, _ in self.runs]
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        prefixes = [
            tokenizer(p.response_prefix, add_special_tokens=False)["input_ids"] if p.response_prefix else []
            for p in prompts
        ]
        return ids, prefixes

    def forced(self, device) -> torch.Tensor | None:
        """(S,) int8 of ``FORCED_CODES`` when any row is forced, else None."""
        codes = [FORCED_CODES[_mode_of(p)] for p in self.rows]
        return torch.tensor(codes, dtype=torch.int8, device=device) if any(codes) else None


def _mode_of(prompt: Prompt) -> PromptMode:
    if prompt.response_prefix:
        return PromptMode.NON_THINKING
    return PromptMode.THINKING if prompt.forbid_think_end_first else PromptMode.FREE


class RolloutEngine(Protocol):
    """A step's life cycle: ``generate`` once per draw, ``end_rollout`` before the update (an engine that holds
    memory of its own releases it), ``sync_weights`` after it, ``close`` at the end. ``separate_weights``: it
    samples from its own copy of the weights (pushed by ``sync_weights``), not from the training model itself."""

    separate_weights: bool

    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, modes=None
    ) -> RolloutBatch:
        """K samples per prompt, seeded per response; ``first_row`` is the global index of the first response (a
        rank's share of the step); ``modes`` (P*K,) each row's mode (``Requests.of``)."""
        ...

    def end_rollout(self) -> None: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


ENGINES: Registry[type] = Registry("rollout engine")


def build_engine(name: str, model, tokenizer, settings: EngineSettings) -> RolloutEngine:
    """The registered engine ``name`` (``rollout.engine``, ``fasttnt eval --engine``) over ``model``."""
    return ENGINES.get(name)(model, tokenizer, settings)
