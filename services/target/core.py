"""The target service without its transport: the sessions verifying on this target, their
admission, the batching of their forwards (services.common.batcher) and the process's cost
model. The gRPC servicer (services.target.servicer) only translates its messages to the
requests here and the replies back.

A session is `session(open, incoming)`: it opens (admission, a KV slot, a prefix copied from
another session of the tenant or prefilled in chunks), then answers each request of
`incoming` in order (a window to verify, or a multi-step run of decoding steps; a session that
drafts here runs its rounds the same way), and ends with `Closed`. Verification itself is
services.target.session, admission services.target.admission, drafting on the target
services.target.drafting."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from services.common.batcher import BatchInfo, MultiStep, StepBatcher, measure_batch_surface
from services.common.compute import compute_thread
from services.common.metrics import RpcMetrics, new_registry
from services.target.admission import FAIR_SHARE_RESERVE, TargetAdmission
from services.target.drafting import Closed, LocalDrafting, LocalSpec, local_cost_curve
from services.target.metrics import TargetMetrics
from services.target.session import TargetSession
from specd.cost_model import TARGET, CostModel
from specd.costs import LoadFit, measure_t_draft, measure_t_target, synthetic_prefix
from specd.drafters.base import Drafter
from specd.errors import Idle, InvalidRequest, ModelError, Overloaded
from specd.grammar import Grammar
from specd.runtime.loading import LoadedModel
from specd.speculation.verifier import Judged
from specd.types import SamplingParams
from specd.verify import Verdict

log = logging.getLogger(__name__)
MAX_PLAIN_STEPS = 4096  # decoding steps one request may ask for (WindowRequest.steps)
# Draft tokens (chain and tree side nodes) one window may bring: each costs a row of logits
# (32k positions x 152k logits is about 10 GB) and, sampled, a dense q (256 of them pass gRPC's
# 64 MiB limit). The largest default cap of a policy is svip's 40.
MAX_WINDOW_TOKENS = 64
IDLE_TIMEOUT_S = 60.0  # a session that sends nothing this long is ended and its KV slot freed
MIN_SHARED_PREFIX = 16  # prompt tokens two sessions share before one copies the other's cache


@dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """How the target serves (TargetSettings holds the same, as flags and environment).

    latency_budget: refuse new sessions while the open ones see more than this many one-token
    forwards per token, or beyond the sessions the cost surface allows within it (0: neither;
    the KV pool's slots still limit sessions). max_window_tokens: draft tokens one window may
    bring. idle_timeout_s: a session with no message this long ends and frees its KV slot (0:
    never; the servicer enforces it). fair_share_reserve: the share of the KV pool's slots kept
    for tenants holding less than a fair share of them."""
    max_batch_size: int = 8
    prefill_chunk: int = 0
    gather: float = 0.5
    latency_budget: float = 0.0
    max_window_tokens: int = MAX_WINDOW_TOKENS
    idle_timeout_s: float = IDLE_TIMEOUT_S
    fair_share_reserve: float = FAIR_SHARE_RESERVE


@dataclass(frozen=True, kw_only=True)
class OpenRequest:
    prompt: list[int]
    sampling: SamplingParams
    features: bool = False  # return the hidden states of committed positions
    tenant: str = ""
    logprobs: int | None = None  # emitted tokens' log-probabilities, with this many alternatives
    speculate: LocalSpec | None = None  # the session drafts here


@dataclass(frozen=True, kw_only=True)
class WindowRequest:
    """A window to verify (drafts: a chain; side tokens and parents: a draft tree's other
    nodes), or with steps > 1 a multi-step run of that many decoding steps. distributions(): the
    drafts' q [k, V] on the target's device, or None (a point mass or greedy); decoded when the
    window is checked, so that its errors come in the order of the other checks."""
    verify_id: int = 0
    drafts: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    distributions: Callable[[], torch.Tensor | None] = lambda: None
    has_distributions: bool = False
    side_tokens: list[int] = field(default_factory=list)
    side_parents: list[int] = field(default_factory=list)
    relaxed: bool = False
    relaxed_threshold: float | None = None
    top_logprobs: int = 0
    steps: int = 0


@dataclass(frozen=True, kw_only=True)
class Reply:
    """What one request's forward answers."""
    verify_id: int
    judged: Judged
    batch: BatchInfo
    prefill_seconds: float  # the session's prefill, on its first reply
    decode_cost: float  # seconds of a one-token decoding step now


class TargetCore:
    def __init__(self, target: LoadedModel, config: TargetConfig = TargetConfig(), *,
                 registry: CollectorRegistry | None = None, executor: ThreadPoolExecutor | None = None,
                 drafter: Drafter | None = None):
        """executor: the compute thread (services.common.compute), one model, one thread.
        drafter: a lookup drafter (ngram, retrieval) sessions may draft with here."""
        self.target, self.config, self.drafter = target, config, drafter
        self.costs = CostModel(TARGET)  # every timing this process keeps (specd.cost_model.TABLE)
        if drafter:  # seconds per drafted token, for cost-aware policies drafting here
            self.costs.seed("local_t_draft", measure_t_draft(drafter, synthetic_prefix(target.vocab_size), repeats=3))
        self.executor = executor or compute_thread("target")
        self.sessions: set[TargetSession] = set()
        self.releasing: set[Future] = set()  # ended sessions' slots, freed behind the running forward
        self.registry = registry or new_registry()
        self.rpc_metrics = RpcMetrics(self.registry, "target")
        self.metrics = TargetMetrics(self.registry, target.name, lambda: len(self.sessions), self._kv_bytes,
                                     lambda: self.costs.value("decode_cost"), self._kv_slots,
                                     lambda: len(self.batcher.queue), lambda: self.costs.value("token_time"),
                                     self._load_fit)
        self.batcher = StepBatcher(target.model, self.executor, config.max_batch_size, self.metrics.observe_batch,
                                   config.gather, self.costs)
        # The cost curve cost-aware policies weigh windows with; its first point is the start-up
        # value of the decode cost, which serving then keeps current.
        verify_seconds = measure_verify_seconds(target)
        self.costs.seed("verify_seconds", verify_seconds)
        self.costs.observe("decode_cost", verify_seconds[0])
        # What a forward of B sessions costs, for policies that price a window in the batch it joins.
        batch_seconds, batch_token_seconds = measure_batch_surface(target, config.max_batch_size)
        self.costs.seed("batch_seconds", batch_seconds)
        self.costs.seed("batch_token_seconds", batch_token_seconds)
        # What its forwards really cost against that surface, for the sessions that draft here.
        self.costs.seed("load_fit", LoadFit(batch_seconds, batch_token_seconds))
        self.batcher.on_forward = self._on_forward
        self.batcher.emitted_of = lambda judged: judged.verdict.num_accepted + 1
        self.admission = TargetAdmission(lambda: target.pool, batch_seconds, verify_seconds[0],
                                         config.latency_budget, config.fair_share_reserve, self.costs)
        if self.admission.max_sessions is not None:
            log.info("latency budget %.2fx (%.1f ms a token): at most %d sessions at once", config.latency_budget,
                     1e3 * config.latency_budget * verify_seconds[0], self.admission.max_sessions)

    @property
    def active_sessions(self) -> int:
        return len(self.sessions)

    def _load_fit(self) -> tuple[float, float]:
        fit = self.costs.value("load_fit")  # None until start-up has measured the surface
        return (fit.a, fit.b) if fit is not None else (1.0, 1.0)

    def _on_forward(self, info: BatchInfo) -> None:
        self.costs.observe("load_fit", (info.batch_size, info.batch_tokens, info.forward_seconds))

    def _kv_slots(self) -> tuple[int, int]:
        pool = self.target.pool
        return (pool.in_use(), pool.num_slots) if pool is not None else (0, 0)

    def _kv_bytes(self) -> int:
        return sum(s.kv.nbytes() for s in list(self.sessions))

    def close(self) -> None:
        """Stop the batching worker (on the server's event loop, after the server stopped)."""
        self.batcher.close()

    def tokenizer_files(self) -> dict[str, bytes]:
        if self.target.tokenizer is None:
            raise ModelError(f"model {self.target.name} has no tokenizer")
        with tempfile.TemporaryDirectory() as tmp:
            self.target.tokenizer.save_pretrained(tmp)
            return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}

    async def session(self, first: OpenRequest,
                      incoming: AsyncIterator[WindowRequest | Exception]) -> AsyncIterator[Reply | Closed]:
        """One session: its replies in order, then Closed. incoming: the client's requests, in
        order (an exception: a message that could not be read, raised in its turn); it ends
        when the client closes."""
        loop = asyncio.get_running_loop()
        try:
            self.admission.admit(first.tenant, [s.tenant for s in self.sessions])
            session = await self._new_session(first)
        except Overloaded:
            self.metrics.observe_refused()
            raise
        donor = self._donor(session)
        self.sessions.add(session)
        local: LocalDrafting | None = None  # the session drafts here
        after_run: asyncio.Future | None = None  # the client's next request, read during a multi-step run
        run: MultiStep | None = None
        try:
            local = self._local_drafting(first.speculate, session)
            t0 = time.perf_counter()
            if donor is not None:  # the prefix another session prefills (or has): copied, not computed
                await donor.prefilled.wait()
                shared = await loop.run_in_executor(self.executor, session.adopt, donor, session.shared_prefix(donor))
                self.metrics.observe_shared_prefill(shared)
            more = True
            while more:  # other sessions' forwards run between the chunks
                cached = session.kv.length
                more = await loop.run_in_executor(self.executor, session.prefill, self.config.prefill_chunk)
                if session.kv.length > cached:
                    self.metrics.observe_prefill_chunk()
            prefill_s = time.perf_counter() - t0
            session.prefilled.set()
            while (req := await self.next_request(after_run or anext(incoming, None))) is not None:
                after_run = None
                if isinstance(req, Exception):
                    raise req
                steps = plain_steps(req, local is not None)
                if steps == 1 and local is None:
                    judged, batch = await self._verify(session, req)
                    yield self._reply(session, req, judged, batch, prefill_s)
                    prefill_s = 0.0
                    continue
                # A multi-step run: the batcher queues each next step itself (MultiStep), so the next
                # forward runs while this step's reply travels. A client that speaks meanwhile
                # (its Close after a stop string, say) stops it after the steps already started,
                # which it still gets; one that only stopped writing gets the whole run. A session
                # that drafts here runs its rounds the same way, each drafting its window first.
                run = self._multi_step(session, req, steps, local)
                done = 0
                while (item := await run.results.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    yield self._reply(session, req, *item, prefill_s, local)
                    prefill_s = 0.0
                    done += 1
                    after_run = after_run or asyncio.ensure_future(anext(incoming, None))
                    if after_run.done() and after_run.result() is not None:
                        run.stop()
                self.metrics.observe_multi_step(done)
            yield local.closed() if local is not None else Closed()
        finally:
            session.prefilled.set()  # nobody waits for a prefill that will not come
            if run is not None:  # no further step once the client is gone
                run.stop()
            if after_run is not None and not after_run.cancel() and not after_run.cancelled():
                after_run.exception()  # read, so that a failed read is not logged as never retrieved
            # Queued behind any forward still running, so the cache is not freed under it; not
            # awaited, because a cancelled call would interrupt the await and skip the rest.
            if local is not None:
                local.close()
            released = self.executor.submit(session.close)
            self.releasing.add(released)
            released.add_done_callback(self.releasing.discard)
            self.sessions.discard(session)
            self.batcher.forget(session.kv)

    async def next_request(self, reading):
        """The client's next message (None: it closed its side), waited for at most
        idle_timeout_s: a client that opened a session and went quiet (hung, or hostile) would
        otherwise hold its KV slot for ever. Past it the session ends (Idle)."""
        timeout = self.config.idle_timeout_s
        try:
            async with asyncio.timeout(timeout or None):
                return await reading
        except TimeoutError:
            raise Idle(f"session: no message for {timeout:g} s (idle_timeout_s)") from None

    def _donor(self, session: TargetSession) -> TargetSession | None:
        """The open session of the same tenant whose prompt shares the longest prefix with this
        one's, at least MIN_SHARED_PREFIX tokens: its cached prompt is copied instead of
        prefilled (the choices of one request, a shared system prompt). Only within a tenant:
        another tenant's could tell by the timing that a prompt was seen."""
        best, best_n = None, MIN_SHARED_PREFIX - 1
        for other in self.sessions:
            if other.tenant == session.tenant and (n := session.shared_prefix(other)) > best_n:
                best, best_n = other, n
        return best

    async def _new_session(self, req: OpenRequest) -> TargetSession:
        """A session in a free KV slot. Where every slot is taken but some belong to sessions
        that already ended (their slots are freed on the compute thread, behind the forward
        running), it waits for those, at most about a forward, then tries once more: a client
        that sends its next request the moment its last one ended is not refused for a slot that
        was about to be free."""
        grammar = None
        if req.sampling.grammar is not None:  # compiled off the event loop, where every session's replies go
            grammar = await asyncio.to_thread(Grammar.for_model, req.sampling.grammar, self.target)

        def new() -> TargetSession:
            return TargetSession(self.target, list(req.prompt), req.sampling, req.features, req.tenant, req.logprobs,
                                 grammar)
        try:
            return new()
        except Overloaded:
            pending = [asyncio.wrap_future(f) for f in list(self.releasing)]
            if not pending:
                raise
        await asyncio.wait(pending)
        return new()

    async def _verify(self, session: TargetSession, req: WindowRequest) -> tuple[Judged, BatchInfo]:
        ids, rows, judge, tree, window = self._window(session, req)
        return await self.batcher.submit(session.kv, ids, rows, judge, session.features, tree, window)

    def _window(self, session: TargetSession, req: WindowRequest):
        """A verification's (ids to feed, logits rows, judge for the compute thread, draft tree
        or None, the window as the forward judges it with the others' or None);
        InvalidRequest for a window this session cannot verify."""
        drafts = req.drafts
        n = len(drafts) + len(req.side_tokens)
        if n > self.config.max_window_tokens:
            raise InvalidRequest("tokens", f"at most {self.config.max_window_tokens} draft tokens a window, chain "
                                           f"and side nodes together (the target's max_window_tokens), got {n}")
        session.check_window(drafts, req.probs, req.has_distributions, req.relaxed, req.top_logprobs)
        tree = session.tree(drafts, req.side_tokens, req.side_parents, req.relaxed, req.top_logprobs)
        q = req.distributions()
        ids, start = session.window(drafts, tree), session.kv.length  # start: the position of ids[0]

        def judge(logits: torch.Tensor, hidden: torch.Tensor | None, judged: Verdict | None = None) -> Judged:
            # on the compute thread, right after the forward
            if tree is not None:
                return session.judge_tree(logits, tree, q)
            return session.judge(logits, hidden, drafts, q, req.relaxed_threshold, req.relaxed, req.top_logprobs,
                                 start, judged)

        rows = len(tree) + 1 if tree is not None else len(drafts) + 1
        return ids, rows, judge, tree, session.batch_window(drafts, q, req.relaxed, tree)

    def _own_window(self, session: TargetSession, local: LocalDrafting):
        """A round of a session that drafts here: (ids to feed, judge, logits rows, the window as
        the forward judges it), its window drafted now, after the committed sequence."""
        drafts = local.draft(session.seq, session.grammar)
        ids, start = session.window(drafts), session.kv.length

        def judge(logits: torch.Tensor, hidden: torch.Tensor | None, judged: Verdict | None = None) -> Judged:
            out = session.judge(logits, hidden, drafts, None, None, False, 0, start, judged)
            local.judged(out.verdict)
            return dataclasses.replace(out, accepted=drafts[:out.verdict.num_accepted], drafted=len(drafts))

        return ids, judge, len(drafts) + 1, session.batch_window(drafts, None, False)

    def _local_drafting(self, spec: LocalSpec | None, session: TargetSession) -> LocalDrafting | None:
        """The session's own drafting, where its open asks for it."""
        if spec is None:
            return None
        if self.drafter is None:
            raise InvalidRequest("speculate", "this target service drafts nothing itself (start it with --drafter)")
        if session.features:
            raise InvalidRequest("speculate", "a session that returns features drafts with a draft service")

        def costs():
            c = self.costs
            return local_cost_curve(c.value("local_t_draft"), c.value("verify_seconds"), c.value("decode_cost"),
                                    c.value("load_fit"))

        local = LocalDrafting(self.drafter, spec, session.sampling, session.seq, self.target.vocab_size, costs)
        cap = local.policy.params.max_draft_tokens
        if cap > self.config.max_window_tokens:
            local.close()
            raise InvalidRequest("speculate.max_draft_tokens", f"at most {self.config.max_window_tokens} (the "
                                                               f"target's max_window_tokens), got {cap}")
        return local

    def _multi_step(self, session: TargetSession, req: WindowRequest, steps: int,
                   local: LocalDrafting | None = None) -> MultiStep:
        """Start `steps` plain decoding steps (with local drafting: rounds); each goes on unless
        the last ended the text (an end-of-sequence token) or filled the context (or the
        length the session drafts to)."""
        left = steps
        end = min(local.max_length, self.target.max_context) if local is not None else self.target.max_context

        def step():
            if local is not None:
                return self._own_window(session, local)
            ids, rows, judge, _, window = self._window(session, req)
            return ids, judge, rows, window

        def next_step():
            nonlocal left
            left -= 1
            if not left or session.seq[-1] in self.target.eos_token_ids or len(session.seq) >= end:
                return None
            return step()

        ids, judge, rows, window = step()
        run = MultiStep(next_step)
        self.batcher.start_run(session.kv, ids, judge, run, session.features, window, rows)
        return run

    def _reply(self, session: TargetSession, req: WindowRequest, judged: Judged, batch: BatchInfo,
               prefill_s: float, local: LocalDrafting | None = None) -> Reply:
        """One forward's verdict for this session, observed in the metrics and costs."""
        verdict = judged.verdict
        self.metrics.observe_verify(len(req.drafts) + len(req.side_tokens) + judged.drafted, batch.forward_seconds)
        if local is not None:  # the load its next window is priced in
            local.load = (max(batch.batch_size - 1, 0), max(batch.batch_tokens - judged.drafted - 1, 0),
                          max(batch.emitted - verdict.num_accepted - 1, 0))
        now = time.perf_counter()
        if session.last_reply_at is not None:  # the time per token this session sees
            self.admission.observe_reply((now - session.last_reply_at) / (verdict.num_accepted + 1))
        session.last_reply_at = now
        return Reply(verify_id=req.verify_id, judged=judged, batch=batch, prefill_seconds=prefill_s,
                     decode_cost=self.costs.value("decode_cost"))


def plain_steps(req: WindowRequest, drafts_here: bool = False) -> int:
    """The decoding steps a request asks for: a multi-step run's length (steps) or one (drafts_here:
    rounds of a session that drafts on the target, which brings no drafts)."""
    if drafts_here and (req.drafts or req.side_tokens):
        raise InvalidRequest("tokens", "a session that drafts on the target verifies only its own drafts")
    if req.steps > 1 and (req.drafts or req.side_tokens):
        raise InvalidRequest("steps", "a multi-step run (steps > 1) verifies no draft tokens")
    if req.steps > MAX_PLAIN_STEPS:
        raise InvalidRequest("steps", f"at most {MAX_PLAIN_STEPS}, got {req.steps}")
    return max(req.steps, 1)


def measure_verify_seconds(target: LoadedModel, max_tokens: int = 17) -> list[float]:
    """Median seconds of a single-session forward over n = 1..max_tokens new tokens after a
    64-token context (specd.costs): the start-up cost curve."""
    return measure_t_target(target, synthetic_prefix(target.vocab_size), range(1, max_tokens + 1), repeats=3)[1]
