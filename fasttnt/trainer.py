"""The GRPO loop. Each step reads as its phases:

    rollout -> verify -> reward -> advantage -> old/ref log-probs -> update -> weight sync -> log (-> checkpoint)

(rollout, verify and reward once per draw: more than one with DAPO's dynamic sampling, fasttnt.dynamic_sampling).

The rewards, advantages, log-probs and loss are the project's kernels; metrics stay on device until one read
per step.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import random
import shutil
import signal
import threading
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from fasttnt_kernels import group_advantages, rollout_correction_weights

from . import distributed
from .checkpoint import (
    TrainerState,
    checkpoint_paths,
    commit_checkpoint,
    list_checkpoints,
    load_training_state,
    read_trainer_state,
    remove_partial,
    save_checkpoint,
    seed_rngs,
    write_trainer_files,
)
from .config import TrainConfig, changed_keys, config_yaml, dump_config, rollout_correction, to_dict
from .data import MATH_INSTRUCTION, DataError, Problem, PromptMode, build_prompt, load_problems, loading_model
from .dynamic_sampling import Draw, choose_groups, concat_draws, select_groups, varied_groups
from .metrics import MARKER_SETS, hack_flags, rollout_metrics, to_floats
from .policy import MicroBatch, PolicyHead, micro_batch_loss, plan_micro_batches, response_logprobs, run_dummy
from .rewards import PackedResponses, compute_rewards
from .rollout import ENGINES, RolloutBatch, decode_responses, select_sequences
from .synthetic import problems as synthetic_problems
from .tiny import warmed_up_model
from .verify import VerifierPool, verify_batch


class VerificationError(RuntimeError):
    """A step's rewards cannot be trusted: too many answers could not be verified."""


class ResumeError(ValueError):
    """A checkpoint that the configured run cannot continue."""


EXIT_PREEMPTED = 3  # the exit code of a run stopped by SIGTERM or SIGINT after saving: resume it


class Preempted(Exception):
    """The run stopped at a signal, after its step and a checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint: Path) -> None:
        super().__init__(f"stopped by {signal_name} after step {step}; checkpoint {checkpoint}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class StopSignals:
    """SIGTERM and SIGINT ask the run to stop after the current step (clusters give a grace period before they
    kill a job: SLURM, Kubernetes); a second SIGINT (a person at the terminal) stops it at once. A repeated SIGTERM
    changes nothing: under a launcher the ranks get it twice, from the scheduler and from the launcher. The
    handlers are installed for the duration of ``run`` (main thread only) and the previous ones put back after."""

    def __init__(self) -> None:
        self.requested: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: now
                self.__exit__()
                raise KeyboardInterrupt("SIGINT again: stopping at once")
            return
        self.requested = name
        tqdm.write(f"{name}: stopping after this step, with a checkpoint (Ctrl-C again to stop at once)")


class ProblemStream:
    """Training problems in a reproducible order; its position is saved with every checkpoint."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.position = 0
        self._order: tuple[int, list[int]] | None = None  # (epoch, permutation) of the current epoch
        if cfg.data.train == "synthetic":
            self._items = None
            self._stream = synthetic_problems("train", levels=cfg.data.levels, seed=cfg.seed)
        else:
            d = cfg.data
            self._items = load_problems(
                str(Path(d.train).expanduser()), problem_field=d.problem_field, answer_field=d.answer_field
            )

    def drop_long_prompts(self, prompt_tokens) -> int:
        """Remove problems whose prompt is longer than ``data.max_prompt_tokens``; returns how many."""
        if self._items is None:
            return 0
        keep = [p for p in self._items if prompt_tokens(p) <= self.cfg.data.max_prompt_tokens]
        if not keep:
            raise DataError(f"{self.cfg.data.train}: every prompt is longer than data.max_prompt_tokens")
        dropped, self._items = len(self._items) - len(keep), keep
        return dropped

    def take(self, n: int) -> list[Problem]:
        if self._items is None:
            out = [Problem(p.problem, p.answer, p.level) for p in itertools.islice(self._stream, n)]
        else:  # epochs over the set, each in its own seeded order
            out = []
            for pos in range(self.position, self.position + n):
                epoch, i = divmod(pos, len(self._items))
                if self._order is None or self._order[0] != epoch:
                    order = list(range(len(self._items)))
                    random.Random(f"{self.cfg.seed}-{epoch}").shuffle(order)
                    self._order = (epoch, order)
                out.append(self._items[self._order[1][i]])
        self.position += n
        return out

    def seek(self, position: int) -> None:
        if self._items is None:
            self._stream = synthetic_problems("train", levels=self.cfg.data.levels, seed=self.cfg.seed)
            for _ in itertools.islice(self._stream, position):
                pass
        self.position = position


def _lr_lambda(cfg: TrainConfig):
    """The learning-rate factor of a step: linear warm-up, then constant, cosine or linear decay."""
    o = cfg.optim

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        if o.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - o.warmup_steps) / max(1, cfg.steps - o.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * decay

    return factor


class Trainer:
    def __init__(
        self,
        cfg: TrainConfig,
        output_dir: Path,
        *,
        resume: bool = False,
        new_config_ok: bool = False,
        progress: bool = True,
    ) -> None:
        """``progress``: show the step bar (off where several runs share one terminal, ``fasttnt compare --jobs``)."""
        self.cfg = cfg
        self.progress = progress
        self.out = Path(output_dir)
        self.ckpt_root = self.out / "checkpoints"
        device_type = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        self.dist = distributed.init(device_type) if distributed.launched_distributed() else None
        self.rank, self.world = (self.dist.rank, self.dist.world) if self.dist else (0, 1)
        self.is_main = self.rank == 0
        self.device = self.dist.device if self.dist else torch.device(device_type)
        self.autocast = self.device.type == "cuda" and cfg.model.dtype == "auto"
        r = cfg.rollout
        if r.prompts_per_step % (self.world * cfg.loss.mini_batches):
            raise ValueError(
                f"rollout.prompts_per_step={r.prompts_per_step} must divide into {self.world} ranks x "
                f"loss.mini_batches={cfg.loss.mini_batches}"
            )
        self.prompts_per_rank = r.prompts_per_step // self.world
        existing = list_checkpoints(self.ckpt_root)
        if existing and not resume:
            raise FileExistsError(
                f"{self.out} holds checkpoints of an earlier run ({existing[-1].name}): pass --resume to continue "
                "it, or choose another --output-dir"
            )
        self.stream = ProblemStream(cfg)  # the data is read and checked before any model is loaded
        resume_from = existing[-1] if resume and existing else None
        if resume_from is not None:
            _check_resume(cfg, resume_from, self.world, new_config_ok=new_config_ok)
        if self.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            remove_partial(self.ckpt_root)
            if resume and resume_from is None:
                tqdm.write(f"--resume: no checkpoint under {self.ckpt_root}; starting from step 0")
            dump_config(cfg, self.out / "config.yaml")

        # rank 0 first: the tiny model's warm-up cache must be written once, then read by the others
        if not self.is_main:
            distributed.barrier()
        self.model, self.tokenizer, self.model_path = self._load_model(resume_from)
        if self.is_main and self.dist:
            distributed.barrier()
        self.model.to(self.device)
        self.model.zero_grad(set_to_none=True)  # whatever made the model (a warm-up) leaves no gradient behind
        if cfg.model.gradient_checkpointing:
            # transformers 5 renamed it; 4.x has only the old name
            getattr(self.model, "activation_checkpointing_enable", self.model.gradient_checkpointing_enable)()
        self.ref_model = None
        if cfg.loss.kl_coef > 0:  # the starting policy, also when resuming
            self.ref_model = self._from_pretrained(self.model_path)
            self.ref_model.to(self.device).eval().requires_grad_(False)
        self.think_end_id = self.tokenizer.convert_tokens_to_ids("</think>")
        if self.think_end_id is None or self.think_end_id == self.tokenizer.unk_token_id:
            raise ValueError(f"{cfg.model.name}: the tokenizer has no single </think> token")

        o = cfg.optim
        self.head = PolicyHead(self.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=True
        )  # fused: one kernel for all parameters, on the CPU as on CUDA
        self.lr_factor = _lr_lambda(cfg)
        self.ds_engine = None
        if self.dist:
            import deepspeed

            self.ds_engine, self.optimizer, _, _ = deepspeed.initialize(
                model=self.head, optimizer=self.optimizer, config=distributed.deepspeed_config(cfg, self.world)
            )
            if cfg.distributed.zero_stage == 3:  # the fused op reads the lm_head weight outside its module
                deepspeed.zero.register_external_parameter(self.head, self.model.get_output_embeddings().weight)
        # the engine before any RNG state is set: vLLM reseeds Python's, NumPy's and torch's RNGs when it starts. It
        # generates from the trainer's current weights (a resumed run's included): the vllm engine pushes them
        # before its first rollout
        self.engine = ENGINES.get(r.engine)(
            self.model,
            self.tokenizer,
            model_path=str(self.model_path),
            max_new_tokens=r.max_new_tokens,
            temperature=r.temperature,
            top_p=r.top_p,
            gpu_memory_utilization=r.gpu_memory_utilization,
            sleep_between_rollouts=r.sleep_between_rollouts,
            weight_sync_bucket_mb=r.weight_sync_bucket_mb,
            max_model_len=cfg.data.max_prompt_tokens + r.max_new_tokens,
            seed=cfg.seed,
            dtype="bfloat16" if self.autocast else "float32",
            device=self.device,
            trust_remote_code=cfg.model.trust_remote_code,
        )
        self.correction = rollout_correction(cfg)
        self.state = TrainerState(step=0, data_position=0, world=self.world)
        if resume_from is not None:
            if self.ds_engine is not None:
                if not (resume_from / "deepspeed").is_dir():
                    raise FileExistsError(
                        f"{resume_from} was written by a single-process run: resume it the same way (no launcher)"
                    )
                self.ds_engine.load_checkpoint(str(resume_from), tag="deepspeed")
            self.state = load_training_state(resume_from, None if self.ds_engine else self.optimizer, rank=self.rank)
            self.stream.seek(self.state.data_position)
        else:
            seed_rngs(cfg.seed)
        if self.is_main:
            self._truncate_metrics(self.state.step)

        train = cfg.data.train
        self.instruction = cfg.data.instruction
        if self.instruction is None:
            self.instruction = "" if train == "synthetic" else MATH_INSTRUCTION
        dropped = self.stream.drop_long_prompts(
            lambda p: len(self.tokenizer(self._prompt(p).text, add_special_tokens=False)["input_ids"])
        )
        if dropped:
            tqdm.write(f"data.train: {dropped} problems dropped, their prompts exceed data.max_prompt_tokens")
        markers = cfg.data.hack_markers
        if markers == "auto":
            markers = "synthetic" if train == "synthetic" else "math"
        self.markers = MARKER_SETS[markers]
        self.verifier = VerifierPool(cfg.verify_workers, cfg.verify_timeout)
        self.tb = self._tensorboard() if self.is_main else None
        self._warned_cap = False

    # -- set-up ---------------------------------------------------------------------------------------------------

    def _load_model(self, resume_from: Path | None):
        m = self.cfg.model
        if m.name == "tiny":

            def bar(total):
                return _bar_callback(tqdm(total=total, desc="warm-up (cached after the first run)", unit="step"))

            model, tokenizer, path = warmed_up_model(
                Path(self.cfg.cache_dir).expanduser(), m.tiny, self.cfg.warmup, progress_factory=bar
            )
        else:
            with loading_model(f"model.name={m.name}"):
                tokenizer = AutoTokenizer.from_pretrained(m.name, trust_remote_code=m.trust_remote_code)
                path = m.name
                model = self._from_pretrained(path)
        if resume_from is not None and not distributed.launched_distributed():
            _load_weights(model, resume_from)  # the checkpoint's weights into the model as configured
        if self.is_main:
            tokenizer.save_pretrained(self.out / "tokenizer")
        return model, tokenizer, path

    def _from_pretrained(self, path):
        """A model as configured: float32 master weights, the attention kernel, Liger on CUDA."""
        m = self.cfg.model
        attn = m.attn_implementation
        if attn == "auto":
            attn = "flash_attention_2" if self.device.type == "cuda" and _has_flash_attn() else "sdpa"
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn, trust_remote_code=m.trust_remote_code
        )
        if self.device.type == "cuda" and m.liger_kernels:
            _apply_liger(model)
        return model

    def _tensorboard(self):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is optional: JSONL is always written
            return None
        return SummaryWriter(self.out / "tensorboard")

    def _truncate_metrics(self, step: int) -> None:
        """A resumed run rewrites history from its checkpoint on: drop the lines of steps after it."""
        path = self.out / "metrics.jsonl"
        if not path.exists():
            return
        kept = [json.dumps(row) for row in _read_jsonl(path) if row["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))

    # -- one step, phase by phase -----------------------------------------------------------------------------

    def step(self) -> dict[str, float]:
        cfg, r = self.cfg, self.cfg.rollout
        step = self.state.step + 1
        times: dict[str, float] = {}
        clock = time.perf_counter()

        def lap(name: str) -> None:  # a phase that runs once per draw adds up over the draws
            nonlocal clock
            now = time.perf_counter()
            times[f"time_{name}"] = times.get(f"time_{name}", 0.0) + now - clock
            clock = now

        lr = cfg.optim.lr * self.lr_factor(self.state.step)  # the rate this step's update uses
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        # rollout -> verify -> reward, once per draw of prompts_per_step prompts; with dynamic sampling, more draws
        # until the step has prompts_per_step groups whose rewards differ (or the cap)
        draws = [self._draw(step, 0, lap)]
        varied = varied_groups(draws[0].rewards.rewards, r.group_size).tolist()  # sync: one read per draw
        while r.dynamic_sampling and len(draws) < r.max_draws and self._short_of_groups(sum(varied)):
            draws.append(self._draw(step, len(draws), lap))
            varied += varied_groups(draws[-1].rewards.rewards, r.group_size).tolist()
        if r.dynamic_sampling:
            self.engine.rest()  # the rollout memory back for the update
        drawn = concat_draws(draws)  # every response drawn: what the step's metrics describe
        trained, filled = drawn, 0
        if r.dynamic_sampling:
            groups, filled = choose_groups(varied, self.prompts_per_rank)
            trained = select_groups(drawn, groups)
        batch, rewards = trained.batch, trained.rewards
        advantages = group_advantages(rewards.rewards, r.group_size, scale=cfg.loss.adv_scale, eps=cfg.loss.adv_eps)
        lap("reward")

        # old and reference log-probs
        old_logp = ref_logp = None
        # off-policy after the first optimizer step, or importance-weighted against the engine's log-probs (which
        # the weights need before the fused loss forms its gradient; TRL computes them likewise for its vLLM
        # correction, grpo_trainer.py, trl 1.16)
        corrected = self.correction != "none" and batch.rollout_logp is not None
        if cfg.loss.ppo_epochs > 1 or cfg.loss.mini_batches > 1 or corrected:
            old_logp = self._logprobs(self._policy(), batch, zero3_collectives=self._zero3())
        if self.ref_model is not None:  # a plain module on every rank: no collectives
            ref_logp = self._logprobs(self.ref_model, batch, zero3_collectives=False)
        lap("logprobs")

        # update
        update = self._update(batch, advantages, old_logp, ref_logp)
        lap("update")

        # weight sync (the vllm engine gathers ZeRO-3 shards bucket by bucket itself)
        self.engine.sync_weights(self.model)
        lap("sync")

        # log: every metric over all ranks' responses, so N ranks log what one process would
        per_response = {
            "correct": drawn.correct,
            "non_thinking": drawn.rewards.non_thinking,
            "lengths": drawn.batch.lengths,
            "hacked": drawn.hacked,
            "truncated": drawn.batch.truncated,
            "limit": drawn.rewards.limit,
            "rewards": drawn.rewards.rewards,
        }
        if self.dist:
            per_response = {k: distributed.all_gather_cat(v) for k, v in per_response.items()}
        metrics = rollout_metrics(**per_response)
        metrics.update(update)
        counts = torch.tensor(
            [
                drawn.batch.response_ids.numel(),
                batch.response_ids.numel(),
                sum(len(p) for p in batch.prompt_ids),
                drawn.timeouts,
                drawn.crashes,
                sum(varied),
                len(varied),
                filled,
            ],
            dtype=torch.float64,
            device=self.device,
        )
        metrics["_counts"] = self._sum(counts)
        values = to_floats({k: v for k, v in metrics.items() if k != "_counts"})  # sync: one read per step
        for name in TOKEN_METRICS:  # measured on no token (every sequence skipped): not written, rather than NaN
            if name in values and not math.isfinite(values[name]):
                del values[name]
        drawn_tokens, n_tokens, prompt_tokens, timeouts, crashes, n_varied, n_groups, n_filled = metrics[
            "_counts"
        ].tolist()
        values.update(times)
        values.update(
            step=step,
            lr=lr,
            verify_timeouts=int(timeouts),
            verify_crashes=int(crashes),
            generated_tokens_per_s=drawn_tokens / max(times["time_generate"], 1e-9),
            trained_tokens_per_s=(n_tokens + prompt_tokens) * cfg.loss.ppo_epochs / max(times["time_update"], 1e-9),
            time_step=sum(times.values()),
        )
        if r.dynamic_sampling:
            values.update(
                draws=len(draws),
                varied_group_frac=n_varied / n_groups,  # of the groups drawn, those whose rewards differ
                kept_group_frac=(r.prompts_per_step - n_filled) / n_groups,  # of the groups drawn, those trained on
                filled_groups=int(n_filled),
            )
            if n_filled and not self._warned_cap and self.is_main:
                self._warned_cap = True
                tqdm.write(
                    f"step {step}: after rollout.max_draws={r.max_draws} draws, {int(n_filled)} of the step's "
                    f"{r.prompts_per_step} groups are equal-reward fills (zero advantage, no policy-gradient term); "
                    "logged per step as filled_groups"
                )
        self.state = TrainerState(step=step, data_position=self.stream.position, world=self.world)
        return values

    def _draw(self, step: int, draw: int, lap) -> Draw:
        """Draw ``draw`` of a step: the next prompts_per_step prompts, this rank's share generated (seeded per
        response; draw 0's seeds are those of a step without dynamic sampling), verified and rewarded."""
        cfg, r = self.cfg, self.cfg.rollout
        problems = self.stream.take(r.prompts_per_step)  # every rank draws the step's prompts, generates its share
        problems = problems[self.rank * self.prompts_per_rank : (self.rank + 1) * self.prompts_per_rank]
        prompts = [self._prompt(p) for p in problems]
        with self._generation_context():
            batch = self.engine.generate(
                prompts,
                r.group_size,
                seed=cfg.seed * 1_000_003 + step,
                first_row=(draw * r.prompts_per_step + self.rank * self.prompts_per_rank) * r.group_size,
                keep_awake=r.dynamic_sampling,  # more draws may follow: one weight push per step, not per draw
            )
        texts = decode_responses(self.tokenizer, batch.responses)
        lap("generate")

        # verify: a truncated response is wrong whatever it says
        golds = [p.answer for p in problems for _ in range(r.group_size)]
        verdicts = verify_batch(texts, golds, pool=self.verifier, require_think_end=True)
        if verdicts.crashes >= 2 and verdicts.crashes > cfg.verify_max_crash_share * len(texts):
            # a crashed item counts as wrong: past a few, the rewards would be the verifier's, not the model's
            raise VerificationError(
                f"step {step}: the verification of {verdicts.crashes} of {len(texts)} answers crashed (its workers "
                f"died; more than one and above verify_max_crash_share={cfg.verify_max_crash_share}); not training "
                "on those rewards. "
                "Out of memory is the usual cause: lower verify_workers"
            )
        correct = torch.tensor(list(verdicts), device=self.device) & ~batch.truncated
        lap("verify")

        # reward: all K samples of a prompt are on this rank, so it is local
        packed = PackedResponses(batch.response_ids, batch.cu_seqlens, batch.truncated, r.group_size)
        rewards = compute_rewards(packed, correct, self.think_end_id, cfg.reward, max_new_tokens=r.max_new_tokens)
        non_thinking = rewards.non_thinking.tolist()  # sync: the hack flags need the text, on the host
        hacked = torch.tensor(hack_flags(texts, non_thinking, self.markers), device=self.device)
        lap("reward")
        return Draw(batch, correct, rewards, hacked, verdicts.timeouts, verdicts.crashes)

    def _short_of_groups(self, varied: int) -> bool:
        """Whether this rank, or any other, has fewer than its share of groups with differing rewards (every rank
        then draws again, so the ranks stay in step)."""
        short = float(varied < self.prompts_per_rank)
        if self.dist:
            short = distributed.all_max_tensor(torch.tensor([short], device=self.device)).item()  # sync: one read
        return short > 0

    def _sum(self, t: torch.Tensor) -> torch.Tensor:
        return distributed.all_sum(t) if self.dist else t

    def _policy(self):
        """The policy's log-prob module: DeepSpeed's engine when distributed (its forward drives ZeRO)."""
        return self.ds_engine if self.ds_engine is not None else self.head

    def _zero3(self) -> bool:
        return self.ds_engine is not None and self.cfg.distributed.zero_stage == 3

    def _full_parameters(self):
        """Under ZeRO-3, every parameter gathered for saving (the whole model on each rank while it lasts)."""
        if self._zero3():
            import deepspeed

            return deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None)
        return contextlib.nullcontext()

    def _generation_context(self):
        """Under ZeRO-3 with the hf engine, the whole model without ZeRO's hooks (see zero3_full_model); the
        vllm engine generates from its own copy and needs nothing."""
        if self._zero3() and self.cfg.rollout.engine == "hf":
            return distributed.zero3_full_model(self.ds_engine, self.model)
        return contextlib.nullcontext()

    def _prompt(self, problem: Problem):
        return build_prompt(self.tokenizer, problem.problem, PromptMode.FREE, instruction=self.instruction)

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast)

    def _logprobs(self, model, batch: RolloutBatch, *, zero3_collectives: bool) -> torch.Tensor:
        """Log-probs (N,) of the batch under ``model`` (the policy, ``_policy()``, or the reference model), without
        gradients, in micro-batches of ``micro_batch_tokens``. ``zero3_collectives``: the forwards gather
        parameters collectively, so every rank runs as many (the ones with fewer pad with dummy forwards)."""
        plan = plan_micro_batches(batch, self.cfg.micro_batch_tokens)
        pad_to = self._max_over_ranks(len(plan)) if zero3_collectives else 0
        with torch.no_grad(), self._autocast():
            logp, _ = response_logprobs(model, batch, plan, temperature=self.cfg.rollout.temperature, pad_to=pad_to)
        return logp

    def _max_over_ranks(self, n: int) -> int:
        return distributed.all_max(n, self.device) if self.dist else n  # sync: one read

    def _update(self, batch: RolloutBatch, advantages, old_logp, ref_logp) -> dict[str, torch.Tensor]:
        """``ppo_epochs`` passes over the batch, each ``mini_batches`` optimizer steps. Loss, grad norm and counts
        are means over the optimizer steps; the token metrics (``TOKEN_METRICS``) are means over every token they
        were measured on, NaN where that is none (every sequence skipped)."""
        loss_cfg = self.cfg.loss
        k = batch.group_size
        per_mb = batch.lengths.numel() // k // loss_cfg.mini_batches  # prompts per mini-batch
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        token_sums = torch.zeros(len(TOKEN_METRICS) + 2, device=self.device)
        count = 0
        for _epoch in range(loss_cfg.ppo_epochs):
            for mb in range(loss_cfg.mini_batches):
                part = _select_groups(batch, mb * per_mb, (mb + 1) * per_mb)
                lo, hi = batch.bounds[mb * per_mb * k], batch.bounds[(mb + 1) * per_mb * k]
                seqs = slice(mb * per_mb * k, (mb + 1) * per_mb * k)
                metrics, step_sums = self._optimizer_step(
                    part,
                    advantages[seqs],
                    old_logp[lo:hi] if old_logp is not None else None,
                    ref_logp[lo:hi] if ref_logp is not None else None,
                )
                token_sums += step_sums
                for name, value in metrics.items():
                    sums[name] = sums.get(name, 0) + value
                count += 1
        means = {name: value / count for name, value in sums.items()}
        trained, rollout_counted = token_sums[-2], token_sums[-1]
        for j, name in enumerate(TOKEN_METRICS):
            means[name] = token_sums[j] / (rollout_counted if name in _ROLLOUT_METRICS else trained)
        if batch.rollout_logp is None:  # an engine that does not say what it sampled with
            for name in _ROLLOUT_METRICS:
                means.pop(name)
        return means

    def _optimizer_step(self, part: RolloutBatch, advantages, old_logp, ref_logp):
        """One optimizer step on a mini-batch, its forward and backward in micro-batches of at most
        ``micro_batch_tokens``, gradients accumulated. The loss's normalisers are the whole mini-batch's over all
        ranks, so the micro-batches' (and ranks') losses add up to the mini-batch's loss and the accumulated
        gradient is the one-forward gradient. Sequences that cannot move the weights are left out first
        (``_drop_zero_advantage``); the normalisers still count them. Under DeepSpeed every rank runs as many
        micro-batches (dummy ones with a zero loss pad the ranks that have fewer), since each backward reduces
        gradients collectively. Returns the step's metrics and the sums (over ranks) of ``TOKEN_METRICS`` followed
        by the tokens trained on and the tokens the rollout diagnostics cover."""
        local = torch.tensor([float(part.bounds[-1]), float(part.lengths.numel())], device=self.device)
        n_tokens, n_seqs = self._sum(local).tolist()  # sync: one read per mini-batch
        sums = torch.zeros(len(_STEP_SUMS), dtype=torch.float32, device=self.device)
        # the rollout correction over the whole mini-batch when the old log-probs are known; else (on-policy, no
        # correction) its diagnostics come from each micro-batch's log-probs, of the sequences trained on
        weights, rollout_tokens = None, None  # tokens the diagnostics cover: all of them here, else those trained on
        if part.rollout_logp is not None and old_logp is None and self.correction != "none":
            raise ValueError("the rollout correction needs the old log-probs (step() computes them first)")
        if part.rollout_logp is not None and old_logp is not None:
            weights, correction = rollout_correction_weights(
                old_logp,
                part.rollout_logp,
                part.cu_seqlens,
                mode=self.correction,
                cap=self.cfg.loss.rollout_correction_cap,
            )
            rollout_tokens = float(part.bounds[-1])
            sums[_ROLLOUT_SUMS] = torch.stack([correction[name] for name in _ROLLOUT_METRICS]) * rollout_tokens
        per_token = (old_logp, ref_logp, weights)
        part, advantages, per_token, skipped = self._drop_zero_advantage(part, advantages, per_token)
        plan = plan_micro_batches(part, self.cfg.micro_batch_tokens)
        n_micro = self._max_over_ranks(len(plan)) if self.ds_engine is not None else len(plan)
        # at least one backward, so a step with every sequence skipped still steps on (zero) gradients, as the
        # unskipped update would
        n_micro = max(n_micro, 1)
        if self.ds_engine is None:
            self.optimizer.zero_grad(set_to_none=True)
        for i in range(n_micro):
            if self.ds_engine is not None:
                self.ds_engine.set_gradient_accumulation_boundary(i == n_micro - 1)
            if i < len(plan):
                total, micro_sums = self._micro_batch_loss(
                    part, plan[i], advantages, *per_token, n_tokens=n_tokens, n_seqs=n_seqs
                )
                sums += micro_sums
            else:
                with self._autocast():
                    loss, _, _ = run_dummy(
                        self._policy(), self.device, temperature=self.cfg.rollout.temperature, with_loss=True
                    )
                total = loss * 0.0  # the collectives of a forward and backward, no gradient
            if self.ds_engine is not None:
                # DeepSpeed averages gradients over ranks; each rank's loss is its part of a global sum
                self.ds_engine.backward(total * self.world)
            else:
                total.backward()
        if self.ds_engine is not None:
            self.ds_engine.step()
            grad_norm = torch.tensor(float(self.ds_engine.get_global_grad_norm() or 0.0))
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.grad_clip)
            self.optimizer.step()
        trained_tokens = float(part.bounds[-1])
        if rollout_tokens is None:
            rollout_tokens = trained_tokens
        # micro-batches run (dummy ones not counted), sequences skipped, tokens trained on, tokens of the rollout
        # diagnostics: one sum over the ranks
        counts = sums.new_tensor([len(plan), skipped, trained_tokens, rollout_tokens])
        totals = self._sum(torch.cat([sums, counts]))
        metrics = {
            "loss": totals[0],
            "grad_norm": grad_norm.to(totals.device).float(),
            "micro_batches": totals[len(_STEP_SUMS)],
            "skipped_seq_frac": totals[len(_STEP_SUMS) + 1] / max(n_seqs, 1.0),
        }
        return metrics, torch.cat([totals[1 : len(_STEP_SUMS)], totals[-2:]])  # TOKEN_METRICS' sums and counts

    def _drop_zero_advantage(self, part: RolloutBatch, advantages, per_token: tuple):
        """``part`` without its sequences whose advantage is exactly 0, the advantages and per-token tensors
        (None or (N,) each) to match, and how many were dropped. Such a sequence's policy-gradient term is
        -ratio * 0 = 0 for every token, whatever the ratio, clip, dual clip or importance weight, so it adds nothing
        to the gradient unless the entropy bonus or the KL term is on (with TNT, a solved prompt's K responses all
        score alike)."""
        loss_cfg = self.cfg.loss
        kl_on = self.ref_model is not None and loss_cfg.kl_coef > 0
        if not loss_cfg.skip_zero_advantage or loss_cfg.entropy_coef > 0 or kl_on:
            return part, advantages, per_token, 0
        keep = [i for i, a in enumerate(advantages.tolist()) if a != 0.0]  # sync: one read per mini-batch
        skipped = advantages.numel() - len(keep)
        if skipped == 0:
            return part, advantages, per_token, 0
        kept, index = select_sequences(part, keep)
        keep_t = torch.tensor(keep, dtype=torch.long, device=advantages.device)
        return kept, advantages[keep_t], tuple(t[index] if t is not None else None for t in per_token), skipped

    def _micro_batch_loss(
        self, part: RolloutBatch, mb: MicroBatch, advantages, old_logp, ref_logp, weights, *, n_tokens, n_seqs
    ):
        """The loss of one micro-batch as its share of the mini-batch's (``linear_policy_loss``, the gradient formed
        in its forward), and its token sums (``_STEP_SUMS``; the rollout diagnostics only when on-policy)."""
        loss_cfg = self.cfg.loss
        lo, hi = part.bounds[mb.first], part.bounds[mb.last]
        cu = part.cu_seqlens[mb.first : mb.last + 1] - lo  # (s+1,)
        loss_args = dict(
            old_logp=old_logp[lo:hi] if old_logp is not None else None,  # None: one pass over the batch, on-policy
            advantages=advantages[mb.first : mb.last],
            cu_seqlens=cu,
            entropy_coef=loss_cfg.entropy_coef,
            clip_low=loss_cfg.clip_low,
            clip_high=loss_cfg.clip_high,
            dual_clip=loss_cfg.dual_clip,
            ref_logp=ref_logp[lo:hi] if ref_logp is not None else None,
            kl_coef=loss_cfg.kl_coef,
            is_weights=weights[lo:hi] if weights is not None else None,
            agg=loss_cfg.agg,
            norm_length=loss_cfg.norm_length,
            total_tokens=n_tokens,
            total_seqs=n_seqs,
        )
        with self._autocast():
            loss, stats, logp = micro_batch_loss(
                self._policy(), part, mb, temperature=self.cfg.rollout.temperature, loss=loss_args
            )
        n = float(hi - lo)
        rollout = torch.zeros(3, device=loss.device)
        if part.rollout_logp is not None and old_logp is None:  # on-policy: the mismatch against these log-probs
            _, correction = rollout_correction_weights(
                logp, part.rollout_logp[lo:hi], cu, mode="none", cap=loss_cfg.rollout_correction_cap
            )
            rollout = torch.stack([correction[name] for name in _ROLLOUT_METRICS]) * n
        token_means = torch.stack(
            [stats["entropy"], stats["clip_frac_low"] + stats["clip_frac_high"], stats["approx_kl"], stats["kl_ref"]]
        )
        # the logged loss is the policy loss alone, without the entropy bonus the fused op adds (as before the fusion)
        policy_loss = loss.detach() + loss_cfg.entropy_coef * stats["entropy"] * n / max(n_tokens, 1.0)
        return loss, torch.cat([policy_loss[None], token_means * n, rollout]).float()

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Train to ``steps``; raises ``Preempted`` when a signal stopped the run (after a checkpoint)."""
        cfg = self.cfg
        history = self._read_history() if self.is_main else []
        bar = tqdm(
            total=cfg.steps,
            initial=self.state.step,
            desc="GRPO",
            unit="step",
            disable=not (self.is_main and self.progress),
        )
        log = (self.out / "metrics.jsonl").open("a") if self.is_main else None
        last_save = time.monotonic()
        try:
            with StopSignals() as signals:
                while self.state.step < cfg.steps:
                    values = self.step()
                    history.append(values)
                    if log is not None:
                        log.write(json.dumps(values) + "\n")
                        log.flush()
                    if self.tb is not None:
                        for name, value in values.items():
                            self.tb.add_scalar(name, value, values["step"])
                    bar.set_postfix(
                        reward=f"{values['reward']:.2f}",
                        acc=f"{values['acc']:.2f}",
                        len=f"{values['len']:.0f}",
                        nt=f"{values['non_thinking_ratio']:.2f}",
                        hack=f"{values['hack_rate']:.2f}",
                    )
                    bar.update(1)
                    step = self.state.step
                    minutes = cfg.save_every_minutes
                    timed = minutes is not None and time.monotonic() - last_save >= 60 * minutes
                    stop, timed = self._agree(signals.requested is not None, timed)
                    if step % cfg.save_every == 0 or step == cfg.steps or timed or stop:
                        self._save_checkpoint()
                        last_save = time.monotonic()
                    if stop and step < cfg.steps:  # a signal during the last step: finish normally
                        self._close_outputs()
                        raise Preempted(signals.requested or "a signal on another rank", step, self._checkpoint(step))
        finally:
            bar.close()
            if log is not None:
                log.close()
            self.verifier.close()
        self._finish(history)
        return history

    def _agree(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag true on any rank, so all ranks stop and save at the same step (one collective a step)."""
        if not self.dist:
            return flags
        t = distributed.all_max_tensor(torch.tensor([float(f) for f in flags], device=self.device))
        return tuple(bool(x) for x in t.tolist())  # sync: one read per step

    def _checkpoint(self, step: int) -> Path:
        return checkpoint_paths(self.ckpt_root, step)[0]

    def _save_checkpoint(self) -> None:
        keep = self.cfg.keep_checkpoints
        text = config_yaml(self.cfg)
        if self.ds_engine is None:
            save_checkpoint(self.ckpt_root, self.state, self.model, self.optimizer, keep=keep, config_yaml=text)
            return
        # distributed: every rank writes its optimizer shard and RNG state into the temporary folder, rank 0 the
        # Hugging Face weights; once all are done rank 0 renames it into place
        final, tmp = checkpoint_paths(self.ckpt_root, self.state.step)
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        distributed.barrier()
        self.ds_engine.save_checkpoint(str(tmp), tag="deepspeed")
        with self._full_parameters():
            if self.is_main:
                self.model.save_pretrained(tmp, safe_serialization=True)
        write_trainer_files(tmp, self.state, rank=self.rank, config_yaml=text)
        distributed.barrier()
        if self.is_main:
            commit_checkpoint(self.ckpt_root, tmp, final, keep=keep)
        distributed.barrier()

    def _read_history(self) -> list[dict[str, float]]:
        path = self.out / "metrics.jsonl"
        return _read_jsonl(path) if path.exists() else []

    def _finish(self, history: list[dict[str, float]]) -> None:
        from .plots import plot_curves

        with self._full_parameters():
            if self.is_main:
                final = self.out / "final"
                tmp = self.out / "final.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                self.model.save_pretrained(tmp, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
                shutil.rmtree(final, ignore_errors=True)
                tmp.rename(final)
        if self.is_main and history:
            plot_curves(history, self.out / "curves.png")
        self._close_outputs()

    def _close_outputs(self) -> None:
        """The engine's memory and TensorBoard's buffered events (a launcher's rank ends without interpreter
        teardown, which would otherwise lose them)."""
        self.engine.close()
        if self.tb is not None:
            self.tb.close()


def _check_resume(cfg: TrainConfig, checkpoint: Path, world: int, *, new_config_ok: bool) -> None:
    """Refuse to continue a checkpoint under a config that changes what it means (the model, the group size, the
    reward, ...) or with another number of ranks, naming what differs; keys in ``SAFE_ON_RESUME`` may change."""
    import yaml

    saved = checkpoint / "config.yaml"
    if not saved.is_file():  # written by an earlier version: the run's own copy, from before this start
        saved = checkpoint.parent.parent / "config.yaml"
    differ = changed_keys(yaml.safe_load(saved.read_text()) or {}, to_dict(cfg)) if saved.is_file() else []
    if differ and not new_config_ok:
        shown = ", ".join(differ[:6]) + (f" and {len(differ) - 6} more" if len(differ) > 6 else "")
        raise ResumeError(
            f"--resume: the config differs from {checkpoint.name}'s in {shown}; resume with the same config, or "
            "pass --resume-with-new-config to continue under the new one"
        )
    ranks = read_trainer_state(checkpoint).world
    if ranks != world:
        raise ResumeError(
            f"--resume: {checkpoint.name} was written by {ranks} rank(s) and this run has {world}: resume it with "
            f"{ranks} (each rank restores its own optimizer shard)"
        )


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a metrics file; a line torn by a kill mid-write (always the last) is dropped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _load_weights(model, folder: Path) -> None:
    """Load a checkpoint's safetensors (one file or shards) into a model built with the same architecture."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        state.update(load_file(file))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {name for name in missing if "lm_head" in name and model.config.tie_word_embeddings}
    if set(missing) - tied or unexpected:
        raise ValueError(f"{folder}: weights do not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})")
    model.tie_weights()


# what a mini-batch's micro-batches add up: the loss, then token sums that become token means
_STEP_SUMS = (
    "loss",
    "entropy",
    "clip_frac",
    "kl",
    "kl_ref",
    "rollout_logp_diff",
    "rollout_is_mean",
    "rollout_is_clipped_frac",
)
_ROLLOUT_SUMS = slice(5, 8)  # the rollout correction's diagnostics among _STEP_SUMS
TOKEN_METRICS = _STEP_SUMS[1:]
"""Metrics that are means over the tokens the update ran on: absent from a step whose every sequence was skipped."""
_ROLLOUT_METRICS = _STEP_SUMS[_ROLLOUT_SUMS]


def _select_groups(batch: RolloutBatch, first: int, last: int) -> RolloutBatch:
    """Prompts ``first..last-1`` of a batch (all K samples of each), repacked from 0."""
    k = batch.group_size
    a, b = first * k, last * k
    lo, hi = batch.bounds[a], batch.bounds[b]
    part = RolloutBatch(
        batch.prompt_ids[a:b],
        batch.response_ids[lo:hi],
        batch.cu_seqlens[a : b + 1] - lo,
        batch.truncated[a:b],
        k,
        rollout_logp=batch.rollout_logp[lo:hi] if batch.rollout_logp is not None else None,
    )
    part.responses = batch.responses[a:b]  # already on the host: no second read from the device
    part.bounds = [x - lo for x in batch.bounds[a : b + 1]]
    return part


def _bar_callback(bar):
    def update(loss: float) -> None:
        bar.set_postfix(loss=f"{loss:.3f}")
        bar.update(1)
        if bar.n >= bar.total:
            bar.close()

    return update


def _has_flash_attn() -> bool:
    import importlib.util

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
