"""Requests of one state key that run at once all keep what they learned: each folds its own
decayed observations into what the others saved (specd.state.StateUpdate), as if they had
run one after another; a policy whose state is values is saved whole, last writer wins."""

from __future__ import annotations

import pytest

from specd.costs import CostCurve
from specd.policies import PolicyResources, build_policy
from specd.state import MemoryStateStore, StateKey, StateUpdate
from specd.types import DraftStep, RoundOutcome

KEY = StateKey("draft", "target", "cost-aware")
CPU = CostCurve(0.0001, [1, 2, 4, 6, 8, 17], [0.033, 0.045, 0.053, 0.053, 0.062, 0.075])


def ngram(index: int, match_len: int) -> DraftStep:
    return DraftStep(index, index - 1, 7, 1.0, 1.0, 0.0, None, match_len)


def learn(state: dict, rounds: list[tuple[int, int, int]]):
    """A cost-aware request from `state` that verifies windows of (drafted, accepted, match
    length) and times each round: the policy at its end."""
    p = build_policy("cost-aware", {}, state, PolicyResources(costs=CPU))
    for drafted, accepted, match in rounds:
        p.observe(RoundOutcome.judged([ngram(i, match) for i in range(1, drafted + 1)], accepted, False))
        p.observe_pace(accepted + 1, 0.05, drafted > 0)
    return p


A = [(3, 3, 2), (2, 0, 2), (4, 2, 5)] * 5
B = [(1, 1, 2), (3, 1, 5), (2, 2, 8)] * 7


def test_concurrent_requests_fold_like_sequential_ones():
    start = learn({}, [(2, 1, 2), (3, 3, 5)] * 4).state()
    store = MemoryStateStore()
    store.save(KEY, start)
    a, b = learn(start, A), learn(start, B)  # both loaded the same state
    for p in (a, b):
        store.update(KEY, StateUpdate.between(start, p.state(), p.state_scale()))
    one_after_another = learn(learn(start, A).state(), B).state()
    saved = store.load(KEY)
    assert saved.keys() == one_after_another.keys()
    for key, value in one_after_another.items():
        assert saved[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # Last writer wins would have kept only B's learning: A's bins would miss its 15 rounds.
    assert saved["n5i1:a"] > b.state()["n5i1:a"] + 1


def test_alone_an_update_saves_the_request_end_state():
    start = learn({}, [(2, 1, 2)] * 3).state()
    p = learn(start, A)
    store = MemoryStateStore()
    store.save(KEY, start)
    store.update(KEY, StateUpdate.between(start, p.state(), p.state_scale()))
    assert store.load(KEY) == pytest.approx(p.state(), rel=1e-12)
    # From nothing saved (a first request, or an expired key): the request's own observations.
    empty = MemoryStateStore()
    empty.update(KEY, StateUpdate.between({}, learn({}, A).state(), learn({}, A).state_scale()))
    assert empty.load(KEY) == pytest.approx(learn({}, A).state(), rel=1e-12)


def test_a_state_of_values_is_saved_whole():
    store = MemoryStateStore()
    store.save(KEY, {"k": 4.0, "old": 1.0})
    store.update(KEY, StateUpdate.between({"k": 4.0, "old": 1.0}, {"k": 5.0}, {}))
    assert store.load(KEY) == {"k": 5.0}
    store.update(KEY, StateUpdate.between({"k": 5.0}, {}, {}))
    assert store.load(KEY) == {}
