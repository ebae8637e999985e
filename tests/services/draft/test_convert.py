"""The draft service's conversion: an Open message it cannot take is an InvalidRequest naming
the field (the servicer only converts and starts the runner)."""

from __future__ import annotations

import pytest

from services.draft.convert import open_from_proto
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.draft.v1 import draft_pb2
from specd.errors import InvalidRequest


def open_msg(**kw) -> draft_pb2.OpenDraft:
    base = dict(prompt_ids=[5, 9, 14], policy="constant",
                max_length=64, lookahead=2, vocab_size=100)
    return draft_pb2.OpenDraft(**{**base, **kw})


def test_a_good_open_becomes_a_draft_open():
    o = open_from_proto(open_msg(policy_params={"k": 3.0}, send_distributions=True))
    assert (o.prompt, o.spec.policy, o.spec.policy_params, o.lookahead, o.max_length) == (
        [5, 9, 14], "constant", {"k": 3.0}, 2, 64)
    assert o.send_distributions and o.vocab_size == 100 and o.sampling.greedy


@pytest.mark.parametrize("kw, field", [
    ({"prompt_ids": []}, "prompt"),
    ({"policy": "none"}, "policy"),
    ({"policy": "no-such-policy"}, "policy"),
    ({"lookahead": 3}, "lookahead"),
    ({"sampling": common_pb2.Sampling(temperature=-1.0)}, "temperature"),
])
def test_an_open_it_cannot_take_names_the_field(kw, field):
    with pytest.raises(InvalidRequest) as e:
        open_from_proto(open_msg(**kw))
    assert e.value.field == field


def test_the_cost_curve_comes_from_the_targets_numbers():
    msg = open_msg(policy="cost-aware", costs=common_pb2.Costs(verify_seconds=[0.03, 0.035, 0.04],
                                                               round_overhead_seconds=0.001, batch_seconds=[0.03, 0.032],
                                                               batch_token_seconds=[0.002, 0.002]))
    curve = open_from_proto(msg).costs.curve(0.005)
    assert (curve.t_draft, curve.ks, curve.overhead) == (0.005, [1, 2, 3], 0.001)
    assert curve.round_time(1) == pytest.approx(0.005 + 0.035 + 0.001)
    with pytest.raises(InvalidRequest, match="cost curve"):
        open_from_proto(open_msg(policy="cost-aware")).costs.curve(0.005)
    with pytest.raises(InvalidRequest) as e:
        open_from_proto(open_msg(costs=common_pb2.Costs(verify_seconds=[0.03], batch_seconds=[0.03, 0.04],
                                                        batch_token_seconds=[0.1]))).costs.curve(0.005)
    assert e.value.field == "costs.batch_token_seconds"
