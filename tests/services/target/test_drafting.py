"""Drafting on the target (OpenTarget.speculate) over real gRPC, through the coordinator with no
draft service: greedy and seeded output equal the target alone's for every policy a lookup
drafter serves, the drafts are counted and accepted, the policy's state comes back to the
state store, a stop string ends the run and frees the session, and what the target cannot do
is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.convert import sampling_to_proto
from services.common.server import channel
from services.common.settings import TargetSettings
from services.common.state import AsyncMemoryStateStore
from services.coordinator.api import GenerateRequest
from services.coordinator.coordinator import Coordinator, CoordinatorConfig
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target import core as target_core
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.costs import CostCurve
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.state import StateKey
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service, eventually
from tests.services.coordinator.test_coordinator import generate

# Prompts that run to max_new_tokens; the answers repeat themselves a little (the last one
# also its prompt), so that lookups are right and wrong.
PROMPTS = ["the cat sat", "Hello there, how are", "the cat sat, the cat sat, the"]
POLICIES = ["constant", "heuristic", "max-confidence", "svip", "adaedl", "adasd", "cost-aware"]
SEEDED = SamplingParams(temperature=1.0, seed=11, max_new_tokens=40)


@pytest.fixture(scope="module")
def drafting_target(service_loop, chat_pair):
    servicer = TargetServicer(chat_pair[0], drafter=build_drafter("ngram", None))
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    yield svc
    svc.stop()


def reference(target, prompt: str, sampling: SamplingParams) -> list[int]:
    ids = target.encode_prompt(prompt, chat=False)
    return SpeculativeEngine(target).generate(ids, sampling, SpecParams("none")).token_ids


@pytest.mark.parametrize("policy", POLICIES)
def test_greedy_output_is_the_target_alone_with_no_draft_service(chat_pair, drafting_target, policy, monkeypatch):
    # cost-aware weighs windows with the times this machine measures, live, so on a loaded one it
    # can draft nothing (a fresh clone's make test: no draft in three prompts). Here drafting is
    # free and a window costs what one token does: it drafts on every machine, the same drafts.
    frozen = CostCurve(0.0, list(range(1, 17)), [1e-3] * 16, smoothing=0.0)
    monkeypatch.setattr(target_core, "local_cost_curve", lambda *_: frozen)
    drafted = accepted = 0
    for prompt in PROMPTS:
        sampling = SamplingParams(max_new_tokens=40)
        request = GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams(policy))
        ids, finish = generate(drafting_target.address, None, request)
        assert ids == reference(chat_pair[0], prompt, sampling)
        stats = finish.spec_stats
        assert stats["drafted_on_target"] and not stats["fallback"]
        assert stats["accepted"] <= stats["drafted"] and stats["verifications"] + stats["accepted"] == len(ids)
        drafted, accepted = drafted + stats["drafted"], accepted + stats["accepted"]
    assert accepted > 0 and drafted > accepted or policy == "cost-aware"  # lookups right and wrong
    assert drafted > 0
    assert drafting_target.servicer.costs.value("load_fit").forwards > 0  # what the forwards cost, for cost-aware's prices


def test_seeded_sampling_is_the_target_alone_with_the_same_seed(chat_pair, drafting_target):
    for prompt in PROMPTS:
        request = GenerateRequest(prompt=prompt, sampling=SEEDED, spec=SpecParams("constant"))
        ids, finish = generate(drafting_target.address, None, request)
        assert ids == reference(chat_pair[0], prompt, SEEDED)
        assert finish.spec_stats["drafted"] > 0


@pytest.mark.parametrize("seed", [None, 9], ids=["greedy", "seeded"])
def test_penalties_apply_at_every_position_the_target_drafts(chat_pair, drafting_target, seed):
    sampling = SamplingParams(temperature=0.0 if seed is None else 0.8, seed=seed, max_new_tokens=32,
                              presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.2,
                              logit_bias=((7, 1.5),))
    drafted = 0
    for prompt in PROMPTS:
        request = GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams("constant"))
        ids, finish = generate(drafting_target.address, None, request)
        assert ids == reference(chat_pair[0], prompt, sampling) and finish.spec_stats["drafted_on_target"]
        drafted += finish.spec_stats["drafted"]
    assert drafted > 0


def test_logprobs_come_back_for_every_token_the_target_drafts_and_emits(chat_pair, drafting_target):
    from services.coordinator.api import FinishEvent
    from services.coordinator.coordinator import Coordinator, CoordinatorConfig

    sampling = SamplingParams(max_new_tokens=32)

    async def run(prompt):
        coord = Coordinator(CoordinatorConfig(drafting_target.address, None), AsyncMemoryStateStore())
        await coord.connect()
        try:
            return [ev async for ev in coord.generate(GenerateRequest(prompt=prompt, sampling=sampling,
                                                                       spec=SpecParams("constant"), logprobs=1))]
        finally:
            await coord.close()

    for prompt in PROMPTS:
        events = asyncio.run(run(prompt))
        finish, tokens = events[-1], [e for e in events if not isinstance(e, FinishEvent)]
        ids = [t for e in tokens for t in e.token_ids]
        found = [lp.logprob for e in tokens for lp in e.logprobs]
        alone = SpeculativeEngine(chat_pair[0]).generate(chat_pair[0].encode_prompt(prompt, chat=False), sampling,
                                                         SpecParams("none"), logprobs=1)
        assert ids == alone.token_ids and finish.spec_stats["drafted_on_target"]
        assert found == pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-4)


def test_a_grammar_masks_and_drafts_where_the_target_drafts_itself(chat_pair, drafting_target):
    from specd.grammar import GrammarSpec

    schema = '{"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, ' \
             '"required": ["name", "age"]}'
    forced = 0
    for spec in (GrammarSpec("json_object"), GrammarSpec("json_schema", schema)):
        sampling = SamplingParams(max_new_tokens=48, grammar=spec)
        for prompt in PROMPTS:
            ids, finish = generate(drafting_target.address, None,
                                   GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams("constant")))
            assert ids == reference(chat_pair[0], prompt, sampling) and finish.spec_stats["drafted_on_target"]
            forced += finish.spec_stats["grammar_drafted"]
    assert forced > 0  # the target drafted what the grammar forced


def test_the_target_drafts_even_with_a_draft_service_configured(chat_pair, drafting_target, hf_draft_service):
    """The coordinator prefers the target's own lookups: no round trip to the draft service."""
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=24),
                              spec=SpecParams("constant"))
    ids, finish = generate(drafting_target.address, hf_draft_service.address, request)
    assert ids == reference(chat_pair[0], PROMPTS[0], SamplingParams(max_new_tokens=24))
    assert finish.spec_stats["drafted_on_target"]


def test_the_policy_state_comes_back_to_the_store(drafting_target, monkeypatch):
    """Each request's cost-aware table comes back, with the decay of its sums: two requests
    that run at once on one coordinator both land in the saved table (specd.state.StateUpdate)."""
    frozen = CostCurve(0.0, list(range(1, 17)), [1e-3] * 16, smoothing=0.0)  # drafts on any machine
    monkeypatch.setattr(target_core, "local_cost_curve", lambda *_: frozen)
    key = StateKey("ngram-8", drafting_target.servicer.target.name, "cost-aware", "default")
    requests = [GenerateRequest(prompt=prompt, sampling=SamplingParams(max_new_tokens=40),
                                spec=SpecParams("cost-aware")) for prompt in (PROMPTS[1], PROMPTS[2])]

    def judged(state):  # judged tokens in the top-level bins, decayed
        return sum(v for k, v in state.items() if k[0] in "nr" and "v" not in k and k[-2:] in (":a", ":r"))

    async def run(*batch):
        store = AsyncMemoryStateStore()
        coord = Coordinator(CoordinatorConfig(drafting_target.address, None), store)
        await coord.connect()
        try:
            await asyncio.gather(*(drain(coord.generate(r)) for r in batch))
        finally:
            await coord.close(save_grace_s=10)
        return judged(await store.load(key))

    alone = [asyncio.run(run(r)) for r in requests]
    assert min(alone) > 2
    assert asyncio.run(run(*requests)) > max(alone) + 0.5 * min(alone)  # last writer wins: one of them


async def drain(events):
    async for _ in events:
        pass


def test_a_stop_string_ends_the_run_and_frees_the_session(chat_pair, drafting_target):
    sampling = SamplingParams(max_new_tokens=40)
    full = chat_pair[0].decode(reference(chat_pair[0], PROMPTS[0], sampling))
    stop = full[6:9]
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=40, stop=[stop]),
                              spec=SpecParams("constant"))
    ids, finish = generate(drafting_target.address, None, request)
    assert chat_pair[0].decode(ids).startswith(full[:full.index(stop)]) and finish.finish_reason == "stop"
    eventually(lambda: drafting_target.servicer.active_sessions == 0)


def test_the_target_says_which_drafter_it_drafts_with(drafting_target, target_service):
    async def info(address):
        async with channel(address) as ch:
            return await target_pb2_grpc.TargetServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10)

    mine = asyncio.run(info(drafting_target.address))
    assert (mine.drafter, mine.drafter_kind) == ("ngram-8", "ngram")
    assert asyncio.run(info(target_service.address)).drafter == ""


def _open_and_verify(address, speculate: target_pb2.LocalDrafting, verify: target_pb2.Verify | None = None):
    """Open (and send verify, if given), then read the replies: a refused Open ends the call before
    a Verify could be written (a write racing that end fails in gRPC's core instead)."""
    async def run():
        async with channel(address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=30)
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(
                prompt_ids=[5, 9, 14, 5, 9], sampling=sampling_to_proto(SamplingParams()), speculate=speculate)))
            if verify is not None:
                await call.write(target_pb2.TargetRequest(verify=verify))
            return [m async for m in call]

    return asyncio.run(run())


@pytest.mark.parametrize("speculate, verify, field", [
    (target_pb2.LocalDrafting(policy="bogus", max_length=20), None, "policy"),
    (target_pb2.LocalDrafting(policy="none", max_length=20), None, "speculate.policy"),
    (target_pb2.LocalDrafting(policy="specdec++", max_length=20), None, "speculate.policy"),
    (target_pb2.LocalDrafting(policy="constant", max_length=3), None, "speculate.max_length"),
    (target_pb2.LocalDrafting(policy="constant", policy_params={"k": -1}, max_length=20), None, "k"),
    (target_pb2.LocalDrafting(policy="constant", max_length=20),
     target_pb2.Verify(verify_id=1, tokens=[3], probs=[1.0]), "tokens"),
], ids=["unknown-policy", "no-policy", "needs-hidden", "short", "bad-param", "client-drafts"])
def test_what_the_target_cannot_draft_is_invalid_argument_naming_the_field(drafting_target, speculate, verify,
                                                                           field):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _open_and_verify(drafting_target.address, speculate, verify)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    eventually(lambda: drafting_target.servicer.active_sessions == 0)


def test_a_target_without_a_drafter_refuses_to_draft(target_service):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _open_and_verify(target_service.address, target_pb2.LocalDrafting(policy="constant", max_length=20))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculate" in e.value.details()


def test_an_unknown_policy_is_refused_naming_it_where_the_target_drafts(drafting_target):
    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=8), spec=SpecParams("bogus"))
    with pytest.raises(InvalidRequest) as e:
        generate(drafting_target.address, None, request)
    assert e.value.field == "policy"


def test_a_client_that_goes_away_mid_run_frees_its_session(drafting_target):
    async def run():
        async with channel(drafting_target.address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=30)
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(
                prompt_ids=[5, 9, 14, 5, 9], sampling=sampling_to_proto(SamplingParams()),
                speculate=target_pb2.LocalDrafting(policy="constant", max_length=400))))
            await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=1, steps=390)))
            first = await call.read()
            call.cancel()
            return first

    assert asyncio.run(run()).verified.next_token >= 0
    eventually(lambda: drafting_target.servicer.active_sessions == 0)


def test_spec_stats_say_the_target_drafted_across_the_coordinators_grpc_api():
    """The gateway reads a remote coordinator's stats through SpecStats: the flag crosses it."""
    from services.coordinator.api import FinishEvent
    from services.coordinator.convert import event_from_proto, event_to_proto

    sent = FinishEvent("length", 5, 8, {"policy": "constant", "drafted": 4, "drafted_on_target": True})
    assert event_from_proto(event_to_proto(sent)).spec_stats["drafted_on_target"] is True
