"""Named training variants: a reward scheme, optionally an algorithm, optionally parameters, as one name that
``fasttnt compare --variants`` and ``fasttnt train --variant`` both take.

    SCHEME[+ALGORITHM...][:key=value,...]

    tnt                   the TNT reward with fasttnt's default loss (GRPO advantages, clip 0.2 / 0.28, token-mean)
    tnt+dapo              DAPO: dynamic sampling and overlong reward shaping, with its clip-higher and token-mean
    tnt+drgrpo            Dr. GRPO: no std scaling of advantages, a constant length normaliser
    tnt+mix               mode-mixed rollouts: half of each group with </think> pre-filled (fasttnt.modes)
    tnt+mix+acc           and the accuracy-aware table: a direct answer pays more only within 0.05 of thinking
    tnt+adaptthink        AdaptThink's objective: tnt+mix+acc with one ratio per sequence, the forced </think>'s
                          old log-prob log 0.5, one advantage per response and no std scaling
    tnt:omega=1           a parameter of the reward (any ``reward.*`` field), a top-level or dotted config key
    uniform-limit:cap=64  ``cap`` is the uniform limit

SCHEME is a reward scheme or a variant defined in a YAML file (``--variants-file``: ``name: {dotted.key: value,
...}``). A variant is a list of ``key=value`` overrides: ``fasttnt train`` applies them after the config file and
before the command line's overrides, ``fasttnt compare`` after its overrides for all runs (so a variant's own
settings win there), before the steps and seeds it sets itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from pathlib import Path

import yaml

from .config import ConfigError, TrainConfig, load_config, read_yaml_mapping, with_overrides
from .rewards import REWARD_SCHEMES, RewardConfig

# algorithm -> its overrides, given the config they apply to (Dr. GRPO's normaliser is the length budget)
ALGORITHMS: dict[str, Callable[[TrainConfig], dict[str, object]]] = {
    # Yu et al. 2025 (DAPO): clip-higher (0.2 / 0.28), dynamic sampling, token-level loss, overlong reward shaping
    # with a buffer of a fifth of the length budget (their 4,096 of 20,480 tokens) and penalty 1. fasttnt's default
    # loss already clips at 0.2 / 0.28 with a token-mean: against it, +dapo adds the sampling and the shaping
    "dapo": lambda cfg: {
        "rollout.dynamic_sampling": True,
        "loss.clip_low": 0.2,
        "loss.clip_high": 0.28,
        "loss.agg": "token-mean",
        "reward.overlong_buffer": max(1, cfg.rollout.max_new_tokens // 5),
        "reward.overlong_penalty": 1.0,
    },
    # Liu et al. 2025 (Understanding R1-Zero-like training): advantages not divided by the group std, and each
    # response's token sum divided by one constant (the length budget) instead of its own length
    "drgrpo": lambda cfg: {
        "loss.adv_scale": "none",
        "loss.agg": "seq-mean-token-sum-norm",
        "loss.norm_length": float(cfg.rollout.max_new_tokens),
    },
    # mode-mixed rollouts (fasttnt.modes): half of each group answered with </think> pre-filled, as AdaptThink forces
    # half into each mode (Zhang et al. 2025); the other half samples freely. The rule: loss.mode_token_logp
    "mix": lambda cfg: {"rollout.forced_non_thinking": 0.5},
    # the accuracy-aware table (RewardConfig.direct_margin): AdaptThink's constraint, delta = 0.05 as in its paper
    "acc": lambda cfg: {"reward.direct_margin": 0.05},
    # AdaptThink's objective (Zhang et al. 2025; THU-KEG/AdaptThink): half of each group forced direct, one ratio per
    # sequence, exp(mean_t log pi - mean_t log pi_old) (gspo), the forced first token's old log-prob log 0.5 (half),
    # advantage acc + delta 1{direct} minus a baseline with no std scaling. Its baseline is the reference model's mean
    # accuracy on x, from samples drawn before training; here the group's mean reward (GRPO's, no reference pass)
    "adaptthink": lambda cfg: {
        "rollout.forced_non_thinking": 0.5,
        "reward.direct_margin": 0.05,
        "loss.policy_loss": "gspo",
        "loss.mode_token_logp": "half",
        "loss.mode_advantage": "shared",
        "loss.adv_scale": "none",
        "loss.mode_token_floor": 0,  # no settled-choice fade: AdaptThink has none
    },
}
ALIASES = {"cap": "reward.uniform_limit"}
_REWARD_FIELDS = {f.name for f in fields(RewardConfig)}
# seed, steps, micro_batch_tokens, ...: the config's own values (its sections are made by default factories)
_TOP_LEVEL_KEYS = {f.name for f in fields(TrainConfig) if f.default_factory is MISSING}


class VariantError(ConfigError):
    """A variant name that cannot be resolved, naming the part at fault."""


def read_variants_file(path: str | Path) -> dict[str, dict[str, object]]:
    """User variants from YAML: ``name: {dotted.key: value, ...}``, each name usable as a SCHEME."""
    try:
        tree = read_yaml_mapping(path, "--variants-file", "a mapping of variant names to config keys")
    except ConfigError as err:
        raise VariantError(str(err)) from None
    out = {}
    for name, keys in tree.items():
        if not isinstance(keys, dict):
            raise VariantError(f"--variants-file: {path}: {name}: expected a mapping of dotted config keys")
        if not isinstance(name, str) or any(c in name for c in "+:,= /"):
            raise VariantError(f"--variants-file: {path}: {name!r}: a name may not contain + : , = / or spaces")
        out[name] = dict(keys)
    return out


def split_variants(text: str) -> list[str]:
    """Variant names from a comma-separated list. A piece with ``=`` and no ``:`` continues the parameters of the
    variant before it: ``tnt,uniform-limit:cap=64,direct_correct=1.5`` is two variants."""
    out: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        if out and ":" in out[-1] and "=" in piece and ":" not in piece:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def variant_overrides(name: str, base: TrainConfig, user: dict[str, dict] | None = None) -> list[str]:
    """The ``key=value`` overrides of variant ``name`` on top of config ``base``: the scheme's (or the user
    variant's) keys, then the algorithm's, computed on the config those and the parameters make (Dr. GRPO's
    normaliser is that config's length budget), then the parameters, which have the last word."""
    user = user or {}
    head, _, params = name.partition(":")
    scheme, *algorithms = head.split("+")
    if scheme in user:
        keys = dict(user[scheme])
    elif scheme in REWARD_SCHEMES:
        keys = {"reward.scheme": scheme}
    else:
        known = ", ".join([*REWARD_SCHEMES.names(), *user])
        raise VariantError(f"{name}: unknown scheme or variant {scheme!r} (known: {known})")
    parameters = {}
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise VariantError(f"{name}: {item!r}: parameters are key=value, e.g. tnt:omega=1")
        key = ALIASES.get(key, key)
        if "." not in key and key not in _TOP_LEVEL_KEYS:
            if key not in _REWARD_FIELDS:
                raise VariantError(f"{name}: {key!r} is no reward parameter ({', '.join(sorted(_REWARD_FIELDS))})")
            key = f"reward.{key}"
        parameters[key] = yaml.safe_load(value) if value else ""
    for algorithm in algorithms:  # in order, each on the config the ones before it and the parameters make
        if algorithm not in ALGORITHMS:
            raise VariantError(f"{name}: unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        try:
            own = with_overrides(base, _as_overrides({**keys, **parameters}))
        except ConfigError as err:
            raise VariantError(f"{name}: {err}") from None
        keys.update(ALGORITHMS[algorithm](own))
    return _as_overrides({**keys, **parameters})


def _as_overrides(keys: dict[str, object]) -> list[str]:
    return [f"{k}={_yaml_scalar(v)}" for k, v in keys.items()]


def _yaml_scalar(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def slug(name: str) -> str:
    """A folder name for a variant: ``tnt:omega=1`` -> ``tnt_omega=1``."""
    return name.replace(":", "_").replace(",", "_").replace("/", "_")


def check_variant(
    name: str, base_overrides: list[str], user: dict[str, dict] | None = None, *, reserved: tuple[str, ...] = ()
) -> None:
    """Resolve ``name`` against the config of ``base_overrides`` and validate the result; a VariantError names
    what is wrong. ``reserved``: keys the caller sets itself, which a variant may not."""
    overrides = variant_overrides(name, load_config(None, base_overrides), user)
    for item in overrides:
        key = item.partition("=")[0]
        if key in reserved:
            raise VariantError(f"{name}: {key} is set for every run by the command itself, not by a variant")
    try:
        load_config(None, [*base_overrides, *overrides])
    except ConfigError as err:
        raise VariantError(f"{name}: {err}") from None
