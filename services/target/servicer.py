"""The target service's gRPC servicer: Info, GetTokenizer and the per-request verification
Session stream. It only translates; verification is services.target.session and the
batching of concurrent sessions is services.target.batcher."""

from __future__ import annotations

import asyncio
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from services.common.convert import (
    distribution_from_proto,
    model_info,
    sampling_from_proto,
)
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.batcher import VerifyBatcher
from services.target.session import TargetSession
from specd.errors import InvalidRequest, ModelError
from specd.models.loading import LoadedModel

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, target: LoadedModel, max_batch_size: int = 8):
        self.target = target
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="target")  # one model, one compute thread
        self.batcher = VerifyBatcher(target.model, self.executor, max_batch_size)
        self.max_batch_size = max_batch_size
        self.active_sessions = 0

    def close(self) -> None:
        """Stop the batching worker (on the server's event loop, after the server stopped)."""
        self.batcher.close()

    async def Info(self, request, context) -> target_pb2.TargetInfo:
        return target_pb2.TargetInfo(model=model_info(self.target), max_batch_size=self.max_batch_size)

    async def GetTokenizer(self, request, context) -> target_pb2.TokenizerFiles:
        if self.target.tokenizer is None:
            raise ModelError(f"model {self.target.name} has no tokenizer")
        with tempfile.TemporaryDirectory() as tmp:
            self.target.tokenizer.save_pretrained(tmp)
            files = {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}
        return target_pb2.TokenizerFiles(files=files)

    async def Session(self, requests, context: grpc.aio.ServicerContext):
        loop = asyncio.get_running_loop()
        stream = aiter(requests)
        first = await anext(stream, None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequest("open", "a target session starts with an Open message")
        session = TargetSession(self.target, list(first.open.prompt_ids), sampling_from_proto(first.open.sampling))
        self.active_sessions += 1
        try:
            await loop.run_in_executor(self.executor, session.prefill)
            async for msg in stream:
                kind = msg.WhichOneof("kind")
                if kind == "close":
                    break
                if kind != "verify":
                    raise InvalidRequest(kind or "kind", "expected verify or close after open")
                yield await self._verify(session, msg.verify)
            yield target_pb2.TargetResponse(closed=target_pb2.TargetClosed())
        finally:
            # Queued behind any forward still running, so the cache is not freed under it; not
            # awaited, because a cancelled call would interrupt the await and skip the rest.
            self.executor.submit(session.close)
            self.active_sessions -= 1

    async def _verify(self, session: TargetSession, msg: target_pb2.Verify) -> target_pb2.TargetResponse:
        drafts = list(msg.tokens)
        q = self._distributions(session, msg, len(drafts))
        threshold = msg.relaxed_threshold if msg.HasField("relaxed_threshold") else None
        if msg.relaxed and q is None and drafts:
            raise InvalidRequest("distributions", "relaxed verification needs the draft distributions")
        ids = session.window(drafts)
        verdict, batch = await self.batcher.submit(
            session.kv, ids, len(drafts) + 1,
            lambda logits: session.verify(logits, drafts, q, threshold, msg.relaxed))
        return target_pb2.TargetResponse(verified=target_pb2.Verified(
            verify_id=msg.verify_id, num_accepted=verdict.num_accepted, next_token=verdict.next_token,
            num_strict=verdict.num_strict, js_distances=verdict.js_distances,
            forward_seconds=batch.forward_seconds, batch_size=batch.batch_size))

    def _distributions(self, session: TargetSession, msg: target_pb2.Verify, k: int) -> torch.Tensor | None:
        """q [k, V] from the request; None for a point mass (n-gram) or greedy verification."""
        if len(msg.probs) not in (0, k):
            raise InvalidRequest("probs", f"expected {k} probabilities, got {len(msg.probs)}")
        if not msg.distributions:
            # Sampling against a point mass when x was drawn from a real q would not be lossless.
            if not session.sampling.greedy and any(p < 1.0 for p in msg.probs):
                raise InvalidRequest("distributions", "sampling verification of drafts with q(x) < 1 "
                                                      "needs their distributions")
            return None
        if len(msg.distributions) != k:
            raise InvalidRequest("distributions", f"expected {k} distributions, got {len(msg.distributions)}")
        try:
            return torch.stack([distribution_from_proto(d, self.target.vocab_size, self.target.device)
                                for d in msg.distributions])
        except ValueError as e:
            raise InvalidRequest("distributions", str(e)) from None
