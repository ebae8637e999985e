"""The coordinator over real draft and target gRPC services on loopback (tiny models):
greedy output is token-identical to the target alone for every policy, drafter and PEARL
setting; failures of either service behave as docs/services.md, "Failures", says; a client that goes away
frees both sessions; concurrent requests share target forwards."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import FinishEvent, GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest, ModelError, Unavailable
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import draft_service, eventually

PROMPTS = ["Hello there, how are", "abcabc abc xyz abc"]
POLICIES = ["none", "constant", "heuristic", "max-confidence", "svip", "adaedl", "adasd", "cost-aware"]


def generate(target_addr, draft_addr, request, store=None, **cfg):
    async def run():
        coord = Coordinator(CoordinatorConfig(target_addr, draft_addr, **cfg), store or AsyncMemoryStateStore())
        await coord.connect()
        ids, finish = [], None
        try:
            async for ev in coord.generate(request):
                if isinstance(ev, FinishEvent):
                    finish = ev
                else:
                    ids += ev.token_ids
        finally:
            await coord.close()
        return ids, finish

    return asyncio.run(run())


def reference(target, prompt: str, n: int) -> list[int]:
    ids = target.encode_prompt(prompt, chat=False)
    return SpeculativeEngine(target).generate(ids, SamplingParams(max_new_tokens=n), SpecParams("none")).token_ids


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("drafter", ["hf", "ngram"])
@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_is_the_target_alone(chat_pair, target_service, hf_draft_service, ngram_draft_service,
                                           policy, drafter, overlap):
    draft = hf_draft_service if drafter == "hf" else ngram_draft_service
    for prompt in PROMPTS:
        request = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_new_tokens=32),
                                  spec=SpecParams(policy), overlap=overlap)
        ids, finish = generate(target_service.address, draft.address, request)
        assert ids == reference(chat_pair[0], prompt, 32)
        stats = finish.spec_stats
        assert not stats["fallback"] and stats["overlap"] == overlap
        if policy != "none":
            assert stats["accepted"] <= stats["drafted"]
            assert stats["verifications"] + stats["accepted"] >= len(ids)


PENALTIES = dict(presence_penalty=1.2, frequency_penalty=0.5, repetition_penalty=1.3, logit_bias=((5, 2.0),))


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("drafter", ["hf", "ngram"])
@pytest.mark.parametrize("seed", [None, 5], ids=["greedy", "seeded"])
def test_penalties_through_the_services_are_the_target_alones(chat_pair, target_service, hf_draft_service,
                                                              ngram_draft_service, drafter, overlap, seed):
    """Penalties and logit_bias travel to the target (Sampling) and apply at every drafted
    position there: the answer is the in-process target alone's with the same penalties."""
    draft = hf_draft_service if drafter == "hf" else ngram_draft_service
    sampling = SamplingParams(temperature=0.8 if seed is not None else 0.0, seed=seed, max_new_tokens=32,
                              **PENALTIES)
    drafted, changed = 0, False
    for prompt in (PROMPTS[0], "the cat sat"):
        ids = chat_pair[0].encode_prompt(prompt, chat=False)
        want = SpeculativeEngine(chat_pair[0]).generate(ids, sampling, SpecParams("none")).token_ids
        got, finish = generate(target_service.address, draft.address,
                               GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams("constant"),
                                               overlap=overlap))
        assert got == want and not finish.spec_stats["fallback"]
        drafted += finish.spec_stats["drafted"]
        changed |= want != reference(chat_pair[0], prompt, 32)
    assert drafted > 0 and changed  # the penalties changed an answer


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("drafter", ["hf", "ngram"])
def test_logprobs_through_the_services_are_the_target_alones(chat_pair, target_service, hf_draft_service,
                                                             ngram_draft_service, drafter, overlap):
    """Each emitted token's log-probability and alternatives come from the target's Verified
    (float32 on the wire), one per token id of each event, as the target alone gives them."""
    draft = hf_draft_service if drafter == "hf" else ngram_draft_service
    sampling = SamplingParams(max_new_tokens=32, stop=("zz",))

    async def run(prompt: str):
        coord = Coordinator(CoordinatorConfig(target_service.address, draft.address), AsyncMemoryStateStore())
        await coord.connect()
        events = []
        try:
            async for ev in coord.generate(GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams(
                    "constant"), overlap=overlap, logprobs=2)):
                events.append(ev)
        finally:
            await coord.close()
        return events

    for prompt in (PROMPTS[0], "the cat sat"):
        events = asyncio.run(run(prompt))
        tokens = [e for e in events if not isinstance(e, FinishEvent)]
        assert all(len(e.logprobs) == len(e.token_ids) for e in tokens)
        ids = [t for e in tokens for t in e.token_ids]
        found = [lp for e in tokens for lp in e.logprobs]
        prompt_ids = chat_pair[0].encode_prompt(prompt, chat=False)
        alone = SpeculativeEngine(chat_pair[0]).generate(prompt_ids, sampling, SpecParams("none"), logprobs=2)
        assert ids == alone.token_ids and len(found) == len(ids) > 0
        tok = chat_pair[0].tokenizer
        for t, lp, want in zip(ids, found, alone.logprobs):
            assert lp.token == tok.decode([t]) and lp.logprob == pytest.approx(want.logprob, abs=1e-4)
            assert [x for x, _ in lp.top] == [tok.decode([i]) for i in want.top_ids]


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "pearl"])
@pytest.mark.parametrize("drafter", ["hf", "ngram"])
def test_a_grammar_through_the_services_is_the_target_alones(chat_pair, target_service, hf_draft_service,
                                                             ngram_draft_service, drafter, overlap):
    """The target masks every window position with the grammar after the drafts before it,
    whatever the draft service proposed: the answer is the in-process target alone's."""
    import json

    from specd.grammar import GrammarSpec

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    draft = hf_draft_service if drafter == "hf" else ngram_draft_service
    sampling = SamplingParams(max_new_tokens=48, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    drafted = 0
    for prompt in (PROMPTS[0], "the cat sat"):
        ids = chat_pair[0].encode_prompt(prompt, chat=False)
        want = SpeculativeEngine(chat_pair[0]).generate(ids, sampling, SpecParams("none"))
        got, finish = generate(target_service.address, draft.address,
                               GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams("constant"),
                                               overlap=overlap))
        assert got == want.token_ids and want.text.startswith("{") and not finish.spec_stats["fallback"]
        drafted += finish.spec_stats["drafted"]
    assert drafted > 0


def test_a_retrieval_draft_service_is_lossless_and_gets_drafts_accepted(service_loop, chat_pair, target_service,
                                                                        tmp_path):
    """The draft service built from its settings (no model loaded) with a datastore of the
    target's answers, corrupted every 5th token so that its drafts are kept and refused."""
    from services.common.settings import DraftSettings
    from services.draft.main import build_servicer
    from services.draft.main import start as start_draft
    from specd.drafters import Datastore
    from tests.services.conftest import Service

    target, prompts = chat_pair[0], [PROMPTS[0], "the cat sat"]  # 32 tokens each, no early EOS
    docs = []
    for prompt in prompts:
        ids = target.encode_prompt(prompt, chat=False) + reference(target, prompt, 32)
        docs.append([t if i % 5 else (t + 1) % len(target.tokenizer) for i, t in enumerate(ids)])
    store = tmp_path / "ds.safetensors"
    Datastore.from_documents(docs).save(store)
    settings = DraftSettings(port=0, drafter="retrieval", datastore=store, target_model="/no/model/needed")
    servicer = build_servicer(settings)
    server, port = service_loop.run(start_draft(settings, servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    try:
        for prompt in prompts:
            request = GenerateRequest(prompt=prompt, sampling=SamplingParams(max_new_tokens=32),
                                      spec=SpecParams("constant"), overlap=True)
            ids, finish = generate(target_service.address, svc.address, request)
            assert ids == reference(target, prompt, 32)
            assert 0 < finish.spec_stats["accepted"] < finish.spec_stats["drafted"], finish.spec_stats
    finally:
        svc.stop()


def test_a_lookup_drafter_runs_sequentially_unless_the_request_asks_for_pearl(target_service, hf_draft_service,
                                                                             ngram_draft_service):
    """PEARL hides drafting time; an n-gram lookup has none, and pre-verifying its first token
    alone costs a target forward (docs/services.md measured it), so its default is sequential."""
    def overlap(draft, asked):
        request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=8),
                                  spec=SpecParams("constant"), overlap=asked)
        return generate(target_service.address, draft.address, request)[1].spec_stats["overlap"]

    assert overlap(ngram_draft_service, None) is False
    assert overlap(ngram_draft_service, True) is True
    assert overlap(hf_draft_service, None) is True
    assert overlap(hf_draft_service, False) is False


def test_speculation_happens(chat_pair, target_service, hf_draft_service):
    """The 1%-noise draft must get tokens accepted, or the identity tests prove little."""
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=32),
                              spec=SpecParams("constant"), overlap=False)
    _, finish = generate(target_service.address, hf_draft_service.address, request)
    assert finish.spec_stats["accepted"] > 0
    assert finish.spec_stats["verifications"] < 32


def test_sampling_runs_with_both_modes(target_service, hf_draft_service):
    for overlap in (False, True):
        request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(1.0, top_k=8, seed=3, max_new_tokens=24),
                                  spec=SpecParams("constant"), overlap=overlap)
        ids, finish = generate(target_service.address, hf_draft_service.address, request)
        assert 0 < len(ids) <= 24 and not finish.spec_stats["fallback"]


def test_the_target_alone_decodes_in_one_multi_step_run_and_a_stop_string_closes_it(chat_pair, target_service):
    """A target-only answer is one Verify (a multi-step run: no round trip per token); a stop string
    met during the run still closes the target's session cleanly."""
    reg, model = target_service.servicer.registry, {"model": chat_pair[0].name}

    def runs() -> tuple[float, float]:
        return (reg.get_sample_value("specd_target_run_steps_count", model) or 0,
                reg.get_sample_value("specd_target_run_steps_sum", model) or 0)

    def closed_ok() -> float:
        return reg.get_sample_value("specd_grpc_requests_total", {"service": "target", "method": "Session",
                                                                  "code": "OK"}) or 0

    before = runs()
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=32), spec=SpecParams("none"))
    ids, finish = generate(target_service.address, None, request)
    assert ids == reference(chat_pair[0], PROMPTS[0], 32) and finish.finish_reason == "length"
    assert runs() == (before[0] + 1, before[1] + 32)

    text = chat_pair[0].tokenizer.decode(ids, skip_special_tokens=True)
    stop, ok = text[12:15], closed_ok()
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=32, stop=(stop,)),
                              spec=SpecParams("none"))
    ids, finish = generate(target_service.address, None, request)
    assert finish.finish_reason == "stop" and len(ids) < 32
    eventually(lambda: closed_ok() == ok + 1)


def test_tokens_that_wait_for_a_slow_reader_come_as_one_event(chat_pair, target_service):
    """A multi-step run goes on while the caller is busy; what it computed meanwhile comes in one event."""
    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, None), AsyncMemoryStateStore())
        await coord.connect()
        events = []
        try:
            request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=32),
                                      spec=SpecParams("none"))
            async for ev in coord.generate(request):
                if not isinstance(ev, FinishEvent):
                    events.append(ev.token_ids)
                    if len(events) == 1:
                        await asyncio.sleep(0.5)  # the run goes on meanwhile
        finally:
            await coord.close()
        return events

    events = asyncio.run(run())
    assert [t for ids in events for t in ids] == reference(chat_pair[0], PROMPTS[0], 32)
    assert max(len(ids) for ids in events) > 1


def test_draft_down_falls_back_to_the_target(chat_pair, target_service):
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=16), spec=SpecParams("heuristic"))
    ids, finish = generate(target_service.address, "127.0.0.1:1", request)
    assert ids == reference(chat_pair[0], PROMPTS[0], 16)
    assert finish.spec_stats["fallback"] and "draft" in finish.spec_stats["fallback_reason"]
    assert finish.spec_stats["fallback_kind"] == "unavailable"


def test_draft_dying_mid_request_falls_back_and_recovers(chat_pair, service_loop, target_service):
    target, draft = chat_pair
    svc = draft_service(service_loop, build_drafter("hf", draft, draft), draft)
    port = svc.address.rsplit(":", 1)[1]

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, svc.address), AsyncMemoryStateStore())
        await coord.connect()
        request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=200),
                                  spec=SpecParams("constant"), overlap=True)
        ids, finish = [], None
        async for ev in coord.generate(request):
            if isinstance(ev, FinishEvent):
                finish = ev
            else:
                ids += ev.token_ids
                if len(ids) >= 4 and svc.server is not None:
                    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(svc.server.stop(0), service_loop.loop))
                    svc.server = None
        await coord.close()
        return ids, finish

    ids, finish = asyncio.run(run())
    assert ids == reference(target, PROMPTS[0], 200)
    assert finish.spec_stats["fallback"]
    assert finish.spec_stats["fallback_kind"] == "failed"
    # The draft comes back on the same port: new requests use it again.
    from services.common.settings import DraftSettings
    from services.draft.main import start as start_draft
    from services.draft.servicer import DraftServicer

    server, _ = service_loop.run(start_draft(DraftSettings(port=int(port)),
                                             DraftServicer(build_drafter("hf", draft, draft), draft)))
    try:
        request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=16), spec=SpecParams("constant"))
        ids, finish = generate(target_service.address, f"127.0.0.1:{port}", request)
        assert ids == reference(target, PROMPTS[0], 16) and not finish.spec_stats["fallback"]
    finally:
        service_loop.run(server.stop(0))


def test_target_down_is_unavailable(hf_draft_service):
    with pytest.raises(Unavailable, match="target"):
        generate("127.0.0.1:1", hf_draft_service.address, GenerateRequest(prompt="hi"))


def test_client_going_away_frees_both_sessions(target_service, hf_draft_service):
    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                            AsyncMemoryStateStore())
        await coord.connect()
        events = coord.generate(GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=300),
                                                spec=SpecParams("constant")))
        await anext(events)
        assert target_service.servicer.active_sessions == 1 and hf_draft_service.servicer.active_sessions == 1
        await events.aclose()
        await coord.close()

    asyncio.run(run())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (target_service.servicer.active_sessions
                                           or hf_draft_service.servicer.active_sessions):
        time.sleep(0.05)
    assert target_service.servicer.active_sessions == 0
    assert hf_draft_service.servicer.active_sessions == 0


def test_logprobs_cross_the_coordinators_grpc_api():
    from services.coordinator.api import Logprob, TokenEvent
    from services.coordinator.convert import event_from_proto, event_to_proto, request_from_proto, request_to_proto

    for asked in (None, 0, 3):
        request = GenerateRequest(prompt="x", logprobs=asked)
        assert request_from_proto(request_to_proto(request), "none").logprobs == asked
    event = TokenEvent((4, 5), "ab", (Logprob("a", -0.5, (("a", -0.5), ("b", -1.25))), Logprob("b", -2.0)))
    assert event_from_proto(event_to_proto(event)) == event


def test_tools_cross_the_coordinators_grpc_api():
    from services.coordinator.convert import request_from_proto, request_to_proto

    messages = ({"role": "user", "content": "Rain?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "w", "arguments": {"city": "Oslo"}}}]},
                {"role": "tool", "content": "rain", "tool_call_id": "c1"})
    request = GenerateRequest(messages=messages, tools_json='[{"type": "function", "function": {"name": "w"}}]')
    back = request_from_proto(request_to_proto(request), "none")
    assert back.messages == messages and back.tools_json == request.tools_json


def test_a_forced_tool_call_through_the_services_is_the_target_alones(service_loop, chat_pair, hf_draft_service):
    """A target whose template takes tools (Hermes tags): the coordinator renders them, the
    target verifies the call under its grammar, and the answer is the target alone's."""
    from dataclasses import replace

    from services.common.settings import TargetSettings
    from services.target.main import start as start_target
    from services.target.servicer import TargetServicer
    from specd.runtime.tiny import char_tokenizer
    from specd.tools import call_grammar, parse_calls
    from tests.services.conftest import Service
    from tests.services.gateway.test_tools import ASK, HERMES, WEATHER

    tok = char_tokenizer()
    tok.chat_template = HERMES
    target = replace(chat_pair[0], tokenizer=tok)
    servicer = TargetServicer(target)
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    sampling = SamplingParams(max_new_tokens=120, grammar=call_grammar([WEATHER], None))
    request = GenerateRequest(messages=tuple(ASK), sampling=sampling, spec=SpecParams("constant"),
                              tools_json=json.dumps([WEATHER]))
    try:
        ids, finish = generate(svc.address, hf_draft_service.address, request)
    finally:
        svc.stop()
    prompt = target.encode_prompt(list(ASK), chat=True, tools=[WEATHER])
    alone = SpeculativeEngine(target).generate(prompt, sampling, SpecParams("none"))
    assert ids == alone.token_ids and finish.spec_stats["drafted"] > 0
    _, calls = parse_calls(alone.text)
    assert [c["function"]["name"] for c in calls] == ["weather"]


def test_mistral_calls_keep_their_control_token_through_the_services(service_loop):
    """Mistral's calls start with [TOOL_CALLS], a control token: the coordinator keeps its text
    for a request with tools (and only then), so the gateway can find the call; the answer is
    the target alone's, with the target drafting itself."""
    from services.common.settings import TargetSettings
    from services.target.main import start as start_target
    from services.target.servicer import TargetServicer
    from specd.drafters import build_drafter
    from specd.runtime.tiny import char_tokenizer, loaded, tiny_llama
    from specd.tools import MISTRAL, call_grammar, parse_calls
    from tests.services.conftest import Service
    from tests.services.gateway.test_tools import ASK, MISTRAL as TEMPLATE, MISTRAL_TOKENS, WEATHER

    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": MISTRAL_TOKENS[:7]})
    tok.chat_template = TEMPLATE
    target = loaded(tiny_llama(0, layers=4, vocab_size=len(tok)), "tiny-mistral", tok)
    servicer = TargetServicer(target, drafter=build_drafter("ngram", None))
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    sampling = SamplingParams(max_new_tokens=120, grammar=call_grammar([WEATHER], None, MISTRAL))

    async def run(tools_json: str):
        coord = Coordinator(CoordinatorConfig(svc.address, None), AsyncMemoryStateStore())
        await coord.connect()
        ids, text = [], ""
        try:
            request = GenerateRequest(messages=tuple(ASK), sampling=sampling, spec=SpecParams("constant"),
                                      tools_json=tools_json)
            async for ev in coord.generate(request):
                if not isinstance(ev, FinishEvent):
                    ids, text = ids + list(ev.token_ids), text + ev.text
        finally:
            await coord.close()
        return ids, text

    try:
        ids, text = asyncio.run(run(json.dumps([WEATHER])))
        _, plain = asyncio.run(run(""))
    finally:
        svc.stop()
    prompt = target.encode_prompt(list(ASK), chat=True, tools=[WEATHER])
    assert ids == SpeculativeEngine(target).generate(prompt, sampling, SpecParams("none")).token_ids
    assert text.startswith("[TOOL_CALLS] [") and "[TOOL_CALLS]" not in plain
    content, calls = parse_calls(text, MISTRAL)
    assert content is None and [c["function"]["name"] for c in calls] == ["weather"]


def test_concurrent_choices_of_one_prompt_prefill_it_once(service_loop, chat_pair, hf_draft_service):
    """Three generations of one long prompt at once (a request's n choices), on a pooled target:
    the later ones copy the first's cached prompt, and each answer is the target alone's."""
    from dataclasses import replace

    from services.common.settings import TargetSettings
    from services.target.main import start as start_target
    from services.target.servicer import TargetServicer
    from tests.services.conftest import Service

    target = replace(chat_pair[0])
    target.use_pool(4, 256)
    servicer = TargetServicer(target)
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    prompt = "the cat sat on the mat and the dog sat on the log " * 2
    sampling = SamplingParams(temperature=0.8, max_new_tokens=24)
    seeds = [replace(sampling, seed=s) for s in (1, 2, 3)]

    async def run():
        coord = Coordinator(CoordinatorConfig(svc.address, hf_draft_service.address), AsyncMemoryStateStore())
        await coord.connect()

        async def one(s):
            return [t for ev in [e async for e in coord.generate(GenerateRequest(
                prompt=prompt, sampling=s, spec=SpecParams("constant"), tenant="k1"))]
                if not isinstance(ev, FinishEvent) for t in ev.token_ids]

        try:
            return await asyncio.gather(*(one(s) for s in seeds))
        finally:
            await coord.close()

    try:
        answers = asyncio.run(run())
        shared = servicer.registry.get_sample_value("specd_target_prefill_shared_tokens_total",
                                                    {"model": target.name})
    finally:
        svc.stop()
    ids = target.encode_prompt(prompt, chat=False)
    # Each later one copies the whole prompt but its last token (two of them, unless a
    # machine so slow that one answer ended before another opened).
    assert shared in (len(ids) - 1, 2 * (len(ids) - 1))
    for s, got in zip(seeds, answers):
        assert got == SpeculativeEngine(target).generate(ids, s, SpecParams("none")).token_ids


def test_the_requests_tenant_reaches_the_targets_session(target_service, hf_draft_service):
    """The gateway names each key's requests (GenerateRequest.tenant); the target keeps its
    fair shares of KV slots by that name, so it must arrive there, through the proto too."""
    from services.coordinator.convert import request_from_proto, request_to_proto

    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=300),
                              spec=SpecParams("constant"), tenant="k0123456789ab")
    assert request_from_proto(request_to_proto(request), "none").tenant == "k0123456789ab"

    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                            AsyncMemoryStateStore())
        await coord.connect()
        events = coord.generate(request)
        await anext(events)
        tenants = [s.tenant for s in target_service.servicer.core.sessions]
        await events.aclose()
        await coord.close()
        return tenants

    assert asyncio.run(run()) == ["k0123456789ab"]


@pytest.mark.parametrize("spec, sampling, field", [
    (SpecParams("nope"), SamplingParams(), "policy"),
    (SpecParams("svip", policy_params={"h": -1.0}), SamplingParams(), "policy_params.h"),
    (SpecParams("svip", policy_params={"bogus": 1.0}), SamplingParams(), "policy_params.bogus"),
    (SpecParams("oracle"), SamplingParams(), "policy"),
    (SpecParams("constant", relaxed=True), SamplingParams(), "relaxed"),
    (SpecParams("constant"), SamplingParams(max_new_tokens=0), "max_new_tokens"),
    (SpecParams("constant"), SamplingParams(temperature=-1.0), "temperature"),
])
def test_bad_requests_name_the_field(target_service, hf_draft_service, spec, sampling, field):
    with pytest.raises(InvalidRequest) as e:
        generate(target_service.address, hf_draft_service.address,
                 GenerateRequest(prompt="hi", sampling=sampling, spec=spec))
    assert e.value.field == field


def test_prompt_longer_than_the_context(target_service, hf_draft_service):
    with pytest.raises(InvalidRequest) as e:
        generate(target_service.address, hf_draft_service.address, GenerateRequest(prompt="x" * 600))
    assert e.value.field == "prompt"


def test_a_draft_with_another_tokenizer_is_refused(service_loop, chat_pair, target_service):
    from specd.runtime.tiny import char_tokenizer, loaded

    other = char_tokenizer()
    other.add_tokens(["<extra>"])  # one more token: another vocabulary, another fingerprint
    draft = chat_pair[1]
    odd = loaded(draft.model, "odd-draft", other)
    svc = draft_service(service_loop, build_drafter("hf", draft, draft), odd)
    try:
        with pytest.raises(ModelError, match="tokenizer"):
            generate(target_service.address, svc.address, GenerateRequest(prompt="hi"))
    finally:
        svc.stop()


def test_concurrent_requests_share_target_forwards(chat_pair, target_service, hf_draft_service):
    async def run():
        coord = Coordinator(CoordinatorConfig(target_service.address, hf_draft_service.address),
                            AsyncMemoryStateStore())
        await coord.connect()

        async def one(prompt):
            ids, finish = [], None
            async for ev in coord.generate(GenerateRequest(prompt=prompt, sampling=SamplingParams(max_new_tokens=48),
                                                           spec=SpecParams("none"))):
                finish = ev if isinstance(ev, FinishEvent) else finish
                ids += [] if isinstance(ev, FinishEvent) else list(ev.token_ids)
            return ids, finish

        results = await asyncio.gather(*(one(p) for p in PROMPTS + ["The quick brown fox"]))
        await coord.close()
        return results

    results = asyncio.run(run())
    for prompt, (ids, _) in zip(PROMPTS + ["The quick brown fox"], results):
        assert ids == reference(chat_pair[0], prompt, 48)
    assert max(f.spec_stats["max_verify_batch"] for _, f in results) > 1


def test_a_silent_draft_service_stalls_into_a_fallback(chat_pair, service_loop, target_service):
    """A draft service that accepts the session but never drafts: after draft_stall_s the
    request goes on with the target alone, and says so."""
    from services.common.server import start_server
    from services.proto.specd.draft.v1 import draft_pb2, draft_pb2_grpc

    class Silent(draft_pb2_grpc.DraftServiceServicer):
        async def Info(self, request, context):
            return draft_pb2.DraftInfo(name="silent", kind="ngram", has_distribution=False)

        async def Session(self, requests, context):
            async for _ in requests:
                pass
            if False:
                yield

    server, port = service_loop.run(start_server(draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name,
                                                 draft_pb2_grpc.add_DraftServiceServicer_to_server, Silent(),
                                                 "127.0.0.1", 0))
    try:
        request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=8),
                                  spec=SpecParams("constant"))
        ids, finish = generate(target_service.address, f"127.0.0.1:{port}", request, draft_stall_s=0.5)
    finally:
        service_loop.run(server.stop(0))
    assert ids == reference(chat_pair[0], PROMPTS[0], 8)
    assert finish.spec_stats["fallback"] and finish.spec_stats["fallback_kind"] == "stalled"
    assert "nothing drafted" in finish.spec_stats["fallback_reason"]


def test_a_session_the_target_refuses_is_overloaded_whatever_the_race(service_loop, chat_pair, hf_draft_service):
    """A target with one KV slot and four concurrent requests: each refused one fails with
    Overloaded (the gateway's 503 with Retry-After) whether the refusal reaches the coordinator
    through the stream or through its next write, never as an internal error or with the gRPC
    call's debug string; the others answer as the target alone."""
    from dataclasses import replace

    from services.common.settings import TargetSettings
    from services.target.main import start as start_target
    from services.target.servicer import TargetServicer
    from specd.errors import Overloaded
    from tests.services.conftest import Service

    target = replace(chat_pair[0])
    target.use_pool(1, 256)
    servicer = TargetServicer(target)
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)

    async def run():
        coord = Coordinator(CoordinatorConfig(svc.address, hf_draft_service.address), AsyncMemoryStateStore())
        await coord.connect()

        async def one():
            request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=24),
                                      spec=SpecParams("constant"), overlap=True)
            ids = []
            try:
                async for ev in coord.generate(request):
                    ids += [] if isinstance(ev, FinishEvent) else list(ev.token_ids)
            except Exception as e:  # noqa: BLE001 - the test looks at what it is
                return e
            return ids

        try:
            return await asyncio.gather(*(one() for _ in range(4)))
        finally:
            await coord.close()

    try:
        results = asyncio.run(run())
    finally:
        svc.stop()
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and len(refused) < 4
    for e in refused:
        assert isinstance(e, Overloaded), repr(e)
        assert "AioRpcError" not in str(e) and "ipv4" not in str(e), str(e)
    for ids in results:
        if not isinstance(ids, Exception):
            assert ids == reference(chat_pair[0], PROMPTS[0], 24)


def _refused_session(service_loop, chat_pair, then):
    """A target service with one KV slot, the slot taken by a served session, and a second
    session it refuses: `then(refused_call, verify_message)` runs once the refusal's status has
    arrived, on the client's event loop; what it returns is returned."""
    from dataclasses import replace

    from services.common.server import channel
    from services.common.settings import TargetSettings
    from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
    from services.target.main import start as start_target
    from services.target.servicer import TargetServicer
    from tests.services.conftest import Service

    target = replace(chat_pair[0])
    target.use_pool(1, 256)
    servicer = TargetServicer(target)
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    open_msg = target_pb2.TargetRequest(open=target_pb2.OpenTarget(prompt_ids=[5, 9, 14]))
    verify = target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=1))

    async def run():
        async with channel(svc.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            held = stub.Session(timeout=20)
            await held.write(open_msg)
            await held.write(verify)
            await held.read()  # served: the one slot is taken
            refused = stub.Session(timeout=20)
            await refused.write(open_msg)
            await refused.code()  # the call has ended
            try:
                return await then(refused, verify)
            finally:
                held.cancel()

    try:
        return asyncio.run(run())
    finally:
        svc.stop()


def test_a_write_to_a_session_the_target_ended_says_why(service_loop, chat_pair):
    """The race the test above cannot force: the target refuses a session (every KV slot taken)
    and the coordinator's next write finds the call ended. The write raises the call's own
    status as a typed error (Overloaded), not an internal InvalidStateError."""
    import grpc

    from services.coordinator.loop import RequestLoop
    from specd.errors import Overloaded

    async def write(refused, verify):
        loop = object.__new__(RequestLoop)
        loop._watch_target(refused)
        with pytest.raises(Overloaded, match="KV slots"):
            await loop._write_target(verify)
        return await refused.code()

    assert _refused_session(service_loop, chat_pair, write) == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_refusal_overwritten_by_a_racing_write_is_still_overloaded(service_loop, chat_pair):
    """The race CI once met: the target's RESOURCE_EXHAUSTED arrives, then a write that was
    already on its way fails in gRPC's core, which replaces the call's status with INTERNAL
    "Internal error from Core" for good. The coordinator noted the service's status when it
    arrived, so the request still fails with Overloaded (the gateway's 503), not Unavailable.
    The overwrite is what grpc.aio's write does on that failure (set_internal_error)."""
    from services.coordinator.loop import CORE_ERROR, RequestLoop
    from specd.errors import Overloaded

    async def overwrite(refused, verify):
        loop = object.__new__(RequestLoop)
        loop._watch_target(refused)  # notes the status that has arrived
        refused._cython_call.set_internal_error("a write raced the end")
        assert await refused.details() == CORE_ERROR  # the service's status is gone from the call
        return await loop._target_ended()

    error = _refused_session(service_loop, chat_pair, overwrite)
    assert isinstance(error, Overloaded) and "KV slots" in str(error), repr(error)
