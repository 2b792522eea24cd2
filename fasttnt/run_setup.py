"""A run set up from its config, in the order that matters (``build``): ranks, the data, the resume checks, the
model, the optimizer, the rollout engine, then the training state. (Named for what it does: ``setup.py`` is the
packaging file's name.)

The order rules, each for a reason:

* the data is read and checked before any model is loaded (a bad row costs seconds, not a model download);
* a resume is checked (same config, same ranks) before anything is written;
* rank 0 builds the model first: the tiny model's warm-up cache is written once, then read by the others;
* the engine is built before any RNG state is set: vLLM reseeds Python's, NumPy's and torch's RNGs when it starts;
  it generates from the trainer's current weights (a resumed run's included: the hf engine samples from the model
  itself, the vllm engine pushes them before its first rollout);
* the training state last: a resume's checkpoint (``checkpoint.restore``: weights, optimizer, RNG states, step and
  data position), or the config's seed.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from . import checkpoint, distributed, files, host_memory
from .checkpoint import TrainerState
from .config import ConfigError, TrainConfig, dump_config
from .data import Problem, PromptMode, build_prompt, dataset_style, loading_model, think_end_token_id
from .embedded.tiny import warmed_up_model
from .engines import EngineSettings, RolloutEngine, build_engine
from .metrics import HackMarkers
from .policy import PolicyHead, tied_rows_into_grad
from .runlog import truncate_metrics
from .stream import ProblemStream


@dataclass(kw_only=True)  # many fields: made by name
class RunParts:
    """Everything a run is made of, built by ``build``."""

    cfg: TrainConfig
    out: Path
    dist: distributed.DistContext | None
    device: torch.device
    autocast: bool  # bf16 autocast (bf16_autocast)
    model: torch.nn.Module
    tokenizer: object
    model_path: Path | str
    ref_model: torch.nn.Module | None
    head: PolicyHead
    optimizer: torch.optim.Optimizer
    ds_engine: object | None
    engine: RolloutEngine
    stream: ProblemStream
    state: TrainerState
    think_end_id: int
    markers: HackMarkers
    # rollout.workers > 0: the world's roles (this process is one of the training ranks; dist is their own world, None
    # where it trains alone)
    pipeline: object | None = None  # fasttnt.pipeline.roles.Pipeline
    resumed_from: Path | None = None  # the checkpoint a resumed run continues

    @property
    def rank(self) -> int:
        return self.dist.rank if self.dist else 0

    @property
    def world(self) -> int:
        return self.dist.world if self.dist else 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def prompts_per_rank(self) -> int:
        return self.cfg.rollout.prompts_per_step // self.world

    def prompt(self, problem: Problem):
        return training_prompt(self.cfg, self.tokenizer, problem)


def bf16_autocast(cfg: TrainConfig, device: torch.device) -> bool:
    """bf16 autocast (the forwards and the engine alike): ``model.dtype`` bfloat16 on any device, auto on CUDA."""
    return cfg.model.dtype == "bfloat16" or (cfg.model.dtype == "auto" and device.type == "cuda")


def training_prompt(cfg: TrainConfig, tokenizer, problem: Problem):
    """The prompt a run gives ``problem``: free mode, ``data.instruction`` (by default ``data.dataset_style``'s),
    ``data.prompt_style``."""
    instruction = dataset_style(cfg.data.train, instruction=cfg.data.instruction).instruction
    return build_prompt(tokenizer, problem.problem, PromptMode.FREE, instruction=instruction,
                        style=cfg.data.prompt_style)  # fmt: skip


def engine_settings(cfg: TrainConfig, model_path, device: torch.device, prompt_budget: int | None, *,
                    zero3_engine=None, give_back_heap: bool = False) -> EngineSettings:  # fmt: skip
    """What the rollout engine of a run is built with: its sampling, the model it serves (bf16 under CUDA autocast),
    the longest sequence (``prompt_budget`` + the length budget), vLLM's memory and weight push, and whether the
    hf engine hands the heap back after a rollout (``host_memory.worth_it``)."""
    r = cfg.rollout
    return EngineSettings(
        max_new_tokens=r.max_new_tokens,
        temperature=r.temperature,
        top_p=r.top_p,
        model_path=str(model_path),
        max_model_len=None if prompt_budget is None else prompt_budget + r.max_new_tokens,
        seed=cfg.seed,
        dtype="bfloat16" if bf16_autocast(cfg, device) else "float32",
        device=device,
        trust_remote_code=cfg.model.trust_remote_code,
        gpu_memory_utilization=r.gpu_memory_utilization,
        sleep_between_rollouts=r.sleep_between_rollouts,
        weight_sync_bucket_mb=r.weight_sync_bucket_mb,
        zero3_engine=zero3_engine,
        forbid_think_end_first=r.forced_rows()[1] > 0,
        give_back_heap=give_back_heap,
    )


def device_type_of(cfg: TrainConfig) -> str:
    """The device type a run trains (and generates) on: ``device``, with ``auto`` CUDA where there is one."""
    return "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"


def build(cfg: TrainConfig, out: Path, *, pipeline=None, resume: bool = False, new_config_ok: bool = False
          ) -> RunParts:  # fmt: skip
    """The run in ``out``: its ranks, model, optimizer, engine, data and state. ``pipeline``: the trainers' side of a
    run with rollout workers (``fasttnt.pipeline.roles.trainers_world``, which the caller joins first: the workers
    generate, fasttnt.pipeline.worker.serve), None without them."""
    device_type = device_type_of(cfg)
    dist = distributed.init(device_type) if distributed.launched_distributed() else None
    world, is_main = (dist.world, dist.rank == 0) if dist else (1, True)
    device = dist.device if dist else distributed.local_device(device_type)
    r = cfg.rollout
    if r.prompts_per_step % (world * cfg.loss.mini_batches):
        raise ValueError(
            f"rollout.prompts_per_step={r.prompts_per_step} must divide into {world} ranks x "
            f"loss.mini_batches={cfg.loss.mini_batches}"
        )

    # -- the checkpoint to resume, the data, the resume checks: before any model loads or anything is written --
    ckpt_root = out / "checkpoints"
    existing = checkpoint.list_checkpoints(ckpt_root)
    if existing and not resume:
        raise FileExistsError(
            f"{out} holds checkpoints of an earlier run ({existing[-1].name}): pass --resume to continue it, or "
            "choose another --output-dir"
        )
    stream = ProblemStream(cfg)
    prompt_budget = prompt_budget_of(cfg)  # from the model's config alone, before its weights load
    resume_from = existing[-1] if resume and existing else None
    if resume_from is not None:
        checkpoint.check_resume(cfg, resume_from, world, new_config_ok=new_config_ok)
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        checkpoint.remove_partial(ckpt_root)
        files.restore_replaced(out / "final")  # a kill while final/ was being replaced
        if resume and resume_from is None:
            tqdm.write(f"--resume: no checkpoint under {ckpt_root}; starting from step 0")
        dump_config(cfg, out / "config.yaml")

    # -- the model: rank 0 first (the warm-up cache), the reference --
    if not is_main:
        distributed.barrier()
    model, tokenizer, model_path = load_policy(cfg, device)
    if is_main and dist:  # the other ranks load it from the cache now
        distributed.barrier()
    if pipeline is not None:  # and the workers
        pipeline.barrier("the trainer's model")
    if is_main:  # saved once, fresh (a leftover file would be copied into every checkpoint), and copied from here
        shutil.rmtree(out / "tokenizer", ignore_errors=True)
        tokenizer.save_pretrained(out / "tokenizer")
    # the CPU's memory measures, for a model large enough that they pay (host_memory.worth_it: by its size)
    memory_measures = host_memory.worth_it(model, device)
    if memory_measures:
        host_memory.serve_large_blocks_from_mmap()  # freed tensors leave the resident set
    model.to(device)
    model.zero_grad(set_to_none=True)  # whatever made the model (a warm-up) leaves no gradient behind
    if cfg.model.gradient_checkpointing:
        # transformers 5 renamed it; 4.x has only the old name
        getattr(model, "activation_checkpointing_enable", model.gradient_checkpointing_enable)()
    if memory_measures and not dist:
        tied_rows_into_grad(model)  # a tied embedding's rows straight into weight.grad (its docstring says why)
    ref_model = None
    if cfg.loss.kl_coef > 0:  # the starting policy, also when resuming
        ref_model = from_pretrained(cfg, model_path, device).to(device).eval().requires_grad_(False)
    think_end_id = think_end_token_id(tokenizer)

    # -- the optimizer, and DeepSpeed around it --
    o = cfg.optim
    head = PolicyHead(model)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True
    )  # fused: one kernel for all parameters, on the CPU as on CUDA
    autocast = bf16_autocast(cfg, device)
    ds_engine = None
    if dist:
        import deepspeed

        ds_engine, optimizer, _, _ = deepspeed.initialize(
            model=head, optimizer=optimizer, config=distributed.deepspeed_config(cfg, world, autocast=autocast)
        )
        if cfg.distributed.zero3:  # the fused op reads the lm_head weight outside its module
            deepspeed.zero.register_external_parameter(head, model.get_output_embeddings().weight)

    # -- the rollout engine: before any RNG state is set (vLLM reseeds them when it starts) --
    zero3 = ds_engine if dist and cfg.distributed.zero3 else None
    settings = engine_settings(
        cfg, model_path, device, prompt_budget, zero3_engine=zero3, give_back_heap=memory_measures
    )
    # with rollout workers the trainer generates nothing: its engine is the hf one around its own model (no copy)
    engine = build_engine("hf" if pipeline else r.engine, model, tokenizer, settings)

    # -- the training state: the checkpoint's (weights, optimizer, RNG states, step, data position) or a fresh start --
    if resume_from is not None:
        state = checkpoint.restore(resume_from, model, optimizer, ds_engine, rank=dist.rank if dist else 0)
        stream.seek(state.data_position)
    else:
        state = TrainerState(step=0, data_position=0, world=world)
        checkpoint.seed_rngs(cfg.seed)
    if is_main:
        truncate_metrics(out / "metrics.jsonl", state.step)

    # -- the responses' hack markers --
    markers = dataset_style(cfg.data.train, markers=cfg.data.hack_markers).markers
    parts = RunParts(
        cfg=cfg, out=out, dist=dist, device=device, autocast=autocast, model=model, tokenizer=tokenizer,
        model_path=model_path, ref_model=ref_model, head=head, optimizer=optimizer, ds_engine=ds_engine, engine=engine,
        stream=stream, state=state, think_end_id=think_end_id, markers=markers, pipeline=pipeline,
        resumed_from=resume_from,
    )  # fmt: skip
    dropped = drop_long_prompts(stream, cfg, tokenizer, prompt_budget)
    if dropped:
        tqdm.write(f"data.train: {dropped} problems dropped, their prompts exceed {prompt_budget} tokens")
    return parts


def drop_long_prompts(stream: ProblemStream, cfg: TrainConfig, tokenizer, prompt_budget: int | None) -> int:
    """Drop from ``stream`` the problems whose training prompts exceed ``prompt_budget`` tokens; how many."""
    if prompt_budget is None:
        return 0
    return stream.drop_long_prompts(
        lambda p: len(tokenizer(training_prompt(cfg, tokenizer, p).text, add_special_tokens=False)["input_ids"]),
        prompt_budget,
    )


def prompt_budget_of(cfg: TrainConfig) -> int | None:
    """The longest prompt a run takes: ``data.max_prompt_tokens``, or what the model's positions leave after
    ``rollout.max_new_tokens``; a config that asks for more positions than the model has is an error naming both
    numbers. None where the model's config names no limit (and none is configured)."""
    d, new = cfg.data, cfg.rollout.max_new_tokens
    if cfg.model.name == "tiny":
        limit = cfg.model.tiny.max_position_embeddings
    else:
        from transformers import AutoConfig

        with loading_model(f"model.name={cfg.model.name}"):
            config = AutoConfig.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
        limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if limit is None:
        return d.max_prompt_tokens
    if d.max_prompt_tokens is None:
        if new >= limit:
            raise ConfigError(f"rollout.max_new_tokens={new}: {cfg.model.name} takes {limit} positions in all")
        return limit - new
    if d.max_prompt_tokens + new > limit:
        raise ConfigError(
            f"data.max_prompt_tokens={d.max_prompt_tokens} + rollout.max_new_tokens={new} = "
            f"{d.max_prompt_tokens + new} positions: {cfg.model.name} takes {limit}"
        )
    return d.max_prompt_tokens


def load_policy(cfg: TrainConfig, device: torch.device):
    """The policy model, its tokenizer and the path it loads from: the tiny model after its (cached) warm-up, or
    a hub id / local folder."""
    m = cfg.model
    if m.name == "tiny":

        def bar(total):
            return _bar_callback(tqdm(total=total, desc="warm-up (cached after the first run)", unit="step"))

        return warmed_up_model(Path(cfg.cache_dir).expanduser(), m.tiny, cfg.warmup, progress_factory=bar)
    with loading_model(f"model.name={m.name}"):
        tokenizer = AutoTokenizer.from_pretrained(m.name, trust_remote_code=m.trust_remote_code)
        return from_pretrained(cfg, m.name, device), tokenizer, m.name


def from_pretrained(cfg: TrainConfig, path, device: torch.device):
    """A model as configured: float32 master weights, the attention kernel, Liger on CUDA."""
    m = cfg.model
    attn = m.attn_implementation
    if attn == "auto":
        attn = "flash_attention_2" if device.type == "cuda" and _has_flash_attn() else "sdpa"
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=attn, trust_remote_code=m.trust_remote_code
    )
    if device.type == "cuda" and m.liger_kernels:
        _apply_liger(model)
    return model


def _bar_callback(bar):
    def update(loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()

    return update


def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def _apply_liger(model) -> None:
    """Liger-Kernel's RMSNorm, SwiGLU and RoPE on this model instance (CUDA, when liger-kernel is installed)."""
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError:
        return
    _apply_liger_kernel_to_instance(
        model=model, rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
