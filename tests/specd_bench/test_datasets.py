"""Dataset loading: --limit and --offset select a window of questions, in file order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specd_bench.datasets import load_questions
from specd.errors import InvalidRequest


@pytest.fixture
def five(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": 100 + i, "turns": [f"q{i}"]}) + "\n\n" for i in range(5)))
    return path


@pytest.mark.parametrize("limit, offset, ids", [(None, 0, [100, 101, 102, 103, 104]), (2, 0, [100, 101]),
                                                (2, 3, [103, 104]), (None, 4, [104]), (9, 2, [102, 103, 104])])
def test_limit_and_offset_pick_a_window(five, limit, offset, ids):
    assert [q.qid for q in load_questions(five, limit, offset)] == [str(i) for i in ids]


def test_offset_past_the_end_is_refused(five):
    with pytest.raises(InvalidRequest, match="5 questions, all skipped by offset 5") as e:
        load_questions(five, None, 5)
    assert e.value.field == "offset"


def test_a_bad_line_before_the_window_still_fails(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"turns": 3}\n{"turns": ["ok"]}\n')
    with pytest.raises(InvalidRequest, match=":1:"):
        load_questions(path, 1, 1)


def test_the_built_in_set_is_40_prompts_in_8_categories():
    """specd/data/prompts.jsonl: every line valid, unique ids, 5 prompts per category, each with
    two turns; some carry a long given context (lookup drafters copy from it)."""
    from collections import Counter

    from specd_bench.datasets import BUILTIN_PATH

    lines = [line for line in BUILTIN_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]
    docs = [json.loads(line) for line in lines]
    assert len(docs) == 40
    assert all(set(d) == {"question_id", "category", "turns"} for d in docs)
    assert len({d["question_id"] for d in docs}) == 40
    assert Counter(d["category"] for d in docs) == {c: 5 for c in (
        "writing", "knowledge", "summarization", "translation", "math", "coding", "extraction", "roleplay")}
    assert all(len(d["turns"]) == 2 and all(t.strip() for t in d["turns"]) for d in docs)
    words = [len(d["turns"][0].split()) for d in docs]
    assert sum(150 <= w <= 400 for w in words) >= 8 and min(words) < 20
    questions = load_questions()
    assert [q.qid for q in questions] == [str(d["question_id"]) for d in docs]
    assert [q.turns for q in questions] == [tuple(d["turns"]) for d in docs]


def test_built_in_is_the_default_and_a_name():
    from specd_bench.datasets import BUILTIN_PATH, dataset_label, dataset_path

    assert dataset_path(None) == dataset_path("built-in") == BUILTIN_PATH
    assert dataset_label(None) == dataset_label(Path("built-in")) == "built-in"
    assert dataset_label(Path("q/question.jsonl")) == "q/question.jsonl"
    assert [q.qid for q in load_questions("built-in", 2, 38)] == ["39", "40"]


@pytest.mark.parametrize("command", ["bench", "bench-dvi", "bench-load", "bench-services"])
def test_every_bench_command_takes_dataset_as_optional(command):
    from specd.cli import build_parser

    parser = build_parser()
    assert parser.parse_args([command]).dataset is None
    assert parser.parse_args([command, "--dataset", "q.jsonl"]).dataset == Path("q.jsonl")
