"""The typed training config: dataclasses, loaded from YAML with ``key=value`` overrides, validated up front.

Every error is a ``ConfigError`` naming the key (``rollout.group_size: expected an int, got 'eight'``); the
CLI turns it into one line and exit code 2 before anything heavy starts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml

from fasttnt_kernels import ROLLOUT_CORRECTIONS, PolicyLossConfig, SettingError

from .data import DATASETS, MARKER_SETS, names_a_path
from .embedded.synthetic import level_weights_fit
from .embedded.tiny import TinyModelConfig, WarmupConfig
from .modes import HALF_SPLIT, UNFADED
from .rewards import RewardConfig
from .typed_yaml import ConfigError, apply_overrides, build, read_yaml_mapping, requirement

__all__ = [  # with the loader's error and YAML reader, which every caller of the config uses
    "SAFE_ON_RESUME", "ConfigError", "DataConfig", "DistributedConfig", "LossConfig", "ModelConfig", "OptimConfig",
    "RolloutConfig", "TrainConfig", "changed_keys", "config_yaml", "dump_config", "load_config", "read_config_file",
    "read_yaml_mapping",
    "rollout_correction", "to_dict", "validate", "with_overrides",
]  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    name: str = "tiny"  # "tiny" (the embedded default, built from `tiny`) or a hub id / local HF folder
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    # the weights and AdamW state stay float32 (16-bit weights would round lr-1e-6 updates away); "auto" adds
    # bf16 autocast on CUDA; "bfloat16" adds it on any device (the CPU's is slow: how the CPU checks the bf16 paths)
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    attn_implementation: Literal["auto", "sdpa", "eager", "flash_attention_2"] = "auto"
    gradient_checkpointing: bool = False
    liger_kernels: bool = True  # Liger's RMSNorm/SwiGLU/RoPE on CUDA when liger-kernel is installed
    trust_remote_code: bool = False

    def validate(self) -> None:
        need = requirement("model")
        need(bool(self.name.strip()), "name", "must name a model: tiny, a hub id or a local folder")
        need(
            not names_a_path(self.name) or Path(self.name).expanduser().is_dir(), "name", f"{self.name} is not a folder"
        )


@dataclass(frozen=True)
class DataConfig:
    train: str = "synthetic"  # "synthetic", a registered set (deepscaler, ...), a hub id or a local file
    problem_field: str | None = None
    answer_field: str | None = None
    levels: tuple[int, ...] = (1, 2, 3, 4)  # synthetic task: digits per operand
    # synthetic task: one weight per level of `levels` for the training draws and, in fasttnt compare, the held-out
    # split's mix (null: uniform draws, and the split's fixed problems per level)
    level_weights: tuple[float, ...] | None = None
    instruction: str | None = None  # appended to each problem; None: the math instruction for math sets
    hack_markers: Literal["auto", "math", "synthetic"] = "auto"
    # "ellipsis": AutoThink's prompt, the think block opened with "<think>\n...\n" (in training and evaluation)
    prompt_style: Literal["plain", "ellipsis"] = "plain"
    # longer prompts are dropped from the training set; None: what the model's positions leave after the responses
    # (its max_position_embeddings - rollout.max_new_tokens). More than that is a config error
    max_prompt_tokens: int | None = None

    def validate(self) -> None:
        need = requirement("data")
        cap = self.max_prompt_tokens
        need(cap is None or cap >= 1, "max_prompt_tokens", "must be >= 1 (or null: the model's limit)")
        need(bool(self.levels) and all(1 <= x <= 9 for x in self.levels), "levels", "digits in 1..9")
        need(level_weights_fit(self.levels, self.level_weights), "level_weights", f"one weight >= 0 per level of "
             f"data.levels {list(self.levels)}, not all 0 (or null)")  # fmt: skip
        need(self.hack_markers == "auto" or self.hack_markers in MARKER_SETS, "hack_markers",
             f"choose one of {list(MARKER_SETS)}")  # fmt: skip
        train = self.train
        looks_local = train.endswith((".jsonl", ".json", ".parquet")) or train.startswith(("/", "./", "~"))
        need(train == "synthetic" or train in DATASETS or not looks_local or Path(train).expanduser().is_file(),
             "train", f"{train} does not exist")  # fmt: skip


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["hf", "vllm"] = "hf"
    prompts_per_step: int = 32
    group_size: int = 8  # K samples per prompt
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    # DAPO's dynamic sampling (Yu et al. 2025, sec. 3.2, which filters on accuracy; here on the reward, verl's
    # filter_groups metric seq_reward, since TNT's rewards differ between right answers of either mode, and with
    # overlong shaping between lengths): a group whose K rewards are all equal has no advantage to learn from, so
    # more prompts_per_step-prompt batches are drawn until the step has prompts_per_step groups whose rewards differ
    # (the surplus is dropped), at most max_draws batches (verl's max_num_gen_batches, 10 in its DAPO scripts). A
    # step that reaches the cap fills its batch with equal-reward groups: zero advantage, no policy-gradient term
    dynamic_sampling: bool = False
    max_draws: int = 10
    # mode-mixed rollouts (fasttnt.modes; AdaptThink forces half of each group into each mode): the share of each
    # group's K samples answered with </think> pre-filled, and the share forced to think (</think> forbidden as the
    # first token); the rest sample freely. Rounded to the nearest row of K, halves up. A thinking-only model
    # (R1-Distill) practically never writes </think> first: without this TNT sees no non-thinking response to judge
    forced_non_thinking: float = 0.0
    forced_thinking: float = 0.0
    # the stale-weight guard: a step whose sampled tokens' log-probs under the engine differ from the trainer's by
    # more than this (the mean |difference| per token, logged as rollout_logp_diff) stops the run before it trains:
    # the engine sampled from other weights than the trainer's (a weight push that did not arrive). Measured: 1e-6
    # with vLLM's CPU build in float32; bf16 engines differ by ~1e-2; a tied head left out, 3.7 (engines/vllm.py).
    # None: off. Checked with an engine that samples from its own copy of the weights (vllm) at top_p 1 (under top-p
    # the engine's log-probs are renormalised over the nucleus, the trainer's are not: they differ by design)
    max_logp_diff: float | None = 0.1
    # generation apart from training (fasttnt.pipeline): the last `workers` ranks of the launched world only generate
    # (rollout -> verify -> reward) and ship their batches to the training ranks, which push their weights back after
    # each update; 0: every rank generates its share between updates (the colocated loop). max_staleness k: a batch
    # may be sampled with weights up to k updates older than the ones it trains (k = 0: on-policy, generation and
    # training in turn; k = 1: the next step's batch is generated during this step's update)
    workers: int = 0
    max_staleness: int = 0
    # the longest a trainer waits for a worker's batch, or a worker for the trainer's weights, before it stops the
    # run naming the other as hung (a process that died stops it at once); a step's generation or update, and a
    # checkpoint's save, must fit in it
    worker_timeout: float = 1800.0
    # how the trainers' weights reach vLLM workers (pipeline.vllm_transfer): gloo, through host memory on any device
    # and at any k; nccl, device to device on CUDA (vLLM's PyNcclCommunicator; at k <= 1, where each push is taken as
    # it is sent). nccl has not run on a GPU
    weight_transfer: Literal["gloo", "nccl"] = "gloo"
    # vllm only
    gpu_memory_utilization: float = 0.5  # on CUDA; on a CPU the engine takes a fixed 1 GiB KV cache
    sleep_between_rollouts: bool = True  # CUDA only (vLLM's sleep mode); elsewhere the engine stays awake, warned
    weight_sync_bucket_mb: int = 512

    @property
    def weight_sync_bucket_bytes(self) -> int:
        return self.weight_sync_bucket_mb * 2**20

    def forced_rows(self) -> tuple[int, int]:
        """Rows of each group forced (non-thinking, thinking): the shares of K rounded to the nearest row, halves up
        (Python's round would take 2.5 to 2)."""
        return tuple(
            math.floor(share * self.group_size + 0.5) for share in (self.forced_non_thinking, self.forced_thinking)
        )

    def validate(self) -> None:
        need = requirement("rollout")
        need(self.prompts_per_step >= 1, "prompts_per_step", "must be >= 1")
        need(self.group_size >= 1, "group_size", "must be >= 1")
        need(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        need(self.max_draws >= 1, "max_draws", "must be >= 1")
        need(self.workers >= 0, "workers", "must be >= 0")
        need(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        need(self.worker_timeout > 0, "worker_timeout", "must be > 0 seconds")
        need(self.max_staleness == 0 or self.workers > 0, "max_staleness",
             f"{self.max_staleness} overlaps generation with training on rollout workers of their own: with "
             "rollout.workers=0 every rank generates between its updates, so nothing can overlap (set "
             "rollout.workers)")  # fmt: skip
        need(self.weight_transfer == "gloo" or (self.workers > 0 and self.engine == "vllm" and self.max_staleness <= 1),
             "weight_transfer", "nccl moves the weights to vLLM rollout workers (rollout.workers >= 1, "
             "rollout.engine=vllm) at rollout.max_staleness <= 1, where each push is taken as it is sent")  # fmt: skip
        shares = {"forced_non_thinking": self.forced_non_thinking, "forced_thinking": self.forced_thinking}
        for key, share in shares.items():
            need(0 <= share <= 1, key, "must be a share of the group in [0, 1]")
        forced = self.forced_rows()
        for (key, share), rows in zip(shares.items(), forced, strict=True):
            need(share == 0 or rows > 0, key,
                 f"{share} of rollout.group_size={self.group_size} rounds to no row ({0.5 / self.group_size:g} "
                 "forces one)")  # fmt: skip
        need(sum(forced) <= self.group_size, "forced_non_thinking + rollout.forced_thinking",
             f"force {forced[0]} + {forced[1]} rows (each rounded to the nearest row, halves up), more than "
             f"rollout.group_size={self.group_size}")  # fmt: skip
        need(self.temperature > 0, "temperature", "must be > 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(0 < self.gpu_memory_utilization < 1, "gpu_memory_utilization", "must be in (0, 1)")
        need(self.max_logp_diff is None or self.max_logp_diff > 0, "max_logp_diff", "must be > 0 (or null: off)")


@dataclass(frozen=True)
class LossConfig:
    # clip_low, clip_high, dual_clip, kl_coef, kl_max, entropy_coef, agg, norm_length, policy_loss, the SAPO
    # temperatures, ratio_level and the VESPO shapes are the kernel's PolicyLossConfig, by name: the trainer builds
    # that one object from them (PolicyLossConfig.of) and hands it to the loss, and validate() runs the kernel
    # type's own checks on them (one set of checks, from the config to the kernel)
    adv_scale: Literal["std", "none"] = "std"
    adv_eps: float = 1e-6
    clip_low: float = 0.2
    clip_high: float = 0.28  # clip-higher (DAPO)
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_max: float | None = 10.0  # the k3 KL term's value capped here, its gradient 0 above (verl's clamp; null: none)
    entropy_coef: float = 0.0
    agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    norm_length: float | None = None
    # the policy-gradient term (fasttnt_kernels.clipped_policy_loss: verl's names): "vanilla", the clipped surrogate;
    # "gspo", the same with each sequence's ratio; "cispo", the clipped importance weight, detached, times A log pi;
    # "sapo", a soft gate in place of the clip; "vespo", a gamma weight of each sequence's ratio, detached, times
    # A log pi
    policy_loss: Literal["vanilla", "gspo", "cispo", "sapo", "vespo"] = "vanilla"
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature for a positive advantage
    sapo_tau_neg: float = 1.05  # and for the others
    # "sequence": CISPO's weight and SAPO's gate read each sequence's ratio, exp(mean log-ratio) (TRL's
    # importance_sampling_level; gspo is the surrogate's)
    ratio_level: Literal["token", "sequence"] = "token"
    # VESPO's weight e^lambda w^k e^(-lambda w) of a sequence's ratio w, for an advantage >= 0 and for the others
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per rollout batch and epoch
    # importance weights exp(old - rollout) for the engine/trainer mismatch (fasttnt_kernels.rollout_correction_
    # weights): "auto" is token-truncate with the vllm engine or top_p < 1 (samples then come from another
    # distribution than the loss's), none otherwise
    rollout_correction: Literal[
        "auto", "none", "token-truncate", "token-mask", "sequence-truncate", "sequence-mask"
    ] = "auto"
    rollout_correction_cap: float = 2.0  # TRL's default is 3.0
    # mode-mixed rollouts (fasttnt.modes, docs/algorithms.md#the-choice): how the first token is weighed against the
    # probability it was drawn with: "mixture" (unbiased), "half" (AdaptThink's log 0.5) or "policy" (none: every
    # direct row's </think> trained as if chosen, the one rule whose step on the choice does not shrink with p)
    mode_token_logp: Literal["mixture", "half", "policy"] = "policy"
    # the choice's advantage: "decoupled", the modes' reward gap on each direct row's </think> and every other token
    # judged within its mode (its expected step has the gap's sign at every p and temperature); "saturating", the
    # answers judged so too and the choice's step sized by the other half of the group's sign: towards direct as
    # (1 - p)^0.5, towards thinking as p^0.5, so it saturates at each mode (fasttnt.modes.saturating_choice);
    # "evidence", each half's gap over the other half's size, so a clear level steps as much as another
    # (fasttnt.modes.evidence_choice); "centered", each group's decoupled step minus the batch's mean one
    # (fasttnt.modes.centered_choice); "shared", GRPO's one advantage per response (the TNT paper's); "auto":
    # decoupled with mode-mixed rollouts, else shared
    mode_advantage: Literal["auto", "shared", "decoupled", "saturating", "evidence", "centered"] = "auto"
    # mode-mixed rollouts: below this pi(</think> first) a choice counts as settled, and its token's term fades as
    # (p / floor)^4 in either direction (a step size, never a sign); "auto": the smallest pi(</think>) of the first
    # step's groups, so the refused mode is not pushed below where the starting policy already had it; 0: off
    mode_token_floor: float | Literal["auto"] = "auto"
    # leave sequences whose advantage is exactly 0 out of the update's forward and backward when they add nothing
    # to the gradient (entropy_coef and KL off); the normalisers still count them, so the gradient is the same
    skip_zero_advantage: bool = True

    def validate(self) -> None:
        need = requirement("loss")
        need(self.mini_batches >= 1, "mini_batches", "must be >= 1")
        need(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        try:  # the kernel's own checks of the fields of its PolicyLossConfig (this class's comment)
            PolicyLossConfig.of(self)
        except SettingError as err:
            need(False, err.key, err.why)
        need(self.rollout_correction_cap >= 1, "rollout_correction_cap", "must be >= 1 (1 means on-policy)")
        floor = self.mode_token_floor
        need(floor == "auto" or 0 <= floor < 1, "mode_token_floor", "must be auto or a probability in [0, 1)")
        need(self.mode_advantage not in UNFADED or floor in ("auto", 0), "mode_token_floor",
             f"must be auto or 0 with loss.mode_advantage={self.mode_advantage}, which has no settled-choice "
             "fade")  # fmt: skip


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4  # the tiny model's; real models use 1e-6 (configs/*.yaml)
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    eps: float = 1e-8  # AdamW's, PyTorch's default
    warmup_steps: int = 5
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0

    def validate(self) -> None:
        need = requirement("optim")
        need(self.lr > 0, "lr", "must be > 0")
        need(self.grad_clip > 0, "grad_clip", "must be > 0")
        need(self.eps > 0, "eps", "must be > 0")
        need(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")

    def lr_at(self, step: int, steps: int) -> float:
        """The learning rate of step ``step`` (from 0) of a ``steps``-step run: a linear warm-up (never 0: the first
        step trains), then constant, or a cosine or linear decay to ``min_lr_ratio`` of ``lr``."""
        if step < self.warmup_steps:
            return self.lr * ((step + 1) / (self.warmup_steps + 1))
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, steps - self.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if self.schedule == "cosine" else 1 - progress
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * decay)


@dataclass(frozen=True)
class DistributedConfig:
    """Used when a launcher starts several processes (deepspeed or torchrun)."""

    zero_stage: Literal[2, 3] = 2  # 2: optimizer state and gradients sharded; 3: parameters too
    bucket_size: int = 50_000_000  # elements per ZeRO communication bucket
    # after the advantages, each mini-batch's groups dealt to the ranks so that their work (tokens, and attention's
    # share) is near-equal (fasttnt.balance): the same update, without the step waiting on the rank that drew the
    # longest responses
    balance_ranks: bool = True

    @property
    def zero3(self) -> bool:
        """Parameters sharded (ZeRO-3): gathered for each forward, and for the fused op's lm_head weight."""
        return self.zero_stage == 3


@dataclass(frozen=True)
class LoggingConfig:
    """Where a run can be watched besides metrics.jsonl, TensorBoard and curves.png (fasttnt.wandb_log)."""

    # Weights & Biases, from the main rank: every metrics.jsonl row, the resolved config, curves.png, and the eval
    # table of ``fasttnt eval`` on this run's final/ or checkpoints. Needs the wandb extra; WANDB_MODE=offline
    # writes the run under <output dir>/wandb for ``wandb sync`` later
    wandb: bool = False
    project: str = "fasttnt"
    name: str | None = None  # None: the output directory's name
    group: str | None = None
    tags: tuple[str, ...] = ()
    entity: str | None = None  # None: wandb's default entity of the logged-in user

    def validate(self) -> None:
        requirement("logging")(bool(self.project.strip()), "project", "must name a W&B project")


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 100
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # at most this many tokens (prompts and responses, packed in one row) per forward and backward: gradients
    # accumulate over a mini-batch's micro-batches, and the old/reference log-prob passes use the same budget.
    # Packed attention keeps sequences apart at no O(tokens^2) cost, so on the CPU one micro-batch per step is best
    micro_batch_tokens: int = 16384
    save_every: int = 20
    save_every_minutes: float | None = None  # also a checkpoint whenever this long has passed since the last one
    keep_checkpoints: int = 2
    verify_timeout: float = 5.0
    verify_workers: int = 2
    # a step in which more than this share of the answers could not be verified (their worker died) stops the run:
    # a crashed item counts as wrong, and a reward that turns correct answers into wrong ones must not train
    verify_max_crash_share: float = 0.05
    cache_dir: str = "~/.cache/fasttnt"  # the tiny model's warm-up is kept here
    model: ModelConfig = field(default_factory=ModelConfig)
    warmup: WarmupConfig = field(default_factory=WarmupConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# -- loading ----------------------------------------------------------------------------------------------------


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """The config from a YAML file (or the defaults) with ``key=value`` overrides applied, then validated."""
    tree = read_config_file(path) if path is not None else {}
    apply_overrides(tree, overrides)
    cfg = build(TrainConfig, tree)
    validate(cfg)
    return cfg


def read_config_file(path: str | Path, _chain: tuple[Path, ...] = ()) -> dict:
    """A config file's tree, its ``base:`` resolved: ``base: other.yaml`` (relative to the file) is read first and
    the file's own keys are laid over it, section by section, so a config holds only what differs from its base (or
    from the defaults). A chain of bases is followed; a cycle, or a base that is not a file name, is refused."""
    path = Path(path).resolve()
    tree = read_yaml_mapping(path, "--config", "a mapping of sections")
    base = tree.pop("base", None)
    if base is None:
        return tree
    if not isinstance(base, str) or not base.strip():
        raise ConfigError(f"--config: {path}: base: must be a file name (relative to the file), got {base!r}")
    target = (path.parent / base).resolve()
    if target in (*_chain, path):
        cycle = " -> ".join(p.name for p in (*_chain, path, target))
        raise ConfigError(f"--config: {path}: base: a cycle ({cycle})")
    if not target.is_file():
        raise ConfigError(f"--config: {path}: base: {base} does not exist (read relative to the file: {target})")
    return _laid_over(read_config_file(target, (*_chain, path)), tree)


def _laid_over(base: dict, tree: dict) -> dict:
    """``tree``'s keys over ``base``'s: a section in both is merged key by key, any other value replaces."""
    merged = dict(base)
    for key, value in tree.items():
        both_sections = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = _laid_over(merged[key], value) if both_sections else value
    return merged


def with_overrides(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """``cfg`` with ``key=value`` overrides applied, types checked but not validated (a config being assembled, as
    a named variant does before its algorithm's values, which depend on it)."""
    tree = to_dict(cfg)
    apply_overrides(tree, overrides)
    return build(TrainConfig, tree)


def validate(cfg: TrainConfig) -> None:
    """Every section's own fields (each section's ``validate``, beside them), then the settings that only make sense
    together across sections; each error a ``ConfigError`` named by its key."""
    need = requirement()
    need(cfg.steps >= 1, "steps", "must be >= 1")
    need(cfg.save_every >= 1, "save_every", "must be >= 1")
    need(cfg.save_every_minutes is None or cfg.save_every_minutes > 0, "save_every_minutes", "must be > 0")
    need(cfg.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
    need(cfg.micro_batch_tokens >= 64, "micro_batch_tokens", "must be >= 64")
    need(cfg.verify_timeout > 0, "verify_timeout", "must be > 0 seconds")
    need(cfg.verify_workers >= 1, "verify_workers", "must be >= 1")
    need(0 <= cfg.verify_max_crash_share <= 1, "verify_max_crash_share", "must be in [0, 1]")
    for section in (cfg.model, cfg.warmup, cfg.data, cfg.rollout, cfg.reward, cfg.loss, cfg.optim, cfg.logging):
        section.validate()
    _validate_across(cfg, need)


def _validate_across(cfg: TrainConfig, need) -> None:
    """The rules that tie one section's keys to another's."""
    r, loss = cfg.rollout, cfg.loss
    forced = r.forced_rows()
    need(not (r.group_size == 1 and loss.adv_scale == "std"), "rollout.group_size",
         "1 sample per prompt has no group std to scale by; use loss.adv_scale=none or group_size >= 2")  # fmt: skip
    need(0 <= cfg.reward.overlong_buffer <= r.max_new_tokens, "reward.overlong_buffer",
         f"must be in [0, rollout.max_new_tokens={r.max_new_tokens}] tokens")  # fmt: skip
    need(r.prompts_per_step % loss.mini_batches == 0, "loss.mini_batches",
         f"{loss.mini_batches} mini-batches do not divide rollout.prompts_per_step={r.prompts_per_step}")  # fmt: skip
    # VESPO folds every per-token weight into its sequence's weight (TRL's vespo): a sequence-level correction's
    # weight would count once per token (TRL refuses those modes too), and the mode token's own weights (its fade,
    # the mixture's pi_old / mu) would reweigh the whole response instead of its first token
    need(loss.policy_loss != "vespo" or not rollout_correction(cfg).startswith("sequence"), "loss.policy_loss",
         "vespo takes token-level rollout corrections only, not "
         f"loss.rollout_correction={rollout_correction(cfg)}")  # fmt: skip
    need(loss.policy_loss != "vespo" or sum(forced) == 0, "loss.policy_loss",
         "vespo folds per-token weights into each sequence's weight, and mode-mixed rollouts (rollout.forced_"
         "non_thinking, rollout.forced_thinking) weigh the first token alone: not supported together")  # fmt: skip
    _validate_choice(loss, forced, need)
    need(loss.mode_token_logp != "half" or forced[1] == 0, "loss.mode_token_logp",
         "half with rollout.forced_thinking > 0: log 0.5 as the old log-prob of a sampled thinking token makes its "
         f"ratio 2 pi(y1), past the clip whenever pi(y1) > (1 + loss.clip_high) / 2 = {(1 + loss.clip_high) / 2:.2f}, "
         "so it can only be pushed down; use mixture or policy")  # fmt: skip
    need(loss.mode_token_logp != "mixture" or r.top_p == 1, "loss.mode_token_logp",
         "mixture assumes free samples drawn from the whole distribution; "
         f"rollout.top_p={r.top_p} cuts it (use 1)")  # fmt: skip


def _validate_choice(loss: LossConfig, forced: tuple[int, int], need) -> None:
    """``loss.mode_advantage`` against the mode mix (``forced``: each group's forced direct and thinking rows) and
    the other ``loss.mode_*`` keys."""
    choice = loss.mode_advantage
    need(
        choice not in (*HALF_SPLIT, "centered") or (sum(forced) > 0 and loss.mode_token_logp == "policy"),
        "loss.mode_advantage",
        f"{choice} needs mode-mixed rollouts (rollout.forced_non_thinking or rollout.forced_thinking > 0) and "
        "loss.mode_token_logp=policy: its term is set for the old policy's own log-prob of each first token",
    )
    need(
        choice not in HALF_SPLIT or all(n != 1 for n in forced),
        "loss.mode_advantage",
        f"{choice} splits each group in two halves that must both hold each forced mode: force 0 or at least 2 "
        f"rows of each (rollout.forced_non_thinking and rollout.forced_thinking give {forced[0]} and {forced[1]})",
    )


def rollout_correction(cfg: TrainConfig) -> str:
    """``loss.rollout_correction`` with ``auto`` resolved: samples from vLLM (its own kernels and bf16 numerics), from
    a top-p-truncated distribution or from weights up to ``rollout.max_staleness`` updates old are not exactly the
    loss's, so they are corrected (at staleness this is the decoupled objective: the clip around the trainer's
    weights at the update's start, the behaviour policy in the weight alone); the hf engine at top_p 1 on-policy
    samples from the trained weights themselves."""
    mode = cfg.loss.rollout_correction
    if mode == "auto":
        r = cfg.rollout
        mode = "token-truncate" if r.engine == "vllm" or r.top_p < 1 or r.max_staleness > 0 else "none"
    assert mode in ROLLOUT_CORRECTIONS
    return mode


# keys a resumed run may change: how long, how often it saves, how it verifies, and how the same computation is
# laid out in memory. Every other key changes what the checkpoint's weights, optimizer and data position mean.
SAFE_ON_RESUME = frozenset(
    {
        "steps",
        "save_every",
        "save_every_minutes",
        "keep_checkpoints",
        "verify_timeout",
        "verify_workers",
        "verify_max_crash_share",
        "micro_batch_tokens",
        "loss.skip_zero_advantage",
        "cache_dir",
        "model.attn_implementation",
        "model.gradient_checkpointing",
        "model.liger_kernels",
        "rollout.gpu_memory_utilization",
        "rollout.sleep_between_rollouts",
        "rollout.weight_sync_bucket_mb",
        "rollout.worker_timeout",
        "rollout.weight_transfer",
        "distributed.bucket_size",
        "distributed.balance_ranks",
        # where the run is watched, not what it computes
        "logging.wandb",
        "logging.project",
        "logging.name",
        "logging.group",
        "logging.tags",
        "logging.entity",
    }
)


def changed_keys(old: dict, new: dict) -> list[str]:
    """Dotted keys whose values differ between two configs as plain data (``to_dict``), safe ones left out; a key
    only one of them has differs."""

    def flat(tree: dict, prefix: str = "") -> dict:
        out = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[prefix + key] = value
        return out

    a, b = flat(old), flat(new)
    missing = object()
    return sorted(k for k in a.keys() | b.keys() if a.get(k, missing) != b.get(k, missing) and k not in SAFE_ON_RESUME)


def to_dict(cfg: TrainConfig) -> dict:
    """The resolved config as plain data (tuples as lists), as written to config.yaml."""

    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    return plain(dataclasses.asdict(cfg))


def dump_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(config_yaml(cfg))


def config_yaml(cfg: TrainConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
