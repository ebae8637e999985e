"""The target service's gRPC servicer: Info, GetTokenizer and the per-request verification
Session stream, translated to and from services.target.core (services.target.convert)."""

from __future__ import annotations

from contextlib import aclosing
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import CollectorRegistry

from services.common.convert import model_info
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.convert import closed_to_proto, open_from_proto, reply_to_proto, window_from_proto
from services.target.core import TargetConfig, TargetCore
from services.target.drafting import Closed
from specd.drafters.base import Drafter
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, target: LoadedModel, *, registry: CollectorRegistry | None = None,
                 executor: ThreadPoolExecutor | None = None, drafter: Drafter | None = None, **config):
        """config: TargetConfig's fields (max_batch_size, latency_budget, ...)."""
        self.core = TargetCore(target, TargetConfig(**config), registry=registry, executor=executor, drafter=drafter)
        self.target, self.registry, self.costs = target, self.core.registry, self.core.costs
        self.rpc_metrics = self.core.rpc_metrics

    @property
    def active_sessions(self) -> int:
        return self.core.active_sessions

    def close(self) -> None:
        self.core.close()

    async def Info(self, request, context) -> target_pb2.TargetInfo:
        c, drafter = self.costs, self.core.drafter
        costs = common_pb2.Costs(verify_seconds=c.value("verify_seconds"), batch_seconds=c.value("batch_seconds"),
                                 batch_token_seconds=c.value("batch_token_seconds"))
        return target_pb2.TargetInfo(model=model_info(self.target), max_batch_size=self.core.config.max_batch_size,
                                     costs=costs, multi_step=True, drafter=drafter.name if drafter else "",
                                     drafter_kind=drafter.kind if drafter else "")

    async def GetTokenizer(self, request, context) -> target_pb2.TokenizerFiles:
        return target_pb2.TokenizerFiles(files=self.core.tokenizer_files())

    async def Session(self, requests, context: grpc.aio.ServicerContext):
        stream = aiter(requests)
        first = await self.core.next_request(anext(stream, None))
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequest("open", "a target session starts with an Open message")
        # aclosing: a client that goes away ends the session (its KV slot freed) at once
        async with aclosing(self.core.session(open_from_proto(first.open), self._requests(stream))) as replies:
            async for out in replies:
                yield closed_to_proto(out) if isinstance(out, Closed) else reply_to_proto(out)

    async def _requests(self, stream):
        """The session's requests after its Open, until a Close or the end of the stream; a
        message that is neither a Verify nor a Close is an error, raised in its turn."""
        async for msg in stream:
            kind = msg.WhichOneof("kind")
            if kind == "close":
                return
            if kind != "verify":
                yield InvalidRequest(kind or "kind", "expected verify or close after open")
                continue
            yield window_from_proto(msg.verify, self.target.vocab_size, self.target.device)
