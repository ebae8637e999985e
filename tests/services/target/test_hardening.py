"""The target service against what a client (or a broken draft) may send, over real gRPC: draft
distributions that would make the acceptance rule accept anything, windows beyond the
service's cap, sessions that go quiet holding a KV slot, and a model whose logits run past its
tokenizer (padded embedding tables), whose padding ids it must never emit."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import grpc
import numpy as np
import pytest
import torch

from services.common.convert import sampling_to_proto
from services.common.server import channel
from services.common.settings import TargetSettings
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.main import start as start_target
from services.target.core import MAX_WINDOW_TOKENS
from services.target.servicer import TargetServicer
from specd.runtime.tiny import char_tokenizer, loaded, tiny_llama
from specd.types import SamplingParams
from tests.services.conftest import Service, eventually

PROMPT = [5, 9, 14, 20, 33, 40, 7, 11]
SAMPLED = SamplingParams(temperature=1.0, seed=None)


def serve(service_loop, target, **options) -> Service:
    servicer = TargetServicer(target, **options)
    server, port = service_loop.run(start_target(TargetSettings(port=0), servicer))
    return Service(f"127.0.0.1:{port}", servicer, server, service_loop)


def dense(q: np.ndarray) -> common_pb2.Distribution:
    return common_pb2.Distribution(dense_f32=q.astype("<f4").tobytes())


def one_verify(address: str, verify: target_pb2.Verify, sampling: SamplingParams = SAMPLED):
    """Open a session, send one Verify: its reply, or the AioRpcError the call ended with."""
    async def run():
        async with channel(address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=30)
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(
                prompt_ids=PROMPT, sampling=sampling_to_proto(sampling))))
            await call.write(target_pb2.TargetRequest(verify=verify))
            try:
                return await call.read()
            except grpc.aio.AioRpcError as e:
                return e
            finally:
                call.cancel()

    return asyncio.run(run())


def refused(address: str, verify: target_pb2.Verify, field: str, sampling: SamplingParams = SAMPLED) -> str:
    e = one_verify(address, verify, sampling)
    assert isinstance(e, grpc.aio.AioRpcError), e
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith(f"{field}: "), e.details()
    return e.details()


# -- relayed draft distributions -------------------------------------------------------------------

def _q(vocab: int, x: int, case: str) -> common_pb2.Distribution:
    q = np.full(vocab, 1.0 / (vocab - 1), dtype=np.float64)
    q[x] = 0.0  # "q(x) = 0": every draft would be accepted, whatever p says
    if case == "nan":
        q[x + 1] = math.nan
    elif case == "negative":
        q[x], q[x + 1] = 0.5, -0.5
    elif case == "sums to 2":
        q[x] = 1.0
    elif case == "sparse index out of range":
        return common_pb2.Distribution(sparse=common_pb2.SparseDistribution(indices=[x, vocab], values=[0.5, 0.5]))
    elif case == "sparse negative index":
        return common_pb2.Distribution(sparse=common_pb2.SparseDistribution(indices=[x, -1], values=[0.5, 0.5]))
    return dense(q)


@pytest.mark.parametrize("case", ["q(x) = 0", "nan", "negative", "sums to 2", "sparse index out of range",
                                  "sparse negative index"])
def test_a_draft_distribution_that_is_not_one_is_refused(target_service, case):
    vocab = target_service.servicer.target.vocab_size
    x = 5
    details = refused(target_service.address, target_pb2.Verify(verify_id=1, tokens=[x], probs=[0.5],
                                                                distributions=[_q(vocab, x, case)]), "distributions")
    assert "distribution 0" in details


@pytest.mark.parametrize("prob", [0.0, -0.5, 1.5, math.nan, math.inf])
def test_a_drafted_tokens_probability_outside_0_1_is_refused(target_service, prob):
    vocab = target_service.servicer.target.vocab_size
    q = np.full(vocab, 1.0 / vocab)
    refused(target_service.address, target_pb2.Verify(verify_id=1, tokens=[5], probs=[prob],
                                                      distributions=[dense(q)]), "probs")


def test_a_proper_distribution_is_verified(target_service):
    vocab = target_service.servicer.target.vocab_size
    q = np.full(vocab, 1.0 / vocab)
    reply = one_verify(target_service.address, target_pb2.Verify(verify_id=1, tokens=[5, 6], probs=[q[5], q[6]],
                                                                 distributions=[dense(q), dense(q)]))
    assert reply.WhichOneof("kind") == "verified" and 0 <= reply.verified.num_accepted <= 2


# -- the window's length ---------------------------------------------------------------------------

def test_a_window_beyond_the_cap_is_refused_naming_the_setting(target_service):
    cap = target_service.servicer.core.config.max_window_tokens
    assert cap == MAX_WINDOW_TOKENS == TargetSettings().max_window_tokens
    details = refused(target_service.address, target_pb2.Verify(verify_id=1, tokens=[5] * (cap + 1)), "tokens",
                      SamplingParams())
    assert "max_window_tokens" in details
    # side nodes of a draft tree count too
    refused(target_service.address, target_pb2.Verify(verify_id=1, tokens=[5] * cap, side_tokens=[6],
                                                      side_parents=[-1]), "tokens", SamplingParams())
    reply = one_verify(target_service.address, target_pb2.Verify(verify_id=1, tokens=[5] * cap), SamplingParams())
    assert reply.WhichOneof("kind") == "verified"


# -- idle sessions ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def idle_service(service_loop, chat_pair):
    target = replace(chat_pair[0])  # the same weights, on a pool of one slot
    target.use_pool(1, 128)
    svc = serve(service_loop, target, idle_timeout_s=0.5)
    yield svc
    svc.stop()


def test_a_quiet_session_is_ended_and_its_slot_freed(idle_service):
    """Open, then nothing: the service ends the call (DEADLINE_EXCEEDED, its own, not the
    client's 30 s deadline), the only KV slot is free again and the next session is served."""
    pool = idle_service.servicer.target.pool

    async def run():
        async with channel(idle_service.address) as ch:
            stub = target_pb2_grpc.TargetServiceStub(ch)
            for verify_first in (False, True):  # quiet from the start, or after a verification
                call = stub.Session(timeout=30)
                await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(prompt_ids=PROMPT)))
                if verify_first:
                    await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=1)))
                    assert (await call.read()).WhichOneof("kind") == "verified"
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                assert "idle_timeout_s" in e.value.details()
                await asyncio.to_thread(eventually, lambda: pool.in_use() == 0 and not idle_service.servicer.core.sessions)
            call = stub.Session(timeout=30)  # served: the slot is free
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(prompt_ids=PROMPT)))
            await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=1)))
            assert (await call.read()).WhichOneof("kind") == "verified"
            await call.write(target_pb2.TargetRequest(close=target_pb2.CloseTarget()))
            assert (await call.read()).WhichOneof("kind") == "closed"
            await call.done_writing()

    asyncio.run(run())
    eventually(lambda: pool.in_use() == 0)


# -- logits past the tokenizer ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def padded(service_loop):
    """A model with 8 logits rows past its tokenizer's ids (as Qwen2.5's padded tables), made to
    win the argmax at most positions, as an untrained padding row may."""
    tok = char_tokenizer()
    n = len(tok)
    model = tiny_llama(0, layers=2, vocab_size=n + 8)
    with torch.no_grad():
        h = model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states[-1][0]
        mean = h.mean(0)
        model.lm_head.weight[n:] = 50 * mean / mean.norm()
    target = loaded(model, "tiny-padded", tok)
    svc = serve(service_loop, target)
    yield svc, target, n
    svc.stop()


def _multi_step(address: str, sampling: SamplingParams, steps: int, drafts: list[int] = ()) -> list[int]:
    async def run():
        async with channel(address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=30)
            await call.write(target_pb2.TargetRequest(open=target_pb2.OpenTarget(
                prompt_ids=PROMPT, sampling=sampling_to_proto(sampling))))
            out = []
            if drafts:  # one window of drafts (point masses), then the multi-step run
                await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(
                    verify_id=1, tokens=list(drafts), probs=[1.0] * len(drafts))))
                v = (await call.read()).verified
                out += list(drafts[:v.num_accepted]) + [v.next_token]
            await call.write(target_pb2.TargetRequest(verify=target_pb2.Verify(verify_id=2, steps=steps)))
            for _ in range(steps):
                out.append((await call.read()).verified.next_token)
            call.cancel()
            return out

    return asyncio.run(run())


def test_ids_past_the_tokenizer_are_never_emitted(padded):
    """Greedy: every id is the argmax over the tokenizer's ids (where the unmasked argmax was a
    padding id at most steps), through plain steps and through verified drafts alike; sampled
    and seeded: every id is one the tokenizer knows."""
    svc, target, n = padded
    ids = _multi_step(svc.address, SamplingParams(), 16)
    seq, pad_wins = list(PROMPT), 0
    with torch.no_grad():
        for token in ids:
            logits = target.model(torch.tensor([seq])).logits[0, -1]
            pad_wins += int(logits.argmax()) >= n
            assert token == int(logits[:n].argmax())
            seq.append(token)
    assert pad_wins > 0  # the model would have emitted padding ids
    assert _multi_step(svc.address, SamplingParams(), 8, drafts=ids[:4]) == ids[:13]  # 4 drafts, 1, 8 steps
    for sampling in (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, seed=7)):
        assert all(0 <= t < n for t in _multi_step(svc.address, sampling, 24))
    # a draft id past the tokenizer is refused, naming the field
    e = one_verify(svc.address, target_pb2.Verify(verify_id=1, tokens=[n + 1], probs=[1.0]), SamplingParams())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("tokens: ")


def test_the_engine_in_process_emits_what_the_target_service_emits(padded):
    """The same rule in process (SpeculativeEngine): greedy and seeded ids equal the service's plain
    runs, padding rows never read (before, the engine's greedy ids were padding ids there)."""
    from specd.engine import SpeculativeEngine
    from specd.types import SpecParams

    svc, target, n = padded
    for sampling in (SamplingParams(max_new_tokens=16), SamplingParams(temperature=1.0, seed=7, max_new_tokens=16)):
        want = _multi_step(svc.address, sampling, 16)
        got = SpeculativeEngine(target).generate(PROMPT, sampling, SpecParams("none")).token_ids
        assert got == want[:len(got)] and all(t < n for t in got), sampling


def test_speculation_on_a_padded_table_equals_the_target_alone(padded):
    """A draft model of the same padded table proposes no padding id (its q has no mass there),
    so every window is verified over the tokenizer's ids as the target alone decodes: greedy and
    seeded output are the same with and without drafts (before, a window holding a padding draft
    read the padding logits and emitted other ids). A prompt with a padding id is refused."""
    from specd.drafters.hf import HfDrafter
    from specd.engine import SpeculativeEngine
    from specd.errors import InvalidRequest
    from specd.runtime.tiny import perturbed
    from specd.types import SpecParams

    _, target, n = padded
    draft = loaded(perturbed(target.model, 0.05, 1), "tiny-padded-draft", target.tokenizer)
    engine = SpeculativeEngine(target, HfDrafter(draft, target))
    for sampling in (SamplingParams(max_new_tokens=24), SamplingParams(temperature=1.0, seed=7, max_new_tokens=24)):
        alone = engine.generate(PROMPT, sampling, SpecParams("none")).token_ids
        spec = engine.generate(PROMPT, sampling, SpecParams("constant"))
        assert spec.token_ids == alone and spec.stats.drafted > 0, sampling
    with pytest.raises(InvalidRequest, match="prompt"):
        engine.generate(PROMPT + [n + 1], SamplingParams(max_new_tokens=4), SpecParams("none"))
