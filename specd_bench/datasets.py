"""Benchmark prompts: JSONL files with a `turns` list of user messages per line (MT-bench,
Zheng et al. 2023; the Alpaca question set of docs/benchmarks.md has the same shape).

Without a path the bench commands run on the built-in set, specd/data/prompts.jsonl: 40 prompts
written for specd, 5 in each of 8 categories (writing, knowledge, summarization, translation,
math, coding, extraction, roleplay), each with a second turn; half of them give a text to work on
(a passage, table, code or sentences to translate; prompts of 65-300 words) that answers copy from.

A second turn is a conversation: [user t1, assistant answer1, user t2], where answer1 is the
target's own answer to t1, generated once before timing starts (BenchRun.encode_prompts).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specd.errors import InvalidRequest

TURN_CHOICES = ("1", "2", "all")
BUILTIN = "built-in"  # what results record for the built-in set; --dataset built-in also names it
BUILTIN_PATH = Path(str(resources.files("specd") / "data" / "prompts.jsonl"))  # shipped with the core


def dataset_path(dataset: str | Path | None) -> Path:
    """The file to read: the built-in set for None or "built-in", else the path given."""
    return BUILTIN_PATH if dataset is None or str(dataset) == BUILTIN else Path(dataset)


def dataset_label(dataset: str | Path | None) -> str:
    """What results and reports record: "built-in" or the path as given."""
    return BUILTIN if dataset is None or str(dataset) == BUILTIN else str(dataset)


@dataclass(frozen=True)
class Question:
    """One dataset line: its id (question_id or line number) and user turns."""

    qid: str
    turns: tuple[str, ...]


@dataclass(frozen=True)
class BenchPrompt:
    """One timed prompt: a question at a turn (1-based)."""

    qid: str
    turn: int
    question: Question

    @property
    def key(self) -> str:
        return f"{self.qid}#t{self.turn}"


def load_questions(path: str | Path | None = None, limit: int | None = None,
                   offset: int = 0) -> list[Question]:
    """Parse the JSONL file (None: the built-in set); a bad line raises InvalidRequest naming
    path:line. offset skips that many questions first (they are still parsed), so a long set can
    be run in parts."""
    path = dataset_path(path)
    if not path.is_file():
        raise InvalidRequest("dataset", f"{path}: no such file")
    out: list[Question] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            out.append(_parse_line(line, path, lineno))
            if limit is not None and len(out) >= offset + limit:
                break
    if not out:
        raise InvalidRequest("dataset", f"{path}: no questions")
    if offset >= len(out):
        raise InvalidRequest("offset", f"{path} has {len(out)} questions, all skipped by offset {offset}")
    return out[offset:]


def _parse_line(line: str, path: Path, lineno: int) -> Question:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise InvalidRequest("dataset", f"{path}:{lineno}: invalid JSON ({e.msg})") from None
    turns = doc.get("turns") if isinstance(doc, dict) else None
    if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
        raise InvalidRequest("dataset", f"{path}:{lineno}: needs a 'turns' list of non-empty strings")
    return Question(str(doc.get("question_id", lineno)), tuple(turns))


def bench_prompts(questions: list[Question], turn: str) -> list[BenchPrompt]:
    """The prompts to time for --turn 1 | 2 | all (questions without a second turn are skipped for 2)."""
    if turn not in TURN_CHOICES:
        raise InvalidRequest("turn", f"must be one of {', '.join(TURN_CHOICES)}, got {turn!r}")
    wanted = (1, 2) if turn == "all" else (int(turn),)
    return [BenchPrompt(q.qid, t, q) for q in questions for t in wanted if t <= len(q.turns)]


def messages(prompt: BenchPrompt, first_answer: str | None) -> list[dict]:
    """Chat messages for a prompt; turn 2 replays the target's first answer."""
    turns = prompt.question.turns
    if prompt.turn == 1:
        return [{"role": "user", "content": turns[0]}]
    return [{"role": "user", "content": turns[0]},
            {"role": "assistant", "content": first_answer or ""},
            {"role": "user", "content": turns[1]}]
