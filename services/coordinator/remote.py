"""`RemoteBackend`: the Backend protocol over a coordinator gRPC service, for a gateway
that does not run its coordinator in-process."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from services.common.grpc_errors import from_rpc_error
from services.common.security import GrpcSecurity
from services.common.server import channel, check_health
from services.coordinator.api import Event, FinishEvent, GenerateRequest, ModelCard
from services.coordinator.convert import event_from_proto, request_to_proto
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc

HEALTH_TIMEOUT_S = 0.5


class RemoteBackend:
    def __init__(self, address: str, timeout_s: float = 600.0, security: GrpcSecurity | None = None):
        self.address, self.timeout_s, self.security = address, timeout_s, security
        self.channel = channel(address, security)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.card = ModelCard("unknown", 0, None)
        self.connected = False

    async def connect(self) -> None:
        try:
            info = await self.stub.Info(common_pb2.InfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "coordinator") from None
        self.card = ModelCard(info.model, info.max_context, info.drafter or None)
        self.connected = True

    def model_card(self) -> ModelCard:
        return self.card

    async def ready(self) -> bool:
        """Connected, and the coordinator answers SERVING (it does while its target does)."""
        return self.connected and await check_health(self.address, HEALTH_TIMEOUT_S, security=self.security)

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        call = self.stub.Generate(request_to_proto(request), timeout=self.timeout_s)
        finish = None
        try:
            async for msg in call:
                event = event_from_proto(msg)
                if isinstance(event, FinishEvent):
                    finish = event  # passed on once the call has ended (below)
                else:
                    yield event
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "coordinator") from None
        finally:
            call.cancel()  # a no-op after a complete stream; frees the request when we stopped early
        # The gateway stops reading at the FinishEvent: were it passed on before the call's OK
        # status came, closing this iterator would cancel an answered call (counted CANCELLED).
        if finish is not None:
            yield finish

    async def close(self) -> None:
        await self.channel.close()
