"""The coordinator's gRPC servicer (`specd.coordinator.v1`): server-streaming Generate over
any Backend (normally the Coordinator). It only translates."""

from __future__ import annotations

from services.coordinator.api import Backend
from services.coordinator.convert import event_to_proto, request_from_proto
from services.proto.specd.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

SERVICE_NAME = coordinator_pb2.DESCRIPTOR.services_by_name["CoordinatorService"].full_name


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServiceServicer):
    def __init__(self, backend: Backend, default_policy: str = "cost-aware"):
        self.backend, self.default_policy = backend, default_policy

    async def Info(self, request, context) -> coordinator_pb2.CoordinatorInfo:
        card = self.backend.model_card()
        return coordinator_pb2.CoordinatorInfo(model=card.id, drafter=card.draft or "", max_context=card.max_context,
                                               tool_format=card.tool_format or "")

    async def Generate(self, request, context):
        # A cancelled call closes this generator, which closes the backend's (freeing both caches).
        events = self.backend.generate(request_from_proto(request, self.default_policy))
        try:
            async for event in events:
                yield event_to_proto(event)
        finally:
            await events.aclose()
