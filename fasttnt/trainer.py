"""The GRPO loop. Each step reads as its phases:

    rollout -> verify -> reward -> advantage -> old/ref log-probs -> update -> weight sync -> log (-> checkpoint)

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
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from fasttnt_kernels import clipped_policy_loss, group_advantages

from . import distributed
from .checkpoint import (
    TrainerState,
    checkpoint_paths,
    commit_checkpoint,
    list_checkpoints,
    load_training_state,
    remove_partial,
    save_checkpoint,
    write_trainer_files,
)
from .config import TrainConfig, dump_config
from .data import MATH_INSTRUCTION, DataError, Problem, PromptMode, build_prompt, load_problems
from .metrics import MARKER_SETS, hack_flags, rollout_metrics, to_floats
from .policy import PolicyHead, response_logprobs
from .rewards import PackedResponses, compute_rewards
from .rollout import ENGINES, RolloutBatch, decode_responses
from .synthetic import problems as synthetic_problems
from .tiny import warmed_up_model
from .verify import VerifierPool, verify_batch


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
    def __init__(self, cfg: TrainConfig, output_dir: Path, *, resume: bool = False) -> None:
        self.cfg = cfg
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
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

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
        self.state = TrainerState(step=0, data_position=0)
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
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
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
        )
        if resume_from is not None:
            self.engine.sync_weights(self.model)  # an engine with its own copy starts from the base weights
        self.verifier = VerifierPool(cfg.verify_workers, cfg.verify_timeout)
        self.tb = self._tensorboard() if self.is_main else None

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

        def lap(name: str) -> None:
            nonlocal clock
            now = time.perf_counter()
            times[f"time_{name}"] = now - clock
            clock = now

        lr = cfg.optim.lr * self.lr_factor(self.state.step)  # the rate this step's update uses
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        # rollout: every rank draws the step's prompts and generates its share, seeded per response
        problems = self.stream.take(r.prompts_per_step)
        problems = problems[self.rank * self.prompts_per_rank : (self.rank + 1) * self.prompts_per_rank]
        prompts = [self._prompt(p) for p in problems]
        with self._generation_context():
            batch = self.engine.generate(
                prompts,
                r.group_size,
                seed=cfg.seed * 1_000_003 + step,
                first_row=self.rank * self.prompts_per_rank * r.group_size,
            )
        texts = decode_responses(self.tokenizer, batch.responses)
        lap("generate")

        # verify: a truncated response is wrong whatever it says
        golds = [p.answer for p in problems for _ in range(r.group_size)]
        verdicts = verify_batch(texts, golds, pool=self.verifier, require_think_end=True)
        correct = torch.tensor(list(verdicts), device=self.device) & ~batch.truncated
        lap("verify")

        # reward and advantage: all K samples of a prompt are on this rank, so both are local
        packed = PackedResponses(batch.response_ids, batch.cu_seqlens, batch.truncated, r.group_size)
        rewards = compute_rewards(packed, correct, self.think_end_id, cfg.reward)
        advantages = group_advantages(rewards.rewards, r.group_size, scale=cfg.loss.adv_scale, eps=cfg.loss.adv_eps)
        non_thinking = rewards.non_thinking.tolist()  # sync: the hack flags need the text, on the host
        hacked = torch.tensor(hack_flags(texts, non_thinking, self.markers), device=self.device)
        lap("reward")

        # old and reference log-probs
        old_logp = ref_logp = None
        if cfg.loss.ppo_epochs > 1 or cfg.loss.mini_batches > 1:
            with torch.no_grad(), self._autocast():
                old_logp, _ = self._logprobs(self._policy(), batch)
        if self.ref_model is not None:
            with torch.no_grad(), self._autocast():
                ref_logp, _ = self._logprobs(self.ref_model, batch)
        lap("logprobs")

        # update
        update = self._update(batch, advantages, old_logp, ref_logp)
        lap("update")

        # weight sync (the vllm engine gathers ZeRO-3 shards bucket by bucket itself)
        self.engine.sync_weights(self.model)
        lap("sync")

        # log: every metric over all ranks' responses, so N ranks log what one process would
        per_response = {
            "correct": correct,
            "non_thinking": rewards.non_thinking,
            "lengths": batch.lengths,
            "hacked": hacked,
            "truncated": batch.truncated,
            "limit": rewards.limit,
            "rewards": rewards.rewards,
        }
        if self.dist:
            per_response = {k: distributed.all_gather_cat(v) for k, v in per_response.items()}
        metrics = rollout_metrics(**per_response)
        metrics.update(update)
        counts = torch.tensor(
            [batch.response_ids.numel(), sum(len(p) for p in batch.prompt_ids), verdicts.timeouts],
            dtype=torch.float64,
            device=self.device,
        )
        metrics["_counts"] = self._sum(counts)
        values = to_floats({k: v for k, v in metrics.items() if k != "_counts"})  # sync: one read per step
        n_tokens, prompt_tokens, timeouts = metrics["_counts"].tolist()
        values.update(times)
        values.update(
            step=step,
            lr=lr,
            verify_timeouts=int(timeouts),
            generated_tokens_per_s=n_tokens / max(times["time_generate"], 1e-9),
            trained_tokens_per_s=(n_tokens + prompt_tokens) * cfg.loss.ppo_epochs / max(times["time_update"], 1e-9),
            time_step=sum(times.values()),
        )
        self.state = TrainerState(step=step, data_position=self.stream.position)
        return values

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

    def _logprobs(self, model, batch: RolloutBatch, with_entropy: bool = False):
        """``model``: the policy (``_policy()``) or the reference model."""
        return response_logprobs(
            model,
            batch,
            temperature=self.cfg.rollout.temperature,
            pack_tokens=self.cfg.pack_tokens,
            pad_id=self.pad_id,
            with_entropy=with_entropy,
        )

    def _update(self, batch: RolloutBatch, advantages, old_logp, ref_logp) -> dict[str, torch.Tensor]:
        cfg, loss_cfg = self.cfg, self.cfg.loss
        k = batch.group_size
        n_prompts = batch.lengths.numel() // k
        per_mb = n_prompts // loss_cfg.mini_batches
        self.model.train()
        sums: dict[str, torch.Tensor] = {}
        count = 0
        for _epoch in range(loss_cfg.ppo_epochs):
            for mb in range(loss_cfg.mini_batches):
                part = _select_groups(batch, mb * per_mb, (mb + 1) * per_mb)
                lo, hi = int(batch.cu_seqlens[mb * per_mb * k]), int(batch.cu_seqlens[(mb + 1) * per_mb * k])
                seqs = slice(mb * per_mb * k, (mb + 1) * per_mb * k)
                # the loss's normalisers are global (all ranks' tokens and sequences), so the ranks' losses add up
                # to the loss of the whole mini-batch
                n_local = torch.tensor(float(hi - lo), device=self.device)
                n_global = self._sum(n_local)
                with self._autocast():
                    logp, entropy = self._logprobs(self._policy(), part, with_entropy=True)
                old = old_logp[lo:hi] if old_logp is not None else logp.detach()
                ref = ref_logp[lo:hi] if ref_logp is not None else None
                loss, stats = clipped_policy_loss(
                    logp,
                    old,
                    advantages[seqs],
                    part.cu_seqlens,
                    clip_low=loss_cfg.clip_low,
                    clip_high=loss_cfg.clip_high,
                    dual_clip=loss_cfg.dual_clip,
                    ref_logp=ref,
                    kl_coef=loss_cfg.kl_coef,
                    agg=loss_cfg.agg,
                    norm_length=loss_cfg.norm_length,
                    total_tokens=float(n_global) if self.dist else None,  # sync: one read per mini-batch
                    total_seqs=float(per_mb * k * self.world) if self.dist else None,
                )
                entropy_sum = entropy.sum()
                total = loss - loss_cfg.entropy_coef * entropy_sum / n_global.clamp(min=1)  # token-mean entropy
                if self.ds_engine is not None:
                    # DeepSpeed averages gradients over ranks; each rank's loss is its part of a global sum
                    self.ds_engine.backward(total * self.world)
                    self.ds_engine.step()
                    grad_norm = torch.tensor(float(self.ds_engine.get_global_grad_norm() or 0.0))
                else:
                    self.optimizer.zero_grad(set_to_none=True)
                    total.backward()
                    grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
                    self.optimizer.step()
                token_stats = torch.stack(
                    [
                        loss.detach(),
                        entropy_sum.detach(),
                        (stats["clip_frac_low"] + stats["clip_frac_high"]) * n_local,
                        stats["approx_kl"] * n_local,
                        stats["kl_ref"] * n_local,
                    ]
                ).float()
                token_stats = self._sum(token_stats)
                n = n_global.clamp(min=1)
                for name, value in (
                    ("loss", token_stats[0]),
                    ("entropy", token_stats[1] / n),
                    ("grad_norm", grad_norm.to(token_stats.device).float()),
                    ("clip_frac", token_stats[2] / n),
                    ("kl", token_stats[3] / n),
                    ("kl_ref", token_stats[4] / n),
                ):
                    sums[name] = sums.get(name, 0) + value
                count += 1
        return {name: value / count for name, value in sums.items()}

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        history = self._read_history() if self.is_main else []
        bar = tqdm(total=cfg.steps, initial=self.state.step, desc="GRPO", unit="step", disable=not self.is_main)
        log = (self.out / "metrics.jsonl").open("a") if self.is_main else None
        try:
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
                if self.state.step % cfg.save_every == 0 or self.state.step == cfg.steps:
                    self._save_checkpoint()
        finally:
            bar.close()
            if log is not None:
                log.close()
            self.verifier.close()
        self._finish(history)
        return history

    def _save_checkpoint(self) -> None:
        keep = self.cfg.keep_checkpoints
        if self.ds_engine is None:
            save_checkpoint(self.ckpt_root, self.state, self.model, self.optimizer, keep=keep)
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
        write_trainer_files(tmp, self.state, rank=self.rank)
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
        self.engine.close()
        if self.tb is not None:
            self.tb.close()


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


def _select_groups(batch: RolloutBatch, first: int, last: int) -> RolloutBatch:
    """Prompts ``first..last-1`` of a batch (all K samples of each), repacked from 0."""
    k = batch.group_size
    a, b = first * k, last * k
    lo, hi = batch.cu_seqlens[a], batch.cu_seqlens[b]
    return RolloutBatch(
        batch.prompt_ids[a:b],
        batch.response_ids[lo:hi],
        batch.cu_seqlens[a : b + 1] - lo,
        batch.truncated[a:b],
        k,
    )


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
