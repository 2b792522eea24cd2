"""Named training variants: a reward scheme, optionally an algorithm, optionally parameters, as one name that
``fasttnt compare --variants`` and ``fasttnt train --variant`` both take.

    SCHEME[+ALGORITHM][:key=value,...]

    tnt                   the TNT reward with the default GRPO loss
    tnt+dapo              DAPO: dynamic sampling, clip-higher, token-mean loss, overlong reward shaping
    tnt+drgrpo            Dr. GRPO: no std scaling of advantages, a constant length normaliser
    tnt:omega=1           a parameter of the reward (any ``reward.*`` field), or a dotted config key
    uniform-limit:cap=64  ``cap`` is the uniform limit

SCHEME is a reward scheme or a variant defined in a YAML file (``name: {dotted.key: value, ...}``). A variant is
a list of ``key=value`` overrides applied after the user's config; its name is kept with the run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import yaml

from .config import ConfigError, TrainConfig, load_config, read_yaml_mapping
from .rewards import REWARD_SCHEMES, RewardConfig

# algorithm -> its overrides, given the config they apply to (Dr. GRPO's normaliser is the length budget)
ALGORITHMS: dict[str, Callable[[TrainConfig], dict[str, object]]] = {
    # the project's default loss, named for symmetry
    "grpo": lambda cfg: {},
    # Yu et al. 2025 (DAPO): clip-higher (0.2 / 0.28), dynamic sampling, token-level loss, overlong reward shaping
    # with a buffer of a fifth of the length budget (their 4,096 of 20,480 tokens) and penalty 1
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
}
ALIASES = {"cap": "reward.uniform_limit"}
_REWARD_FIELDS = {f.name for f in fields(RewardConfig)}


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


def variant_overrides(name: str, base: TrainConfig, user: dict[str, dict] | None = None) -> list[str]:
    """The ``key=value`` overrides of variant ``name`` on top of config ``base``."""
    user = user or {}
    head, _, params = name.partition(":")
    scheme, _, algorithm = head.partition("+")
    if scheme in user:
        keys = dict(user[scheme])
    elif scheme in REWARD_SCHEMES:
        keys = {"reward.scheme": scheme}
    else:
        known = ", ".join([*REWARD_SCHEMES.names(), *user])
        raise VariantError(f"{name}: unknown scheme or variant {scheme!r} (known: {known})")
    if algorithm:
        if algorithm not in ALGORITHMS:
            raise VariantError(f"{name}: unknown algorithm {algorithm!r} (known: {', '.join(ALGORITHMS)})")
        keys.update(ALGORITHMS[algorithm](base))
    for item in filter(None, (p.strip() for p in params.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise VariantError(f"{name}: {item!r}: parameters are key=value, e.g. tnt:omega=1")
        key = ALIASES.get(key, key)
        if "." not in key:
            if key not in _REWARD_FIELDS:
                raise VariantError(f"{name}: {key!r} is no reward parameter ({', '.join(sorted(_REWARD_FIELDS))})")
            key = f"reward.{key}"
        keys[key] = yaml.safe_load(value) if value else ""
    return [f"{k}={_yaml_scalar(v)}" for k, v in keys.items()]


def _yaml_scalar(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def slug(name: str) -> str:
    """A folder name for a variant: ``tnt:omega=1`` -> ``tnt_omega=1``."""
    return name.replace(":", "_").replace(",", "_").replace("/", "_")


def check_variant(name: str, base_overrides: list[str], user: dict[str, dict] | None = None) -> None:
    """Resolve ``name`` against the config of ``base_overrides`` and validate the result; a VariantError names
    what is wrong."""
    overrides = variant_overrides(name, load_config(None, base_overrides), user)
    try:
        load_config(None, [*base_overrides, *overrides])
    except ConfigError as err:
        raise VariantError(f"{name}: {err}") from None
