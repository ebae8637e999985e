"""The coordinator: the Backend that serves requests over the draft and target services.

It owns what is per deployment rather than per request: the two channels, the target's
tokenizer (fetched from the target service, so it needs no model files), the pair check
(a draft whose tokenizer differs from the target's is refused), the shared policy state
(loaded before a request, saved after it in the background: the answer never waits for it) and
the overlap setting. Each request runs a services.coordinator.loop.RequestLoop.

The draft is optional: when its Info call fails, a breaker (services.common.breaker) skips it
for `draft_cooldown_s`, so requests fall back to the target alone at once instead of each
waiting out the Info timeout; then one request probes it again. `ready()` is the target's
health, checked over the coordinator's own channel with a short timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from services.common.breaker import Breaker
from services.common.grpc_errors import from_rpc_error
from services.common.metrics import new_registry
from services.common.security import GrpcSecurity
from services.common.server import channel
from services.common.state import AsyncStateStore
from services.coordinator.api import (
    MAX_REQUEST_DRAFT_TOKENS,
    Event,
    FinishEvent,
    GenerateRequest,
    ModelCard,
    TokenEvent,
    named_logprobs,
)
from services.coordinator.loop import LoopConfig, RequestLoop
from services.coordinator.metrics import CoordinatorMetrics
from services.proto.specd.common.v1 import common_pb2
from services.proto.specd.draft.v1 import draft_pb2, draft_pb2_grpc
from services.proto.specd.target.v1 import target_pb2_grpc
from specd.cost_model import COORDINATOR, CostModel
from specd.detok import TextStream
from specd.drafters import MODEL_FREE as MODEL_FREE_KINDS
from specd.errors import ModelError, SpecdError, Unavailable
from specd.runtime.loading import encode_prompt
from specd.speculation.round import validate_prompt
from specd.tools import call_tokens, template_format
from specd.policies import NO_SPECULATION, POLICIES, check_drafter, check_spec
from specd.state import StateKey, StateUpdate
from specd.tree import check_branches

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoordinatorConfig:
    target_address: str
    draft_address: str | None  # None: target-only decoding
    overlap: bool = True  # PEARL (not for a lookup drafter); a request may override it
    request_timeout_s: float = 600.0
    draft_stall_s: float = 10.0
    info_timeout_s: float = 5.0
    draft_cooldown_s: float = 5.0  # after a failed draft Info, use the target alone this long
    health_timeout_s: float = 0.5  # of one health check of the target (ready())
    security: GrpcSecurity = GrpcSecurity()  # TLS and the token on both channels (default: plaintext)
    max_draft_tokens: int = MAX_REQUEST_DRAFT_TOKENS  # the most drafts a request may ask per window


class Coordinator:
    def __init__(self, cfg: CoordinatorConfig, state_store: AsyncStateStore,
                 registry: CollectorRegistry | None = None):
        self.cfg, self.state_store = cfg, state_store
        self.registry = registry or new_registry()  # the Prometheus series of every request
        self.metrics = CoordinatorMetrics(self.registry)
        self.target_channel = channel(cfg.target_address, cfg.security)
        self.target_stub = target_pb2_grpc.TargetServiceStub(self.target_channel)
        self.draft_channel = channel(cfg.draft_address, cfg.security) if cfg.draft_address else None
        self.draft_stub = draft_pb2_grpc.DraftServiceStub(self.draft_channel) if self.draft_channel else None
        self.target_info: common_pb2.ModelInfo | None = None
        self.tokenizer = None
        self.drafter_name: str | None = None
        # What cost-aware drafting weighs (specd.cost_model.TABLE): the target's start-up cost
        # curve and batched surface (TargetInfo), kept current from every request's verifications.
        self.costs = CostModel(COORDINATOR)
        self.multi_step = False  # the target answers a multi-step run step by step (Verify.steps)
        self.target_drafter: str | None = None  # the lookup drafter the target drafts with itself
        self.draft_breaker = Breaker(cfg.draft_cooldown_s)
        self._saves: set[asyncio.Task] = set()  # policy-state saves under way (kept from the GC)
        self._on_close: list = []

    # -- connecting -------------------------------------------------------------------------
    async def connect(self) -> None:
        """Describe the target, fetch its tokenizer and check the draft fits (ModelError if not)."""
        await self._ensure_target()
        info = await self._draft_info()
        if isinstance(info, ModelError):
            raise info
        if isinstance(info, SpecdError) and self.draft_stub is not None:
            log.warning("draft service not available yet (%s); requests fall back to the target alone", info)

    async def _ensure_target(self) -> None:
        if self.target_info is not None:
            return
        timeout = self.cfg.info_timeout_s
        try:
            info = await self.target_stub.Info(common_pb2.InfoRequest(), timeout=timeout)
            files = await self.target_stub.GetTokenizer(common_pb2.InfoRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            raise from_rpc_error(e, "target") from None
        self.tokenizer = _load_tokenizer(dict(files.files))
        self.costs.seed("verify_seconds", list(info.costs.verify_seconds))
        self.costs.seed("batch_seconds", list(info.costs.batch_seconds))
        self.costs.seed("batch_token_seconds", list(info.costs.batch_token_seconds))
        self.multi_step = info.multi_step
        self.target_drafter = info.drafter if info.drafter and info.multi_step else None
        self.drafter_name = self.drafter_name or self.target_drafter
        self.target_info = info.model

    async def _draft_info(self) -> draft_pb2.DraftInfo | SpecdError:
        """The draft service's description, or why it cannot be used now."""
        if self.draft_stub is None:
            return Unavailable("no draft service configured")
        if not self.draft_breaker.allow():
            return Unavailable(f"draft service unavailable: it failed within the last "
                               f"{self.cfg.draft_cooldown_s:g} s; not tried again yet")
        try:
            info = await self.draft_stub.Info(common_pb2.InfoRequest(), timeout=self.cfg.info_timeout_s)
        except grpc.aio.AioRpcError as e:
            self.draft_breaker.failure()
            return from_rpc_error(e, "draft")
        self.draft_breaker.success()
        theirs, ours = info.model.tokenizer_fingerprint, self.target_info.tokenizer_fingerprint
        if theirs and ours and theirs != ours:
            return ModelError(f"draft {info.name} (tokenizer {theirs}) does not share the tokenizer of "
                              f"target {self.target_info.name} ({ours}); refusing the pair")
        self.drafter_name = info.name
        return info

    # -- Backend ----------------------------------------------------------------------------
    def model_card(self) -> ModelCard:
        name = self.target_info.name if self.target_info else "unknown"
        return ModelCard(name, self.target_info.max_context if self.target_info else 0, self.drafter_name,
                         template_format(self.tokenizer) if self.tokenizer is not None else None)

    async def ready(self) -> bool:
        """Connected, and the target answers SERVING within health_timeout_s."""
        return self.target_info is not None and await self.target_serving()

    async def target_serving(self) -> bool:
        """The target's standard health check, over the coordinator's channel to it."""
        try:
            reply = await health_pb2_grpc.HealthStub(self.target_channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.cfg.health_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        drafter = self.target_drafter if self._drafts_on_target(request) else self.drafter_name
        return self.metrics.metered(self._generate(request), request, self.model_card().id, drafter)

    def on_close(self, callback) -> None:
        """Call callback() when the coordinator closes (e.g. cancel a health watcher)."""
        self._on_close.append(callback)

    async def close(self, save_grace_s: float = 2.0) -> None:
        """Close the channels and the state store, after waiting at most save_grace_s for the
        policy-state saves under way (the rest are cancelled)."""
        for callback in self._on_close:
            callback()
        if self._saves:
            _, pending = await asyncio.wait(set(self._saves), timeout=save_grace_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await self.target_channel.close()
        if self.draft_channel is not None:
            await self.draft_channel.close()
        await self.state_store.close()

    # -- one request ------------------------------------------------------------------------
    async def _generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        request.validate(max_draft_tokens_limit=self.cfg.max_draft_tokens)  # before tokenizing: a gRPC client may not have come through a gateway
        await self._ensure_target()
        # Tokenizing a long prompt takes a while: off the event loop, where every stream runs.
        prompt = await asyncio.to_thread(self._prompt_ids, request)
        cfg = await self._loop_config(request, prompt)
        draft_stub, fallback_reason = None, ""
        if self._drafts_on_target(request):
            cfg = await self._with_target_drafter(cfg)
        elif request.spec.policy != NO_SPECULATION:
            draft = await self._draft_info()
            if isinstance(draft, SpecdError):
                fallback_reason = str(draft)
            else:
                check_drafter(request.spec, draft.name, draft.has_distribution)
                check_branches(request.spec.branches, draft.kind, draft.branch_length)
                draft_stub = self.draft_stub
                cfg = await self._with_draft(cfg, draft, request.overlap)
        loop = RequestLoop(cfg, self.target_stub, draft_stub)
        if fallback_reason:
            loop.stats.fallback, loop.stats.fallback_reason = True, fallback_reason
            loop.stats.fallback_kind = "unavailable"
        stream = TextStream(self.tokenizer, request.sampling.stop,
                            call_tokens(self.tokenizer) if request.tools_json else None)
        try:
            async for new in loop.run():
                released = len(stream.ids)  # the index of new[0] among the generated ids
                delta = stream.push(new)
                if delta.token_ids or delta.text:
                    lps = (named_logprobs(self.tokenizer, delta.token_ids,
                                          loop.logprobs[released:released + len(delta.token_ids)])
                           if request.logprobs is not None else ())
                    yield TokenEvent(delta.token_ids, delta.text, lps)
                if stream.stopped:
                    loop.finish_reason = "stop"
                    break
            tail = stream.finish()
            if tail.text:
                yield TokenEvent((), tail.text)
        finally:
            await loop.close()
        # Saved in the background, scheduled before the last event: the caller stops reading
        # at the FinishEvent (code after it never runs), and the answer must not wait for Redis.
        self._save_state(cfg, loop)
        self._follow_costs(loop)
        yield FinishEvent(loop.finish_reason or "length", len(prompt), len(stream.ids),
                          {**loop.stats.to_dict(), "new_tokens": len(stream.ids)})

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_ids is not None:
            prompt = list(request.prompt_ids)
        elif request.messages is not None:
            prompt = encode_prompt(self.tokenizer, [dict(m) for m in request.messages], chat=True,
                                   tools=request.tool_specs())
        else:
            prompt = encode_prompt(self.tokenizer, request.prompt or "", chat=False)
        validate_prompt(prompt, self.target_info.vocab_size, self.target_info.max_context)
        return prompt

    async def _loop_config(self, request: GenerateRequest, prompt: list[int]) -> LoopConfig:
        info, spec, sampling = self.target_info, request.spec, request.sampling
        sampling.validate(max_new_tokens_limit=info.max_context)
        check_spec(spec, sampling)  # names a bad parameter before any work starts
        overlap = self.cfg.overlap if request.overlap is None else request.overlap
        return LoopConfig(
            prompt=prompt, sampling=sampling, spec=spec, overlap=overlap and not spec.relaxed,  # relaxed: sequential
            max_length=min(len(prompt) + sampling.max_new_tokens, info.max_context),
            eos=frozenset(info.eos_token_ids), vocab_size=info.vocab_size, timeout_s=self.cfg.request_timeout_s,
            draft_stall_s=self.cfg.draft_stall_s, multi_step=self.multi_step, tenant=request.tenant,
            logprobs=request.logprobs)

    async def _with_draft(self, cfg: LoopConfig, draft: draft_pb2.DraftInfo, asked: bool | None) -> LoopConfig:
        state = await self._load_state(self._state_key(cfg, draft.name))
        send_q = draft.has_distribution and (not cfg.sampling.greedy or cfg.spec.relaxed)
        # A lookup drafter has no drafting time for PEARL to hide, and its pre-verification of a
        # window's first token alone costs a target forward: sequential, unless the request asks.
        # So are draft trees, which grow from whole windows (PEARL sends windows in parts).
        trees = (cfg.spec.branches if cfg.spec.branches is not None else draft.branches) \
            and not cfg.sampling.adjusts_logits and cfg.logprobs is None  # then the draft grows no tree
        overlap = cfg.overlap and (asked is not None or (draft.kind not in MODEL_FREE_KINDS and not trees))
        return dataclasses.replace(cfg, overlap=overlap, send_distributions=send_q, policy_state=state,
                                   drafter=draft.name,
                                   verify_seconds=self._scaled("verify_seconds"),
                                   batch_seconds=self._scaled("batch_seconds"),
                                   batch_token_seconds=self._scaled("batch_token_seconds"),
                                   round_overhead_s=self.costs.value("round_overhead"),
                                   top_logprobs=draft.top_logprobs, features=draft.needs_features)

    def _drafts_on_target(self, request: GenerateRequest) -> bool:
        """Whether the request's windows are drafted on the target itself (TargetInfo.drafter): a
        lookup drafter there needs no round trip to a draft service. Not for what only a draft
        service does: draft trees, relaxed verification, a policy reading a draft model."""
        spec = request.spec
        policy = POLICIES.get(spec.policy)  # an unknown one is refused naming it, in _generate
        return (self.target_drafter is not None and policy is not None and not spec.branches and not spec.relaxed
                and not policy.needs_hidden)

    async def _with_target_drafter(self, cfg: LoopConfig) -> LoopConfig:
        state = await self._load_state(self._state_key(cfg, self.target_drafter))
        return dataclasses.replace(cfg, overlap=False, policy_state=state, drafter=self.target_drafter,
                                   drafts_on_target=True)

    def _scaled(self, name: str) -> tuple[float, ...]:
        """Start-up costs of the target (a cost model's name), scaled by how its decode cost has
        drifted since."""
        curve, decode_s = self.costs.value("verify_seconds"), self.costs.value("target_decode_cost")
        scale = decode_s / curve[0] if curve and decode_s and curve[0] > 0 else 1.0
        return tuple(t * scale for t in self.costs.value(name))

    def _follow_costs(self, loop: RequestLoop) -> None:
        if loop.stats.target_decode_s_per_token > 0:
            self.costs.observe("target_decode_cost", loop.stats.target_decode_s_per_token)
        if loop.overhead_n:  # each measured round counts once: a long request counts more
            self.costs.observe("round_overhead", loop.overhead_s / loop.overhead_n, count=loop.overhead_n)

    def _state_key(self, cfg: LoopConfig, drafter: str) -> StateKey:
        return StateKey(drafter, self.target_info.name, cfg.spec.policy, cfg.spec.task_tag)

    async def _load_state(self, key: StateKey) -> dict:
        try:
            return await self.state_store.load(key)
        except Exception as e:  # noqa: BLE001 - shared state is an optimisation: serve without it
            log.warning("%s; starting from the policy's defaults", e)
            return {}

    def _save_state(self, cfg: LoopConfig, loop: RequestLoop) -> None:
        """Record the request's final policy state and fold it into the saved one in a
        background task (merged with concurrent requests', specd.state.StateUpdate)."""
        if loop.policy_state is None or cfg.drafter is None:
            return
        self.metrics.record_policy_state(self.metrics.labels(self.model_card().id, cfg.spec.policy, cfg.drafter),
                                         cfg.spec.task_tag, loop.policy_state)
        update = StateUpdate.between(cfg.policy_state, loop.policy_state, loop.policy_scale)
        task = asyncio.ensure_future(self._save(self._state_key(cfg, cfg.drafter), update))
        self._saves.add(task)
        task.add_done_callback(self._saves.discard)

    async def _save(self, key: StateKey, update: StateUpdate) -> None:
        try:
            await self.state_store.update(key, update)
        except Exception as e:  # noqa: BLE001 - a lost save costs only what this request learned
            log.warning("%s; adaptive policy state not saved", e)


def _load_tokenizer(files: dict[str, bytes]):
    from transformers import AutoTokenizer

    if not files:
        raise ModelError("the target service sent no tokenizer files")
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            (Path(tmp) / Path(name).name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True)
