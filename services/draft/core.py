"""The draft service without its transport: its drafter, the sessions drafting with it (each a
services.draft.runner.DraftRunner), the batching of their draft steps, the process's cost
model and online learning. The gRPC servicer (services.draft.servicer) only translates its
messages to the requests here and the events back (services.draft.convert).

A session is `session(open, commits)`: a runner drafts windows ahead under the request's
policy while the commits of its verifications arrive; its events (tokens, window ends,
commit acknowledgements) come out in order, then `DraftClosed`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry

from services.common.batcher import Gathered, StepBatcher
from services.common.compute import compute_thread
from services.common.metrics import RpcMetrics, new_registry
from services.common.replay import RedisDVI
from services.common.state import REDIS_ERRORS
from services.draft.learning import OnlineLearning
from services.draft.metrics import DraftMetrics
from services.draft.runner import DraftRunner
from specd.cost_model import DRAFT, CostModel
from specd.costs import CostCurve, measure_t_draft, synthetic_prefix
from specd.drafters.base import Drafter
from specd.errors import InvalidRequest
from specd.policies import PolicyResources, request_policy
from specd.runtime.loading import LoadedModel
from specd.speculation.proposer import Commit, Token, WindowEnd
from specd.tree import TreePlanner, tree_shape
from specd.types import SamplingParams, SpecParams

log = logging.getLogger(__name__)
_CLOSE = object()


@dataclass(frozen=True, kw_only=True)
class TargetCosts:
    """The target's costs as the coordinator sends them (specd.common.v1.Costs): its cost curve
    and batched surface, scaled to its current decode cost, and the round overhead."""
    verify_seconds: list[float] = field(default_factory=list)
    batch_seconds: list[float] = field(default_factory=list)
    batch_token_seconds: list[float] = field(default_factory=list)
    round_overhead_seconds: float = 0.0

    def curve(self, t_draft: float) -> CostCurve:
        """A session's cost curve: the target's, with the draft's t_draft; InvalidRequest where
        the coordinator sent none, or a surface that does not fit together."""
        if not self.verify_seconds:
            raise InvalidRequest("costs.verify_seconds", "the cost-aware policy needs the target's cost curve; "
                                                         "the coordinator sent none (is the target service older?)")
        if len(self.batch_token_seconds) != len(self.batch_seconds):
            raise InvalidRequest("costs.batch_token_seconds", "needs one value per element of batch_seconds")
        ts = list(self.verify_seconds)
        return CostCurve(t_draft, list(range(1, len(ts) + 1)), ts, overhead=self.round_overhead_seconds,
                         batch_seconds=list(self.batch_seconds), batch_token_seconds=list(self.batch_token_seconds))


@dataclass(frozen=True)
class DraftOpen:
    """A checked OpenDraft: what a drafting session needs to start."""

    prompt: list[int]
    sampling: SamplingParams
    spec: SpecParams
    state: dict
    max_length: int
    lookahead: int  # 1: sequential, 2: PEARL
    send_distributions: bool
    vocab_size: int | None  # the target's, when the coordinator says
    branches: int | None = None  # side branches per window (draft trees); None: the service's default
    costs: TargetCosts = TargetCosts()


@dataclass(frozen=True, kw_only=True)
class DraftClosed:
    """What a session ends with: the policy's state to save (and the decay of its sums,
    StoppingPolicy.state_scale), what it drafted."""
    policy_state: dict[str, float]
    num_drafted: int
    draft_seconds: float
    policy_scale: dict[str, float] = field(default_factory=dict)


class DraftCore:
    def __init__(self, drafter: Drafter, model: LoadedModel | None, specdecpp_head=None, *,
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

    async def session(self, o: DraftOpen, commits: AsyncIterator[Commit | Exception]) -> AsyncIterator[object]:
        """One session's events in order (Token, WindowEnd, Ack), then DraftClosed. commits: the
        coordinator's, in order (an exception: a message that could not be read, which ends the
        session with that error); it ends when the coordinator closes. An error drafting or
        applying a commit ends the session with that error, so the coordinator falls back at
        once instead of waiting."""
        out: asyncio.Queue = asyncio.Queue()
        runner = self._runner(o, out.put_nowait)
        self.runners.add(runner)
        drafting = asyncio.create_task(runner.run())
        reading = asyncio.create_task(_apply(commits, runner, out))
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
                yield event
            yield DraftClosed(policy_state=runner.policy.state(), num_drafted=runner.num_drafted,
                              draft_seconds=runner.draft_seconds, policy_scale=runner.policy.state_scale())
        finally:
            reading.cancel()
            drafting.cancel()
            # Queued behind any forward still running, so the cache is not freed under it; not
            # awaited, because a cancelled call would interrupt the await and skip the rest.
            self.executor.submit(runner.session.close)
            self.runners.discard(runner)

    def _runner(self, o: DraftOpen, publish: Callable[[object], None]) -> DraftRunner:
        # Ids the session may be fed: the draft model's rows, and the target's vocabulary where
        # the coordinator says (a padded table may be larger than either).
        sizes = [v for v in (self.model.vocab_size if self.model is not None else 0, o.vocab_size) if v]
        vocab = min(sizes) if sizes else None
        bad = next((t for t in o.prompt if not 0 <= t < (vocab or 1 << 31)), None)
        if bad is not None:
            raise InvalidRequest("prompt", f"token ids must be in [0, {vocab or '2**31'}), got {bad}")

        def costs():  # asked by cost-aware and draft trees only
            return o.costs.curve(self.costs.value("t_draft"))

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


async def _apply(commits: AsyncIterator[Commit | Exception], runner: DraftRunner, out: asyncio.Queue) -> None:
    """Apply commits as they arrive; the end of them ends the session."""
    async for commit in commits:
        if isinstance(commit, Exception):
            out.put_nowait(commit)
            return
        runner.commit(commit)
    out.put_nowait(_CLOSE)


def _forward_failure(task: asyncio.Task, out: asyncio.Queue) -> None:
    """An error drafting or applying a commit ends the stream with that error."""
    if not task.cancelled() and task.exception() is not None:
        out.put_nowait(task.exception())
