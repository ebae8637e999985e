"""Prometheus series of the coordinator, from each request's plain statistics (LoopStats /
GenerationStats, the `spec_stats` of its FinishEvent). They are exported by the coordinator
service on its metrics port, and by the gateway when it runs the coordinator in-process.

Labels: `model` (the target), `policy`, `drafter` ("none" for target-only requests).

Counters (cumulative):
  specd_requests_total{status}            status: ok | cancelled | invalid_argument | unavailable | error
  specd_drafted_tokens_total              draft tokens sent for verification
  specd_accepted_tokens_total             of those, accepted by the target
  specd_emitted_tokens_total              tokens returned to callers
  specd_verifications_total               target forward passes (one per verified chunk)
  specd_fallbacks_total{reason}           requests finished by the target alone because the draft
                                          failed: unavailable (at the start), failed (mid-request),
                                          stalled (drafted nothing for draft_stall_s)
  specd_drafted_tokens_by_position_total{position}, specd_accepted_tokens_by_position_total{position}
                                          per draft position in a chunk (1, 2, ..., "17+")
  specd_generation_seconds_total          wall seconds the requests took
  specd_target_only_seconds_total         seconds target-only decoding would have taken for the same
                                          tokens: the target's prefill time plus emitted tokens times
                                          its measured per-token decode cost (kept current by the
                                          target service, services.target.metrics) at the load each
                                          verification saw (a plain step in a forward of that many
                                          sessions, from the target's batched cost surface), so the
                                          speedup and its alert compare like with like under load
  specd_draft_wait_seconds_total          of the generation seconds, those spent waiting on the draft
                                          alone (nothing to verify yet)
  specd_verify_wait_seconds_total         ... and those with a verification in flight
Histograms:
  specd_draft_length_tokens               draft tokens per verification
  specd_accepted_length_tokens            accepted tokens per verification
  specd_request_duration_seconds          end to end, per request
  specd_time_to_first_token_seconds       request start to the first emitted token
  specd_inter_token_latency_seconds       seconds per output token after the first: each
                                          verification's gap shared evenly by the tokens it emitted
Gauges:
  specd_policy_state{task_tag, key}       the adaptive policy's state after the latest request; task_tag
                                          is opaque (tag_label) but for "default"
                                          (the thresholds: `lam` of max-confidence/adaedl, `k` of heuristic,
                                          `rej_h_sum`/`rej_n` of adasd)
  specd_active_sessions{service="coordinator"}

PromQL (5-minute windows; add `by (policy, drafter)` inside each sum to split):
  acceptance rate        sum(rate(specd_accepted_tokens_total[5m])) / sum(rate(specd_drafted_tokens_total[5m]))
  mean accepted length   sum(rate(specd_accepted_tokens_total[5m])) / sum(rate(specd_verifications_total[5m])) + 1
  emitted per verify     sum(rate(specd_emitted_tokens_total[5m])) / sum(rate(specd_verifications_total[5m]))
  speedup                sum(rate(specd_target_only_seconds_total[5m])) / sum(rate(specd_generation_seconds_total[5m]))
  acceptance by position sum by (position) (rate(specd_accepted_tokens_by_position_total[5m]))
                           / sum by (position) (rate(specd_drafted_tokens_by_position_total[5m]))
  p95 latency            histogram_quantile(0.95, sum by (le) (rate(specd_request_duration_seconds_bucket[5m])))
  p95 TTFT               histogram_quantile(0.95, sum by (le) (rate(specd_time_to_first_token_seconds_bucket[5m])))
  p95 inter-token        histogram_quantile(0.95, sum by (le) (rate(specd_inter_token_latency_seconds_bucket[5m])))
  fallback ratio         sum(rate(specd_fallbacks_total[5m])) / sum(rate(specd_requests_total[5m]))
  draft-bound share      sum(rate(specd_draft_wait_seconds_total[5m])) / sum(rate(specd_generation_seconds_total[5m]))

Speedup is a per-request latency ratio: under concurrent load both sides are per-request
seconds, so it says how much sooner each answer arrives, not how many more requests fit.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import (
    LATENCY_BUCKETS,
    MAX_LABELLED_POSITION,
    STEP_BUCKETS,
    TOKEN_BUCKETS,
    active_sessions,
    count_label,
    opaque_label,
)
from services.coordinator.api import Event, FinishEvent, GenerateRequest, TokenEvent
from services.coordinator.loop import FALLBACK_KINDS
from specd.errors import InvalidRequest, Unavailable
from specd.policies import NO_SPECULATION, POLICIES

LABELS = ["model", "policy", "drafter"]


def tag_label(task_tag: str) -> str:
    """The `task_tag` label of a tag: "default" as it is, any other (chosen by clients, scoped to
    their key by the gateway) opaque_label("t", tag), so that /metrics shows no client's text."""
    return task_tag if task_tag == "default" else opaque_label("t", task_tag)


MAX_TASK_TAGS = 64  # distinct task tags given series of their own; later ones share "other"


class CoordinatorMetrics:
    def __init__(self, registry: CollectorRegistry, sessions: Callable[[], int] | None = None):
        self.registry = registry
        self.active = 0
        active_sessions(registry, "coordinator", sessions or (lambda: self.active))

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, [*LABELS, *extra], registry=registry)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=registry)

        self.requests = counter("specd_requests", "requests by final status", ("status",))
        self.drafted = counter("specd_drafted_tokens", "draft tokens sent for verification")
        self.accepted = counter("specd_accepted_tokens", "draft tokens the target accepted")
        self.emitted = counter("specd_emitted_tokens", "tokens returned to callers")
        self.verifications = counter("specd_verifications", "target verification passes")
        self.fallbacks = counter("specd_fallbacks", "requests finished by the target alone (draft failed)",
                                 ("reason",))
        self.drafted_at = counter("specd_drafted_tokens_by_position", "draft tokens verified, by position",
                                  ("position",))
        self.accepted_at = counter("specd_accepted_tokens_by_position", "draft tokens accepted, by position",
                                   ("position",))
        self.generation_s = counter("specd_generation_seconds", "wall seconds requests took")
        self.target_only_s = counter("specd_target_only_seconds",
                                     "seconds target-only decoding would have taken for the same tokens")
        self.draft_wait_s = counter("specd_draft_wait_seconds", "seconds requests waited on the draft alone")
        self.verify_wait_s = counter("specd_verify_wait_seconds", "seconds requests had a verification in flight")
        self.draft_length = histogram("specd_draft_length_tokens", "draft tokens per verification", TOKEN_BUCKETS)
        self.accepted_length = histogram("specd_accepted_length_tokens", "accepted tokens per verification",
                                         TOKEN_BUCKETS)
        self.duration = histogram("specd_request_duration_seconds", "end-to-end request latency",
                                  LATENCY_BUCKETS)
        self.ttft = histogram("specd_time_to_first_token_seconds", "time to the first emitted token",
                              LATENCY_BUCKETS)
        self.itl = histogram("specd_inter_token_latency_seconds", "seconds per output token after the first",
                             STEP_BUCKETS)
        self.policy_state = Gauge("specd_policy_state", "adaptive policy state after the latest request",
                                  [*LABELS, "task_tag", "key"], registry=registry)
        self._task_tags: set[str] = set()

    # -- one request ------------------------------------------------------------------------
    @staticmethod
    def labels(model: str, policy: str, drafter: str | None) -> tuple[str, str, str]:
        if policy != NO_SPECULATION and policy not in POLICIES:
            policy = "invalid"  # never a caller's string as a label
        return model, policy, drafter if drafter and policy != NO_SPECULATION else "none"

    async def metered(self, events: AsyncIterator[Event], request: GenerateRequest, model: str,
                      drafter: str | None) -> AsyncIterator[Event]:
        """Pass events through, timing the request and recording its statistics at the end.
        Closing this iterator closes `events` (the backend frees its sessions at once)."""
        labels = self.labels(model, request.spec.policy, drafter)
        start = last = time.perf_counter()
        first_token = True
        status = "cancelled"  # unless the request finishes or fails
        self.active += 1
        try:
            async for event in events:
                now = time.perf_counter()
                if isinstance(event, TokenEvent) and event.token_ids:
                    if first_token:
                        self.ttft.labels(*labels).observe(now - start)
                        first_token = False
                    else:
                        per_token = (now - last) / len(event.token_ids)
                        itl = self.itl.labels(*labels)
                        for _ in event.token_ids:
                            itl.observe(per_token)
                    last = now
                elif isinstance(event, FinishEvent):
                    status = "ok"
                    self._record(labels, event.spec_stats, now - start)
                yield event
        except InvalidRequest:
            status = "invalid_argument"
            raise
        except Unavailable:
            status = "unavailable"
            raise
        except Exception:
            status = "error"
            raise
        finally:
            self.active -= 1
            self.requests.labels(*labels, status).inc()
            await events.aclose()

    def _record(self, labels: tuple[str, str, str], s: dict, seconds: float) -> None:
        self.duration.labels(*labels).observe(seconds)
        self.generation_s.labels(*labels).inc(seconds)
        emitted = s.get("new_tokens", 0)
        self.emitted.labels(*labels).inc(emitted)
        self.drafted.labels(*labels).inc(s.get("drafted", 0))
        self.accepted.labels(*labels).inc(s.get("accepted", 0))
        self.verifications.labels(*labels).inc(s.get("verifications", 0))
        # Every reason's series exists from the first request on, so that a ratio reads 0, not "no data".
        kind = s.get("fallback_kind") if s.get("fallback") else None
        for reason in FALLBACK_KINDS:
            self.fallbacks.labels(*labels, reason).inc(1 if reason == kind else 0)
        self.draft_wait_s.labels(*labels).inc(s.get("draft_wait_s", 0.0))
        self.verify_wait_s.labels(*labels).inc(s.get("verify_wait_s", 0.0))
        decode_s = s.get("target_only_s_per_token") or s.get("target_decode_s_per_token")
        if decode_s:
            self.target_only_s.labels(*labels).inc(s.get("target_prefill_s", 0.0) + emitted * decode_s)
        draft_length, accepted_length = self.draft_length.labels(*labels), self.accepted_length.labels(*labels)
        drafted_at: dict[str, int] = {}
        accepted_at: dict[str, int] = {}
        for k, n in zip(s.get("draft_lengths", ()), s.get("accepted_lengths", ())):
            draft_length.observe(k)
            accepted_length.observe(n)
            for i in range(1, k + 1):
                pos = count_label(i, MAX_LABELLED_POSITION)
                drafted_at[pos] = drafted_at.get(pos, 0) + 1
                if i <= n:
                    accepted_at[pos] = accepted_at.get(pos, 0) + 1
        for pos, count in drafted_at.items():
            self.drafted_at.labels(*labels, pos).inc(count)
            self.accepted_at.labels(*labels, pos).inc(accepted_at.get(pos, 0))

    def record_policy_state(self, labels: tuple[str, str, str], task_tag: str, state: dict[str, float]) -> None:
        task_tag = tag_label(task_tag)
        if task_tag not in self._task_tags:
            if len(self._task_tags) >= MAX_TASK_TAGS:
                task_tag = "other"
            else:
                self._task_tags.add(task_tag)
        for key, value in state.items():
            self.policy_state.labels(*labels, task_tag, key).set(value)
