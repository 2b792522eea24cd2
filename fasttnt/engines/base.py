"""The rollout-engine interface, the registry the config's ``rollout.engine`` names, and ``build_engine``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..data import Prompt
from ..registry import Registry
from .batch import RolloutBatch


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


class RolloutEngine(Protocol):
    """A step's life cycle: ``generate`` once per draw, ``end_rollout`` before the update (an engine that holds
    memory of its own releases it), ``sync_weights`` after it, ``close`` at the end. ``separate_weights``: it
    samples from its own copy of the weights (pushed by ``sync_weights``), not from the training model itself."""

    separate_weights: bool

    def generate(self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0) -> RolloutBatch:
        """K samples per prompt, seeded per response; ``first_row`` is the global index of the first response (a
        rank's share of the step)."""
        ...

    def end_rollout(self) -> None: ...

    def sync_weights(self, model: torch.nn.Module) -> None: ...

    def close(self) -> None: ...


ENGINES: Registry[type] = Registry("rollout engine")


def build_engine(name: str, model, tokenizer, settings: EngineSettings) -> RolloutEngine:
    """The registered engine ``name`` (``rollout.engine``, ``fasttnt eval --engine``) over ``model``."""
    return ENGINES.get(name)(model, tokenizer, settings)
