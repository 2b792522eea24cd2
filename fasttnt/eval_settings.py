"""What ``fasttnt eval`` runs with (``EvalSettings``) and the benchmarks it runs when none are named: the one copy of
the evaluation's defaults, which the command line's flags take as theirs. A module of its own, without torch, so the
command line reads them as it builds its parser (``fasttnt eval --help`` shows them) without importing the
evaluation (``fasttnt.evaluate``)."""

from __future__ import annotations

from dataclasses import dataclass

BENCHMARK_ORDER = ("aime24", "aime25", "amc23", "math500", "minerva", "olympiad", "gpqa")
"""The registered math benchmarks, in the order the tables list them; ``fasttnt eval`` runs them all by default."""

MATH_MAX_NEW_TOKENS = 16384
"""The length budget on the math benchmarks when ``--max-new-tokens`` is not given (the peers' 16K responses);
``EvalSettings.max_new_tokens`` is the synthetic task's."""


@dataclass(frozen=True)
class EvalSettings:
    samples: int = 4  # per problem; accuracy is their mean (pass@1)
    mode: str = "free"
    temperature: float = 0.6  # DeepSeek's recommended sampling for R1-series models, as the peers evaluate
    top_p: float = 0.95
    max_new_tokens: int = 96  # the synthetic task's budget (fasttnt eval gives the math sets MATH_MAX_NEW_TOKENS)
    engine: str = "hf"
    seed: int = 0
    synthetic_per_level: int = 50
    # the held-out split's mix of levels 1-4 (fasttnt.embedded.synthetic.held_out); None: per_level of each
    synthetic_level_weights: tuple[float, ...] | None = None
    batch_prompts: int = 64
    limit: int | None = None  # at most this many problems per benchmark
    prompt_style: str = "plain"  # or "ellipsis": AutoThink's (fasttnt.data.build_prompt)
