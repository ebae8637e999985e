"""What target-only decoding would have cost, as the coordinator reports it for the speedup
series and its alert: a plain step at the load each verification saw, so a loaded target is not
mistaken for speculation that does not pay."""

from __future__ import annotations

import pytest

from services.coordinator.loop import LoopConfig, RequestLoop
from services.proto.specd.target.v1 import target_pb2
from specd.types import SamplingParams, SpecParams

SURFACE = (0.040, 0.043, 0.046, 0.049, 0.052, 0.055, 0.058, 0.060)  # B sessions x 1 token, B = 1..8


def _loop(surface=SURFACE) -> RequestLoop:
    cfg = LoopConfig([1, 2, 3], SamplingParams(max_new_tokens=64), SpecParams("cost-aware"), False, 67,
                     frozenset(), 100, False, {}, 10.0, 10.0, "ngram", batch_seconds=surface)
    return RequestLoop(cfg, None, None)


def test_target_only_cost_follows_the_load_of_each_verification():
    loop = _loop()
    # Alone: a plain step costs the decode cost the target reports (drifted 10% above start-up).
    loop._record(2, 1, target_pb2.Verified(batch_size=1, decode_seconds_per_token=0.044))
    assert loop.stats.target_only_s_per_token == pytest.approx(0.044)
    # Then with 7 others: the 8-session step, scaled by the same drift, for each of 3 tokens.
    loop._record(4, 2, target_pb2.Verified(batch_size=8, decode_seconds_per_token=0.044))
    assert loop.stats.target_only_s_per_token == pytest.approx((2 * 0.044 + 3 * 0.060 * 1.1) / 5)
    assert loop.stats.target_decode_s_per_token == 0.044  # the unloaded cost stays what it was
    assert loop.stats.to_dict()["target_only_s_per_token"] > loop.stats.to_dict()["target_decode_s_per_token"]


def test_without_a_surface_the_decode_cost_is_the_baseline():
    loop = _loop(surface=())
    loop._record(0, 0, target_pb2.Verified(batch_size=8, decode_seconds_per_token=0.05))
    assert loop.stats.target_only_s_per_token == pytest.approx(0.05)
