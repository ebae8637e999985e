"""Draft distributions cross the wire exactly (lossless verification depends on it)."""

from __future__ import annotations

import pytest
import torch

from services.common.convert import distribution_from_proto, distribution_to_proto, sampling_from_proto, sampling_to_proto
from specd.sampling import logits_to_probs
from specd.types import SamplingParams


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=6), SamplingParams(1.3, top_p=0.5)])
def test_distributions_round_trip_bit_exactly(params):
    torch.manual_seed(0)
    q = logits_to_probs(torch.randn(1000) * 4, params)
    msg = distribution_to_proto(q)
    sparse = int((q > 0).sum()) <= 500
    assert msg.WhichOneof("encoding") == ("sparse" if sparse else "dense_f32")
    assert torch.equal(distribution_from_proto(msg, 1000, torch.device("cpu")), q)


def test_a_distribution_of_the_wrong_size_is_refused():
    msg = distribution_to_proto(torch.full((10,), 0.1))
    with pytest.raises(ValueError, match="10 entries"):
        distribution_from_proto(msg, 12, torch.device("cpu"))


def test_sampling_round_trips_and_unset_means_greedy():
    s = SamplingParams(0.8, 5, 0.9, 42)
    assert sampling_from_proto(sampling_to_proto(s)) == SamplingParams(0.8, 5, 0.9, 42, 1)
    unset = sampling_from_proto(sampling_to_proto(SamplingParams()).__class__())
    assert unset.greedy and unset.top_p == 1.0 and unset.seed is None


def test_features_and_top_logprobs_round_trip_and_bad_ones_are_refused():
    from services.common.convert import (
        features_from_proto,
        features_to_proto,
        top_logprobs_from_proto,
        top_logprobs_to_proto,
    )
    from services.draft.convert import commit_from_proto
    from services.proto.specd.draft.v1 import draft_pb2
    from specd.dvi import top_logprobs
    from specd.errors import InvalidRequest

    h = torch.randn(3, 8)
    start, back = features_from_proto(features_to_proto(5, h))
    assert start == 5 and torch.equal(back, h)
    assert features_from_proto(features_to_proto(0, h[:0])) is None
    lp, ids = top_logprobs(torch.randn(2, 30), 4)
    for (i, l), want_i, want_l in zip(top_logprobs_from_proto(top_logprobs_to_proto((lp, ids))), ids, lp):
        assert torch.equal(i, want_i) and torch.allclose(l, want_l)
    bad = features_to_proto(0, h)
    bad.rows = 4
    with pytest.raises(InvalidRequest, match="features"):
        commit_from_proto(draft_pb2.Commit(tokens=[1], num_verified=1, features=bad))
    with pytest.raises(InvalidRequest, match="top_logprobs"):
        commit_from_proto(draft_pb2.Commit(tokens=[1], num_verified=0, top_logprobs=top_logprobs_to_proto((lp, ids))))
