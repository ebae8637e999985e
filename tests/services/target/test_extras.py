"""What the target service returns beside the verdict, over real gRPC: the top log-probs of
judged draft positions (DVI) and the hidden states of committed positions (feature drafters);
a bad request names its field."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from services.common.convert import features_from_proto
from services.common.server import channel
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc

PROMPT = [5, 9, 14, 20, 33, 40]


def _session(address, open_msg, verifies):
    async def run():
        async with channel(address) as ch:
            call = target_pb2_grpc.TargetServiceStub(ch).Session(timeout=20)
            await call.write(target_pb2.TargetRequest(open=open_msg))
            replies = []
            for v in verifies:
                await call.write(target_pb2.TargetRequest(verify=v))
                replies.append((await call.read()).verified)
            await call.done_writing()
            return replies

    return asyncio.run(run())


def test_top_logprobs_and_features_come_back_for_the_right_positions(chat_pair, target_service):
    target, _ = chat_pair
    model = target.model
    with torch.no_grad():
        out = model(torch.tensor([PROMPT]), output_hidden_states=True)
    greedy = int(out.logits[0, -1].argmax())
    wrong = (greedy + 1) % target.vocab_size
    # Draft the target's own next token, then a wrong one: one accepted, one rejected.
    first, second = _session(target_service.address, target_pb2.OpenTarget(prompt_ids=PROMPT, features=True), [
        target_pb2.Verify(verify_id=1, tokens=[greedy, wrong], probs=[1.0, 1.0], top_logprobs=4),
        target_pb2.Verify(verify_id=2, tokens=[], top_logprobs=4)])
    assert first.num_accepted == 1 and len(first.top_logprobs) == 2  # judged: the accepted and the rejected
    assert first.top_logprobs[0].ids[0] == greedy
    lp = out.logits[0, -1].float().log_softmax(-1)
    assert first.top_logprobs[0].logprobs[0] == pytest.approx(float(lp[greedy]), abs=1e-4)
    start, feats = features_from_proto(first.features)
    # The prompt's positions and the fed ones now committed: the last prompt token and the accepted draft.
    assert start == 0 and feats.shape == (len(PROMPT) + 1, model.config.hidden_size)
    torch.testing.assert_close(feats[:len(PROMPT)], out.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
    assert len(second.top_logprobs) == 0  # nothing drafted, nothing judged
    start2, feats2 = features_from_proto(second.features)
    assert start2 == len(PROMPT) + 1 and feats2.shape[0] == 1


def test_a_bad_top_logprobs_is_invalid_argument(target_service):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        _session(target_service.address, target_pb2.OpenTarget(prompt_ids=PROMPT),
                 [target_pb2.Verify(verify_id=1, tokens=[3], probs=[1.0], top_logprobs=1000)])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_logprobs" in e.value.details()
