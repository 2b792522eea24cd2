"""``fasttnt compare``'s plan: every (warm-up seed, training seed, variant) as a run with its resolved config and
its folder, and the warm-ups the runs start from."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..config import TrainConfig, load_config, to_dict
from ..evaluate import EvalSettings
from ..variants import slug as variant_slug
from ..variants import variant_overrides

SCHEME_ORDER = ("tnt", "no-limit", "uniform-limit", "binary")
# set per run by compare, never by a variant
RUN_KEYS = ("steps", "save_every", "keep_checkpoints", "save_every_minutes", "seed", "warmup.seed")


@dataclass(frozen=True)
class CompareSettings:
    variants: tuple[str, ...] = SCHEME_ORDER
    seeds: int = 2  # training seeds per warm-up (the prompts and samples)
    first_seed: int = 0  # the training seeds are first_seed, first_seed + 1, ...
    warmup_seeds: int = 1  # warm-ups (the starting model), each trained from its own seed
    steps: int = 80
    # one cap for every query: longer than any honest direct answer (11-14 tokens with EOS) and shorter than every
    # 3- or 4-digit hacked one (40+ tokens), but not than most 2-digit hacks (29-35): it stops some hacks and not
    # others, as a uniform cap does
    uniform_limit: float = 32.0
    jobs: int = 1  # runs trained at once, each in its own process
    eval: EvalSettings = field(
        default_factory=lambda: EvalSettings(samples=4, max_new_tokens=96, synthetic_per_level=50)
    )
    # further evaluation temperatures, each with its own report (the training temperature, 1.0 by default, shows
    # what the policy does as it was trained; 0.6, eval's, what a user of R1-style models samples)
    temperatures: tuple[float, ...] = ()
    # the steps whose models are evaluated, a run's numbers the mean over them (its checkpoints are kept there):
    # a late mean, because one snapshot of a run that still swings can differ from the next by many points; ():
    # the final model alone
    eval_steps: tuple[int, ...] = ()

    @property
    def evaluated_steps(self) -> tuple[int, ...]:
        """The steps whose models each run is evaluated at, in order (the last alone by default)."""
        return tuple(sorted(set(self.eval_steps))) or (self.steps,)


@dataclass(frozen=True)
class Run:
    variant: str
    warmup: int
    seed: int
    out: Path
    cfg: TrainConfig

    @property
    def name(self) -> str:
        return f"{self.variant} warm-up {self.warmup} seed {self.seed}"


def run_dir(output_dir: Path, warmup: int, seed: int, variant: str) -> Path:
    """Where a run of ``variant`` from warm-up ``warmup`` and training seed ``seed`` keeps its files."""
    return output_dir / "runs" / f"w{warmup}-seed{seed}" / variant_slug(variant)


def default_jobs() -> int:
    """Runs at once: one per core, at most 8. On 2 cores, two runs at one thread each did 1.76x the work of one
    at two threads (the tiny model's steps are mostly Python and small kernels)."""
    return max(1, min(8, os.cpu_count() or 1))


def plan_runs(
    settings: CompareSettings, output_dir: Path, overrides: list[str], user_variants: dict | None = None
) -> list[Run]:
    """Every (warm-up, seed, variant) with its resolved config; the variants of one warm-up and seed see the same
    prompts (the seed orders them) from the same starting model."""
    base_overrides = [*overrides, f"reward.uniform_limit={settings.uniform_limit}"]
    base = load_config(None, base_overrides)
    runs = []
    for w in range(settings.warmup_seeds):
        for seed in range(settings.first_seed, settings.first_seed + settings.seeds):
            for variant in settings.variants:
                cfg = load_config(
                    None,
                    [
                        *base_overrides,
                        *variant_overrides(variant, base, user_variants),
                        f"steps={settings.steps}",
                        *checkpoint_overrides(settings),
                        f"seed={seed}",
                        f"warmup.seed={base.warmup.seed + w}",
                    ],
                )
                out = run_dir(output_dir, w, seed, variant)
                runs.append(Run(variant, w, seed, out, cfg))
    return runs


def checkpoint_overrides(settings: CompareSettings) -> list[str]:
    """A run's checkpoints: one at each evaluated step (a checkpoint every gcd of those steps), all kept: the trainer
    also saves at the last step, which need not be a multiple; no time-based saves, which would push one out."""
    every = math.gcd(*settings.evaluated_steps)
    saves = -(-settings.steps // every)  # every multiple of `every` up to the last step, and the last step
    return [f"save_every={every}", f"keep_checkpoints={saves}", "save_every_minutes=null"]


def fingerprint(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(to_dict(cfg), sort_keys=True).encode()).hexdigest()


def trained_before(run: Run) -> bool:
    stamp = run.out / "compare_run.json"
    if not ((run.out / "final" / "config.json").is_file() and stamp.is_file()):
        return False
    return json.loads(stamp.read_text()).get("config_sha256") == fingerprint(run.cfg)


def warmup_path(cfg: TrainConfig) -> Path | None:
    """Where a run's warm-up is cached; None for a hub model, which has none."""
    from ..embedded.tiny import warmup_cache_path

    if cfg.model.name != "tiny":
        return None
    return warmup_cache_path(Path(cfg.cache_dir).expanduser(), cfg.model.tiny, cfg.warmup)
