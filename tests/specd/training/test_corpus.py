"""The training corpus: the target's own answers, in resumable shards."""

from __future__ import annotations

import json

import pytest

from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.runtime import load_model
from specd.training.corpus import TEMPLATES, TOPICS, Corpus, answer_prompts, build_corpus, file_prompts
from specd.types import SamplingParams, SpecParams


@pytest.fixture(scope="module")
def target(tiny_dirs):
    return load_model(str(tiny_dirs[0]), device="cpu")


def test_corpus_holds_the_targets_own_greedy_answers(target, tmp_path):
    corpus = build_corpus(target, tmp_path, 200, temperatures=(0.0,), batch_size=4, max_new_tokens=12)
    assert corpus.positions() >= 200
    seqs = list(corpus)
    engine = SpeculativeEngine(target)
    for s in seqs[:6]:  # batched, left-padded generation answers as the target does alone
        prompt = s.ids[:s.prompt_len]
        alone = engine.generate(prompt, SamplingParams(max_new_tokens=12), SpecParams("none")).token_ids
        assert s.ids[s.prompt_len:] == alone
    prompts = json.loads((tmp_path / "prompts.json").read_text())
    assert len(prompts) == len(TEMPLATES) * len(TOPICS)
    assert target.decode(seqs[0].ids[:seqs[0].prompt_len]).find(prompts[0]) >= 0


def test_a_rerun_resumes_and_keeps_what_is_there(target, tmp_path):
    build_corpus(target, tmp_path, 60, temperatures=(0.0, 1.0), batch_size=4, max_new_tokens=12)
    before = {p.name: p.read_bytes() for p in Corpus(tmp_path).shards()}
    build_corpus(target, tmp_path, 60, temperatures=(0.0, 1.0), batch_size=4, max_new_tokens=12)
    assert {p.name: p.read_bytes() for p in Corpus(tmp_path).shards()} == before  # nothing to add
    more = build_corpus(target, tmp_path, 200, temperatures=(0.0, 1.0), batch_size=4, max_new_tokens=12)
    after = {p.name: p.read_bytes() for p in more.shards()}
    assert len(after) > len(before) and all(after[name] == data for name, data in before.items())
    assert more.positions() >= 200


def test_self_instruct_and_file_prompts_join_the_templates(target, tmp_path):
    extra = tmp_path / "extra.jsonl"
    extra.write_text(json.dumps({"turns": ["first extra", "second extra"]}) + "\n\n")
    build_corpus(target, tmp_path / "w", 10, prompt_files=[extra], self_instruct=4, batch_size=4, max_new_tokens=8)
    prompts = json.loads((tmp_path / "w" / "prompts.json").read_text())
    assert {"first extra", "second extra"} <= set(prompts)
    assert len(prompts) >= len(TEMPLATES) * len(TOPICS) + 2


def test_held_out_prompts_are_answered_once(target, tmp_path):
    answered = answer_prompts(target, ["one", "two", "three"], 0.0, 6, batch_size=2)
    assert len(answered) == 3 and all(len(s.ids) - s.prompt_len <= 6 for s in answered)


def test_bad_input_names_the_field_or_line(target, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"turns": ["ok"]}) + "\n" + "not json\n")
    with pytest.raises(InvalidRequest, match="bad.jsonl:2"):
        file_prompts([bad])
    with pytest.raises(InvalidRequest, match="positions"):
        build_corpus(target, tmp_path, 0)
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        build_corpus(target, tmp_path, 10, max_new_tokens=0)
    with pytest.raises(InvalidRequest, match="temperatures"):
        build_corpus(target, tmp_path, 10, temperatures=(-1.0,))
