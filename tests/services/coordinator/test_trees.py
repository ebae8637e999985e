"""Draft trees through the services (specd.tree): the draft service grows each window into a
tree, the coordinator sends it whole, the target verifies it in one forward (alone over a
KVSession, beside other sessions' rows over the KV pool). Greedy and seeded output stay the
target alone's, with lookup trees and with the hybrid drafter; a malformed tree is refused
naming the field."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest

from services.common.settings import TargetSettings
from services.coordinator.api import GenerateRequest
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.main import start as start_target
from services.target.servicer import TargetServicer
from specd.drafters import build_drafter
from specd.drafters.early_exit import EarlyExitDrafter
from specd.drafters.hybrid import HybridDrafter
from specd.drafters.ngram import NgramDrafter
from specd.engine import SpeculativeEngine
from specd.types import SamplingParams, SpecParams
from tests.services.conftest import Service, draft_service
from tests.services.coordinator.test_coordinator import generate

PROMPTS = ["abcabc abc xyz abc abd", "the cat sat on the mat, the cat sat on the hat"]


SAMPLINGS = {"greedy": SamplingParams(max_new_tokens=40),
             "seeded": SamplingParams(temperature=1.0, seed=7, max_new_tokens=40)}


def flat_target(loop, target) -> Service:
    """A target service whose cost curve says a forward over 17 tokens costs what one over 1 does
    (as on a GPU), so that every round is worth a tree: the tiny model's measured curve is noise."""
    servicer = TargetServicer(target)
    curve = servicer.costs.value("verify_seconds")
    servicer.costs.seed("verify_seconds", [curve[0]] * len(curve))
    server, port = loop.run(start_target(TargetSettings(port=0), servicer))
    return Service(f"127.0.0.1:{port}", servicer, server, loop)


@pytest.fixture(scope="module")
def targets(service_loop, chat_pair):
    """Target services verifying trees alone over a KVSession, and in shared forwards over the pool."""
    pooled = replace(chat_pair[0])
    pooled.use_pool(4, 256)
    services = {"session": flat_target(service_loop, chat_pair[0]), "pool": flat_target(service_loop, pooled)}
    yield services
    for svc in services.values():
        svc.stop()


@pytest.fixture(scope="module")
def ngram_tree_service(service_loop):
    svc = draft_service(service_loop, build_drafter("ngram", None), None, branches=3)
    yield svc
    svc.stop()


@pytest.fixture(scope="module")
def hybrid_service(service_loop, chat_pair):
    target = chat_pair[0]
    svc = draft_service(service_loop, HybridDrafter(EarlyExitDrafter(target, 2, None), NgramDrafter()), target)
    yield svc
    svc.stop()


def target_alone(target, prompt: str, sampling: SamplingParams) -> list[int]:
    ids = target.encode_prompt(prompt, chat=False)
    return SpeculativeEngine(target).generate(ids, sampling, SpecParams("none")).token_ids


def run_all(target_addr: str, draft_addr: str, sampling: SamplingParams, spec: SpecParams, target,
            overlap: bool | None = None):
    trees = branched = 0
    for prompt in PROMPTS:
        request = GenerateRequest(prompt=prompt, sampling=sampling, spec=spec, overlap=overlap)
        ids, finish = generate(target_addr, draft_addr, request)
        assert ids == target_alone(target, prompt, sampling), prompt
        stats = finish.spec_stats
        assert not stats["fallback"] and stats["overlap"] is bool(overlap)  # trees: sequential unless asked
        trees, branched = trees + stats["tree_rounds"], branched + stats["branch_accepted"]
    return trees, branched


@pytest.mark.parametrize("kv", ["session", "pool"])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=list(SAMPLINGS))
def test_lookup_trees_through_the_services_are_the_target_alone(chat_pair, targets, ngram_tree_service, kv, sampling):
    target = targets[kv]
    trees, _ = run_all(target.address, ngram_tree_service.address, SAMPLINGS[sampling], SpecParams("constant"),
                       chat_pair[0])
    assert trees > 0  # the trees were verified, not only chains


def test_the_hybrid_drafter_through_the_services_is_the_target_alone(chat_pair, targets, hybrid_service):
    """The early-exit chain is often wrong where the lookup's branch is right: the accepted path
    leaves the chain, and the output is still the target's."""
    trees, branched = run_all(targets["pool"].address, hybrid_service.address, SAMPLINGS["greedy"],
                              SpecParams("constant"), chat_pair[0])
    assert trees > 0 and branched > 0


def test_trees_under_pearl_when_a_request_asks(chat_pair, targets, hybrid_service):
    """PEARL sends windows in parts; a whole one still goes as a tree, a part as a chain, and the
    drafts past a side path roll back: the output stays the target's."""
    run_all(targets["pool"].address, hybrid_service.address, SAMPLINGS["greedy"], SpecParams("constant"),
            chat_pair[0], overlap=True)


def test_a_request_can_turn_trees_off(chat_pair, targets, ngram_tree_service):
    spec = SpecParams("constant", branches=0)
    assert run_all(targets["session"].address, ngram_tree_service.address, SAMPLINGS["greedy"], spec,
                   chat_pair[0]) == (0, 0)


@pytest.mark.parametrize("side, field", [
    ({"side_tokens": [5, 6], "side_parents": [-1]}, "side_parents"),
    ({"side_tokens": [5, 5], "side_parents": [-1, -1]}, "side_tokens"),  # a repeated sibling
    ({"side_tokens": [5], "side_parents": [3]}, "side_parents"),  # a parent after the node
    ({"side_tokens": [10_000], "side_parents": [-1]}, "side_tokens"),
    ({"side_tokens": [5], "side_parents": [-1], "top_logprobs": 3}, "side_tokens"),  # defined for chains
])
def test_a_malformed_tree_is_refused_naming_the_field(chat_pair, target_service, side, field):
    prompt = chat_pair[0].encode_prompt(PROMPTS[0], chat=False)

    async def run():
        async with grpc.aio.insecure_channel(target_service.address) as channel:
            call = target_pb2_grpc.TargetServiceStub(channel).Session()
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(prompt_ids=prompt)))
            await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=1, tokens=[7], **side)))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call.read()
            return e.value

    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.details()


def test_unseeded_sampling_verifies_the_hybrid_tree_with_the_chain_q(targets, hybrid_service):
    """Unseeded sampling sends the model chain's distributions beside the tree's point-mass side
    nodes; the target judges the chain with its q first (specd.tree.verify_tree_sampling, whose
    distribution the engine's statistical test checks). Here: the plumbing, end to end."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=40)
    trees = 0
    for prompt in PROMPTS:
        request = GenerateRequest(prompt=prompt, sampling=sampling, spec=SpecParams("constant"))
        ids, finish = generate(targets["pool"].address, hybrid_service.address, request)
        assert len(ids) == 40 or finish.finish_reason == "stop"
        assert not finish.spec_stats["fallback"]
        trees += finish.spec_stats["tree_rounds"]
    assert trees > 0


def test_trees_asked_of_a_drafter_without_alternatives_are_a_bad_request(chat_pair, target_service, hf_draft_service):
    """A request's branches reach a model drafter that proposes no alternatives: InvalidRequest
    naming the field before any work (the gateway's 400), not a silent fallback to the target."""
    from specd.errors import InvalidRequest

    request = GenerateRequest(prompt=PROMPTS[0], sampling=SamplingParams(max_new_tokens=8),
                              spec=SpecParams("constant", branches=2))
    with pytest.raises(InvalidRequest) as e:
        generate(target_service.address, hf_draft_service.address, request)
    assert e.value.field == "branches"
