"""The retrieval datastore: longest-suffix search against brute force, the majority-path
continuation, files, and how the retrieval drafter chooses between the request's own text
and the datastore."""

from __future__ import annotations

import numpy as np
import pytest

from specd.drafters import Datastore, RetrievalDrafter, build_drafter
from specd.drafters.datastore import SEP, bundled_datastore_path
from specd.errors import InvalidRequest
from specd.types import SamplingParams


def brute_match(data: np.ndarray, context: list[int], width: int) -> tuple[set[int], int]:
    """Every end of the longest suffix of context (<= width) that has a next token in data."""
    best: tuple[set[int], int] = (set(), 0)
    for m in range(1, min(width, len(context)) + 1):
        ends = {e for e in range(m - 1, len(data) - 1)
                if data[e + 1] >= 0 and list(data[e - m + 1:e + 1]) == context[-m:]}
        if not ends:
            break
        best = (ends, m)
    return best


def test_match_finds_every_occurrence_of_the_longest_suffix():
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 6, rng.integers(1, 40)).tolist() for _ in range(30)]  # small alphabet: many repeats
    store = Datastore.from_documents(docs, width=5)
    body = store.data[store.width:]  # positions in `data` are offset by the leading separators
    for _ in range(200):
        context = rng.integers(0, 7, rng.integers(1, 9)).tolist()  # 6 never occurs
        ends, length = store.match(np.array(context))
        want, want_len = brute_match(body, context, 5)
        assert length == want_len
        assert set((ends - store.width).tolist()) == want


def test_continuation_follows_the_majority_while_it_holds():
    docs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9, 2, 3, 4, 8], [2, 3, 4, 5, 6, 1]]
    store = Datastore.from_documents(docs)
    # "2 3": four occurrences, 4 follows all of them, then 5 (3 of 4), then 6 (2 of 3: still a
    # majority of the occurrences that agreed so far), then 1 is only 1 of 2: stop
    assert store.lookup(np.array([7, 2, 3]), 16) == ([4, 5, 6], 2)
    assert store.lookup(np.array([2, 3]), 2) == ([4, 5], 2)  # max_len
    # the longest match decides: "9 2 3" occurs once
    assert store.lookup(np.array([9, 2, 3]), 16) == ([4, 8], 3)
    assert store.lookup(np.array([42]), 16) == ([], 0)  # never seen
    assert store.lookup(np.array([6]), 16) == ([1], 1)  # a document's last token has no continuation
    assert store.tokens == 23 and store.documents == 4


def test_retrieved_tokens_say_how_contested_they_are():
    docs = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7], [9, 2, 3, 4, 8], [2, 3, 4, 5, 6, 1]]
    store = Datastore.from_documents(docs)
    # "2 3" occurs four times: 4 follows all four, 5 three of them, 6 two of the three
    got = draft_all(RetrievalDrafter(store).open(), [7, 2, 3])[:3]
    assert [(d.token, d.votes) for d in got] == [(4, 4), (5, 4), (6, 3)] and got[0].retrieved
    assert [d.support for d in got] == pytest.approx([1.0, 3 / 4, 2 / 3])


def test_a_continuation_never_crosses_into_the_next_document():
    store = Datastore.from_documents([[1, 2], [3, 4]])
    assert store.lookup(np.array([1]), 16) == ([2], 1)
    assert store.lookup(np.array([2]), 16) == ([], 0)


def test_save_and_load_round_trip(tmp_path):
    store = Datastore.from_documents([[1, 2, 3], [4, 5]], width=4, meta={"target": "t"})
    path = tmp_path / "ds.safetensors"
    store.save(path)
    again = Datastore.load(path, vocab_size=10)
    assert again.width == 4 and again.meta["target"] == "t"
    assert np.array_equal(again.data, store.data) and np.array_equal(again.index, store.index)
    with pytest.raises(InvalidRequest, match="datastore.*another tokenizer"):
        Datastore.load(path, vocab_size=5)
    with pytest.raises(InvalidRequest, match="datastore.*no datastore file"):
        Datastore.load(tmp_path / "missing.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(InvalidRequest, match="is not a datastore"):
        Datastore.load(tmp_path / "junk.safetensors")


def test_bad_tokens_are_refused():
    with pytest.raises(InvalidRequest, match="datastore"):
        Datastore(np.array([1, -5, 2]))
    assert Datastore.from_documents([]).lookup(np.array([1, 2]), 8) == ([], 0)
    assert SEP == -1


def draft_all(session, seq: list[int]) -> list:
    out = []
    while (d := session.next(seq + [t.token for t in out], SamplingParams(), None, False)) is not None:
        out.append(d)
        if len(out) == 20:
            break
    return out


def test_retrieval_prefers_the_longer_match_and_marks_where_it_came_from():
    store = Datastore.from_documents([[10, 11, 12, 13, 14, 15]])
    drafter = RetrievalDrafter(store)
    assert drafter.kind == "retrieval" and drafter.name == "retrieval-8" and not drafter.has_distribution
    # the request never said "11 12" before; the datastore did: its continuation, marked retrieved
    got = draft_all(drafter.open(), [1, 2, 11, 12])
    assert [d.token for d in got] == [13, 14, 15]
    assert all(d.retrieved and d.match_len == 2 for d in got)
    # a longer match in the request's own text wins over a shorter one in the datastore
    got = draft_all(drafter.open(), [5, 11, 12, 7, 8, 5, 11, 12])
    assert [d.token for d in got][:3] == [7, 8, 5] and not got[0].retrieved and got[0].match_len == 3
    # equal length: the request's own text
    got = draft_all(drafter.open(), [11, 12, 99, 11, 12])
    assert got[0].token == 99 and not got[0].retrieved


def test_build_drafter_finds_the_bundled_datastore_or_names_the_field(tiny_target, tmp_path):
    with pytest.raises(InvalidRequest, match="datastore"):
        build_drafter("retrieval", tiny_target)  # nothing bundled for the tiny model
    path = tmp_path / "ds.safetensors"
    Datastore.from_documents([[1, 2, 3]]).save(path)
    assert build_drafter("retrieval", tiny_target, datastore=path).kind == "retrieval"
    assert bundled_datastore_path("no-such-target") is None
    bundled = bundled_datastore_path("smollm2-135m-instruct")
    assert bundled is not None and bundled.stat().st_size < 8 << 20  # shipped in the package, small
    assert build_drafter("retrieval", None, target_name="smollm2-135m-instruct").datastore.tokens > 100_000


def test_alternatives_give_each_next_token_its_own_majority_path():
    docs = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 7, 8], [9, 2, 6]]
    store = Datastore.from_documents(docs)
    ends, length = store.match(np.array([1, 2]))
    assert length == 2
    assert store.alternatives(ends, 4, 8) == [[3, 4], [7, 8]]  # most frequent first
    assert store.alternatives(ends, 1, 1) == [[3]]


def test_session_branches_offer_own_repeats_then_the_datastore():
    store = Datastore.from_documents([[4, 5, 60, 61], [4, 5, 70, 71], [4, 5, 70, 72]])
    session = RetrievalDrafter(store).open()
    # the request said "3 4 5" twice before, followed by 8 and by 9 (most recent first)
    seq = [3, 4, 5, 8, 3, 4, 5, 9, 3, 4, 5]
    got = session.branches(seq, [9], 3)
    assert got[0] == [9, 3, 4]  # the most recent repeat
    assert got[1:3] == [[70, 71], [60, 61]]  # then the datastore, most frequent first (a tie: the lower id)
    assert got[3] == [8, 3, 4]  # then older repeats
    assert all(len(b) <= 3 for b in got)


@pytest.mark.parametrize("rule", ["recent", "majority", "race"])
def test_a_walk_over_few_occurrences_chooses_as_over_many(rule, monkeypatch):
    """A Walk narrows few occurrences in plain Python and many with numpy: the same tokens,
    votes and support either way, ties to the smallest token (random texts of a small
    vocabulary, so that occurrences disagree and tie often)."""
    from specd.drafters import datastore

    rng = np.random.default_rng(0)
    for trial in range(300):
        text = rng.integers(0, 4, 400).astype(np.int32)
        text[rng.random(400) < 0.05] = SEP
        ends = np.sort(rng.choice(390, size=int(rng.integers(1, 40)), replace=False))
        noise = rng.exponential(size=4).astype(np.float32)
        walks = []
        for few in (0, 10_000):  # numpy throughout, Python throughout
            monkeypatch.setattr(datastore, "FEW", few)
            walk, out = datastore.Walk(text, ends, rule, 12), []
            while (got := walk.next(noise)) is not None:
                out.append(got)
            walks.append(out)
        assert walks[0] == walks[1], trial
