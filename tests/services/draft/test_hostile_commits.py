"""The draft service against token ids out of its vocabulary, over real gRPC: fed to the draft
model they would index past its embeddings (a device-side assert on CUDA, which takes the
process down), so a commit or a prompt carrying one ends the session with INVALID_ARGUMENT
naming the field."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.common.server import channel
from services.proto.specd.draft.v1 import draft_pb2, draft_pb2_grpc

PROMPT = [5, 9, 14, 20, 33]


def session_error(address: str, prompt: list[int], commit_tokens: list[int] | None,
                  vocab_size: int = 0) -> grpc.aio.AioRpcError:
    async def run():
        async with channel(address) as ch:
            call = draft_pb2_grpc.DraftServiceStub(ch).Session(timeout=30)
            await call.write(draft_pb2.DraftRequest(open=draft_pb2.OpenDraft(
                prompt_ids=prompt, policy="constant", max_length=64, lookahead=1, vocab_size=vocab_size)))
            if commit_tokens is not None:
                await call.write(draft_pb2.DraftRequest(commit=draft_pb2.Commit(
                    commit_id=1, tokens=commit_tokens, num_verified=0)))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                while True:
                    await call.read()
            return e.value

    return asyncio.run(run())


@pytest.mark.parametrize("bad", ["past the model", "negative"])
def test_a_commit_with_an_id_out_of_the_vocabulary_is_refused(hf_draft_service, chat_pair, bad):
    vocab = chat_pair[1].vocab_size
    token = vocab if bad == "past the model" else -1
    e = session_error(hf_draft_service.address, PROMPT, [3, token])
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("tokens: "), e.details()


def test_the_targets_smaller_vocabulary_bounds_the_ids_too(ngram_draft_service):
    """A drafter without a model takes the target's vocabulary (OpenDraft.vocab_size)."""
    e = session_error(ngram_draft_service.address, PROMPT, [50], vocab_size=40)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("tokens: "), e.details()


def test_a_prompt_with_an_id_out_of_the_vocabulary_is_refused(hf_draft_service, chat_pair):
    e = session_error(hf_draft_service.address, PROMPT + [chat_pair[1].vocab_size], None)
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and e.details().startswith("prompt: "), e.details()
