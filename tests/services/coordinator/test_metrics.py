"""Prometheus series of the coordinator, draft and target after real requests over loopback
gRPC (tiny models): every series exists, and the numbers agree with each other and with
the requests' own spec_stats (accepted <= drafted, emitted = accepted + verifications,
per-position counts sum to the totals, histograms count what happened)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.common.metrics import catalog, new_registry
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.coordinator.metrics import tag_label
from specd.errors import InvalidRequest
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import eventually

PROMPT = "Hello there, how are"


def total(registry: CollectorRegistry, name: str, **labels) -> float:
    """Sum of every sample called name whose labels include `labels`."""
    return sum(s.value for family in registry.collect() for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def names(registry: CollectorRegistry) -> set[str]:
    return {s.name for family in registry.collect() for s in family.samples}


async def _requests(coord: Coordinator, requests: list[GenerateRequest]) -> list[FinishEvent | Exception]:
    out = []
    for request in requests:
        try:
            async for event in coord.generate(request):
                if isinstance(event, FinishEvent):
                    out.append(event)
        except InvalidRequest as e:
            out.append(e)
    return out


def _request(policy: str, n: int = 24, **kw) -> GenerateRequest:
    """Sequential (PEARL off): whole windows are verified, so every draft position shows up
    (with overlap a draft no faster than the target is verified a token at a time)."""
    return GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=n), spec=SpecParams(policy, **kw),
                           overlap=False)


@pytest.fixture(scope="module")
def served(target_service, hf_draft_service):
    """Four requests (constant, heuristic with a task tag, target-only, one invalid) and one
    client that leaves after its first tokens, through one coordinator; the target's and
    draft's metrics are read as differences around them (their services are shared)."""
    t_reg, d_reg = target_service.servicer.registry, hf_draft_service.servicer.registry
    before = {"verify": total(t_reg, "specd_verify_seconds_count"),
              "draft_tokens": total(d_reg, "specd_draft_tokens_total"),
              "draft_steps": total(d_reg, "specd_draft_step_seconds_count"),
              "windows": total(d_reg, "specd_draft_windows_total"),
              "draft_ok": total(d_reg, "specd_grpc_requests_total", method="Session", code="OK")}
    registry = new_registry()

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                            AsyncMemoryStateStore(), registry)
        await coord.connect()
        try:
            done = await _requests(coord, [_request("constant"), _request("heuristic", task_tag="code"),
                                           _request("none"), _request("constant", policy_params={"nope": 1})])
            events = coord.generate(_request("constant", 64))  # the client goes away mid-answer
            await anext(events)
            await events.aclose()
            return done
        finally:
            await coord.close()

    finishes = asyncio.run(run())
    return registry, finishes, before, t_reg, d_reg


def test_every_coordinator_series_is_exported(served):
    registry = served[0]
    exported = names(registry)
    for name in ["specd_requests_total", "specd_drafted_tokens_total", "specd_accepted_tokens_total",
                 "specd_emitted_tokens_total", "specd_verifications_total", "specd_drafted_tokens_by_position_total",
                 "specd_accepted_tokens_by_position_total", "specd_generation_seconds_total",
                 "specd_target_only_seconds_total", "specd_draft_length_tokens_bucket",
                 "specd_accepted_length_tokens_bucket", "specd_request_duration_seconds_bucket",
                 "specd_time_to_first_token_seconds_bucket", "specd_inter_token_latency_seconds_bucket",
                 "specd_policy_state", "specd_active_sessions", "process_resident_memory_bytes"]:
        assert name in exported, name
    assert exported - {"specd_fallbacks_total"} <= catalog() | {"process_max_fds", "process_open_fds"}


def test_requests_are_counted_by_status(served):
    registry = served[0]
    assert total(registry, "specd_requests_total", status="ok") == 3
    assert total(registry, "specd_requests_total", status="invalid_argument") == 1
    assert total(registry, "specd_requests_total", status="cancelled") == 1
    assert total(registry, "specd_requests_total", policy="none", drafter="none") == 1
    assert total(registry, "specd_active_sessions", service="coordinator") == 0


def test_token_counters_agree_with_spec_stats(served):
    registry, finishes = served[0], served[1]
    ok = [f for f in finishes if isinstance(f, FinishEvent)]
    assert len(ok) == 3 and all(f.finish_reason == "length" for f in ok)
    for policy in ("constant", "heuristic", "none"):
        stats = [f.spec_stats for f in ok if f.spec_stats["policy"] == policy]
        assert len(stats) == 1, policy
        s = stats[0]
        drafted = total(registry, "specd_drafted_tokens_total", policy=policy)
        accepted = total(registry, "specd_accepted_tokens_total", policy=policy)
        verifications = total(registry, "specd_verifications_total", policy=policy)
        emitted = total(registry, "specd_emitted_tokens_total", policy=policy)
        # The cancelled constant request recorded no tokens: only finished requests count.
        assert (drafted, accepted, verifications, emitted) == (s["drafted"], s["accepted"], s["verifications"],
                                                             s["new_tokens"]), policy
        assert accepted <= drafted
        assert emitted == accepted + verifications  # every verification: its accepted drafts + one token
    assert total(registry, "specd_accepted_tokens_total", policy="constant") > 0  # speculation happened


def test_per_position_counts_and_histograms_sum_to_the_totals(served):
    registry = served[0]
    for policy in ("constant", "heuristic"):
        drafted = total(registry, "specd_drafted_tokens_total", policy=policy)
        accepted = total(registry, "specd_accepted_tokens_total", policy=policy)
        assert total(registry, "specd_drafted_tokens_by_position_total", policy=policy) == drafted
        assert total(registry, "specd_accepted_tokens_by_position_total", policy=policy) == accepted
        first = total(registry, "specd_drafted_tokens_by_position_total", policy=policy, position="1")
        second = total(registry, "specd_drafted_tokens_by_position_total", policy=policy, position="2")
        assert first >= second > 0  # a draft position is reached only through the ones before it
        assert total(registry, "specd_draft_length_tokens_sum", policy=policy) == drafted
        assert total(registry, "specd_accepted_length_tokens_sum", policy=policy) == accepted
        assert total(registry, "specd_draft_length_tokens_count", policy=policy) == first
        assert total(registry, "specd_request_duration_seconds_count", policy=policy) == 1
        # The client that left after its first tokens had a first token too.
        assert total(registry, "specd_time_to_first_token_seconds_count", policy=policy) == (
            2 if policy == "constant" else 1)
    emitted = total(registry, "specd_emitted_tokens_total")
    # One observation per token after each request's first event (which may carry several).
    assert 0 < total(registry, "specd_inter_token_latency_seconds_count") <= emitted - 3


def test_speedup_series_prices_the_target_alone(served):
    registry = served[0]
    for policy in ("constant", "heuristic", "none"):
        generation = total(registry, "specd_generation_seconds_total", policy=policy)
        target_only = total(registry, "specd_target_only_seconds_total", policy=policy)
        assert generation > 0 and target_only > 0, policy
        assert total(registry, "specd_request_duration_seconds_sum", policy=policy) == pytest.approx(generation)
        waits = (total(registry, "specd_draft_wait_seconds_total", policy=policy)
                 + total(registry, "specd_verify_wait_seconds_total", policy=policy))
        assert 0 < waits <= generation, policy


def test_policy_state_gauge_follows_the_task_tag(served):
    registry = served[0]
    k = total(registry, "specd_policy_state", policy="heuristic", task_tag=tag_label("code"), key="k")
    assert k >= 1  # the heuristic's adapted draft length after the request
    assert 'task_tag="code"' not in generate_latest(registry).decode()  # no client's text on /metrics
    assert total(registry, "specd_policy_state", policy="constant") == 0  # a stateless policy: no series


def test_target_and_draft_series_count_the_work(served):
    _, finishes, before, t_reg, d_reg = served
    ok = [f.spec_stats for f in finishes if isinstance(f, FinishEvent)]
    verifications = sum(s["verifications"] for s in ok)
    # The cancelled request also verified something before it went away.
    assert total(t_reg, "specd_verify_seconds_count") - before["verify"] > verifications
    assert total(t_reg, "specd_verify_seconds_count", window="0") > 0  # target-only steps
    assert total(t_reg, "specd_target_decode_seconds_per_token") > 0
    assert total(t_reg, "specd_target_token_seconds") > 0  # the time per token the sessions saw
    assert total(t_reg, "specd_verify_last_batch_size") >= 1
    drafted = total(d_reg, "specd_draft_tokens_total") - before["draft_tokens"]
    assert drafted >= sum(s["drafted"] for s in ok)  # the cancelled request drafted too
    assert total(d_reg, "specd_draft_step_seconds_count") - before["draft_steps"] >= drafted
    assert total(d_reg, "specd_draft_windows_total") - before["windows"] > 0
    eventually(lambda: total(d_reg, "specd_grpc_requests_total", method="Session", code="OK")
               - before["draft_ok"] >= 2)
    for reg, service in ((t_reg, "target"), (d_reg, "draft")):
        eventually(lambda: total(reg, "specd_active_sessions", service=service) == 0)  # noqa: B023
        eventually(lambda: total(reg, "specd_kv_cache_bytes", service=service) == 0)  # noqa: B023
        assert b"specd_kv_cache_bytes" in generate_latest(reg)


def test_kv_bytes_are_counted_while_a_session_is_open(target_service, hf_draft_service):
    """The KV gauge reads the open sessions' caches, so it is > 0 mid-request."""
    t_reg, d_reg = target_service.servicer.registry, hf_draft_service.servicer.registry
    seen = {}

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                            AsyncMemoryStateStore())
        await coord.connect()
        try:
            events = coord.generate(_request("constant", 64))
            async for _ in events:
                seen["target"] = total(t_reg, "specd_kv_cache_bytes", service="target")
                seen["draft"] = total(d_reg, "specd_kv_cache_bytes", service="draft")
                seen["sessions"] = total(t_reg, "specd_active_sessions", service="target")
                break
            await events.aclose()
        finally:
            await coord.close()

    asyncio.run(run())
    assert seen["target"] > 0 and seen["draft"] > 0 and seen["sessions"] >= 1


def test_fallbacks_are_counted(target_service):
    registry = new_registry()

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, "127.0.0.1:1"), AsyncMemoryStateStore(),
                            registry)
        await coord.connect()
        try:
            return await _requests(coord, [_request("heuristic", 8)])
        finally:
            await coord.close()

    (finish,) = asyncio.run(run())
    assert finish.spec_stats["fallback"]
    assert total(registry, "specd_fallbacks_total", policy="heuristic") == 1
    assert total(registry, "specd_fallbacks_total", policy="heuristic", reason="unavailable") == 1
    assert {s.labels["reason"] for f in registry.collect() for s in f.samples
            if s.name == "specd_fallbacks_total"} == {"unavailable", "failed", "stalled"}
    assert total(registry, "specd_requests_total", status="ok") == 1


def test_invalid_grpc_calls_are_counted_with_their_code(target_service):
    """The interceptor counts each call by its final status code."""
    import grpc

    from services.common.server import channel
    from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc

    reg = target_service.servicer.registry
    before = total(reg, "specd_grpc_requests_total", method="Session", code="INVALID_ARGUMENT")

    async def run():
        async with channel(target_service.address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=10)
            await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify()))  # no Open first
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            return e.value.code()

    assert asyncio.run(run()) == grpc.StatusCode.INVALID_ARGUMENT
    eventually(lambda: total(reg, "specd_grpc_requests_total", method="Session", code="INVALID_ARGUMENT") > before)
    assert total(reg, "specd_grpc_requests_total", method="Session", code="INVALID_ARGUMENT") == before + 1


def test_a_finished_request_ends_its_sessions_with_ok(target_service, hf_draft_service):
    """The coordinator closes both streams and waits for each service's status before it lets
    the calls go, so a clean finish is an OK session on the target and the draft by the time
    the request's last event is out, never a cancelled one. Before, the draft's was cancelled
    as soon as its `closed` message arrived (sometimes counted CANCELLED), and the target's
    was never closed at all (always CANCELLED)."""
    t_reg, d_reg = target_service.servicer.registry, hf_draft_service.servicer.registry

    def sessions(code: str) -> tuple[float, float]:
        return tuple(total(reg, "specd_grpc_requests_total", method="Session", code=code)
                     for reg in (t_reg, d_reg))

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                            AsyncMemoryStateStore(), new_registry())
        await coord.connect()
        try:
            for overlap in (False, True) * 25:
                ok, cancelled = sessions("OK"), sessions("CANCELLED")
                request = dataclasses.replace(_request("constant", 8), overlap=overlap)
                finishes = await _requests(coord, [request])
                assert finishes[0].finish_reason == "length" and not finishes[0].spec_stats["fallback"]
                assert [a - b for a, b in zip(sessions("OK") + sessions("CANCELLED"), ok + cancelled)] == [
                    1, 1, 0, 0], overlap  # target and draft OK, neither cancelled
        finally:
            await coord.close()

    asyncio.run(run())
