"""LocalBackend over the tiny pair: greedy events token-identical to the target alone, bad
requests refused before the first event, and every way of leaving early (aclose, task
cancellation) frees the run's KV caches."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest

from services.coordinator.api import FinishEvent, GenerateRequest, TokenEvent
from services.coordinator.local import LocalBackend
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.runtime import load_model
from specd.types import SamplingParams, SpecParams

LONG_CHAT = ({"role": "user", "content": "Hello"},)  # the tiny target answers 300+ tokens without EOS
PROMPT_IDS = (5, 9, 17, 33, 5, 9, 17)


@pytest.fixture(scope="module")
def tiny_engine(tiny_dirs):
    """The tiny pair loaded from disk with its char tokenizer (context 512), hf drafter."""
    target = load_model(str(tiny_dirs[0]), device="cpu", dtype="float32")
    draft = load_model(str(tiny_dirs[1]), device="cpu", dtype="float32")
    return SpeculativeEngine(target, build_drafter("hf", target, draft))


@pytest.fixture(scope="module")
def local_backend(tiny_engine):
    backend = LocalBackend(tiny_engine)
    yield backend
    asyncio.run(backend.close())


def _collect(backend, request: GenerateRequest) -> list:
    async def run():
        return [event async for event in backend.generate(request)]

    return asyncio.run(run())


def _wait_idle(backend, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while backend.active_sessions and time.monotonic() < deadline:
        time.sleep(0.01)
    assert backend.active_sessions == 0


@pytest.mark.parametrize("policy", ["constant", "heuristic", "svip", "adaedl", "max-confidence"])
def test_greedy_events_equal_the_target_alone(local_backend, tiny_engine, policy):
    sampling = SamplingParams(max_new_tokens=48)
    for request in (GenerateRequest(prompt_ids=PROMPT_IDS, sampling=sampling, spec=SpecParams(policy)),
                    GenerateRequest(messages=LONG_CHAT, sampling=sampling, spec=SpecParams(policy))):
        prompt = request.prompt_ids or tiny_engine.target.encode_prompt(list(request.messages), chat=True)
        want = tiny_engine.generate(prompt, sampling, SpecParams("none"))
        events = _collect(local_backend, request)
        *tokens, finish = events
        assert all(isinstance(e, TokenEvent) for e in tokens) and isinstance(finish, FinishEvent)
        assert [t for e in tokens for t in e.token_ids] == want.token_ids
        assert "".join(e.text for e in tokens) == want.text
        assert (finish.finish_reason, finish.prompt_tokens, finish.completion_tokens) == \
            (want.finish_reason, len(prompt), len(want.token_ids))
        stats = finish.spec_stats
        assert stats["policy"] == policy and stats["fallback"] is False
        assert stats["drafted"] >= stats["accepted"] > 0 and stats["new_tokens"] == len(want.token_ids)
    assert local_backend.active_sessions == 0


def test_a_request_asking_for_pearl_overlaps_and_equals_the_target_alone(local_backend, tiny_engine):
    sampling = SamplingParams(max_new_tokens=48)
    want = tiny_engine.generate(list(PROMPT_IDS), sampling, SpecParams("none"))
    request = GenerateRequest(prompt_ids=PROMPT_IDS, sampling=sampling, spec=SpecParams("constant"), overlap=True)
    *tokens, finish = _collect(local_backend, request)
    assert [t for e in tokens for t in e.token_ids] == want.token_ids
    stats = finish.spec_stats
    assert stats["overlap"] is True and stats["fallback"] is False and stats["drafted"] > 0
    sequential = _collect(local_backend, dataclasses.replace(request, overlap=None))[-1].spec_stats
    assert sequential["overlap"] is False and sequential["fallback"] is False
    assert local_backend.active_sessions == 0


def test_leaving_a_pearl_request_early_stops_its_drafting_thread(local_backend):
    async def run():
        events = local_backend.generate(GenerateRequest(messages=LONG_CHAT, sampling=SamplingParams(max_new_tokens=400),
                                                        spec=SpecParams("constant"), overlap=True))
        assert isinstance(await anext(events), TokenEvent)
        await events.aclose()

    asyncio.run(run())
    _wait_idle(local_backend)
    deadline = time.monotonic() + 5.0
    while any(t.name == "specd-pearl-draft" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "specd-pearl-draft" for t in threading.enumerate())


def test_stop_string_ends_the_stream_with_stop(local_backend, tiny_engine):
    full = _collect(local_backend, GenerateRequest(messages=LONG_CHAT,
                                                   sampling=SamplingParams(max_new_tokens=40)))
    text = "".join(e.text for e in full[:-1])
    stop = text[10:13]
    events = _collect(local_backend, GenerateRequest(
        messages=LONG_CHAT, sampling=SamplingParams(max_new_tokens=40, stop=(stop,)),
        spec=SpecParams("heuristic")))
    assert "".join(e.text for e in events[:-1]) == text[:text.index(stop)]
    assert events[-1].finish_reason == "stop"


@pytest.mark.parametrize("request_, field", [
    (GenerateRequest(prompt_ids=PROMPT_IDS, spec=SpecParams("no-such-policy")), "policy"),
    (GenerateRequest(prompt_ids=PROMPT_IDS, spec=SpecParams("svip", policy_params={"h": -1.0})),
     "policy_params.h"),
    (GenerateRequest(prompt_ids=PROMPT_IDS, sampling=SamplingParams(max_new_tokens=0)), "max_new_tokens"),
    (GenerateRequest(prompt="   "), "prompt"),
    (GenerateRequest(prompt="x" * 600), "prompt"),
])
def test_bad_requests_fail_before_the_first_event(local_backend, request_, field):
    with pytest.raises(InvalidRequest) as err:
        _collect(local_backend, request_)
    assert err.value.field == field
    assert local_backend.active_sessions == 0


def test_aclose_after_the_first_event_frees_the_run(local_backend):
    async def run():
        events = local_backend.generate(GenerateRequest(messages=LONG_CHAT,
                                                        sampling=SamplingParams(max_new_tokens=400)))
        assert isinstance(await anext(events), TokenEvent)
        assert local_backend.active_sessions == 1
        await events.aclose()

    cancelled = local_backend.cancelled_sessions
    asyncio.run(run())
    _wait_idle(local_backend)
    assert local_backend.cancelled_sessions == cancelled + 1


def test_cancelling_the_consumer_task_frees_the_run(local_backend):
    async def consume(started: asyncio.Event):
        async for _ in local_backend.generate(GenerateRequest(messages=LONG_CHAT,
                                                              sampling=SamplingParams(max_new_tokens=400))):
            started.set()

    async def run():
        started = asyncio.Event()
        task = asyncio.create_task(consume(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    cancelled = local_backend.cancelled_sessions
    asyncio.run(run())
    _wait_idle(local_backend)
    assert local_backend.cancelled_sessions == cancelled + 1


def test_model_card_and_ready(local_backend, tiny_engine):
    card = local_backend.model_card()
    assert card.id == tiny_engine.target.name and card.max_context == 512
    assert card.draft == tiny_engine.drafter.name
    assert asyncio.run(local_backend.ready()) is True
