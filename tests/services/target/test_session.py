"""TargetSession's rules for a window it is sent: what it cannot verify losslessly is refused
before any forward, naming the field."""

from __future__ import annotations

import pytest

from services.target.session import TargetSession
from specd.errors import InvalidRequest
from specd.speculation.verifier import MAX_TOP_LOGPROBS
from specd.types import SamplingParams

GREEDY, SAMPLED = SamplingParams(max_new_tokens=8), SamplingParams(temperature=1.0, max_new_tokens=8)


@pytest.fixture
def session(tiny_target):
    def open_(sampling: SamplingParams) -> TargetSession:
        s = TargetSession(tiny_target, [1, 2, 3], sampling)
        sessions.append(s)
        return s

    sessions: list[TargetSession] = []
    yield open_
    for s in sessions:
        s.close()


@pytest.mark.parametrize("sampling, drafts, probs, dists, relaxed, top_k, field", [
    # sampling against a point mass when x was drawn from a real q would not be lossless
    (SAMPLED, [5, 6], [1.0, 0.5], False, False, 0, "distributions"),
    (SAMPLED, [5, 6], [1.0], False, False, 0, "probs"),
    (GREEDY, [5, 6], [], False, True, 0, "distributions"),  # relaxed needs q
    (GREEDY, [5], [], False, False, MAX_TOP_LOGPROBS + 1, "top_logprobs"),
])
def test_a_window_it_cannot_verify_losslessly_is_refused(session, sampling, drafts, probs, dists, relaxed,
                                                         top_k, field):
    with pytest.raises(InvalidRequest) as e:
        session(sampling).check_window(drafts, probs, dists, relaxed, top_k)
    assert e.value.field == field


@pytest.mark.parametrize("sampling, drafts, probs, dists", [
    (SAMPLED, [5, 6], [1.0, 1.0], False),  # point masses (n-gram): lossless without q
    (SAMPLED, [5, 6], [0.3, 0.5], True),
    (GREEDY, [5, 6], [0.3, 0.5], False),  # greedy verification needs no q
])
def test_windows_it_can_verify_pass(session, sampling, drafts, probs, dists):
    session(sampling).check_window(drafts, probs, dists, False, 8)
