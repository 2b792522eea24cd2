"""Loading problem sets from local files, the registered hub sets, prompts, and the synthetic task."""

from __future__ import annotations

import itertools
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fasttnt.data import DATASETS, DataError, Problem, PromptMode, build_prompt, load_problems
from fasttnt.embedded.char_tokenizer import THINK_END, build_char_tokenizer
from fasttnt.embedded.synthetic import SyntheticProblem, held_out, problems, split_of, trace
from fasttnt.verify import extract_answer, verify_batch

ROWS = [
    {"problem": "What is 1+1?", "answer": "2", "level": 1},
    {"problem": "Simplify \\sqrt{8}.", "answer": "2\\sqrt{2}", "level": "Level 3"},
    {"problem": "AMC-style float answer", "answer": 27.0},
    {"problem": "Olympiad-style list answer", "answer": ["3", "5"]},
]


def _write(path, rows):
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_local_files_load_with_answers_normalised(tmp_path, suffix):
    path = _write(tmp_path / f"set{suffix}", ROWS)
    got = load_problems(str(path), answer_field="answer")
    assert got == [
        Problem("What is 1+1?", "2"),
        Problem("Simplify \\sqrt{8}.", "2\\sqrt{2}"),
        Problem("AMC-style float answer", "27"),
        Problem("Olympiad-style list answer", "3, 5"),
    ]


def test_parquet_and_field_mapping(tmp_path):
    rows = [{"question": f"q{i}", "final": str(i), "difficulty": i % 5 + 1} for i in range(7)]
    path = _write(tmp_path / "set.parquet", rows)
    from fasttnt.data import DatasetSpec

    spec = DatasetSpec(str(path), problem_field="question", answer_field="final", level_field="difficulty")
    got = load_problems(spec, limit=5)
    assert [(p.problem, p.answer, p.level) for p in got] == [(f"q{i}", str(i), i % 5 + 1) for i in range(5)]


def test_registered_sets_can_point_at_a_local_copy(tmp_path):
    # the registry names the hub's columns; a local copy of MATH-500 in the same shape loads through it
    rows = [{"problem": "p", "answer": "\\frac12", "level": 4, "subject": "Algebra"}]
    path = _write(tmp_path / "math500.jsonl", rows)
    from dataclasses import replace

    (problem,) = load_problems(replace(DATASETS.get("math500"), path=str(path)))
    assert problem == Problem("p", "\\frac12", 4)
    assert set(DATASETS.names()) >= {
        "deepscaler",
        "aime24",
        "aime25",
        "amc23",
        "math500",
        "minerva",
        "olympiad",
        "gpqa",
    }


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"problem": "a", "answer": "1"}\n{"problem": "b"}\n', r"set\.jsonl: row 2: missing field 'answer'"),
        ('{"question": "a", "answer": "1"}\n', r"row 1: missing field 'problem' \(fields present: answer, question\)"),
        ('{"problem": "a", "answer": {"x": 1}}\n', r"row 1: field 'answer': answer is a dict"),
        ('{"problem": "a", "answer": true}\n', r"row 1: field 'answer': answer is True"),
        ('{"problem": "", "answer": "1"}\n', r"row 1: field 'problem' must be a non-empty string"),
        ('{"problem": 5, "answer": "1"}\n', r"row 1: field 'problem' must be a non-empty string"),
        ('{"problem": "a", "answer": "1"}\nnot json\n', r"set\.jsonl: row 2: not valid JSON"),
        ("", r"set\.jsonl: no rows"),
        ("\n\n", r"set\.jsonl: no rows"),
        ('["just", "strings"]\n', r"row 1: expected an object"),
    ],
)
def test_bad_rows_name_file_row_and_field(tmp_path, content, match):
    path = tmp_path / "set.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=match):
        load_problems(str(path))


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_problems(str(tmp_path / "absent.jsonl"))
    (tmp_path / "bad.json").write_text('{"rows": 1}')
    with pytest.raises(DataError, match=r"bad\.json: expected a list of rows"):
        load_problems(str(tmp_path / "bad.json"))
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file"):
        load_problems(str(tmp_path / "bad.parquet"))


def test_hub_ids_fail_clearly_without_network(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match=r"HuggingFaceH4/aime_2024 \(split 'train'\): could not load from the hub"):
        load_problems("aime24")


# -- prompts ----------------------------------------------------------------------------------------------------


def test_prompt_modes_through_the_chat_template():
    tok = build_char_tokenizer()
    free = build_prompt(tok, "47+85", "free")
    assert free.text == "<|user|>47+85<|assistant|><think>"
    assert free.response_prefix == "" and not free.forbid_think_end_first
    thinking = build_prompt(tok, "47+85", PromptMode.THINKING)
    assert thinking.text == free.text and thinking.forbid_think_end_first
    direct = build_prompt(tok, "47+85", PromptMode.NON_THINKING)
    assert direct.text == free.text and direct.response_prefix == THINK_END
    with_instruction = build_prompt(tok, "1+1", instruction="Box it.")
    assert with_instruction.text == "<|user|>1+1\nBox it.<|assistant|><think>"


def test_a_template_without_think_gets_the_block_opened():
    tok = build_char_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}Q:{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    )
    assert build_prompt(tok, "2+2").text == "Q:2+2A:<think>\n"
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        build_prompt(tok, "2+2")
    with pytest.raises(ValueError):
        build_prompt(build_char_tokenizer(), "2+2", "sometimes")


# -- the synthetic task -----------------------------------------------------------------------------------------


def _replay_trace(steps: str) -> str:
    """Check each line's arithmetic and return the digits the trace ends with."""
    digits = ""
    for line in steps.strip("\n").split("\n"):
        terms, rest = line.split("=")
        total, digits = rest.split(":")
        assert sum(int(t) for t in terms.split("+")) == int(total)
    return digits


@pytest.mark.parametrize(("a", "b"), [(0, 0), (3, 4), (9, 9), (47, 85), (999, 1), (1234, 8766), (10, 90)])
def test_traces_are_right(a, b):
    steps = trace(a, b)
    assert _replay_trace(steps) == str(a + b)


def test_generator_is_deterministic_and_splits_never_overlap():
    first = list(itertools.islice(problems("train", seed=3), 500))
    again = list(itertools.islice(problems("train", seed=3), 500))
    other = list(itertools.islice(problems("train", seed=4), 500))
    assert first == again and first != other
    test = held_out(200, seed=3)
    train_texts = {p.problem for p in itertools.islice(problems("train", seed=3), 20_000)}
    assert not train_texts & {p.problem for p in test}
    assert all(split_of(p.problem) == "test" for p in test)
    assert {p.level for p in first} == {1, 2, 3, 4}
    assert len({p.problem for p in test}) == len(test)  # held-out problems are distinct


def test_every_response_form_verifies_and_has_its_mode():
    sample = list(itertools.islice(problems("train", seed=0, levels=(1, 2, 3, 4, 5)), 300))
    for p in sample:
        assert (
            isinstance(p, SyntheticProblem)
            and str(int(p.problem.split("+")[0]) + int(p.problem.split("+")[1])) == p.answer
        )
        assert (
            not p.thinking.startswith(THINK_END) and p.direct.startswith(THINK_END) and p.hacked.startswith(THINK_END)
        )
        assert _replay_trace(p.thinking.split(THINK_END)[0]) == p.answer
        assert extract_answer(p.hacked) == p.answer
    for p in sample:  # the double-checked thinking: the trace, the sum redone with its operands swapped, the answer
        a, b = p.problem.split("+")
        steps, rest = p.checked.split(f"check {b}+{a}={p.answer}\n")
        assert steps + rest == p.thinking and not p.checked.startswith(THINK_END)
    for form in ("thinking", "direct", "hacked", "checked"):
        verdicts = verify_batch([getattr(p, form) for p in sample], [p.answer for p in sample])
        assert all(verdicts) and verdicts.symbolic == 0


def test_level_weights_share_out_the_draws_and_the_held_out_split():
    from fasttnt.embedded.synthetic import level_counts

    # a weight of 0 leaves its level out of the draws; the default stream is the uniform one it always was
    drawn = {p.level for p in itertools.islice(problems("train", seed=1, weights=(0, 1, 0, 2)), 400)}
    assert drawn == {2, 4}
    assert {p.level for p in itertools.islice(problems("train", seed=1), 400)} == {1, 2, 3, 4}
    # whole counts that sum to the total, each within 1 of its exact share
    for total, weights in ((200, (0.7, 0.1, 0.1, 0.1)), (7, (1, 1, 1)), (10, (0.5, 0.5, 0, 0)), (3, (1, 1, 1, 1))):
        counts = level_counts(total, weights)
        assert sum(counts) == total
        assert all(abs(c - total * w / sum(weights)) < 1 for c, w in zip(counts, weights, strict=True))
    # the split's per_level x 4 problems shared out by the weights; level 1's ~10 test problems repeat in order
    split = held_out(50, seed=3, weights=(0.7, 0.1, 0.1, 0.1))
    by_level = {lv: [p for p in split if p.level == lv] for lv in (1, 2, 3, 4)}
    assert [len(v) for v in by_level.values()] == [140, 20, 20, 20]
    ones = [p.problem for p in by_level[1]]
    distinct = list(dict.fromkeys(ones))
    assert ones == [distinct[i % len(distinct)] for i in range(140)] and 5 <= len(distinct) < 140
    assert distinct == [p.problem for p in held_out(50, seed=3) if p.level == 1]  # the same problems, repeated
    assert len({p.problem for p in by_level[2]}) == 20  # enough distinct problems: no repeat
    # a level with no share is left out (a weight of 0 at a level whose problems never run out)
    assert {p.level for p in held_out(5, seed=3, weights=(1, 1, 1, 0))} == {1, 2, 3}
    for bad in ((1, 1), (1, -1, 1, 1), (0, 0, 0, 0)):
        with pytest.raises(ValueError, match="level weights"):
            held_out(5, weights=bad)


def test_bad_generator_arguments():
    with pytest.raises(ValueError, match="split"):
        next(problems("dev"))
    with pytest.raises(ValueError, match="levels"):
        next(problems("train", levels=(0,)))
