"""Dataset loading: --limit and --offset select a window of questions, in file order."""

from __future__ import annotations

import json

import pytest

from specd.bench.datasets import load_questions
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
