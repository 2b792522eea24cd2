"""Problems and prompts: math sets from the hub or local files, the synthetic task, and chat-templated prompts
in the three modes (free, forced thinking, forced non-thinking)."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

# the one import of this package that runs back up (the embedded task's warm-up builds its prompts here): each task
# says what marks a hack in its responses, and the embedded one is a task like any set this module loads
from .embedded import synthetic
from .metrics import MATH_MARKERS, HackMarkers
from .registry import Registry
from .verify.answers import THINK_END

THINK_START = "<think>"  # opens the think block; THINK_END (verify.answers) closes it


class DataError(ValueError):
    """A data source that cannot be used, with the file (or hub id), the row and the field at fault."""


@contextlib.contextmanager
def loading_model(what: str):
    """A model or tokenizer that cannot be loaded (no such folder, no hub access, not a model) as a one-line
    ``DataError`` naming ``what`` (``--model X``, ``model.name=X``), not transformers' page of advice."""
    try:
        yield
    except OSError as err:
        first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
        raise DataError(f"{what}: cannot load it: {first}") from err


def names_a_path(name: str) -> bool:
    """Whether a model name is written as a path (and so must be a folder), not a hub id."""
    return name.startswith(("/", "./", "../", "~"))


@dataclass(frozen=True)
class Problem:
    problem: str
    answer: str
    level: int | None = None  # difficulty, where the set has one (MATH-500's 1-5, the synthetic digits)


@dataclass(frozen=True)
class DatasetSpec:
    """Where a set lives and which fields hold what."""

    path: str  # hub id, or a local .jsonl/.json/.parquet file
    split: str = "train"
    config: str | None = None
    problem_field: str = "problem"
    answer_field: str = "answer"
    level_field: str | None = None


# Column names as the sets publish them on the hub (checked against their dataset cards and peers' loaders).
DATASETS: Registry[DatasetSpec] = Registry("dataset")
DATASETS.add("deepscaler", DatasetSpec("agentica-org/DeepScaleR-Preview-Dataset", "train"))
DATASETS.add("aime24", DatasetSpec("HuggingFaceH4/aime_2024", "train"))
DATASETS.add("aime25", DatasetSpec("math-ai/aime25", "test"))
DATASETS.add("amc23", DatasetSpec("math-ai/amc23", "test", problem_field="question"))  # answers are floats: 27.0
DATASETS.add("math500", DatasetSpec("HuggingFaceH4/MATH-500", "test", level_field="level"))
DATASETS.add("minerva", DatasetSpec("math-ai/minervamath", "test", problem_field="question"))
# final_answer is a list of strings (several for multi-answer problems)
DATASETS.add("olympiad", DatasetSpec("math-ai/olympiadbench", "test", "default", "question", "final_answer"))
# an ungated GPQA-Diamond copy whose questions carry their lettered choices and whose answer is the letter
DATASETS.add("gpqa", DatasetSpec("fingertap/GPQA-Diamond", "test", problem_field="question"))

_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


def _answer_text(value: Any, where: str) -> str:
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: answer is {value!r}; expected a string, a number or a list of strings")
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise DataError(f"{where}: answer is {value!r}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return ", ".join(v.strip() for v in value)
    raise DataError(
        f"{where}: answer is a {type(value).__name__} ({value!r:.60}); expected a string, a number or a list of strings"
    )


def _problem_from_row(row: Any, spec: DatasetSpec, where: str) -> Problem:
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected an object with fields, got {type(row).__name__}")
    for field in (spec.problem_field, spec.answer_field):
        if field not in row or row[field] is None:
            present = ", ".join(sorted(map(str, row))) or "none"
            raise DataError(f"{where}: missing field {field!r} (fields present: {present})")
    problem = row[spec.problem_field]
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{where}: field {spec.problem_field!r} must be a non-empty string, got {problem!r:.60}")
    answer = _answer_text(row[spec.answer_field], f"{where}: field {spec.answer_field!r}")
    if not answer:
        raise DataError(f"{where}: field {spec.answer_field!r} is empty")
    level = None
    if spec.level_field is not None and row.get(spec.level_field) is not None:
        raw = row[spec.level_field]
        try:
            level = int(str(raw).removeprefix("Level ").strip())
        except ValueError:
            raise DataError(f"{where}: field {spec.level_field!r} is {raw!r}, not a level number") from None
    return Problem(problem.strip(), answer, level)


def _read_local(path: Path) -> list[Any]:
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as err:  # pyarrow raises several types for a damaged file; name the file either way
            raise DataError(f"{path}: not a readable parquet file ({err})") from err
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as err:
                    raise DataError(f"{path}: row {number}: not valid JSON ({err.msg})") from None
        return rows
    try:
        data = json.loads(text) if text.strip() else []
    except json.JSONDecodeError as err:
        raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a list of rows (or {{'data': [...]}}), got {type(data).__name__}")
    return data


def _read_hub(spec: DatasetSpec) -> list[Any]:
    try:
        import datasets
    except ImportError as err:
        raise DataError(f"{spec.path}: loading from the hub needs the 'datasets' package") from err
    try:
        return list(datasets.load_dataset(spec.path, spec.config, split=spec.split))
    except Exception as err:  # network, auth and missing-split errors come in many types; keep the cause
        raise DataError(
            f"{spec.path} (split {spec.split!r}): could not load from the hub ({type(err).__name__}: {err}); "
            "without network access pass a local .jsonl/.json/.parquet file instead"
        ) from err


def load_problems(
    source: str | DatasetSpec,
    *,
    split: str | None = None,
    problem_field: str | None = None,
    answer_field: str | None = None,
    limit: int | None = None,
) -> list[Problem]:
    """Problems from a registered set name (``math500``), a local file, or a hub id, with field overrides.

    Every row is checked; the first bad one raises ``DataError`` naming the file, the row (1-based) and the field.
    """
    if isinstance(source, DatasetSpec):
        spec = source
    elif source in DATASETS:
        spec = DATASETS.get(source)
    else:
        spec = DatasetSpec(source)
    overrides = {"split": split, "problem_field": problem_field, "answer_field": answer_field}
    spec = replace(spec, **{k: v for k, v in overrides.items() if v is not None})
    local = Path(spec.path)
    is_local = local.suffix in _LOCAL_SUFFIXES or local.exists()
    rows = _read_local(local) if is_local else _read_hub(spec)
    if not rows:
        raise DataError(f"{spec.path}: no rows")
    if limit is not None:
        rows = rows[:limit]
    return [_problem_from_row(row, spec, f"{spec.path}: row {i}") for i, row in enumerate(rows, start=1)]


# -- prompts ----------------------------------------------------------------------------------------------------

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
"""The instruction DeepSeek recommends for R1-series models on math (their model card's usage notes)."""
SYNTHETIC = "synthetic"
"""The embedded arithmetic task (``fasttnt.embedded.synthetic``), as ``data.train`` and ``fasttnt eval --benchmarks``
name it."""


MARKER_SETS = {"math": MATH_MARKERS, "synthetic": synthetic.HACK_MARKERS}
"""``data.hack_markers``' choices: each task's markers of thinking, by name."""


class DatasetStyle(NamedTuple):
    """What a dataset's prompts ask and what marks a hack in its responses."""

    instruction: str  # appended to each problem (``build_prompt``)
    markers: HackMarkers  # thinking after ``</think>`` (``metrics.hack_flags``)


def dataset_style(dataset: str, *, instruction: str | None = None, markers: str = "auto") -> DatasetStyle:
    """The instruction and hack markers of ``dataset``'s prompts, for training and evaluation alike: none and the
    synthetic task's markers for ``synthetic``, DeepSeek's math instruction and the math markers for any other set.
    ``instruction`` (None: that default) and ``markers`` (a ``MARKER_SETS`` name, ``auto``: that default) are
    ``data.instruction`` and ``data.hack_markers``."""
    synthetic = dataset == SYNTHETIC
    if instruction is None:
        instruction = "" if synthetic else MATH_INSTRUCTION
    if markers == "auto":
        markers = "synthetic" if synthetic else "math"
    return DatasetStyle(instruction, MARKER_SETS[markers])


class PromptMode(str, Enum):
    FREE = "free"  # the model chooses: its first token </think> means non-thinking
    THINKING = "thinking"  # the first token may not be </think>
    NON_THINKING = "non-thinking"  # </think> is pre-filled as the response's first token


@dataclass(frozen=True)
class Prompt:
    text: str  # the templated prompt; it ends inside an open think block
    response_prefix: str = ""  # pre-filled start of the response (counted as response tokens): "</think>" or ""
    forbid_think_end_first: bool = False  # the engine must not sample </think> as the first response token

    def in_mode(self, mode: PromptMode | str) -> Prompt:
        """The same prompt answered in ``mode``: non-thinking pre-fills ``</think>``, thinking forbids it first."""
        mode = PromptMode(mode)
        return replace(
            self,
            response_prefix=THINK_END if mode is PromptMode.NON_THINKING else "",
            forbid_think_end_first=mode is PromptMode.THINKING,
        )


PROMPT_STYLES = ("plain", "ellipsis")
ELLIPSIS = "\n...\n"
"""AutoThink's ellipsis prompt (Tu et al. 2025, sec. 2.1): the think block opened with "<think>\n...\n", after which an
R1-style model sometimes closes it at once (</think>) and answers directly."""


def build_prompt(
    tokenizer, problem: str, mode: PromptMode | str = PromptMode.FREE, *, instruction: str = "", style: str = "plain"
) -> Prompt:
    """The problem through the tokenizer's own chat template, ending with ``<think>`` (added when the template
    does not open the think block itself, as DeepSeek-R1's current template does); ``style="ellipsis"``: with
    AutoThink's "...", ``<think>\n...\n``."""
    mode = PromptMode(mode)
    content = f"{problem}\n{instruction}" if instruction else problem
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the tokenizer has no chat template; set tokenizer.chat_template")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )
    if not text.rstrip().endswith(THINK_START):
        text += THINK_START + "\n"
    if style == "ellipsis":
        text = text.rstrip() + ELLIPSIS
    elif style != "plain":
        raise ValueError(f"prompt style {style!r} is not one of {PROMPT_STYLES}")
    return Prompt(text).in_mode(mode)


def think_end_token_id(tokenizer, *, required: bool = True) -> int | None:
    """The id of ``</think>``, which must be one token (the modes and the TNT reward are read from it). Without
    one: a ValueError naming the tokenizer, or None when not ``required`` (a model evaluated in free mode)."""
    token_id = tokenizer.convert_tokens_to_ids(THINK_END)
    if token_id is None or token_id == tokenizer.unk_token_id:
        if required:
            name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
            raise ValueError(f"{name}: the tokenizer has no single {THINK_END} token")
        return None
    return token_id
