"""Answer verification: extract the final answer of a response and judge it against the gold answer.

Model output is untrusted input. Nothing here evaluates it as Python: answers are compared as normalised
strings, as exact numbers (``fractions.Fraction`` from a strict regex), and only then symbolically through
math-verify's LaTeX extraction, whose parser (latex2sympy's ANTLR grammar) builds sympy objects without ``eval``.
Symbolic work can hang (``9^{9^{9^9}}``), so ``verify_batch`` runs it in worker processes and kills a worker that
passes the per-item timeout; the item counts as wrong, and as a timeout in the returned statistics.

math-verify was chosen over a hand-written LaTeX parser or raw sympy because it already handles the formats
competition answers come in (fractions, radicals, percentages, units, intervals, tuples, sets, relations) and
is what open-r1 and TRL use for math rewards; we use only its LaTeX path (its plain-expression path calls sympy's
``parse_expr``, which evaluates Python).
"""

from .answers import (
    MAX_ANSWER_CHARS,
    MAX_RESPONSE_CHARS,
    THINK_END,
    extract_answer,
    fast_equivalent,
    is_equivalent,
    normalize,
    symbolic_equivalent,
)
from .pool import Verdicts, VerifierPool, VerifierStartupError, verify_batch

__all__ = ["MAX_ANSWER_CHARS", "MAX_RESPONSE_CHARS", "THINK_END", "Verdicts", "VerifierPool", "VerifierStartupError",
           "extract_answer", "fast_equivalent", "is_equivalent", "normalize", "symbolic_equivalent",
           "verify_batch"]  # fmt: skip
