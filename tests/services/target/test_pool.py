"""The target service on a KV pool, over real gRPC: chunked prefill gives the same verdicts and
hidden states as a whole prefill, a session beyond the pool's slots is refused at once with
RESOURCE_EXHAUSTED (and none of the open ones is disturbed), and closing frees the slot."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import grpc
import pytest
import torch

from services.common.convert import features_from_proto
from services.common.server import channel
from services.common.settings import TargetSettings
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.main import start as start_target
from services.target.admission import fair_share
from services.target.servicer import TargetServicer

from tests.services.conftest import Service, eventually

PROMPT = [5, 9, 14, 20, 33, 40, 7, 11]


@pytest.fixture(scope="module")
def pooled_service(service_loop, chat_pair):
    target = replace(chat_pair[0])  # the same weights; the fixture's own model keeps no pool
    target.use_pool(2, 128)
    servicer = TargetServicer(target, prefill_chunk=3)  # the prompt is prefilled in three forwards
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    yield svc
    svc.stop()


async def _open(stub, prompt=PROMPT, features=False, tenant=""):
    call = stub.Session(timeout=20)
    await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(prompt_ids=prompt, features=features,
                                                                         tenant=tenant)))
    return call


async def _close(call):
    await call.write(target_pb2.TargetRequest(close=target_pb2.CloseTarget()))
    await call.read()  # the Closed reply
    await call.done_writing()


async def _verify(call, tokens, verify_id=1):
    await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=verify_id, tokens=tokens,
                                                                       probs=[1.0] * len(tokens))))
    return (await call.read()).verified


def test_chunked_prefill_gives_the_whole_prefills_verdict_and_features(chat_pair, pooled_service):
    model = chat_pair[0].model
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_hidden_states=True)
    greedy = int(out.logits[0, -1].argmax())

    async def run():
        async with channel(pooled_service.address) as ch:
            call = await _open(target_pb2_grpc.TargetServiceStub(ch), features=True)
            verdict = await _verify(call, [greedy, (greedy + 1) % chat_pair[0].vocab_size])
            await call.done_writing()
            return verdict

    verdict = asyncio.run(run())
    assert verdict.num_accepted == 1
    start, feats = features_from_proto(verdict.features)
    assert start == 0 and feats.shape[0] == len(PROMPT) + 1
    torch.testing.assert_close(feats[:len(PROMPT)], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)


def test_a_session_beyond_the_slots_is_refused_and_the_others_go_on(chat_pair, pooled_service):
    pool = pooled_service.servicer.target.pool
    registry, labels = pooled_service.servicer.registry, {"model": chat_pair[0].name}
    refused_before = registry.get_sample_value("specd_target_refused_sessions_total", labels) or 0.0

    async def run():
        async with channel(pooled_service.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            held = [await _open(stub), await _open(stub, PROMPT[:5])]
            first = [await _verify(c, []) for c in held]  # both open and served
            extra = await _open(stub)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert registry.get_sample_value("specd_target_kv_slots_in_use", labels) == 2
            assert registry.get_sample_value("specd_target_kv_slots", labels) == 2
            assert registry.get_sample_value("specd_target_refused_sessions_total", labels) == refused_before + 1
            again = [await _verify(c, [], 2) for c in held]  # neither open session was disturbed
            assert all(a.num_accepted == 0 for a in again)
            await _close(held[0])
            await asyncio.sleep(0.2)  # the slot is freed on the compute thread, behind any forward
            replacement = await _open(stub)
            assert (await _verify(replacement, [])).next_token == first[0].next_token
            for c in (held[1], replacement):
                await _close(c)
            return first

    asyncio.run(run())
    for _ in range(50):  # closing is queued on the compute thread
        if pool.in_use() == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert pool.in_use() == 0


def test_fair_shares_of_the_last_slots():
    # 16 slots, 2 kept: above them anyone is admitted; within them only a tenant under
    # ceil(16 / (tenants open + 1)).
    assert fair_share("a", ["a"] * 13, 3, 16, 0.125) == ""
    assert "fair share" in fair_share("a", ["a"] * 14, 2, 16, 0.125)
    assert fair_share("b", ["a"] * 14, 2, 16, 0.125) == ""
    assert fair_share("b", ["a"] * 14 + ["b"], 1, 16, 0.125) == ""  # 1 < ceil(16 / 3)
    assert "fair share" in fair_share("c", ["a"] * 9 + ["c"] * 6, 1, 16, 0.125)  # 6 >= ceil(16 / 3)
    assert fair_share("", [""] * 15, 1, 16, 0.125) == ""  # no tenant named: first come, first served
    assert fair_share("a", ["a"] * 15, 1, 16, 0.0) == ""  # no reserve


def test_the_last_slot_goes_to_a_tenant_under_its_fair_share(pooled_service):
    """Two slots, one kept (the reserve, 1/8, rounds up): tenant a takes one, is refused the
    last, which tenant b gets. Before, a took both and b was refused."""
    pool = pooled_service.servicer.target.pool

    async def run():
        async with channel(pooled_service.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            first = await _open(stub, tenant="ka")
            await _verify(first, [])
            hog = await _open(stub, tenant="ka")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await hog.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "fair share" in refused.value.details()
            other = await _open(stub, tenant="kb")
            assert (await _verify(other, [])).next_token >= 0  # served
            for c in (first, other):
                await _close(c)

    asyncio.run(run())
    eventually(lambda: pool.in_use() == 0)


def test_a_tenants_second_session_copies_the_prompt_prefix_it_shares(pooled_service):
    """Two sessions of one tenant with a 40-token prompt in common: the second takes the first's
    39 cached positions instead of prefilling them, and verifies exactly as the first does.
    Another tenant's session prefills its own."""
    registry, labels = pooled_service.servicer.registry, {"model": pooled_service.servicer.target.name}
    shared_before = registry.get_sample_value("specd_target_prefill_shared_tokens_total", labels) or 0.0
    prompt = [(7 * i + 3) % 90 + 5 for i in range(40)]

    async def run(tenants):
        async with channel(pooled_service.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            first = await _open(stub, prompt, tenant=tenants[0])
            a = await _verify(first, prompt[:3])
            second = await _open(stub, prompt, tenant=tenants[1])
            b = await _verify(second, prompt[:3])
            for c in (first, second):
                await _close(c)
            return a, b

    a, b = asyncio.run(run(("", "")))  # (no tenant named: the 2-slot pool keeps no fair share)
    assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)
    assert registry.get_sample_value("specd_target_prefill_shared_tokens_total", labels) == shared_before + 39
    eventually(lambda: pooled_service.servicer.target.pool.in_use() == 0)
    a, b = asyncio.run(run(("", "kb")))
    assert (a.num_accepted, a.next_token) == (b.num_accepted, b.next_token)
    assert registry.get_sample_value("specd_target_prefill_shared_tokens_total", labels) == shared_before + 39


def test_a_session_opened_the_moment_another_closed_gets_its_slot(pooled_service):
    """Every slot taken, one session closes while a forward runs: its slot is freed on the
    compute thread behind that forward. A session opened at once (a closed-loop client's next
    request) waits for it and is served; before, it was refused (RESOURCE_EXHAUSTED, a 503)
    for a slot that was about to be free."""
    servicer = pooled_service.servicer

    async def run():
        async with channel(pooled_service.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            held = [await _open(stub), await _open(stub, PROMPT[:5])]
            first = [await _verify(c, []) for c in held]
            busy = servicer.core.executor.submit(time.sleep, 1.5)  # a long forward on the compute thread
            await _close(held[0])
            assert not busy.done()
            replacement = await _open(stub)
            verdict = await _verify(replacement, [])
            assert verdict.next_token == first[0].next_token
            for c in (held[1], replacement):
                await _close(c)

    asyncio.run(run())
    eventually(lambda: servicer.target.pool.in_use() == 0)


def test_a_client_gone_during_a_multi_step_run_frees_its_slot(pooled_service):
    """The run stops with the call: no step of it is queued any more, and its KV slot is free."""
    servicer = pooled_service.servicer
    pool = servicer.target.pool

    async def run():
        async with channel(pooled_service.address) as ch:
            call = await _open(target_pb2_grpc.TargetServiceStub(ch))
            await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=1, steps=100)))
            for _ in range(2):
                assert (await call.read()).WhichOneof("kind") == "verified"
            assert pool.in_use() == 1
            call.cancel()

    asyncio.run(run())
    eventually(lambda: pool.in_use() == 0 and not servicer.core.sessions and not servicer.core.batcher.queue)


def test_info_has_the_batched_cost_surface_and_verdicts_the_forwards_load(pooled_service):
    async def run():
        async with channel(pooled_service.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            info = await stub.Info(common_pb2.InfoRequest())
            call = await _open(stub)
            plain = await _verify(call, [])
            window = await _verify(call, [3, 4, 5], 2)
            await _close(call)
            return info, plain, window

    registry, labels = pooled_service.servicer.registry, {"model": pooled_service.servicer.target.name}
    chunks = registry.get_sample_value("specd_target_prefill_chunks_total", labels)
    tokens = registry.get_sample_value("specd_target_forward_tokens_sum", labels)
    info, plain, window = asyncio.run(run())
    # The 8-token prompt's first 7 are prefilled in chunks of 3; the two forwards fed 1 and 4 tokens.
    assert registry.get_sample_value("specd_target_prefill_chunks_total", labels) == chunks + 3
    assert registry.get_sample_value("specd_target_forward_tokens_sum", labels) == tokens + 5
    assert registry.get_sample_value("specd_verify_queue_seconds_count", labels) >= 2
    # Two KV slots: the surface is measured for forwards of one and of two sessions.
    assert len(info.costs.batch_seconds) == len(info.costs.batch_token_seconds) == 2
    assert all(t > 0 for t in info.costs.batch_seconds) and all(t >= 0 for t in info.costs.batch_token_seconds)
    assert (plain.batch_size, plain.batch_tokens) == (1, 1)  # the pending token alone
    assert (window.batch_size, window.batch_tokens) == (1, 4)  # the pending token and three drafts


def test_sessions_within_a_latency_budget_follow_the_cost_surface():
    from services.target.admission import sessions_within_budget

    surface = [0.030, 0.032, 0.036, 0.042, 0.050, 0.061, 0.075, 0.092]  # B = 1..8 sessions x 1 token
    assert sessions_within_budget(surface, 2.0) == 5  # 0.050 <= 0.060 < 0.061
    assert sessions_within_budget(surface, 1000.0) == 8
    assert sessions_within_budget(surface, 0.5) == 1  # always one
    assert sessions_within_budget([], 2.0) == 1


def test_a_session_beyond_the_latency_budget_is_refused_and_the_others_go_on(service_loop, chat_pair):
    """--latency-budget: with the surface measured for 2 sessions and a budget every size meets,
    the cap is 2 sessions (the pool has 4 slots); the third is refused with RESOURCE_EXHAUSTED at
    once and the two open ones are served undisturbed; a closed one makes room again."""
    target = replace(chat_pair[0])
    target.use_pool(4, 128)
    servicer = TargetServicer(target, max_batch_size=2, latency_budget=1000.0)
    assert servicer.core.admission.max_sessions == 2
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)

    async def run():
        async with channel(svc.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            held = [await _open(stub), await _open(stub, PROMPT[:5])]
            first = [await _verify(c, []) for c in held]
            extra = await _open(stub)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "latency budget" in refused.value.details()
            again = [await _verify(c, [], 2) for c in held]
            assert all(a.num_accepted == 0 for a in again)
            await _close(held[0])
            await asyncio.sleep(0.2)
            replacement = await _open(stub)
            assert (await _verify(replacement, [])).next_token == first[0].next_token
            for c in (held[1], replacement):
                await _close(c)

    try:
        asyncio.run(run())
    finally:
        svc.stop()


def test_a_session_is_refused_while_the_open_ones_are_over_their_time_per_token(service_loop, chat_pair):
    """--latency-budget also reads the clock: while the open sessions see more time per token
    than the budget allows, a new session is refused at once; a reading too old to go by, or no
    session open, admits one (a stale slow reading never locks the service)."""
    target = replace(chat_pair[0])
    target.use_pool(4, 128)
    servicer = TargetServicer(target, max_batch_size=4, latency_budget=1000.0)
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)

    async def run():
        async with channel(svc.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            first = await _open(stub)
            await _verify(first, [])
            await asyncio.sleep(0.05)
            await _verify(first, [], 2)  # timed: a real time per token, under any budget here
            one_token_s = servicer.costs.value("verify_seconds")[0]
            assert 0 < servicer.costs.value("token_time") < 1000.0 * one_token_s
            servicer.costs.seed("token_time", 2000.0 * one_token_s)  # as if badly overloaded ...
            servicer.core.admission.token_time_at = time.perf_counter() - 5.0  # ... long ago: too old to go by
            stale = await _open(stub)
            assert (await _verify(stale, [])).num_accepted == 0  # admitted
            await _close(stale)
            servicer.costs.seed("token_time", 2000.0 * one_token_s)  # overloaded now
            servicer.core.admission.token_time_at = time.perf_counter()
            extra = await _open(stub)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "over its latency budget" in refused.value.details()
            await _close(first)
            await asyncio.sleep(0.2)
            alone = await _open(stub)  # none open: admitted, whatever the last reading
            assert (await _verify(alone, [])).num_accepted == 0
            await _close(alone)

    try:
        asyncio.run(run())
    finally:
        svc.stop()
