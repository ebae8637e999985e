"""The draft service's gRPC servicer: Info and the per-request drafting Session stream,
translated to and from services.draft.core (services.draft.convert)."""

from __future__ import annotations

from contextlib import aclosing

import grpc

from services.common.convert import model_info
from services.draft.convert import commit_from_proto, event_to_proto, open_from_proto
from services.draft.core import DraftClosed, DraftCore
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.draft.v1 import draft_pb2, draft_pb2_grpc
from specd.drafters.base import Drafter
from specd.dvi import TOP_K
from specd.errors import InvalidRequest
from specd.policies import POLICIES
from specd.runtime.loading import LoadedModel

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, drafter: Drafter, model: LoadedModel | None, specdecpp_head=None, **options):
        """options: DraftCore's (registry, dvi, executor, max_batch_size, load_caps, ...)."""
        self.core = DraftCore(drafter, model, specdecpp_head, **options)
        self.drafter, self.model, self.registry = drafter, model, self.core.registry
        self.rpc_metrics = self.core.rpc_metrics

    async def start_learning(self) -> None:
        await self.core.start_learning()

    def close(self) -> None:
        self.core.close()

    @property
    def active_sessions(self) -> int:
        return self.core.active_sessions

    async def Info(self, request, context) -> draft_pb2.DraftInfo:
        info = model_info(self.model) if self.model is not None else common_pb2.ModelInfo(name="-")
        learning = self.core.learning is not None
        return draft_pb2.DraftInfo(model=info, kind=self.drafter.kind, name=self.drafter.name,
                                   has_distribution=self.drafter.has_distribution,
                                   policies=[p for p in POLICIES if p != "oracle"],
                                   top_logprobs=TOP_K if learning else 0,
                                   adapter_version=self.drafter.lora_version if learning else 0,
                                   needs_features=self.drafter.needs_target_features,
                                   branches=0 if learning else self.core.branches,
                                   branch_length=self.drafter.branch_length)

    async def Session(self, requests, context: grpc.aio.ServicerContext):
        stream = aiter(requests)
        first = await anext(stream, None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequest("open", "a draft session starts with an Open message")
        # aclosing: a coordinator that goes away ends the session (its drafting stopped) at once
        async with aclosing(self.core.session(open_from_proto(first.open), _commits(stream))) as events:
            async for event in events:
                if isinstance(event, DraftClosed):
                    yield draft_pb2.DraftResponse(closed=draft_pb2.DraftClosed(
                        policy_state=event.policy_state, num_drafted=event.num_drafted,
                        draft_seconds=event.draft_seconds, policy_scale=event.policy_scale))
                else:
                    yield event_to_proto(event)


async def _commits(stream):
    """The session's commits after its Open, until a Close or the end of the stream; a message
    that is neither is an error, which ends the session."""
    async for msg in stream:
        kind = msg.WhichOneof("kind")
        if kind == "close":
            return
        if kind != "commit":
            yield InvalidRequest(kind or "kind", "expected commit or close after open")
            return
        yield commit_from_proto(msg.commit)
