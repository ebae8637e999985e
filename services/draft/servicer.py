"""The draft service's gRPC servicer: Info and the per-request drafting Session stream.
It only translates; the drafting itself is services.draft.runner.DraftRunner."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor

import grpc
from prometheus_client import CollectorRegistry

from services.common.batcher import Gathered, StepBatcher
from services.common.compute import compute_thread
from services.common.convert import model_info
from services.common.metrics import RpcMetrics, new_registry
from services.common.replay import RedisDVI
from services.common.state import REDIS_ERRORS
from services.draft.convert import commit_from_proto, costs_from_proto, event_to_proto, open_from_proto
from services.draft.learning import OnlineLearning
from services.draft.metrics import DraftMetrics
from services.draft.runner import DraftRunner, Token, WindowEnd
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.draft.v1 import draft_pb2, draft_pb2_grpc
from specd.cost_model import DRAFT, CostModel
from specd.costs import measure_t_draft, synthetic_prefix
from specd.drafters.base import Drafter
from specd.dvi import TOP_K
from specd.errors import InvalidRequest
from specd.runtime.loading import LoadedModel
from specd.policies import POLICIES, PolicyResources, request_policy
from specd.tree import TreePlanner, tree_shape

log = logging.getLogger(__name__)
_CLOSE = object()
SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, drafter: Drafter, model: LoadedModel | None, specdecpp_head=None,
                 registry: CollectorRegistry | None = None, dvi: RedisDVI | None = None, dvi_poll_s: float = 1.0,
                 executor: ThreadPoolExecutor | None = None, max_batch_size: int = 16,
                 load_caps: tuple[tuple[int, int], ...] = (), branches: int | None = None):
        """executor: the compute thread (services.common.compute), one model, one thread.
        max_batch_size: most sessions' draft steps in one forward (model drafters over a KV pool).
        load_caps: windows capped by the target's load (services.common.settings.parse_load_caps).
        branches: side branches of a draft tree where a request does not say (None: the drafter's)."""
        self.load_caps = load_caps
        self.branches = tree_shape(branches, drafter, "", False)[0]  # names the setting a drafter cannot take
        self.drafter, self.model, self.specdecpp_head = drafter, model, specdecpp_head
        self.executor = executor or compute_thread("draft")
        self.costs = CostModel(DRAFT)  # every timing this process keeps (specd.cost_model.TABLE)
        # Draft steps of concurrent sessions share forwards; a session comes back at once when its
        # window goes on, so the batcher never waits for one (gather 0).
        self.batcher = StepBatcher(None, self.executor, max_batch_size, self._on_batch, gather=0.0, costs=self.costs)
        self.runners: set[DraftRunner] = set()
        self.registry = registry or new_registry()
        self.rpc_metrics = RpcMetrics(self.registry, "draft")
        self.metrics = DraftMetrics(self.registry, drafter.name, lambda: len(self.runners),
                                    lambda: sum(r.session.nbytes() for r in list(self.runners)))
        # Seconds per draft step: measured at start-up, then a moving average of served steps.
        prefix = synthetic_prefix(model.vocab_size if model is not None else 1000)
        self.costs.seed("t_draft", measure_t_draft(drafter, prefix, repeats=3))
        self.learning: OnlineLearning | None = None  # DVI: started by start_learning()
        if dvi is not None:
            if not drafter.learns_online:
                raise InvalidRequest("dvi", f"online learning needs an early-exit or feature drafter, "
                                            f"not {drafter.kind}")
            self.learning = OnlineLearning(dvi, drafter, self.executor, self.metrics, dvi_poll_s)

    async def start_learning(self) -> None:
        """Start logging to the replay stream and following published adapters (on the server's loop)."""
        if self.learning is not None:
            try:  # the latest adapter before the first session; Redis down only delays it
                await self.learning.sync()
            except REDIS_ERRORS as e:
                log.warning("DVI: no adapter from Redis at start-up (%s); the watcher retries", e)
            await self.learning.start()

    def close(self) -> None:
        self.batcher.close()
        if self.learning is not None:
            self.learning.stop()

    @property
    def active_sessions(self) -> int:
        return len(self.runners)

    async def Info(self, request, context) -> draft_pb2.DraftInfo:
        info = model_info(self.model) if self.model is not None else common_pb2.ModelInfo(name="-")
        policies = [p for p in POLICIES if p != "oracle"]
        learning = self.learning is not None
        return draft_pb2.DraftInfo(model=info, kind=self.drafter.kind, name=self.drafter.name,
                                   has_distribution=self.drafter.has_distribution, policies=policies,
                                   top_logprobs=TOP_K if learning else 0,
                                   adapter_version=self.drafter.lora_version if learning else 0,
                                   needs_features=self.drafter.needs_target_features,
                                   branches=0 if learning else self.branches,
                                   branch_length=self.drafter.branch_length)

    async def Session(self, requests, context: grpc.aio.ServicerContext):
        first = await anext(aiter(requests), None)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequest("open", "a draft session starts with an Open message")
        out: asyncio.Queue = asyncio.Queue()
        runner = self._runner(first.open, out.put_nowait)
        self.runners.add(runner)
        drafting = asyncio.create_task(runner.run())
        reading = asyncio.create_task(_read(requests, runner, out))
        drafting.add_done_callback(lambda task: _forward_failure(task, out))
        reading.add_done_callback(lambda task: _forward_failure(task, out))  # a bad commit ends the session
        tokens = self.metrics.tokens.labels(self.drafter.name, runner.policy.name)
        try:
            while (event := await out.get()) is not _CLOSE:
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Token):
                    tokens.inc()
                elif isinstance(event, WindowEnd):
                    self.metrics.windows.labels(self.drafter.name, runner.policy.name, event.reason).inc()
                yield event_to_proto(event)
            yield draft_pb2.DraftResponse(closed=draft_pb2.DraftClosed(
                policy_state=runner.policy.state(), num_drafted=runner.num_drafted,
                draft_seconds=runner.draft_seconds))
        finally:
            reading.cancel()
            drafting.cancel()
            # Queued behind any forward still running, so the cache is not freed under it; not
            # awaited, because a cancelled call would interrupt the await and skip the rest.
            self.executor.submit(runner.session.close)
            self.runners.discard(runner)

    def _runner(self, msg: draft_pb2.OpenDraft, publish) -> DraftRunner:
        o = open_from_proto(msg)
        # Ids the session may be fed: the draft model's rows, and the target's vocabulary where
        # the coordinator says (a padded table may be larger than either).
        sizes = [v for v in (self.model.vocab_size if self.model is not None else 0, o.vocab_size) if v]
        vocab = min(sizes) if sizes else None
        bad = next((t for t in o.prompt if not 0 <= t < (vocab or 1 << 31)), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token ids must be in [0, {vocab or '2**31'}), got {bad}")

        def costs():  # asked by cost-aware and draft trees only
            return costs_from_proto(msg, self.costs.value("t_draft"))

        policy = request_policy(o.spec, o.state, PolicyResources(None, self.specdecpp_head), costs)
        learning = self.learning
        # Draft trees; not while learning online, whose top log-probabilities are a chain's, nor
        # under penalties, whose counts follow one chain (specd.penalties).
        shape = tree_shape(self.branches if o.branches is None else o.branches, self.drafter, o.spec.policy,
                           o.spec.relaxed)
        trees = TreePlanner(*shape) if shape[0] and learning is None and not o.sampling.adjusts_logits else None
        curve = (policy.resources.costs or costs()) if trees is not None else None
        runner = DraftRunner(self.drafter.open(o.vocab_size), policy, o.sampling, o.prompt, max_length=o.max_length,
                             lookahead=o.lookahead, send_q=o.send_distributions and self.drafter.has_distribution,
                             executor=self.executor, publish=publish, on_step=self._on_step,
                             log_records=learning.log if learning is not None else None,
                             adapter_version=lambda: self.drafter.lora_version, batcher=self.batcher,
                             load_caps=self.load_caps, trees=trees,
                             t_target=curve.t_monotone if curve is not None else None)
        runner.vocab_size = vocab
        return runner

    def _on_batch(self, batch: Gathered) -> None:
        self.metrics.batch_size.observe(batch.sessions)

    def _on_step(self, seconds: float) -> None:
        self.metrics.step_s.observe(seconds)
        self.costs.observe("t_draft", seconds)


async def _read(requests, runner: DraftRunner, out: asyncio.Queue) -> None:
    """Apply commits as they arrive; Close (or the client half-closing) ends the session."""
    async for msg in requests:
        kind = msg.WhichOneof("kind")
        if kind == "commit":
            runner.commit(commit_from_proto(msg.commit))
        elif kind == "close":
            break
        else:
            out.put_nowait(InvalidRequest(kind or "kind", "expected commit or close after open"))
            return
    out.put_nowait(_CLOSE)


def _forward_failure(task: asyncio.Task, out: asyncio.Queue) -> None:
    """An error drafting or applying a commit ends the stream with that error (the
    interceptor maps it), so the coordinator falls back at once instead of waiting."""
    if not task.cancelled() and task.exception() is not None:
        out.put_nowait(task.exception())
