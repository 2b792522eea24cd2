"""Rollout engines: K sampled responses per prompt, returned packed (``RolloutBatch``), chosen by
``rollout.engine`` and built by ``build_engine``.

    hf    fasttnt's own decode loop over the training model (engines/hf.py), CPU or GPU
    vllm  a colocated vLLM ``LLM`` per rank, weights pushed after each update (engines/vllm.py)

Both return the log-prob each token was sampled with, for the rollout correction (``loss.rollout_correction``).
"""

from . import hf, vllm  # noqa: F401  (each registers its engine)
from .base import ENGINES, EngineSettings, RolloutEngine, build_engine
from .batch import RolloutBatch, decode_responses, pack_sequences

__all__ = ["ENGINES", "EngineSettings", "RolloutBatch", "RolloutEngine", "build_engine", "decode_responses",
           "pack_sequences"]  # fmt: skip
