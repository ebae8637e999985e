"""Multi-step runs over real gRPC: one Verify with steps = N is answered by N Verified messages
equal to N single plain steps (greedy and seeded sampling), ends early at an end-of-sequence
token or when the client sends Close, and is refused with drafts or past its cap, naming
`steps`."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from services.common.convert import sampling_to_proto
from services.common.server import channel
from services.common.settings import TargetSettings
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.main import start as start_target
from services.target.core import MAX_PLAIN_STEPS
from services.target.servicer import TargetServicer
from specd.types import SamplingParams
from tests.services.conftest import Service

PROMPT = [5, 9, 14, 20, 33, 40]
GREEDY = SamplingParams(max_new_tokens=64)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_new_tokens=64)


def _session(address, verifies, sampling=GREEDY, close_after: int | None = None):
    """Open, send each Verify once the one before is answered (a last multi-step run is read to the
    end of the call): (tokens, replies, closed). close_after: send Close once this many replies have come (during a run), without waiting."""
    async def run():
        async with channel(address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=30)
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(
                prompt_ids=PROMPT, sampling=sampling_to_proto(sampling))))
            replies, closed = [], False
            for i, v in enumerate(verifies):
                await call.write(target_pb2.TargetRequest(verify=v))
                if v.steps <= 1 or i + 1 < len(verifies):  # a message sent during a run would end it
                    replies += [(await call.read()).verified for _ in range(max(v.steps, 1))]
            if close_after is not None:
                while len(replies) < close_after:
                    replies.append((await call.read()).verified)
                await call.write(target_pb2.TargetRequest(close=target_pb2.CloseTarget()))
            await call.done_writing()
            while (msg := await call.read()) is not grpc.aio.EOF:
                if msg.WhichOneof("kind") == "closed":
                    closed = True
                else:
                    replies.append(msg.verified)
            return [r.next_token for r in replies], replies, closed

    return asyncio.run(run())


def _steps(n: int) -> list[target_pb2.Verify]:
    return [target_pb2.Verify(verify_id=i + 1) for i in range(n)]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_multi_step_run_is_the_same_plain_steps_one_reply_each(target_service, sampling):
    one_by_one, _, _ = _session(target_service.address, _steps(12), sampling)
    run, replies, closed = _session(target_service.address, [target_pb2.Verify(verify_id=1, steps=12)], sampling)
    assert run == one_by_one and closed
    assert all(r.num_accepted == 0 and r.forward_seconds > 0 for r in replies)
    assert replies[0].prefill_seconds > 0 and not any(r.prefill_seconds for r in replies[1:])
    # A multi-step run after single steps, and a step after a run, go on from where the session is.
    mixed, _, _ = _session(target_service.address, [*_steps(3), target_pb2.Verify(verify_id=4, steps=7),
                                                    *_steps(2)], sampling)
    assert mixed == one_by_one


def test_the_target_says_it_runs_multi_step_runs_and_counts_their_steps(target_service):
    async def info():
        async with channel(target_service.address) as ch:
            return await target_pb2_grpc.TargetServiceStub(ch).Info(common_pb2.InfoRequest(), timeout=10)

    assert asyncio.run(info()).multi_step
    registry, labels = target_service.servicer.registry, {"model": target_service.servicer.target.name}
    before = registry.get_sample_value("specd_target_run_steps_sum", labels) or 0
    _session(target_service.address, [target_pb2.Verify(verify_id=1, steps=5)])
    assert registry.get_sample_value("specd_target_run_steps_sum", labels) == before + 5


def test_a_multi_step_run_ends_at_an_end_of_sequence_token(service_loop, chat_pair, target_service):
    tokens, _, _ = _session(target_service.address, _steps(8))
    eos = tokens[3]  # the fourth token ends the run (an earlier equal one would end it first)
    servicer = TargetServicer(dataclasses.replace(chat_pair[0], eos_token_ids=frozenset({eos})))
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    svc = Service(f"127.0.0.1:{port}", servicer, server, service_loop)
    try:
        run, _, closed = _session(svc.address, [target_pb2.Verify(verify_id=1, steps=8)])
    finally:
        svc.stop()
    assert run == tokens[:tokens.index(eos) + 1] and closed


def test_close_during_a_multi_step_run_ends_it_there(target_service):
    steps = 400
    _, replies, closed = _session(target_service.address, [target_pb2.Verify(verify_id=1, steps=steps)],
                                  close_after=1)
    assert closed and 1 <= len(replies) < steps


@pytest.mark.parametrize("verify", [target_pb2.Verify(verify_id=1, tokens=[3], probs=[1.0], steps=4),
                                    target_pb2.Verify(verify_id=1, side_tokens=[3], side_parents=[-1], steps=4),
                                    target_pb2.Verify(verify_id=1, steps=MAX_PLAIN_STEPS + 1)],
                         ids=["with-drafts", "with-a-tree", "too-long"])
def test_a_bad_multi_step_run_is_invalid_argument_naming_steps(target_service, verify):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _session(target_service.address, [verify])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "steps" in e.value.details()
