"""fasttnt's kernels inside other GRPO codebases: ``fasttnt.integrations.trl`` (TRL's GRPOTrainer) and
``fasttnt.integrations.verl`` (verl's registries). Each imports its peer only when used."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def judge(
    tokenizer,
    responses: list[list[int]],
    golds: list[str],
    verify: Callable[[list[str], list[str]], Sequence[bool]] | None = None,
) -> list[bool]:
    """Is each response (token ids) correct, as the TNT reward counts it: ``verify(texts, golds)`` says so
    (default: fasttnt's verifier, the final answer after ``</think>``) and it ended with EOS (a truncated response
    is wrong whatever it says). The judge of both integrations' TNT rewards."""
    from ..rollout import decode_responses

    texts = decode_responses(tokenizer, responses)
    if verify is None:
        from ..verify import verify_batch

        verdicts = list(verify_batch(texts, golds, require_think_end=True))
    else:
        verdicts = [bool(v) for v in verify(texts, golds)]
    eos = tokenizer.eos_token_id
    return [v and bool(ids) and ids[-1] == eos for v, ids in zip(verdicts, responses, strict=True)]
