"""Every decoder family through the services, over real gRPC on loopback, on tiny checkpoints
built from transformers' config classes: greedy output equals transformers' generate with
drafting on the target and with an hf draft of the same family on the draft service (both over
their own KV pools), and a target's pool caps its sessions whatever the model: the next one is
refused at once with RESOURCE_EXHAUSTED (the gateway's 503 with Retry-After) and the open ones
go on undisturbed."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.server import channel
from services.common.settings import DraftSettings, TargetSettings
from services.coordinator.api import GenerateRequest
from services.draft.main import start as start_draft
from services.draft.servicer import DraftServicer
from services.proto.specd.target.v1 import target_pb2_grpc
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.drafters import build_drafter
from specd.runtime.tiny import char_tokenizer, loaded, perturbed, tiny_family
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service, eventually
from tests.services.coordinator.test_coordinator import generate
from tests.services.target.test_pool import _close, _open, _verify
from tests.specd.runtime.test_families import greedy_reference

# one of each model type, with the trait that sets it apart where the tiny models have a variant
SERVED = ["llama-llama3", "mistral-window", "qwen2", "qwen3", "gemma2", "gemma3", "phi3-longrope"]
PROMPT = "the cat sat, the cat sat, the"
TOKENS = 40


@pytest.fixture(scope="module", params=SERVED)
def pair(request):
    tok = char_tokenizer()
    model = tiny_family(request.param, vocab_size=len(tok))
    target = loaded(model, request.param, tok)
    target.use_pool(4, 256)
    draft = loaded(perturbed(model, 0.01, seed=3), request.param + "-draft", tok)
    draft.use_pool(4, 256)
    return request.param, target, draft


def _serve(loop, start, settings, servicer) -> Service:
    server, port = loop.run(start(settings, servicer))
    return Service(f"127.0.0.1:{port}", servicer, server, loop)


def test_greedy_through_the_services_equals_transformers_generate(service_loop, pair):
    family, target, draft = pair
    want = greedy_reference(target.model, family, target.encode_prompt(PROMPT, chat=False), TOKENS)
    drafting = _serve(service_loop, start_target, TargetSettings(port=0),
                      TargetServicer(target, drafter=build_drafter("ngram", None)))
    request = GenerateRequest(prompt=PROMPT, sampling=SamplingParams(max_new_tokens=TOKENS),
                              spec=SpecParams("constant"))
    try:
        ids, finish = generate(drafting.address, None, request)
    finally:
        drafting.stop()
    assert ids == want[:len(ids)] and (len(ids) == TOKENS or ids[-1] in target.eos_token_ids)
    assert finish.spec_stats["drafted_on_target"] and finish.spec_stats["drafted"] > 0

    plain = _serve(service_loop, start_target, TargetSettings(port=0), TargetServicer(target))
    drafts = _serve(service_loop, start_draft, DraftSettings(port=0),
                    DraftServicer(build_drafter("hf", draft, draft), draft))
    try:
        ids, finish = generate(plain.address, drafts.address, request)
    finally:
        plain.stop()
        drafts.stop()
    assert ids == want[:len(ids)]
    stats = finish.spec_stats
    assert not stats["fallback"] and stats["drafted"] >= stats["accepted"] > 0
    # Both services gave their slots back (freed on their compute threads, as their calls unwind).
    eventually(lambda: draft.pool.in_use() == 0 and target.pool.in_use() == 0)


def test_a_session_beyond_the_pool_is_refused_whatever_the_model(service_loop, pair):
    family, target, _ = pair
    from dataclasses import replace

    capped = replace(target)
    capped.use_pool(2, 128)
    svc = _serve(service_loop, start_target, TargetSettings(port=0), TargetServicer(capped))
    prompt = target.encode_prompt(PROMPT, chat=False)

    async def run():
        async with channel(svc.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            held = [await _open(stub, prompt), await _open(stub, prompt[:5])]
            first = [await _verify(c, []) for c in held]
            extra = await _open(stub, prompt)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await extra.read()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            again = [await _verify(c, [], 2) for c in held]  # the open sessions go on undisturbed
            for p, a, b in zip((prompt, prompt[:5]), first, again):
                assert [a.next_token, b.next_token] == greedy_reference(target.model, family, p, 2)
            for c in held:
                await _close(c)

    try:
        asyncio.run(run())
    finally:
        svc.stop()
