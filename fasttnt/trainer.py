"""The GRPO loop. Each step reads as its phases:

    rollout -> verify -> reward -> advantage -> old/ref log-probs -> update -> weight sync -> log (-> checkpoint)

The rewards, advantages, log-probs and loss are the project's kernels; metrics stay on device until one read
per step.
"""

from __future__ import annotations

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

from .checkpoint import TrainerState, list_checkpoints, load_training_state, remove_partial, save_checkpoint
from .config import TrainConfig, dump_config
from .data import MATH_INSTRUCTION, DataError, Problem, PromptMode, build_prompt, load_problems
from .metrics import MARKER_SETS, hack_flags, rollout_metrics, to_floats
from .policy import response_logprobs
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
        self.device = torch.device(
            "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
        )
        self.autocast = self.device.type == "cuda" and cfg.model.dtype == "auto"
        existing = list_checkpoints(self.ckpt_root)
        if existing and not resume:
            raise FileExistsError(
                f"{self.out} holds checkpoints of an earlier run ({existing[-1].name}): pass --resume to continue "
                "it, or choose another --output-dir"
            )
        self.stream = ProblemStream(cfg)  # the data is read and checked before any model is loaded
        self.out.mkdir(parents=True, exist_ok=True)
        remove_partial(self.ckpt_root)
        resume_from = existing[-1] if resume and existing else None
        if resume and resume_from is None:
            tqdm.write(f"--resume: no checkpoint under {self.ckpt_root}; starting from step 0")
        dump_config(cfg, self.out / "config.yaml")

        self.model, self.tokenizer, self.model_path = self._load_model(resume_from)
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
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=o.betas, weight_decay=o.weight_decay, fused=True
        )  # fused: one kernel for all parameters, on the CPU as on CUDA
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        self.state = TrainerState(step=0, data_position=0)
        if resume_from is not None:
            self.state = load_training_state(resume_from, self.optimizer, self.scheduler)
            self.stream.seek(self.state.data_position)
        else:
            torch.manual_seed(cfg.seed)
            random.seed(cfg.seed)
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
        r = cfg.rollout
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
        self.tb = self._tensorboard()

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
        if resume_from is not None:  # the checkpoint's weights into the model as configured
            _load_weights(model, resume_from)
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

        lr = self.scheduler.get_last_lr()[0]  # the rate this step's update uses

        # rollout
        problems = self.stream.take(r.prompts_per_step)
        prompts = [self._prompt(p) for p in problems]
        batch = self.engine.generate(prompts, r.group_size, seed=cfg.seed * 1_000_003 + step)
        texts = decode_responses(self.tokenizer, batch.responses())
        lap("generate")

        # verify: a truncated response is wrong whatever it says
        golds = [p.answer for p in problems for _ in range(r.group_size)]
        verdicts = verify_batch(texts, golds, pool=self.verifier, require_think_end=True)
        correct = torch.tensor(list(verdicts), device=self.device) & ~batch.truncated
        lap("verify")

        # reward and advantage
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
                old_logp, _ = self._logprobs(self.model, batch)
        if self.ref_model is not None:
            with torch.no_grad(), self._autocast():
                ref_logp, _ = self._logprobs(self.ref_model, batch)
        lap("logprobs")

        # update
        update = self._update(batch, advantages, old_logp, ref_logp)
        lap("update")

        # weight sync
        self.engine.sync_weights(self.model)
        lap("sync")

        # log
        n_tokens = batch.response_ids.numel()
        metrics = rollout_metrics(
            correct=correct,
            non_thinking=rewards.non_thinking,
            lengths=batch.lengths,
            hacked=hacked,
            truncated=batch.truncated,
            limit=rewards.limit,
            rewards=rewards.rewards,
        )
        metrics.update(update)
        values = to_floats(metrics)  # sync: one read of every metric per step
        values.update(times)
        step_time = sum(times.values())
        prompt_tokens = sum(len(p) for p in batch.prompt_ids)
        values.update(
            step=step,
            lr=lr,
            verify_timeouts=verdicts.timeouts,
            generated_tokens_per_s=n_tokens / max(times["time_generate"], 1e-9),
            trained_tokens_per_s=(n_tokens + prompt_tokens) * cfg.loss.ppo_epochs / max(times["time_update"], 1e-9),
            time_step=step_time,
        )
        self.state = TrainerState(step=step, data_position=self.stream.position)
        return values

    def _prompt(self, problem: Problem):
        return build_prompt(self.tokenizer, problem.problem, PromptMode.FREE, instruction=self.instruction)

    def _autocast(self):
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.autocast)

    def _logprobs(self, model, batch: RolloutBatch, with_entropy: bool = False):
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
                with self._autocast():
                    logp, entropy = self._logprobs(self.model, part, with_entropy=True)
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
                )
                entropy_mean = entropy.mean() if entropy.numel() else entropy.sum()
                total = loss - loss_cfg.entropy_coef * entropy_mean
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip)
                self.optimizer.step()
                for name, value in (
                    ("loss", loss.detach()),
                    ("entropy", entropy_mean.detach()),
                    ("grad_norm", grad_norm.detach()),
                    ("clip_frac", stats["clip_frac_low"] + stats["clip_frac_high"]),
                    ("kl", stats["approx_kl"]),
                    ("kl_ref", stats["kl_ref"]),
                ):
                    sums[name] = sums.get(name, 0) + value.float()
                count += 1
        self.scheduler.step()
        return {name: value / count for name, value in sums.items()}

    # -- the run ----------------------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        history = self._read_history()
        bar = tqdm(total=cfg.steps, initial=self.state.step, desc="GRPO", unit="step")
        try:
            with (self.out / "metrics.jsonl").open("a") as log:
                while self.state.step < cfg.steps:
                    values = self.step()
                    history.append(values)
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
                        save_checkpoint(
                            self.ckpt_root,
                            self.state,
                            self.model,
                            self.optimizer,
                            self.scheduler,
                            keep=cfg.keep_checkpoints,
                        )
        finally:
            bar.close()
            self.verifier.close()
        self._finish(history)
        return history

    def _read_history(self) -> list[dict[str, float]]:
        path = self.out / "metrics.jsonl"
        return _read_jsonl(path) if path.exists() else []

    def _finish(self, history: list[dict[str, float]]) -> None:
        from .plots import plot_curves

        final = self.out / "final"
        tmp = self.out / "final.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp, safe_serialization=True)
        self.tokenizer.save_pretrained(tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        if history:
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
