"""One request's draft -> verify loop over the draft and target services, with PEARL
overlap (Liu et al. 2024, arXiv 2408.11850; docs/services.md).

The draft service streams draft tokens and window ends; the target service verifies
*chunks*. Whenever the target is idle the loop sends it the next chunk: the drafts that
follow the committed sequence, up to the end of the window they belong to.

- Sequential (overlap off): a chunk is a whole window, sent once the policy has ended it;
  the draft waits for the verdict before drafting on (lookahead 1). This is the classic
  loop of specd.engine, split across two processes.
- PEARL (overlap on): the draft drafts the next window while the target verifies the
  current one (post-verify, lookahead 2), and a window still being drafted is sent as far
  as it goes when the target would otherwise idle; its first token is verified while
  tokens 2.. are drafted (pre-verify).

Every verification emits the accepted drafts and one recovered or bonus token. A draft
token drafted past the end of a verified chunk survives only if it equals the token the
target emitted there (for the bonus position: the target's own sample from p, so the
output distribution stays exactly the target's). The draft service applies the same rule
and acknowledges each commit with its epoch, which tells the loop which buffered tokens
are stale. Both modes therefore emit exactly what the target alone would (greedy), or the
target's distribution (sampling).

If the draft service fails, the request goes on with the target alone (chunks of zero
drafts) and the statistics say `fallback`. If the target fails, the request fails with
Unavailable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from services.common.convert import sampling_to_proto
from services.common.grpc_errors import client_message, from_rpc_error, status_error
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.draft.v1 import draft_pb2
from services.proto.specd.target.v1 import target_pb2
from specd.errors import Unavailable
from specd.logprobs import TokenLogprob
from specd.speculation.sequencer import Chunk, Sequencer
from specd.stats import GenerationStats
from specd.types import SamplingParams, SpecParams

log = logging.getLogger(__name__)


# How a request came to finish with the target alone: no draft service at the start, its
# session broke mid-request, or it drafted nothing for draft_stall_s.
FALLBACK_KINDS = ("unavailable", "failed", "stalled")
# What grpc.aio marks a call with when one of its operations fails in the core (a write after the
# service ended the call); the service's own status replaces it within moments.
CORE_ERROR = "Internal error from Core"
CORE_ERROR_WAITS = 100  # 10 ms each


@dataclass
class LoopStats(GenerationStats):
    fallback: bool = False
    fallback_reason: str = ""
    fallback_kind: str = ""  # one of FALLBACK_KINDS when fallback
    drafted_on_target: bool = False  # the target drafted the windows itself (OpenTarget.speculate)
    overlap: bool = False
    draft_wait_s: float = 0.0  # the loop idle, waiting on the draft alone
    verify_wait_s: float = 0.0  # a verification in flight
    drafted_total: int = 0  # every token the draft service drafted, verified or not
    continuations_kept: int = 0  # drafts past a verified chunk that equalled its bonus token
    batch_sizes: list[int] = field(default_factory=list)
    target_prefill_s: float = 0.0  # the target's prompt prefill
    target_decode_s_per_token: float = 0.0  # the target's measured cost of a plain decoding step
    # what target-only decoding would have cost the tokens verified so far, each at the load its
    # verification saw (a plain step in a forward of that many sessions)
    target_only_s: float = 0.0
    target_only_tokens: int = 0

    @property
    def target_only_s_per_token(self) -> float:
        return self.target_only_s / self.target_only_tokens if self.target_only_tokens else 0.0

    def to_dict(self) -> dict:
        return {**super().to_dict(), "fallback": self.fallback, "fallback_reason": self.fallback_reason,
                "fallback_kind": self.fallback_kind, "drafted_on_target": self.drafted_on_target,
                "overlap": self.overlap, "draft_wait_s": round(self.draft_wait_s, 4),
                "verify_wait_s": round(self.verify_wait_s, 4), "drafted_total": self.drafted_total,
                "continuations_kept": self.continuations_kept,
                "max_verify_batch": max(self.batch_sizes, default=0),
                "target_prefill_s": round(self.target_prefill_s, 6),
                "target_decode_s_per_token": round(self.target_decode_s_per_token, 6),
                "target_only_s_per_token": round(self.target_only_s_per_token, 6)}


@dataclass(frozen=True, kw_only=True)
class LoopConfig:
    prompt: list[int]
    sampling: SamplingParams
    spec: SpecParams
    max_length: int  # prompt + max_new_tokens, within the context
    vocab_size: int
    timeout_s: float  # deadline of the whole request on both services
    draft_stall_s: float  # waiting this long on the draft alone means it is stuck: fall back
    overlap: bool = False  # PEARL: the draft drafts the next window while this one is verified
    eos: frozenset[int] = frozenset()
    send_distributions: bool = False  # sampling (or relaxed) with a drafter that has q
    policy_state: dict = field(default_factory=dict)
    drafter: str | None = None  # the draft service's drafter (None: no draft service yet)
    verify_seconds: tuple[float, ...] = ()  # the target's cost curve, for cost-aware policies
    batch_seconds: tuple[float, ...] = ()  # and its batched cost surface
    batch_token_seconds: tuple[float, ...] = ()
    round_overhead_s: float = 0.0  # seconds a verification costs beyond the target's forward
    top_logprobs: int = 0  # a drafter that learns online (DVI) gets the target's top log-probs
    features: bool = False  # a feature drafter gets the target's hidden states of committed positions
    multi_step: bool = False  # the target runs several plain steps for one Verify (Verify.steps)
    drafts_on_target: bool = False  # the target drafts the windows itself, run by run (no draft service)
    tenant: str = ""  # who the request is for (GenerateRequest.tenant): the target's fair share of KV slots
    logprobs: int | None = None  # emitted tokens' log-probabilities, with this many alternatives


def settled_status(call) -> tuple[grpc.StatusCode, str]:
    """A finished call's (code, details), read without waiting: its status coroutines return at
    once when the status is set, so this runs in a done callback, before any later change."""
    def now(coroutine):
        try:
            coroutine.send(None)
        except StopIteration as done:
            return done.value
        coroutine.close()
        raise RuntimeError("the call has not finished")
    return now(call.code()), now(call.details())


class RequestLoop:
    def __init__(self, cfg: LoopConfig, target_stub, draft_stub):
        self.cfg = cfg
        self.target_stub, self.draft_stub = target_stub, draft_stub
        # what to verify next and what each verdict commits (specd.speculation.sequencer)
        self.rounds = Sequencer(cfg.prompt, max_length=cfg.max_length, eos=cfg.eos, overlap=cfg.overlap,
                                drafting=draft_stub is not None)
        self.logprobs: list[TokenLogprob] = []  # of the emitted tokens, with cfg.logprobs
        self.stats = LoopStats(cfg.spec.policy, cfg.drafter, prompt_tokens=len(cfg.prompt),
                               lossy=cfg.spec.relaxed, overlap=cfg.overlap,
                               drafted_on_target=cfg.drafts_on_target)
        self.events: asyncio.Queue = asyncio.Queue()
        self.draft_call = self.target_call = None
        self.target_status: tuple[grpc.StatusCode, str] | None = None  # what the target ended its call with
        self.tasks: list[asyncio.Task] = []
        self.policy_state: dict | None = None  # returned by the draft service on close
        self.policy_scale: dict = {}  # and the decay of its sums (StoppingPolicy.state_scale)
        self.finish_reason: str | None = None
        self.verify_id = self.commit_id = 0
        self.replies_due = 0  # Verified messages the outstanding verification (a multi-step run: each step) has yet to send
        self.sent_at = 0.0  # when the outstanding verification was sent
        self.overhead_s, self.overhead_n = 0.0, 0  # round trip beyond the forward, summed
        self.started = 0.0

    @property
    def seq(self) -> list[int]:
        """The committed tokens, prompt first."""
        return self.rounds.seq

    # -- public -----------------------------------------------------------------------------
    async def run(self) -> AsyncIterator[list[int]]:
        """Yields each verification's newly emitted tokens; close() must follow."""
        self.started = time.perf_counter()
        await self._open()
        chunk: Chunk | None = None  # the outstanding verification's
        out: list[int] = []  # emitted, not yet yielded
        while self.finish_reason is None:
            if chunk is None:
                chunk = self.rounds.next_chunk()
                if chunk is not None:
                    await self._send_verify(chunk, self.rounds.steps(chunk, self.cfg.multi_step))
            # Tokens go to the caller once the next verification is on its way, so the target
            # works while they stream, and as one batch when replies wait in the queue (a
            # multi-step run running ahead of a busy coordinator).
            if out and self.events.empty():
                yield out
                out = []
            t0 = time.perf_counter()
            source, msg = await self._next_event(waiting_on_target=chunk is not None)
            waited = time.perf_counter() - t0
            if chunk is not None:
                self.stats.verify_wait_s += waited
            else:
                self.stats.draft_wait_s += waited
            if source == "target":
                if chunk is None:
                    raise Unavailable("target service answered a verification nobody asked for")
                out += await self._on_verified(msg, chunk)
                self.replies_due -= 1
                if not self.replies_due:
                    chunk = None
            else:
                self._on_draft(source, msg)
        if out:
            yield out

    async def _next_event(self, waiting_on_target: bool) -> tuple[str, object]:
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for wraps the wait in a task of its
        # own, once per event of every request.
        if not self.events.empty():
            return self.events.get_nowait()
        if waiting_on_target:
            try:
                async with asyncio.timeout(self.cfg.timeout_s):
                    return await self.events.get()
            except TimeoutError:
                raise Unavailable(f"target service: no verdict within {self.cfg.timeout_s} s") from None
        try:
            async with asyncio.timeout(self.cfg.draft_stall_s):
                return await self.events.get()
        except TimeoutError:
            return "draft_stall", Unavailable(
                f"draft service: nothing drafted within {self.cfg.draft_stall_s} s (at position "
                f"{len(self.seq)}, {len(self.rounds.drafts)} drafts held, {self.rounds.unacked} commits "
                "unacknowledged)")

    async def close(self) -> None:
        """End both sessions; on a normal finish collect the draft's policy state."""
        self.stats.wall_time_s = time.perf_counter() - self.started if self.started else 0.0
        self.stats.new_tokens = len(self.seq) - len(self.cfg.prompt)
        self.stats.finish_reason = self.finish_reason or "cancelled"
        if self.finish_reason is not None:  # a normal finish: end both sessions as meant, at once
            closing = [self._close_target()]
            if self.draft_call is not None and not self.stats.fallback:
                closing.append(self._close_draft())
            await asyncio.gather(*closing)
        for call in (self.draft_call, self.target_call):
            if call is not None:
                call.cancel()
        for task in self.tasks:
            task.cancel()

    # -- streams ----------------------------------------------------------------------------
    async def _open(self) -> None:
        cfg = self.cfg
        spec = cfg.spec
        self._watch_target(self.target_stub.Session(timeout=cfg.timeout_s))
        open_msg = target_pb2.OpenTarget(prompt_ids=cfg.prompt, sampling=sampling_to_proto(cfg.sampling),
                                         features=cfg.features, tenant=cfg.tenant)
        if cfg.logprobs is not None:
            open_msg.logprobs = cfg.logprobs
        if cfg.drafts_on_target:
            open_msg.speculate.CopyFrom(target_pb2.LocalDrafting(
                policy=spec.policy, policy_params=spec.policy_params, policy_state=cfg.policy_state,
                max_length=cfg.max_length))
            if spec.max_draft_tokens is not None:
                open_msg.speculate.max_draft_tokens = spec.max_draft_tokens
        await self._write_target(target_pb2.TargetRequest(open=open_msg))
        self.tasks.append(asyncio.create_task(self._pump("target", self.target_call)))
        if self.draft_stub is None:
            return
        open_msg = draft_pb2.OpenDraft(
            prompt_ids=cfg.prompt, sampling=sampling_to_proto(cfg.sampling), policy=spec.policy,
            policy_params=spec.policy_params, policy_state=cfg.policy_state, max_length=cfg.max_length,
            lookahead=2 if cfg.overlap else 1, send_distributions=cfg.send_distributions,
            vocab_size=cfg.vocab_size,
            costs=common_pb2.Costs(verify_seconds=cfg.verify_seconds, batch_seconds=cfg.batch_seconds,
                                   batch_token_seconds=cfg.batch_token_seconds,
                                   round_overhead_seconds=cfg.round_overhead_s))
        if spec.max_draft_tokens is not None:
            open_msg.max_draft_tokens = spec.max_draft_tokens
        if spec.branches is not None:
            open_msg.branches = spec.branches
        if cfg.logprobs is not None:  # they are returned along chains (specd.logprobs)
            open_msg.branches = 0
        self.draft_call = self.draft_stub.Session(timeout=cfg.timeout_s)
        self.tasks.append(asyncio.create_task(self._pump("draft", self.draft_call)))
        await self._write_draft(draft_pb2.DraftRequest(open=open_msg))

    async def _pump(self, source: str, call) -> None:
        """Forward every message of a stream to the event queue; an error becomes an event."""
        try:
            while (msg := await call.read()) is not grpc.aio.EOF:
                self.events.put_nowait((source, msg))
            self.events.put_nowait((f"{source}_error", Unavailable(f"{source} service ended the session")))
        except grpc.aio.AioRpcError as e:
            if source == "target" and e.code() == grpc.StatusCode.INTERNAL and e.details() == CORE_ERROR:
                error = await self._target_ended()  # a write raced the call's end: the service's status
            else:
                error = from_rpc_error(e, source)
            self.events.put_nowait((f"{source}_error", error))
        except asyncio.CancelledError:
            pass

    async def _write_target(self, msg) -> None:
        try:
            await self.target_call.write(msg)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.INTERNAL and e.details() == CORE_ERROR:
                raise await self._target_ended() from None  # a write raced the call's end
            raise from_rpc_error(e, "target") from None
        except (grpc.aio.UsageError, asyncio.InvalidStateError):
            # The call has ended (a refused session: every KV slot taken): its status says why.
            raise await self._target_ended() from None

    def _watch_target(self, call) -> None:
        """Use call as the target session, noting the status it ends with (_note_target_status)."""
        self.target_call, self.target_status = call, None
        call.add_done_callback(self._note_target_status)

    def _note_target_status(self, call) -> None:
        """Keep the first status the target's call ends with that is not gRPC core's write error.
        A write that races the call's end marks the call INTERNAL ("Internal error from Core"),
        also when the service's own status (a refused session's RESOURCE_EXHAUSTED) had already
        arrived, which is then lost from the call; the callback runs at each status set."""
        try:
            status = settled_status(call)
        except Exception:  # noqa: BLE001 - never into gRPC's own machinery, which called this
            return
        if self.target_status is None and status[1] != CORE_ERROR:
            self.target_status = status

    async def _target_ended(self) -> Exception:
        """The error the target ended the session with. A write that raced the end fails in
        gRPC's core and marks the call INTERNAL; the status the service sent was noted before
        (_note_target_status) or replaces that when it arrives, so it is waited for."""
        try:
            code = await asyncio.wait_for(self.target_call.code(), 5.0)
            details = await self.target_call.details()
            for _ in range(CORE_ERROR_WAITS):
                if self.target_status is not None:
                    code, details = self.target_status
                    break
                if code != grpc.StatusCode.INTERNAL or details != CORE_ERROR:
                    break
                await asyncio.sleep(0.01)
                code, details = await self.target_call.code(), await self.target_call.details()
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            return Unavailable(f"target service: the session ended ({type(e).__name__})")
        return status_error(code, details or "", "target")

    async def _write_draft(self, msg) -> None:
        if self.stats.fallback:
            return
        try:
            await self.draft_call.write(msg)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
            self._fall_back(client_message(e, "draft"), "failed")  # str(e) carries peer addresses

    async def _close_target(self) -> None:
        """Close, then wait for the service to end the call: cancelling a finished session
        would count every request as a cancelled call on the target's gRPC series. No
        verification is outstanding at a normal finish, so this is one round trip. A session
        that drafted on the target ends with its policy's state (TargetClosed)."""
        try:
            await self.target_call.write(target_pb2.TargetRequest(close=target_pb2.CloseTarget()))
            await self.target_call.done_writing()
            while self.cfg.drafts_on_target:  # the replies of a stopped run come before it
                source, msg = await asyncio.wait_for(self.events.get(), 5.0)
                if source == "target" and msg.WhichOneof("kind") == "closed":
                    self.policy_state = dict(msg.closed.policy_state)
                    self.policy_scale = dict(msg.closed.policy_scale)
                    self.stats.drafted_total = msg.closed.num_drafted
                    self.stats.grammar_drafted = msg.closed.grammar_drafted
                    break
                if source == "target_error":
                    break
            await asyncio.wait_for(self.target_call.code(), 5.0)
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.warning("target session did not close cleanly: %s", e)

    async def _close_draft(self) -> None:
        try:
            await self.draft_call.write(draft_pb2.DraftRequest(close=draft_pb2.CloseDraft()))
            await self.draft_call.done_writing()
            while True:
                source, msg = await asyncio.wait_for(self.events.get(), 5.0)
                if source == "draft" and msg.WhichOneof("kind") == "closed":
                    self.policy_state = dict(msg.closed.policy_state)
                    self.policy_scale = dict(msg.closed.policy_scale)
                    self.stats.drafted_total = msg.closed.num_drafted
                    # Let the service end the call itself: cancelling it now (close() does)
                    # would cut the handler off after its last message, a clean close
                    # counted as a cancelled one.
                    await asyncio.wait_for(self.draft_call.code(), 5.0)
                    return
                if source == "draft_error":
                    return  # the target's own closing messages are _close_target's business
        except (TimeoutError, grpc.aio.AioRpcError, grpc.aio.UsageError) as e:
            log.warning("draft session did not close cleanly: %s", e)

    # -- draft messages -----------------------------------------------------------------------
    def _on_draft(self, source: str, msg) -> None:
        if source == "target_error":
            raise msg
        if source in ("draft_error", "draft_stall"):
            self._fall_back(client_message(msg, "draft"), "failed" if source == "draft_error" else "stalled")
            return
        kind = msg.WhichOneof("kind")
        if kind == "token":
            self.rounds.proposed(msg.token)
        elif kind == "window_end":
            w = msg.window_end
            self.rounds.window_ended(w, w.relaxed_threshold if w.HasField("relaxed_threshold") else None)
        elif kind == "ack":
            self.rounds.acknowledged(msg.ack.epoch)

    def _fall_back(self, reason: str, kind: str) -> None:
        """reason: a client-facing text (grpc_errors.client_message): it reaches the API as
        spec_stats.fallback_reason."""
        if not self.stats.fallback:
            log.warning("falling back to target-only decoding: %s", reason)
        self.stats.fallback, self.stats.fallback_reason, self.stats.fallback_kind = True, reason, kind
        self.rounds.stop_drafting()
        if self.draft_call is not None:
            self.draft_call.cancel()

    # -- verification -------------------------------------------------------------------------
    async def _send_verify(self, chunk: Chunk, steps: int = 1) -> None:
        self.verify_id += 1
        self.replies_due = steps
        drafts = chunk.drafts
        msg = target_pb2.Verify(verify_id=self.verify_id, tokens=[t.token for t in drafts],
                                probs=[t.prob for t in drafts], relaxed=self.cfg.spec.relaxed,
                                steps=steps if steps > 1 else 0)
        if self.cfg.send_distributions and drafts:
            msg.distributions.extend(t.q for t in drafts)
        if self.rounds.threshold is not None and self.cfg.spec.relaxed:
            msg.relaxed_threshold = self.rounds.threshold
        if chunk.side_tokens:
            msg.side_tokens.extend(chunk.side_tokens)
            msg.side_parents.extend(chunk.side_parents)
        elif drafts and not self.stats.fallback:
            msg.top_logprobs = self.cfg.top_logprobs
        self.sent_at = time.perf_counter()
        await self._write_target(target_pb2.TargetRequest(verify=msg))

    async def _on_verified(self, msg, chunk: Chunk) -> list[int]:
        if msg.WhichOneof("kind") != "verified":
            raise Unavailable("target service ended the session")
        v = msg.verified
        if not v.prefill_seconds and self.sent_at:  # the first reply also waited for the prompt's prefill
            self.overhead_s += max(time.perf_counter() - self.sent_at - v.forward_seconds, 0.0)
            self.overhead_n += 1
        self.sent_at = 0.0  # a multi-step run's later steps were not asked for one by one
        side = len(chunk.side_tokens)
        c = self.rounds.verified(chunk, v.num_accepted, v.next_token, drafted=v.drafted,
                                 accepted_tokens=v.accepted_tokens)
        self._record(c.k, c.n, v, [t.entropy for t in chunk.drafts], side)
        self.stats.continuations_kept += c.continuation_kept  # PEARL: the next window's first draft was the bonus
        self.finish_reason = c.finish_reason
        if self.cfg.logprobs is not None:
            if len(v.emitted_logprobs) < len(c.emitted):
                raise Unavailable("target service returned no log-probabilities (an older version?)")
            self.logprobs += [TokenLogprob(e.logprob, tuple(e.top_ids), tuple(e.top_logprobs))
                              for e in v.emitted_logprobs[:len(c.emitted)]]
        if c.notify:
            self.commit_id += 1
            await self._write_draft(draft_pb2.DraftRequest(commit=draft_pb2.Commit(
                commit_id=self.commit_id, tokens=c.tokens, num_verified=c.k, num_strict=v.num_strict,
                js_distances=v.js_distances, top_logprobs=v.top_logprobs, features=v.features,
                other_sessions=max(v.batch_size - 1, 0), other_tokens=max(v.batch_tokens - c.k - side - 1, 0),
                side_nodes=side)))
        return c.emitted

    def _record(self, k: int, n: int, v: target_pb2.Verified, entropies: Sequence[float] = (), side: int = 0) -> None:
        s = self.stats
        s.batch_sizes.append(v.batch_size)
        s.target_prefill_s += v.prefill_seconds
        s.target_decode_s_per_token = v.decode_seconds_per_token
        s.target_only_s += (n + 1) * self._plain_step_at(v.batch_size, v.decode_seconds_per_token)
        s.target_only_tokens += n + 1
        if side:  # a draft tree: num_strict of the path's n tokens lead along the chain
            s.record_tree_round(k + side, n, v.num_strict, entropies)
        else:
            s.record_round(k, n, v.num_strict, n - min(n, v.num_strict), entropies)

    def _plain_step_at(self, sessions: int, decode_s: float) -> float:
        """A plain decoding step's seconds in a forward of `sessions` sessions: the target's
        batched cost surface, scaled to its current decode cost (decode_s when it has none)."""
        surface = self.cfg.batch_seconds
        if not surface or sessions <= 1 or surface[0] <= 0:
            return decode_s
        at = surface[min(sessions, len(surface)) - 1]
        return at * (decode_s / surface[0]) if decode_s > 0 else at

