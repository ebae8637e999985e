"""`RemoteBackend`: the Backend protocol over a coordinator gRPC service, for a gateway
that does not run its coordinator in-process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.grpc_errors import from_rpc_error
from services.common.security import GrpcSecurity
from services.common.server import channel
from services.coordinator.api import Event, FinishEvent, GenerateRequest, ModelCard
from services.coordinator.convert import event_from_proto, request_to_proto
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.coordinator.v1 import coordinator_pb2_grpc

HEALTH_TIMEOUT_S = 0.5
# /health is unauthenticated: a flood of probes must not become a flood of health calls. One
# answer serves every probe for this long, and probes that come while a check runs share it.
HEALTH_CACHE_S = 0.5


class RemoteBackend:
    def __init__(self, address: str, timeout_s: float = 600.0, security: GrpcSecurity | None = None):
        self.address, self.timeout_s, self.security = address, timeout_s, security
        self.channel = channel(address, security)
        self.stub = coordinator_pb2_grpc.CoordinatorServiceStub(self.channel)
        self.card = ModelCard("unknown", 0, None)
        self.connected = False
        self._health: tuple[float, bool] | None = None  # (when, SERVING), the last check's
        self._checking: asyncio.Future | None = None

    async def connect(self) -> None:
        try:
            info = await self.stub.Info(common_pb2.InfoRequest(), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "coordinator") from None
        self.card = ModelCard(info.model, info.max_context, info.drafter or None, info.tool_format or None)
        self.connected = True

    def model_card(self) -> ModelCard:
        return self.card

    async def ready(self) -> bool:
        """Connected, and the coordinator answers SERVING (it does while its target does): over
        the backend's own channel (a channel per probe meant a resolution, a handshake and the
        PEM files read again for every unauthenticated /health), at most every HEALTH_CACHE_S."""
        if not self.connected:
            return False
        if self._health is not None and time.monotonic() - self._health[0] < HEALTH_CACHE_S:
            return self._health[1]
        if self._checking is None:
            self._checking = asyncio.ensure_future(self._check())
        checking = self._checking
        try:
            return await asyncio.shield(checking)  # a probe that goes away does not cancel the others'
        finally:
            if checking.done() and self._checking is checking:
                self._checking = None

    async def _check(self) -> bool:
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(),
                                                                         timeout=HEALTH_TIMEOUT_S)
            serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.aio.AioRpcError:
            serving = False
        self._health = (time.monotonic(), serving)
        return serving

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
