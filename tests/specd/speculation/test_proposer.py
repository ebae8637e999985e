"""The draft side of the round (specd.speculation.proposer) on its own: what it drafts after a
commit. The drivers that move it are tested in tests/services/test_drivers.py."""

from __future__ import annotations

from specd.drafters import build_drafter
from specd.policies import PolicyResources, request_policy
from specd.speculation.proposer import Commit, Proposer, Token
from specd.types import SamplingParams, SpecParams

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3]  # "1 2 3" was followed by "4 5 1 ...": a lookup drafts 4, 5, 1


def draft_window(p: Proposer, events: list) -> list[int]:
    while (ready := p.prepare()) is not None:
        window, epoch, after = ready
        p.drafted(window, epoch, after, p.next(after), 0.0)
    tokens = [e.token for e in events if isinstance(e, Token)]
    events.clear()
    return tokens


def test_a_dropped_draft_leaves_nothing_of_itself_in_the_session():
    """A policy drops the second draft (5): the window is [4], and the target commits 4 then 9.
    The next window is drafted from the committed text as a fresh session would draft it, not
    from the lookup's walk past the dropped token (which would go on with 1, and the oracle
    would keep it)."""
    oracle = request_policy(SpecParams("oracle"), {}, PolicyResources((4, 9, 1, 2, 3), None), lambda: None)
    events: list = []
    p = Proposer(build_drafter("ngram", None).open(64), oracle, SamplingParams(), list(PROMPT), max_length=40,
                 lookahead=1, send_q=False, publish=events.append)
    assert draft_window(p, events) == [4]
    p.commit(Commit(1, (4, 9), num_verified=1, num_strict=1))
    events.clear()
    committed = PROMPT + [4, 9]
    fresh = build_drafter("ngram", None).open(64).next(committed, SamplingParams(), None, False)
    assert draft_window(p, events) == ([fresh.token] if fresh is not None else [])
