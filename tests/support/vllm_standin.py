"""A stand-in for the ``vllm`` package with the rules of vLLM's colocated sleep mode enforced: sleep mode needs CUDA
(vLLM's CPU build refuses it), so this is where the engine's sleep/wake order is tested; everything else the
engine does runs against real vLLM's CPU build (tests/test_vllm_real.py). Each rule is what vLLM 0.31.0 does (read
in its source):

* the external launcher reads RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (``KeyError`` without them);
* building an engine reseeds Python's, NumPy's and torch's global RNGs (vLLM's ``set_random_seed``);
* ``sleep`` while any part is asleep is ignored (0.22's executor: "Executor is already sleeping");
* ``sleep(level=2)`` discards the weights: here they become NaN, so generating from them is caught;
* waking memory that is already mapped raises (0.22's allocator would map it twice: a CUDA error);
* generating with any part asleep raises (0.31 schedules nothing until every part is awake: a hang);
* one engine per process holds the GPU: a second one fails while the first is alive (vLLM's memory check);
* the V2 model runner unless ``VLLM_USE_V2_MODEL_RUNNER=0`` (0.31 on CUDA with Triton, for a dense model).

Generation is real: the weights pushed through ``apply_model`` sample tokens on the CPU, each request from its own
seeded generator, and the log-probs returned are "processed" (after temperature and top-p), as
``logprobs_mode="processed_logprobs"`` asks.
"""

from __future__ import annotations

import os
import random
import sys
import types
import weakref
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

TAGS = ("weights", "kv_cache")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
    seed: int | None = None
    extra_args: dict | None = None
    stop_token_ids: list[int] | None = None


@dataclass
class Logprob:
    logprob: float


@dataclass
class CompletionOutput:
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]
    finish_reason: str


@dataclass
class RequestOutput:
    outputs: list[CompletionOutput] = field(default_factory=list)


class _EngineModel:
    """The engine's model, whose weights load by Hugging Face name (the tied head's included)."""

    def __init__(self, hf_model) -> None:
        self.hf = hf_model

    def load_weights(self, weights) -> None:
        params = dict(self.hf.named_parameters(remove_duplicate=False))
        for name, tensor in weights:
            params[name].data.copy_(tensor.to(params[name].dtype))


class LLM:
    live: ClassVar[weakref.WeakSet] = weakref.WeakSet()
    built: ClassVar[list[dict]] = []  # the constructor arguments of every engine, in order
    logs: ClassVar[list[list[str]]] = []  # the calls made on every engine, in order (kept after it is freed)

    def __init__(self, model: str, **kwargs) -> None:
        from transformers import AutoModelForCausalLM

        for key in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            _ = os.environ[key]  # KeyError, as vLLM's external launcher
        if any(True for _ in LLM.live):
            raise RuntimeError("Free memory on device is less than desired GPU memory utilization (another engine)")
        self.kwargs = {"model": model, **kwargs}
        LLM.built.append(self.kwargs)
        self.model = _EngineModel(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval())
        v2 = os.environ.get("VLLM_USE_V2_MODEL_RUNNER") != "0"
        self.llm_engine = types.SimpleNamespace(vllm_config=types.SimpleNamespace(use_v2_model_runner=v2))
        seed = kwargs.get("seed", 0)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        self.sleeping: set[str] = set()
        self.calls: list[str] = []
        LLM.logs.append(self.calls)
        LLM.live.add(self)

    # -- sleep mode ---------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        assert self.kwargs.get("enable_sleep_mode"), "sleep needs enable_sleep_mode=True"
        if self.sleeping:
            self.calls.append("sleep-ignored")
            return
        self.calls.append(f"sleep({level})")
        if level == 2:
            for p in self.model.hf.parameters():
                p.data.fill_(float("nan"))
        self.sleeping = set(TAGS)

    def wake_up(self, tags: list[str] | None = None) -> None:
        wanted = set(tags or TAGS)
        mapped = wanted - self.sleeping
        if mapped:
            raise RuntimeError(f"CUDA Error: waking memory that is mapped ({sorted(mapped)}): mapped twice")
        self.sleeping -= wanted
        self.calls.append(f"wake({','.join(sorted(wanted))})")

    # -- weights ------------------------------------------------------------------------------------------------

    def collective_rpc(self, method: str, kwargs: dict | None = None):
        assert method == "reload_weights", method
        if "weights" in self.sleeping:
            raise RuntimeError("reload_weights with the weights asleep: their memory is not mapped")
        self.calls.append("reload_weights")
        self.model.load_weights(kwargs["weights_iterator"])
        return [None]

    def reset_prefix_cache(self) -> bool:
        self.calls.append("reset_prefix_cache")
        return True

    # -- generation ---------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompts, params, use_tqdm: bool = True) -> list[RequestOutput]:
        if self.sleeping:
            raise RuntimeError(f"generate with {sorted(self.sleeping)} asleep: nothing would be scheduled (a hang)")
        if any(torch.isnan(p).any() for p in self.model.hf.parameters()):
            raise RuntimeError("generate from discarded weights: a level-2 sleep was not followed by a weight push")
        self.calls.append("generate")
        return [self._request(p["prompt_token_ids"], sp) for p, sp in zip(prompts, params, strict=True)]

    def _request(self, prompt: list[int], sp: SamplingParams) -> RequestOutput:
        gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else 0)
        # vLLM 0.31 stops at the EOS, the generation config's other EOS ids and the stop_token_ids asked for
        # (SamplingParams.update_from_generation_config, vllm/v1/core/sched/utils.py check_stop)
        eos = self.model.hf.generation_config.eos_token_id
        stops = {*(eos if isinstance(eos, list) else [eos]), *(sp.stop_token_ids or [])}
        out = RequestOutput()
        for _ in range(sp.n):
            ids, logprobs, finish = list(prompt), [], "length"
            for _ in range(sp.max_tokens):
                z = self.model.hf(input_ids=torch.tensor([ids])).logits[0, -1].float() / sp.temperature
                if sp.top_p < 1.0:
                    probs, order = z.softmax(-1).sort(descending=True)
                    drop = probs.cumsum(-1) - probs >= sp.top_p
                    z[order[drop]] = -float("inf")
                logp = torch.log_softmax(z, -1)
                token = int(torch.multinomial(logp.exp(), 1, generator=gen))
                ids.append(token)
                logprobs.append({token: Logprob(float(logp[token]))})
                if token in stops:
                    finish = "stop"
                    break
            out.outputs.append(CompletionOutput(ids[len(prompt) :], logprobs, finish))
        return out


class _Platform:
    device_type = "cuda"

    @staticmethod
    def is_sleep_mode_available() -> bool:
        return True  # the stand-in stands in for CUDA's sleep mode


class _ModelConfig:
    def __init__(self, model: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoConfig

        self.max_model_len = AutoConfig.from_pretrained(model).max_position_embeddings


def install(monkeypatch) -> types.ModuleType:
    """Put the stand-in where ``import vllm`` finds it, for one test."""
    module = types.ModuleType("vllm")
    module.__version__ = "0.31.0"
    module.LLM, module.SamplingParams = LLM, SamplingParams
    parallel_state = types.ModuleType("vllm.distributed.parallel_state")
    parallel_state._WORLD = parallel_state._NODE_COUNT = None
    parallel_state.destroy_distributed_environment = lambda: None
    distributed = types.ModuleType("vllm.distributed")
    distributed.parallel_state = parallel_state
    platforms = types.ModuleType("vllm.platforms")
    platforms.current_platform = _Platform()
    config = types.ModuleType("vllm.config")
    config.ModelConfig = _ModelConfig
    for name, mod in (("vllm", module), ("vllm.distributed", distributed), ("vllm.platforms", platforms),
                      ("vllm.config", config), ("vllm.distributed.parallel_state", parallel_state)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    LLM.built.clear()
    LLM.logs.clear()
    return module
