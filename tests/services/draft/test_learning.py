"""Online learning (DVI) across the services, against a real Redis and real gRPC: the replay
stream round trip, records logged by the draft service with the target's top log-probs, and
an adapter hot-swapped into a live session without dropping it or changing the output."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from services.common.replay import RedisDVI
from services.common.settings import DraftSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.draft.main import build_servicer
from services.draft.main import start as start_draft
from services.draft.servicer import DraftServicer
from services.proto.specd.common.v1 import common_pb2
from specd.drafters.early_exit import EarlyExitDrafter
from specd.dvi import HeadLoRA, Record, top_logprobs
from specd.errors import InvalidRequest
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service
from tests.services.coordinator.test_coordinator import generate, reference

PROMPT = "Hello there, how are"


def test_replay_stream_and_adapters_round_trip_through_redis(redis_url):
    async def run():
        dvi = RedisDVI(redis_url, "tiny:early-exit-1", namespace="t")
        try:
            lp, ids = top_logprobs(torch.randn(3, 50), 5)
            recs = [Record(torch.randn(8), i, float(i % 2), ids[i], lp[i], version=2) for i in range(3)]
            await dvi.add(recs)
            await dvi.redis.xadd(dvi.stream_key, {"junk": b"1"})  # a malformed entry is skipped, not fatal
            got = await dvi.read("0", 10)
            assert len(got) == 4 and got[3][1] is None
            for r, (_, back) in zip(recs, got):
                assert (back.token, back.reward, back.version) == (r.token, r.reward, 2)
                assert torch.allclose(back.hidden, r.hidden, atol=1e-2) and torch.equal(back.top_ids, r.top_ids)
            assert await dvi.read(got[-1][0], 10, block_ms=10) == []  # nothing after the last id
            assert await dvi.version() == 0 and await dvi.fetch() is None
            lora = HeadLoRA(8, 50, rank=2, version=5)
            await dvi.publish(lora)
            back = await dvi.fetch()
            assert await dvi.version() == 5 and back.version == 5 and torch.equal(back.A, lora.A.detach())
        finally:
            await dvi.close()

    asyncio.run(run())


@pytest.fixture
def learning_draft(service_loop, chat_pair, redis_url):
    target, _ = chat_pair
    drafter = EarlyExitDrafter(target, layers=1)
    servicer = DraftServicer(drafter, target, dvi=RedisDVI(redis_url, drafter.name), dvi_poll_s=0.05)
    server, port = service_loop.run(start_draft(DraftSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    yield svc
    svc.stop()


def _strong_lora(drafter, version):
    rows, hidden = drafter.head_weight.shape
    lora = HeadLoRA(hidden, rows, rank=4, version=version)
    with torch.no_grad():
        lora.B.normal_(0, 3.0, generator=torch.Generator().manual_seed(version))
    return lora


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
def test_draft_service_logs_judged_drafts_and_hot_swaps_mid_session(chat_pair, target_service, learning_draft,
                                                                     redis_url, overlap):
    target, _ = chat_pair
    servicer: DraftServicer = learning_draft.servicer
    drafter = servicer.drafter
    dvi = RedisDVI(redis_url, drafter.name)

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, learning_draft.address), AsyncMemoryStateStore())
        await coord.connect()
        request = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=48),
                                  spec=SpecParams("constant", policy_params={"k": 3}), overlap=overlap)
        ids, finish, swapped = [], None, False
        try:
            async for ev in coord.generate(request):
                if isinstance(ev, FinishEvent):
                    finish = ev
                    continue
                ids += ev.token_ids
                if len(ids) >= 8 and not swapped:  # publish a new adapter while the session drafts
                    await dvi.publish(_strong_lora(drafter, 7))
                    deadline = time.monotonic() + 10
                    while drafter.lora_version != 7 and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    swapped = True
            records = [r for _, r in await dvi.read("0", 10_000)]
            info = await coord.draft_stub.Info(common_pb2.InfoRequest())
        finally:
            await coord.close()
            await dvi.close()
        return ids, finish, records, info

    try:
        ids, finish, records, info = asyncio.run(run())
    finally:
        drafter.set_lora(None)
    assert drafter is servicer.drafter
    assert ids == reference(target, PROMPT, 48)  # lossless before, during and after the swap
    stats = finish.spec_stats
    assert not stats["fallback"] and stats["drafted"] > 0
    assert info.top_logprobs == 16 and info.adapter_version == 7
    assert 0 < len(records) <= stats["drafted"]
    assert sum(r.reward for r in records) <= stats["accepted"]
    for r in records:  # greedy: accepted exactly when the draft is the target's top token
        assert (r.reward == 1.0) == (int(r.top_ids[0]) == r.token)
        assert r.hidden.numel() == drafter.head_weight.shape[1] and r.top_ids.numel() == 16
    assert {r.version for r in records} <= {0, 7} and 7 in {r.version for r in records}
    import redis

    def logged():
        return servicer.registry.get_sample_value("specd_dvi_records_total",
                                                  {"drafter": drafter.name, "outcome": "logged"})

    with redis.Redis.from_url(redis_url) as client:  # counted once each batch has landed
        deadline = time.monotonic() + 5
        while logged() != client.xlen(dvi.stream_key) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert logged() == client.xlen(dvi.stream_key) >= len(records)
    assert servicer.registry.get_sample_value("specd_dvi_adapter_version", {"drafter": drafter.name}) == 7


def test_dvi_needs_redis_and_a_learning_drafter(chat_pair, redis_url):
    with pytest.raises(InvalidRequest, match="early-exit"):
        build_servicer(DraftSettings(drafter="ngram", dvi=True, redis_url=redis_url))
    with pytest.raises(InvalidRequest, match="redis_url"):
        build_servicer(DraftSettings(drafter="early-exit", target_model="/nonexistent", dvi=True, redis_url=None))
    with pytest.raises(InvalidRequest, match="early-exit or feature"):
        from specd.drafters import build_drafter

        DraftServicer(build_drafter("ngram", None), None, dvi=RedisDVI(redis_url, "ngram"))


def test_a_draft_service_with_redis_down_still_starts_and_serves(service_loop, chat_pair, target_service):
    """DVI costs records when Redis is away, never the service or a request."""
    target, _ = chat_pair
    drafter = EarlyExitDrafter(target, layers=1)
    servicer = DraftServicer(drafter, target, dvi=RedisDVI("redis://127.0.0.1:1/0", drafter.name), dvi_poll_s=0.05)
    server, port = service_loop.run(start_draft(DraftSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    try:
        request = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=24), spec=SpecParams("constant"))
        ids, finish = generate(target_service.address, svc.address, request)
        assert ids == reference(target, PROMPT, 24) and not finish.spec_stats["fallback"]
        assert finish.spec_stats["drafted"] > 0
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not servicer.registry.get_sample_value(
                "specd_dvi_records_total", {"drafter": drafter.name, "outcome": "dropped"}):
            time.sleep(0.05)
        assert servicer.registry.get_sample_value("specd_dvi_records_total",
                                                  {"drafter": drafter.name, "outcome": "dropped"}) > 0
    finally:
        svc.stop()
