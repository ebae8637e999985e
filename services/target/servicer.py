"""The target service's gRPC servicer: Info, GetTokenizer and the per-request verification
Session stream. Verification is services.target.session, admission services.target.admission
and the batching of concurrent sessions services.common.batcher."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
from prometheus_client import CollectorRegistry

from services.common.batcher import BatchInfo, PlainRun, StepBatcher, measure_batch_surface
from services.common.compute import compute_thread
from services.common.convert import (
    distribution_from_proto,
    features_to_proto,
    model_info,
    sampling_from_proto,
    top_logprobs_to_proto,
)
from services.common.metrics import RpcMetrics, new_registry
from services.proto.specd.target.v1 import target_pb2, target_pb2_grpc
from services.target.admission import FAIR_SHARE_RESERVE, TargetAdmission
from services.target.drafting import LocalDrafting, local_cost_curve
from services.target.metrics import TargetMetrics
from services.target.session import TargetSession
from specd.cost_model import TARGET, CostModel
from specd.costs import LoadFit, measure_t_draft, measure_t_target, synthetic_prefix
from specd.drafters.base import Drafter
from specd.errors import InvalidRequest, ModelError, Overloaded
from specd.grammar import Grammar
from specd.models.loading import LoadedModel

log = logging.getLogger(__name__)
MAX_PLAIN_STEPS = 4096  # decoding steps one Verify may ask for (Verify.steps)
# Draft tokens (chain and tree side nodes) one Verify may bring: each costs a row of logits
# (32k positions x 152k logits is about 10 GB) and, sampled, a dense q (256 of them pass gRPC's
# 64 MiB limit). The largest default cap of a policy is svip's 40.
MAX_WINDOW_TOKENS = 64
IDLE_TIMEOUT_S = 60.0  # a session that sends nothing this long is ended and its KV slot freed
MIN_SHARED_PREFIX = 16  # prompt tokens two sessions share before one copies the other's cache
Q_SUM_SLACK = 1e-3  # a dense q sums to 1 within float32 round-off over a large vocabulary
SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetService"].full_name


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(self, target: LoadedModel, max_batch_size: int = 8, registry: CollectorRegistry | None = None,
                 prefill_chunk: int = 0, gather: float = 0.5, executor: ThreadPoolExecutor | None = None,
                 latency_budget: float = 0.0, drafter: Drafter | None = None,
                 max_window_tokens: int = MAX_WINDOW_TOKENS, idle_timeout_s: float = IDLE_TIMEOUT_S,
                 fair_share_reserve: float = FAIR_SHARE_RESERVE):
        """executor: the compute thread (services.common.compute), one model, one thread.
        latency_budget: refuse new sessions while the open ones see more than this many one-token
        forwards per token, or beyond the sessions the cost surface allows within it (0: neither;
        the KV pool's slots still limit sessions).
        drafter: a lookup drafter (ngram, retrieval) sessions may draft with here (OpenTarget.speculate).
        max_window_tokens: draft tokens one Verify may bring (TargetSettings.max_window_tokens).
        idle_timeout_s: a session with no message this long ends with DEADLINE_EXCEEDED and frees
        its KV slot (0: never; TargetSettings.idle_timeout_s).
        fair_share_reserve: the share of the KV pool's slots kept for tenants (OpenTarget.tenant)
        holding less than a fair share of them (TargetSettings.kv_fair_share_reserve)."""
        self.target = target
        self.max_window_tokens, self.idle_timeout_s = max_window_tokens, idle_timeout_s
        self.drafter = drafter
        self.costs = CostModel(TARGET)  # every timing this process keeps (specd.cost_model.TABLE)
        if drafter:  # seconds per drafted token, for cost-aware policies drafting here
            self.costs.seed("local_t_draft", measure_t_draft(drafter, synthetic_prefix(target.vocab_size), repeats=3))
        self.prefill_chunk = prefill_chunk
        self.executor = executor or compute_thread("target")
        self.sessions: set[TargetSession] = set()
        self.releasing: set[Future] = set()  # ended sessions' slots, freed behind the running forward
        self.registry = registry or new_registry()
        self.rpc_metrics = RpcMetrics(self.registry, "target")
        self.metrics = TargetMetrics(self.registry, target.name, lambda: len(self.sessions), self._kv_bytes,
                                     lambda: self.costs.value("decode_cost"), self._kv_slots,
                                     lambda: len(self.batcher.queue), lambda: self.costs.value("token_time"))
        self.batcher = StepBatcher(target.model, self.executor, max_batch_size, self.metrics.observe_batch, gather,
                                   self.costs)
        self.max_batch_size = max_batch_size
        # The cost curve cost-aware policies weigh windows with; its first point is the start-up
        # value of the decode cost, which serving then keeps current.
        verify_seconds = measure_verify_seconds(target)
        self.costs.seed("verify_seconds", verify_seconds)
        self.costs.observe("decode_cost", verify_seconds[0])
        # What a forward of B sessions costs, for policies that price a window in the batch it joins.
        batch_seconds, batch_token_seconds = measure_batch_surface(target, max_batch_size)
        self.costs.seed("batch_seconds", batch_seconds)
        self.costs.seed("batch_token_seconds", batch_token_seconds)
        # What its forwards really cost against that surface, for the sessions that draft here.
        self.costs.seed("load_fit", LoadFit(batch_seconds, batch_token_seconds))
        self.batcher.on_forward = self._on_forward
        self.batcher.emitted_of = lambda judged: judged[0].num_accepted + 1
        self.admission = TargetAdmission(lambda: target.pool, batch_seconds, verify_seconds[0],
                                         latency_budget, fair_share_reserve, self.costs)
        if self.admission.max_sessions is not None:
            log.info("latency budget %.2fx (%.1f ms a token): at most %d sessions at once", latency_budget,
                     1e3 * latency_budget * verify_seconds[0], self.admission.max_sessions)

    @property
    def active_sessions(self) -> int:
        return len(self.sessions)

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

    async def Info(self, request, context) -> target_pb2.TargetInfo:
        return target_pb2.TargetInfo(model=model_info(self.target), max_batch_size=self.max_batch_size,
                                     verify_seconds=self.costs.value("verify_seconds"),
                                     batch_seconds=self.costs.value("batch_seconds"),
                                     batch_token_seconds=self.costs.value("batch_token_seconds"), plain_runs=True,
                                     drafter=self.drafter.name if self.drafter else "",
                                     drafter_kind=self.drafter.kind if self.drafter else "")

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
        first = await self._next_message(anext(stream, None), context)
        if first is None or first.WhichOneof("kind") != "open":
            raise InvalidRequest("open", "a target session starts with an Open message")
        try:
            self.admission.admit(first.open.tenant, [s.tenant for s in self.sessions])
            session = await self._new_session(first.open)
        except Overloaded:
            self.metrics.observe_refused()
            raise
        donor = self._donor(session)
        self.sessions.add(session)
        local: LocalDrafting | None = None  # the session drafts here
        after_run: asyncio.Future | None = None  # the client's next message, read during a plain run
        run: PlainRun | None = None
        try:
            local = self._local_drafting(first.open, session)
            t0 = time.perf_counter()
            if donor is not None:  # the prefix another session prefills (or has): copied, not computed
                await donor.prefilled.wait()
                shared = await loop.run_in_executor(self.executor, session.adopt, donor, session.shared_prefix(donor))
                self.metrics.observe_shared_prefill(shared)
            more = True
            while more:  # other sessions' forwards run between the chunks
                cached = session.kv.length
                more = await loop.run_in_executor(self.executor, session.prefill, self.prefill_chunk)
                if session.kv.length > cached:
                    self.metrics.observe_prefill_chunk()
            prefill_s = time.perf_counter() - t0
            session.prefilled.set()
            while (msg := await self._next_message(after_run if after_run is not None else anext(stream, None),
                                                   context)) is not None:
                after_run = None
                kind = msg.WhichOneof("kind")
                if kind == "close":
                    break
                if kind != "verify":
                    raise InvalidRequest(kind or "kind", "expected verify or close after open")
                steps = plain_steps(msg.verify, local is not None)
                if steps == 1 and local is None:
                    reply = await self._verify(session, msg.verify)
                    reply.verified.prefill_seconds, prefill_s = prefill_s, 0.0
                    yield reply
                    continue
                # A plain run: the batcher queues each next step itself (PlainRun), so the next
                # forward runs while this step's reply travels. A client that speaks meanwhile
                # (its Close after a stop string, say) stops it after the steps already started,
                # which it still gets; one that only stopped writing gets the whole run. A session
                # that drafts here runs its rounds the same way, each drafting its window first.
                run = self._plain_run(session, msg.verify, steps, local)
                done = 0
                while (item := await run.results.get()) is not None:
                    if isinstance(item, BaseException):
                        raise item
                    reply = self._reply(session, msg.verify, *item, local=local)
                    reply.verified.prefill_seconds, prefill_s = prefill_s, 0.0
                    done += 1
                    yield reply
                    after_run = after_run or asyncio.ensure_future(anext(stream, None))
                    if after_run.done() and after_run.result() is not None:
                        run.stop()
                self.metrics.observe_plain_run(done)
            closed = local.closed() if local is not None else target_pb2.TargetClosed()
            yield target_pb2.TargetResponse(closed=closed)
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

    async def _next_message(self, reading, context: grpc.aio.ServicerContext):
        """The client's next message (None: it closed its side), waited for at most
        idle_timeout_s: a client that opened a session and went quiet (hung, or hostile) would
        otherwise hold its KV slot for ever. Past it the call ends with DEADLINE_EXCEEDED."""
        try:
            async with asyncio.timeout(self.idle_timeout_s or None):
                return await reading
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"session: no message for {self.idle_timeout_s:g} s (idle_timeout_s)")

    async def _new_session(self, open_msg: target_pb2.OpenTarget) -> TargetSession:
        """A session in a free KV slot. Where every slot is taken but some belong to sessions
        that already ended (their slots are freed on the compute thread, behind the forward
        running), it waits for those, at most about a forward, then tries once more: a client
        that sends its next request the moment its last one ended is not refused for a slot that
        was about to be free."""
        sampling = sampling_from_proto(open_msg.sampling)
        grammar = None
        if sampling.grammar is not None:  # compiled off the event loop, where every session's replies go
            grammar = await asyncio.to_thread(Grammar.for_model, sampling.grammar, self.target)

        def new() -> TargetSession:
            return TargetSession(self.target, list(open_msg.prompt_ids), sampling, open_msg.features, open_msg.tenant,
                                 open_msg.logprobs if open_msg.HasField("logprobs") else None, grammar)
        try:
            return new()
        except Overloaded:
            pending = [asyncio.wrap_future(f) for f in list(self.releasing)]
            if not pending:
                raise
        await asyncio.wait(pending)
        return new()

    async def _verify(self, session: TargetSession, msg: target_pb2.Verify) -> target_pb2.TargetResponse:
        ids, rows, judge, tree, window = self._window(session, msg)
        result = await self.batcher.submit(session.kv, ids, rows, judge, session.features, tree, window)
        return self._reply(session, msg, *result)

    def _window(self, session: TargetSession, msg: target_pb2.Verify):
        """A verification's (ids to feed, logits rows, judge for the compute thread, draft tree
        or None, the window as the forward judges it with the others' or None);
        InvalidRequest for a window this session cannot verify."""
        drafts = list(msg.tokens)
        n = len(drafts) + len(msg.side_tokens)
        if n > self.max_window_tokens:
            raise InvalidRequest("tokens", f"at most {self.max_window_tokens} draft tokens a window, chain and "
                                           f"side nodes together (the target's max_window_tokens), got {n}")
        session.check_window(drafts, list(msg.probs), bool(msg.distributions), msg.relaxed, msg.top_logprobs)
        tree = session.tree(drafts, list(msg.side_tokens), list(msg.side_parents), msg.relaxed, msg.top_logprobs)
        q = self._distributions(msg, drafts)
        threshold = msg.relaxed_threshold if msg.HasField("relaxed_threshold") else None
        ids, start = session.window(drafts, tree), session.kv.length  # start: the position of ids[0]

        def judge(logits: torch.Tensor, hidden: torch.Tensor | None, judged: Verdict | None = None):
            # On the compute thread, right after the forward: hidden may be a buffer the next reuses.
            if tree is not None:
                verdict, accepted = session.judge_tree(logits, tree, q)
                return verdict, None, None, accepted, 0, []
            verdict, top, feats, emitted = session.judge(logits, hidden, drafts, q, threshold, msg.relaxed,
                                                         msg.top_logprobs, start, judged)
            return verdict, top, features_to_proto(*feats) if feats else None, [], 0, emitted

        rows = len(tree) + 1 if tree is not None else len(drafts) + 1
        return ids, rows, judge, tree, session.batch_window(drafts, q, msg.relaxed, tree)

    def _own_window(self, session: TargetSession, local: LocalDrafting):
        """A round of a session that drafts here: (ids to feed, judge, logits rows, the window as
        the forward judges it), its window drafted now, after the committed sequence."""
        drafts = local.draft(session.seq, session.grammar)
        ids, start = session.window(drafts), session.kv.length

        def judge(logits: torch.Tensor, hidden: torch.Tensor | None, judged: Verdict | None = None):
            committed = len(session.seq)
            verdict, _, _, emitted = session.judge(logits, hidden, drafts, None, None, False, 0, start, judged)
            local.judged(committed, verdict)
            return verdict, None, None, drafts[:verdict.num_accepted], len(drafts), emitted

        return ids, judge, len(drafts) + 1, session.batch_window(drafts, None, False)

    def _local_drafting(self, open_msg: target_pb2.OpenTarget, session: TargetSession) -> LocalDrafting | None:
        """The session's own drafting, where its Open asks for it (OpenTarget.speculate)."""
        if not open_msg.HasField("speculate"):
            return None
        if self.drafter is None:
            raise InvalidRequest("speculate", "this target service drafts nothing itself (start it with --drafter)")
        if open_msg.features:
            raise InvalidRequest("speculate", "a session that returns features drafts with a draft service")

        def costs():
            c = self.costs
            return local_cost_curve(c.value("local_t_draft"), c.value("verify_seconds"), c.value("decode_cost"),
                                    c.value("load_fit"))

        local = LocalDrafting(self.drafter, open_msg.speculate, session.sampling, len(session.seq),
                              self.target.vocab_size, costs)
        cap = local.policy.params.max_draft_tokens
        if cap > self.max_window_tokens:
            local.close()
            raise InvalidRequest("speculate.max_draft_tokens", f"at most {self.max_window_tokens} (the target's "
                                                               f"max_window_tokens), got {cap}")
        return local

    def _plain_run(self, session: TargetSession, msg: target_pb2.Verify, steps: int,
                   local: LocalDrafting | None = None) -> PlainRun:
        """Start `steps` plain decoding steps (with local drafting: rounds); each goes on unless
        the last ended the text (an end-of-sequence token) or filled the context (or the
        length the session drafts to)."""
        left = steps
        end = min(local.max_length, self.target.max_context) if local is not None else self.target.max_context

        def step():
            if local is not None:
                return self._own_window(session, local)
            ids, rows, judge, _, window = self._window(session, msg)
            return ids, judge, rows, window

        def next_step():
            nonlocal left
            left -= 1
            if not left or session.seq[-1] in self.target.eos_token_ids or len(session.seq) >= end:
                return None
            return step()

        ids, judge, rows, window = step()
        run = PlainRun(next_step)
        self.batcher.start_run(session.kv, ids, judge, run, session.features, window, rows)
        return run

    def _reply(self, session: TargetSession, msg: target_pb2.Verify, judged, batch,
               local: LocalDrafting | None = None) -> target_pb2.TargetResponse:
        """The Verified message of one forward's verdict, observed in the metrics."""
        verdict, top, feats, accepted, drafted, emitted = judged
        self.metrics.observe_verify(len(msg.tokens) + len(msg.side_tokens) + drafted, batch.forward_seconds)
        if local is not None:  # the load its next window is priced in
            local.load = (max(batch.batch_size - 1, 0), max(batch.batch_tokens - drafted - 1, 0),
                          max(batch.emitted - verdict.num_accepted - 1, 0))
        now = time.perf_counter()
        if session.last_reply_at is not None:  # the time per token this session sees
            self.admission.observe_reply((now - session.last_reply_at) / (verdict.num_accepted + 1))
        session.last_reply_at = now
        return target_pb2.TargetResponse(verified=target_pb2.Verified(
            top_logprobs=top_logprobs_to_proto(top), features=feats, accepted_tokens=accepted,
            verify_id=msg.verify_id, num_accepted=verdict.num_accepted, next_token=verdict.next_token,
            num_strict=verdict.num_strict, js_distances=verdict.js_distances,
            forward_seconds=batch.forward_seconds, batch_size=batch.batch_size, batch_tokens=batch.batch_tokens,
            decode_seconds_per_token=self.costs.value("decode_cost"), drafted=drafted,
            emitted_logprobs=[target_pb2.EmittedLogprob(logprob=e.logprob, top_ids=e.top_ids,
                                                        top_logprobs=e.top_logprobs) for e in emitted]))

    def _distributions(self, msg: target_pb2.Verify, drafts: list[int]) -> torch.Tensor | None:
        """q [k, V] from the request; None for a point mass (n-gram) or greedy verification.
        Checked before use (check_distributions): the rule accepts x when u * q(x) <= p(x), so a
        q(x) <= 0 accepts every draft, and NaNs or negative entries break the residual."""
        if not msg.distributions:
            return None
        k, vocab = len(drafts), self.target.vocab_size
        if len(msg.distributions) != k:
            raise InvalidRequest("distributions", f"expected {k} distributions, got {len(msg.distributions)}")
        rows = []
        for i, d in enumerate(msg.distributions):
            if d.WhichOneof("encoding") != "dense_f32":
                idx = np.asarray(d.sparse.indices, dtype=np.int64)
                if len(idx) != len(d.sparse.values) or (idx.size and (idx.min() < 0 or idx.max() >= vocab)):
                    raise InvalidRequest("distributions", f"distribution {i}: sparse indices must be in "
                                                          f"[0, {vocab}), one per value")
            try:  # on the CPU: checked there, then one copy to the device
                rows.append(distribution_from_proto(d, vocab, torch.device("cpu")))
            except ValueError as e:
                raise InvalidRequest("distributions", f"distribution {i}: {e}") from None
        q = torch.stack(rows)
        check_distributions(q, drafts)
        return q.to(self.target.device)


def check_distributions(q: torch.Tensor, drafts: list[int]) -> None:
    """InvalidRequest naming `distributions` unless every row of q [k, V] is finite,
    non-negative, sums to 1 and gives its drafted token q(x) > 0 (it was drawn from it)."""
    finite = torch.isfinite(q).all(-1)
    nonneg = (q >= 0).all(-1)
    sums = q.sum(-1, dtype=torch.float64)
    ids = torch.tensor(drafts, dtype=torch.long).clamp(0, q.shape[-1] - 1)  # ids are range-checked later
    qx = q[torch.arange(len(drafts)), ids]
    for i in range(len(drafts)):
        if not (finite[i] and nonneg[i]):
            raise InvalidRequest("distributions", f"distribution {i}: entries must be finite and non-negative")
        if abs(float(sums[i]) - 1.0) > Q_SUM_SLACK:
            raise InvalidRequest("distributions", f"distribution {i}: must sum to 1, sums to {float(sums[i]):.6g}")
        if not qx[i] > 0:
            raise InvalidRequest("distributions", f"distribution {i}: q(x) of its drafted token {drafts[i]} must "
                                                  f"be > 0 (it was drafted from q)")


def plain_steps(msg: target_pb2.Verify, drafts_here: bool = False) -> int:
    """The decoding steps a Verify asks for: a plain run's length (Verify.steps) or one
    (drafts_here: rounds of a session that drafts on the target, which brings no drafts)."""
    if drafts_here and (msg.tokens or msg.side_tokens):
        raise InvalidRequest("tokens", "a session that drafts on the target verifies only its own drafts")
    if msg.steps > 1 and (msg.tokens or msg.side_tokens):
        raise InvalidRequest("steps", "a plain run (steps > 1) verifies no draft tokens")
    if msg.steps > MAX_PLAIN_STEPS:
        raise InvalidRequest("steps", f"at most {MAX_PLAIN_STEPS}, got {msg.steps}")
    return max(msg.steps, 1)


def measure_verify_seconds(target: LoadedModel, max_tokens: int = 17) -> list[float]:
    """Median seconds of a single-session forward over n = 1..max_tokens new tokens after a
    64-token context (specd.costs): the start-up cost curve."""
    return measure_t_target(target, synthetic_prefix(target.vocab_size), range(1, max_tokens + 1), repeats=3)[1]
