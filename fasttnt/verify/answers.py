"""Answers: the final answer of a response, and its equivalence with the gold answer (strings, exact numbers,
then math-verify's LaTeX path; nothing is evaluated as Python)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from fractions import Fraction

THINK_END = "</think>"
MAX_RESPONSE_CHARS = 32_768
"""Only this many trailing characters of a response are searched for its answer (1 MB of text costs nothing)."""
MAX_ANSWER_CHARS = 512
"""An extracted answer longer than this is judged by string and number only, never parsed symbolically."""
DEFAULT_TIMEOUT = 5.0

# -- extraction -----------------------------------------------------------------------------------------------

_BOXED = re.compile(r"\\(?:boxed|fbox)")
# "The answer is 5", "Final answer: 5", "**Answer:** 5": the last one in the text wins
_ANSWER_PHRASE = re.compile(r"(?i)(?:final answer|the answer|answer)\s*(?:is|:)\**:?\s*([^\n]{1,300})")


def _braced(text: str, open_at: int) -> str | None:
    """The contents of the brace group opening at ``text[open_at] == '{'``, or None if it never closes."""
    depth = 0
    i = open_at
    while i < len(text):
        c = text[i]
        if c == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # an escaped brace is content, not structure
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1 : i]
        i += 1
    return None


_MAX_BOX_CANDIDATES = 8  # a looping response with thousands of unclosed boxes must not cost a rescan for each


def _last_boxed(text: str) -> str | None:
    for match in list(_BOXED.finditer(text))[::-1][:_MAX_BOX_CANDIDATES]:
        rest = match.end()
        while rest < len(text) and text[rest] == " ":
            rest += 1
        if rest < len(text) and text[rest] == "{":
            content = _braced(text, rest)
            if content is not None:
                return content
            continue  # unclosed (a truncated response): try the one before
        if rest > match.end():  # "\boxed 5": one token after the space
            token = re.match(r"[^\s$]+", text[rest:])
            if token:
                return token.group(0)
    return None


def extract_answer(text: str, *, require_think_end: bool = False) -> str | None:
    """The final answer of a response: the last ``\\boxed{...}``/``\\fbox{...}`` (nested braces kept), else
    ``\\boxed 5``, else the last "the answer is ..." / "Answer: ...". Only the part after the first ``</think>`` is
    searched when there is one; only the last ``MAX_RESPONSE_CHARS`` characters are read.

    ``require_think_end``: a hybrid model's response that never closes its think block has no answer (else a
    ``\\boxed`` in an unfinished draft would pay, and such responses also escape the TNT limit).
    """
    if THINK_END in text:
        text = text.split(THINK_END, 1)[1]
    elif require_think_end:
        return None
    text = text[-MAX_RESPONSE_CHARS:]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip() or None
    phrases = _ANSWER_PHRASE.findall(text)
    if not phrases:
        return None
    answer = phrases[-1].strip()
    answer = re.sub(r"^\$+|\$+$", "", answer.rstrip(".").strip()).strip()
    answer = re.sub(r"^\\\(|\\\)$", "", answer).strip()
    return answer.rstrip(".").strip() or None


# -- fast path: strings and exact numbers ---------------------------------------------------------------------

_SPACING = re.compile(r"\\[,;:! ]|\\left|\\right|\\displaystyle|\$")
_TEXT_MACRO = re.compile(r"\\(?:text|textbf|textit|mathrm|mathbf|mbox|operatorname)\{([^{}]*)\}")
_DEGREES = re.compile(r"\^\{?\\circ\}?|°|\\circ")
_NUMBER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")
_FRAC = re.compile(r"([+-]?)\\frac\{([+-]?\d+)\}\{([+-]?\d+)\}|([+-]?)\\frac(\d)(\d)")
_SLASH = re.compile(r"([+-]?\d+)/([+-]?\d+)")
_CHOICE = re.compile(r"\(?([A-J])\)?")
_CHOICE_PRED = re.compile(r"\(?([A-J])\)?(?:[.:)]|\s|$)")


def normalize(answer: str) -> str:
    """Spacing commands, ``\\left``/``\\right``, ``$``, degree signs and a trailing period removed; ``\\text{..}``
    and friends unwrapped; ``\\dfrac``/``\\tfrac`` as ``\\frac``; a single ``x = `` in front dropped."""
    s = _SPACING.sub("", answer)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for _ in range(3):  # nested \text{\textbf{..}}
        s = _TEXT_MACRO.sub(r"\1", s)
    s = _DEGREES.sub("", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = re.sub(r"^[a-zA-Z]=(?!=)", "", s)
    return s


@dataclass(frozen=True)
class _Number:
    value: Fraction
    percent: bool
    integer: bool  # written as an integer: two unequal integers are certainly different answers


_MAX_NUMBER_CHARS = 200  # longer digit strings are not numbers we compare exactly (int() refuses 4,300+ digits)


def _as_number(s: str) -> _Number | None:
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    percent = s.endswith("%")
    s = s.removesuffix("\\%").removesuffix("%")
    if _NUMBER.fullmatch(s):
        return _Number(Fraction(s.replace(",", "")), percent, "." not in s)
    m = _FRAC.fullmatch(s) or _SLASH.fullmatch(s)
    if m is None:
        return None
    groups = [g for g in m.groups() if g is not None]
    sign = -1 if groups[0] == "-" else 1
    num, den = (groups[1], groups[2]) if len(groups) == 3 else (groups[0], groups[1])
    if int(den) == 0:
        return None
    return _Number(sign * Fraction(int(num), int(den)), percent, False)


def fast_equivalent(pred: str, gold: str) -> bool | None:
    """True or False when strings, exact numbers or choice letters decide; None when symbolic work is needed."""
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return True
    gold_choice = _CHOICE.fullmatch(g)
    if gold_choice:  # multiple choice (GPQA): compare letters
        pred_choice = _CHOICE_PRED.match(p)
        return bool(pred_choice) and pred_choice.group(1) == gold_choice.group(1)
    pn, gn = _as_number(p), _as_number(g)
    if pn is not None and gn is not None:
        candidates = {pn.value} | ({pn.value / 100} if pn.percent else set())
        targets = {gn.value} | ({gn.value / 100} if gn.percent else set())
        if candidates & targets:
            return True
        if pn.integer and gn.integer:
            return False
    return None


# -- symbolic path ----------------------------------------------------------------------------------------------


def symbolic_equivalent(pred: str, gold: str) -> bool:
    """math-verify on both answers as LaTeX. No timeout of its own: run it where it can be killed."""
    import logging

    from math_verify import LatexExtractionConfig, parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns that we disable its signal-based timeout
    config = [LatexExtractionConfig(boxed_match_priority=0)]
    gold_parsed = parse(f"\\boxed{{{gold}}}", extraction_config=config, parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{pred}}}", extraction_config=config, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


def is_equivalent(pred: str | None, gold: str) -> bool:
    """Normalised string match, then exact numbers, then symbolic equivalence (math-verify). In-process and
    without a timeout: for untrusted text in bulk use ``verify_batch``."""
    if pred is None:
        return False
    decided = fast_equivalent(pred, gold)
    if decided is not None:
        return decided
    if len(pred) > MAX_ANSWER_CHARS or len(gold) > MAX_ANSWER_CHARS:
        return False
    try:
        return symbolic_equivalent(pred, gold)
    except (ValueError, TypeError, ArithmeticError, RecursionError, AttributeError, IndexError, KeyError):
        return False  # an answer the parser cannot read is not a correct answer
