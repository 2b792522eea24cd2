"""The ``vllm`` engine: a colocated vLLM ``LLM`` on each rank, weights pushed from the trained model after every
update. vLLM does not install on CPU-only machines: it follows TRL's tested colocate code and is tested against a
stand-in that enforces vLLM's rules (tests/vllm_standin.py)."""

from __future__ import annotations

import functools
import gc
import os

import torch

from .. import distributed
from ..data import Prompt
from .base import ENGINES, EngineSettings
from .batch import RolloutBatch, pack_sequences
from .sampler import row_seeds


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

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        try:
            from vllm import LLM, SamplingParams
        except ImportError as err:
            raise RuntimeError("rollout.engine=vllm needs vLLM on a CUDA machine: pip install 'fasttnt[gpu]'") from err
        self._sampling_params = SamplingParams
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(settings.device)
        self.max_new_tokens = settings.max_new_tokens
        self.temperature, self.top_p = settings.temperature, settings.top_p
        self.sleep_between_rollouts = sleep_between_rollouts = settings.sleep_between_rollouts
        self.bucket_bytes = settings.weight_sync_bucket_mb * 2**20
        _external_launcher_env()
        self.llm = LLM(
            model=settings.model_path,
            dtype=settings.dtype,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=settings.gpu_memory_utilization,
            enable_sleep_mode=sleep_between_rollouts,
            enable_prefix_caching=True,
            max_model_len=settings.max_model_len,
            seed=settings.seed,
            logprobs_mode="processed_logprobs",
            trust_remote_code=settings.trust_remote_code,
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

    def generate(self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0) -> RolloutBatch:
        """Awake until ``end_rollout``: a step's draws share one wake-up and one weight push."""
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
        ids, cu = pack_sequences(responses, self.device)
        return RolloutBatch(
            rows,
            ids,
            cu,
            torch.tensor(truncated, device=self.device),
            group_size,
            rollout_logp=torch.tensor(logprobs, dtype=torch.float32, device=self.device),
        )

    def end_rollout(self) -> None:
        """Asleep for the update (its memory back to the trainer), once per step after all its draws: a level-2
        sleep discards the weights, so draws that each slept would push the same weights again."""
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
            with distributed.gathered([p for _, p in bucket]):
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
