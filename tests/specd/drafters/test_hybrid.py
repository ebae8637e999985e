"""The hybrid drafter: the model's chain, the lookup drafter's own proposal as its first branch."""

from __future__ import annotations

import pytest

from specd.drafters import (
    Datastore,
    EarlyExitDrafter,
    FeatureDrafter,
    HybridDrafter,
    NgramDrafter,
    RetrievalDrafter,
    build_drafter,
)
from specd.errors import InvalidRequest
from specd.runtime.session import KVSession
from specd.types import SamplingParams

GREEDY = SamplingParams()
SEQ = [1, 2, 3, 5, 1, 2, 4, 0, 1, 2, 3, 6, 8, 1, 2]  # after [1, 2]: 3 twice, 4 once


def lookup_alone(drafter, seq, params, n, vocab):
    s, ext, out = drafter.open(vocab), list(seq), []
    while len(out) < n and (d := s.next(ext, params, None, False)) is not None:
        out.append(d.token)
        ext.append(d.token)
    return out


def test_hybrid_drafts_the_models_tokens(tiny_target):
    model = EarlyExitDrafter(tiny_target, 2)
    session = HybridDrafter(model, NgramDrafter()).open()
    want, _ = KVSession(model.forward, tiny_target.device).extend(SEQ, 1)
    d = session.next(SEQ, GREEDY, None, False)
    assert d.token == int(want[0].argmax()) and d.q is not None
    assert session.kv.length == len(SEQ)
    session.rollback(4)
    assert session.kv.length == 4
    session.close()


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, 0, 1.0, 3, 16)])
def test_hybrid_branches_lead_with_what_the_lookup_would_draft(tiny_target, params):
    """First branch: the lookup drafter's own proposal (with a seed, its race choice); then its
    alternatives. Asking leaves no stale walk behind."""
    lookup = NgramDrafter()
    session = HybridDrafter(EarlyExitDrafter(tiny_target, 2), lookup).open()
    own = lookup_alone(lookup, SEQ, params, 4, tiny_target.vocab_size)
    got = session.branches(SEQ, [], 4, params)
    assert got[0] == own and len(own) == 4
    assert got[1:] == lookup.open().branches(SEQ, [], 4, params)
    assert session.branches(SEQ + [own[0]], [], 3, params)[0] == own[1:4]


def test_hybrid_needs_a_model_and_a_lookup_drafter(tiny_target):
    with pytest.raises(ValueError, match="hybrid"):
        HybridDrafter(NgramDrafter(), NgramDrafter())
    with pytest.raises(ValueError, match="hybrid"):
        HybridDrafter(EarlyExitDrafter(tiny_target, 2), EarlyExitDrafter(tiny_target, 2))
    with pytest.raises(ValueError, match="hybrid.*not feature"):  # it drafts from the target's features
        HybridDrafter(FeatureDrafter(tiny_target), NgramDrafter())


def test_build_hybrid(tiny_target, tmp_path):
    path = tmp_path / "store.safetensors"
    Datastore.from_documents([[1, 2, 3]]).save(path)
    drafter = build_drafter("hybrid", tiny_target, draft_layers=2, datastore=path)
    assert isinstance(drafter.model, EarlyExitDrafter) and isinstance(drafter.lookup, RetrievalDrafter)
    assert drafter.name == f"{drafter.model.name}+{drafter.lookup.name}"
    with pytest.raises(InvalidRequest, match="datastore"):  # none bundled for the tiny target
        build_drafter("hybrid", tiny_target, draft_layers=2)
