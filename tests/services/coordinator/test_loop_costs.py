"""What target-only decoding would have cost, as the coordinator reports it for the speedup
series and its alert: a plain step at the load each verification saw, so a loaded target is not
mistaken for speculation that does not pay. And the round-trip overhead it follows for the
cost-aware policy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.coordinator.coordinator import Coordinator
from services.coordinator.loop import LoopConfig, RequestLoop
from services.proto.specd.target.v1 import target_pb2
from specd.cost_model import COORDINATOR, CostModel, smoothed
from specd.types import SamplingParams, SpecParams

SURFACE = (0.040, 0.043, 0.046, 0.049, 0.052, 0.055, 0.058, 0.060)  # B sessions x 1 token, B = 1..8


def _loop(surface=SURFACE) -> RequestLoop:
    cfg = LoopConfig(prompt=[1, 2, 3], sampling=SamplingParams(max_new_tokens=64), spec=SpecParams("cost-aware"),
                     max_length=67, vocab_size=100, timeout_s=10.0, draft_stall_s=10.0, drafter="ngram",
                     batch_seconds=surface)
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


def test_round_overhead_counts_each_measured_round_once():
    """The coordinator's round-trip overhead: a request's mean over its rounds, weighed like that
    many single rounds (the first request sets it)."""
    coordinator = SimpleNamespace(costs=CostModel(COORDINATOR))

    def finished(mean: float, rounds: int) -> SimpleNamespace:
        return SimpleNamespace(stats=SimpleNamespace(target_decode_s_per_token=0.0),
                               overhead_s=mean * rounds, overhead_n=rounds)

    Coordinator._follow_costs(coordinator, finished(0.010, 3))
    assert coordinator.costs.value("round_overhead") == pytest.approx(0.010)
    Coordinator._follow_costs(coordinator, finished(0.020, 40))
    singles = 0.010
    for _ in range(40):
        singles = smoothed(singles, 0.020)
    assert coordinator.costs.value("round_overhead") == pytest.approx(singles)
    Coordinator._follow_costs(coordinator, finished(0.5, 0))  # no round measured: nothing moves
    assert coordinator.costs.value("round_overhead") == pytest.approx(singles)


def test_a_write_that_raced_a_refusal_reports_the_refusal():
    """grpc.aio marks a call INTERNAL ("Internal error from Core") the moment a write fails because
    the service already ended it, then replaces that with the service's own status when it arrives.
    A refused session must surface as Overloaded (the gateway's 503 with Retry-After), not as an
    internal error: make test once saw the race."""
    import asyncio

    import grpc

    from services.coordinator.loop import CORE_ERROR
    from specd.errors import Overloaded

    class RacingCall:  # the call's status as grpc.aio reports it: the core's first, the service's later
        def __init__(self):
            self.asked = 0

        async def code(self):
            self.asked += 1
            return grpc.StatusCode.INTERNAL if self.asked < 3 else grpc.StatusCode.RESOURCE_EXHAUSTED

        async def details(self):
            return CORE_ERROR if self.asked < 3 else "all 1 KV slots are in use"

    loop = _loop()
    loop.target_call = RacingCall()
    assert isinstance(asyncio.run(loop._target_ended()), Overloaded)
