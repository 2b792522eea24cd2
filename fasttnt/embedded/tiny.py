"""The embedded default model: a tiny Qwen2-architecture model built from a config, and its supervised warm-up
on the synthetic task (both modes, cached on disk so a second run skips it)."""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from .. import files
from ..attention import Packing, packed_hidden_states, use_packed_attention
from ..data import THINK_END, build_prompt
from ..typed_yaml import requirement
from .char_tokenizer import build_char_tokenizer
from .synthetic import level_weights_fit, problems


@dataclass(frozen=True)
class TinyModelConfig:
    """A Qwen2 small enough to train on two CPU cores (~0.6M parameters at the defaults)."""

    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    # R1-Distill-Qwen-1.5B and -7B keep their input and output embeddings apart. Tied, the </think> row would also be
    # the input that every direct answer reads at its next position, so learning the answers of any level would move
    # every level's choice logit (benchmarks/choice_attribution.py measures that spill)
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class WarmupConfig:
    """Supervised warm-up: thinking and direct responses to the synthetic task, by a fixed recipe."""

    steps: int = 800
    batch_size: int = 128
    lr: float = 3e-3
    warmup_steps: int = 50
    levels: tuple[int, ...] = (1, 2, 3, 4)
    level_weights: tuple[float, ...] | None = None  # one per level of `levels`; None: uniform draws
    direct_share: float = 0.5  # share of examples answered directly (the rest think)
    hack_share: float = 0.1  # share of the direct examples that write their steps after </think> anyway
    # whether the direct examples teach the choice of answering directly (their </think> a response token). False:
    # their </think> is in the prompt, as when pre-filled, so the model learns to answer after a pre-filled
    # </think> without learning to write it first: the stand-in for a thinking-only distilled model (R1-Distill
    # answers well when </think> is forced, and practically never writes it itself)
    choose_direct: bool = True
    # whether the thinking examples double-check the sum before </think> (SyntheticProblem.checked): R1-style models
    # do even on 2 + 2, so answering an easy problem directly saves a real share of its tokens
    double_check: bool = False
    seed: int = 0

    def validate(self) -> None:
        """This section's own fields (``config.validate`` calls it with the others)."""
        need = requirement("warmup")
        need(level_weights_fit(self.levels, self.level_weights), "level_weights",
             f"one weight >= 0 per level of warmup.levels {list(self.levels)}, not all 0 (or null)")  # fmt: skip


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyModelConfig, seed: int = 0) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def _examples(tokenizer, cfg: WarmupConfig):
    """Endless (prompt ids, response ids) pairs; the response ends with EOS."""
    rng = random.Random(f"warmup-{cfg.seed}")
    eos = tokenizer.eos_token
    for p in problems("train", levels=cfg.levels, seed=cfg.seed, weights=cfg.level_weights):
        prompt = build_prompt(tokenizer, p.problem).text
        if rng.random() < cfg.direct_share:
            response = p.hacked if rng.random() < cfg.hack_share else p.direct
            if not cfg.choose_direct:  # the </think> pre-filled: no loss on choosing it
                prompt, response = prompt + response[: len(THINK_END)], response[len(THINK_END) :]
        else:
            response = p.checked if cfg.double_check else p.thinking
        yield (
            tokenizer(prompt, add_special_tokens=False)["input_ids"],
            tokenizer(response + eos, add_special_tokens=False)["input_ids"],
        )


def _token_mean_loss(model, pairs) -> torch.Tensor:
    """Cross-entropy over every response token of the batch, in one packed forward: the examples back to back in
    one row, each attending to itself alone (``fasttnt.attention``, as the update's forward), so no compute goes to
    padding (direct answers are ~20 tokens with their prompt, traces up to ~75: a padded batch spent 17% of its
    tokens on padding even sorted into 4 buckets). The logits are taken at the positions that predict a response
    token only. ``model`` must route its attention through ``use_packed_attention``."""
    lengths = [len(p) + len(r) for p, r in pairs]
    ids = torch.tensor([t for p, r in pairs for t in (*p, *r)])  # (T,)
    positions = torch.cat([torch.arange(n) for n in lengths])  # (T,) each example's own
    starts = itertools.accumulate(lengths[:-1], initial=0)
    # (R,) the position before each response token, which predicts it
    before = torch.tensor([s + len(p) - 1 + i for s, (p, r) in zip(starts, pairs, strict=True) for i in range(len(r))])
    hidden = packed_hidden_states(model.model, ids[None], positions[None], Packing.of(lengths, ids.device))[0]  # (T, H)
    logits = model.get_output_embeddings()(hidden.index_select(0, before))  # (R, V): a 100-token vocabulary
    return torch.nn.functional.cross_entropy(logits, ids[before + 1])


def warmup(model, tokenizer, cfg: WarmupConfig, *, progress=None) -> list[float]:
    """Train ``model`` in place on the warm-up mixture; returns the loss per step."""
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / cfg.warmup_steps) * max(0.05, 1 - s / cfg.steps)
    )
    stream = _examples(tokenizer, cfg)
    losses = []
    use_packed_attention(model)  # what the update's forward also sets: generation keeps the model's own attention
    model.train()
    for _ in range(cfg.steps):
        loss = _token_mean_loss(model, list(itertools.islice(stream, cfg.batch_size)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        schedule.step()
        losses.append(loss.item())  # sync: the warm-up is CPU-sized, and the bar shows the loss
        if progress is not None:
            progress(losses[-1])
    # the last step's gradients must not leave with the model: an optimizer that accumulates into .grad (DeepSpeed's
    # does) would add them to its first step. Measured: 2 ranks, one of which had just warmed the model up, logged
    # a first-step grad norm of 0.50 (half a clipped warm-up gradient) against 0.00024 once the cache existed
    opt.zero_grad(set_to_none=True)
    model.eval()
    return losses


WARMUP_CODE = ("embedded/tiny.py", "embedded/char_tokenizer.py", "embedded/synthetic.py", "data.py", "attention.py")
"""The modules whose code makes the warm-up (the model, the tokenizer, the problems, the prompts), relative to the
package: their sources are part of the cache key."""


def warmup_code_key(package: Path | None = None) -> str:
    """A hash of the sources of ``WARMUP_CODE`` in ``package`` (this fasttnt's by default): a warm-up cached by
    other code (an older fasttnt, an edited checkout) is not taken for this code's."""
    package = package or Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for name in WARMUP_CODE:
        digest.update(name.encode() + b"\0" + (package / name).read_bytes())
    return digest.hexdigest()[:12]


def warmup_cache_path(cache_dir: Path, model_cfg: TinyModelConfig, warmup_cfg: WarmupConfig) -> Path:
    """Where the warm-up of this exact recipe is (or will be) cached: the key hashes both configs, then the code
    that trains it (``warmup_code_key``)."""
    key = hashlib.sha256(json.dumps([asdict(model_cfg), asdict(warmup_cfg)], sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / f"tiny-warmup-{key[:16]}-{warmup_code_key()}"


def _stale_entries(path: Path) -> list[Path]:
    """Cached warm-ups of the same configs as ``path`` from other code (an entry made before the code key is
    named by the configs' key alone); an interrupted warm-up's ``.tmp`` folder is no entry."""
    same_configs = path.name.rsplit("-", 1)[0]
    return sorted(
        p
        for p in path.parent.glob(f"{same_configs}*")
        if p != path and p.suffix != ".tmp" and (p / "config.json").is_file()
    )


def warmed_up_model(
    cache_dir: Path, model_cfg: TinyModelConfig, warmup_cfg: WarmupConfig, *, progress_factory=None
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast, Path]:
    """The tiny model after the warm-up, from ``cache_dir`` when this exact recipe was trained before.

    The cache key hashes both configs and the code (``warmup_cache_path``); a warm-up of the same configs by other
    code is said in one line and trained again. The entry is written to a temporary folder and renamed into place,
    so an interrupted warm-up never leaves a half-written model behind.
    """
    path = warmup_cache_path(cache_dir, model_cfg, warmup_cfg)
    if (path / "config.json").is_file():
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        return AutoModelForCausalLM.from_pretrained(path), tokenizer, path
    stale = _stale_entries(path)
    if stale:
        print(
            f"fasttnt: the cached warm-up {stale[-1]} was trained by other code (an older fasttnt or an edited "
            f"checkout); warming up again into {path}",
            file=sys.stderr,
        )
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, model_cfg, seed=warmup_cfg.seed)
    progress = progress_factory(warmup_cfg.steps) if progress_factory else None
    start = time.perf_counter()
    losses = warmup(model, tokenizer, warmup_cfg, progress=progress)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    (tmp / "warmup.json").write_text(
        json.dumps({"seconds": time.perf_counter() - start, "final_loss": losses[-1], **asdict(warmup_cfg)})
    )
    files.replace_folder(tmp, path)  # an incomplete entry there (no config.json) is replaced
    return model, tokenizer, path
