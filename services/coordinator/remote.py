"""`RemoteBackend`: the Backend protocol over a coordinator gRPC service, for a gateway
that does not run its coordinator in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.grpc_errors import from_rpc_error
from services.common.server import channel, check_health
from services.coordinator.api import Event, GenerateRequest, ModelCard
from services.coordinator.convert import event_from_proto, request_to_proto
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc


class RemoteBackend:
    def __init__(self, address: str, timeout_s: float = 600.0):
        self.address, self.timeout_s = address, timeout_s
        self.channel = channel(address)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.card = ModelCard("unknown", 0, None)

    async def connect(self) -> None:
        try:
            info = await self.stub.Info(common_pb2.InfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "coordinator") from None
        self.card = ModelCard(info.model, info.max_context, info.drafter or None)

    def model_card(self) -> ModelCard:
        return self.card

    async def ready(self) -> bool:
        return await check_health(self.address)

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        call = self.stub.Generate(request_to_proto(request), timeout=self.timeout_s)
        try:
            async for msg in call:
                yield event_from_proto(msg)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "coordinator") from None
        finally:
            call.cancel()  # a no-op after a complete stream; frees the request when we stopped early

    async def close(self) -> None:
        await self.channel.close()
