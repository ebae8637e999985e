"""Prometheus series of the target service (exported on its metrics port), labelled by
`model`:

  specd_verify_seconds{window}            histogram: forward-pass seconds of a verification (until
                                          its verdicts exist), by its number of draft tokens ("0" is
                                          a plain decoding step; above 16, "17+"); a batched forward
                                          counts for each session
  specd_verify_batch_size                 histogram: sessions per verification forward pass
  specd_verify_last_batch_size            gauge: sessions in the latest forward pass
  specd_target_forward_tokens             histogram: new tokens per verification forward pass (all
                                          its sessions' windows)
  specd_verify_queue_seconds              histogram: seconds a verification waited for its forward
                                          pass (behind the running one, and gathering its batch)
  specd_verify_queue_depth                gauge: verifications waiting for a forward pass
  specd_verify_gather_seconds             histogram: seconds a forward pass waited for the sessions
                                          the previous one answered to come back (--batch-gather)
  specd_verify_gather_missed_total        counter: sessions the previous forward answered that were
                                          not back when the next one started
  specd_verify_next_steps_seconds         histogram: seconds between forward passes spent queueing
                                          the multi-step runs' next steps, with the target's own drafting
                                          for its sessions (--drafter): on the path from one forward
                                          to the next
  specd_target_prefill_chunks_total       counter: prompt chunks prefilled (prefill_chunk tokens each)
  specd_target_prefill_shared_tokens_total counter: prompt positions copied from another session of the
                                          same tenant with the same prompt prefix (n choices, a shared
                                          system prompt) instead of prefilled
  specd_target_decode_seconds_per_token   gauge: the measured cost of one plain decoding step (one
                                          session, one token), measured at start-up and kept current
                                          while serving; coordinators price target-only decoding
                                          with it (specd_target_only_seconds_total)
  specd_target_kv_slots                   gauge: sessions the KV pool holds (0: no pool)
  specd_target_kv_slots_in_use            gauge: of those, taken by open sessions
  specd_target_refused_sessions_total     counter: sessions refused because every slot was taken
  specd_active_sessions{service="target"}, specd_kv_cache_bytes{service="target"}

PromQL: p95 verify latency by window size
  histogram_quantile(0.95, sum by (le, window) (rate(specd_verify_seconds_bucket[5m])))
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.batcher import Gathered
from services.common.metrics import (
    BATCH_BUCKETS,
    MAX_LABELLED_WINDOW,
    STEP_BUCKETS,
    active_sessions,
    count_label,
    kv_cache_bytes,
)

TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class TargetMetrics:
    def __init__(self, registry: CollectorRegistry, model: str, sessions: Callable[[], int] = lambda: 0,
                 kv_bytes: Callable[[], int] = lambda: 0, decode_cost: Callable[[], float] = lambda: 0.0,
                 kv_slots: Callable[[], tuple[int, int]] = lambda: (0, 0),
                 queue_depth: Callable[[], int] = lambda: 0, token_seconds: Callable[[], float] = lambda: 0.0,
                 load_fit: Callable[[], tuple[float, float]] = lambda: (1.0, 1.0)):
        """kv_slots: (slots in use, slots) of the KV pool; token_seconds: the time per token the open
        sessions see (what a latency budget reads); load_fit: (a, b), what its forwards' base and
        further tokens cost against the start-up surface (specd.costs.LoadFit)."""
        self.registry, self.model = registry, model
        active_sessions(registry, "target", sessions)
        kv_cache_bytes(registry, "target", kv_bytes)
        self.verify_s = Histogram("specd_verify_seconds", "verification forward seconds by draft tokens",
                                  ["model", "window"], buckets=STEP_BUCKETS, registry=registry)
        self.batch_size = Histogram("specd_verify_batch_size", "sessions per verification forward",
                                    ["model"], buckets=BATCH_BUCKETS, registry=registry)
        self.last_batch = Gauge("specd_verify_last_batch_size", "sessions in the latest forward", ["model"],
                                registry=registry)
        cost = Gauge("specd_target_decode_seconds_per_token", "measured seconds of one plain decoding step",
                     ["model"], registry=registry)
        cost.labels(model).set_function(decode_cost)
        slots = Gauge("specd_target_kv_slots", "sessions the KV pool holds (0: no pool)", ["model"], registry=registry)
        slots.labels(model).set_function(lambda: kv_slots()[1])
        in_use = Gauge("specd_target_kv_slots_in_use", "KV pool slots taken by open sessions", ["model"],
                       registry=registry)
        in_use.labels(model).set_function(lambda: kv_slots()[0])
        self.forward_tokens = Histogram("specd_target_forward_tokens", "new tokens per verification forward",
                                        ["model"], buckets=TOKEN_BUCKETS, registry=registry)
        self.queue_s = Histogram("specd_verify_queue_seconds", "seconds a verification waited for its forward",
                                 ["model"], buckets=STEP_BUCKETS, registry=registry)
        self.gather_s = Histogram("specd_verify_gather_seconds", "seconds a forward waited for the last one's "
                                  "sessions", ["model"], buckets=STEP_BUCKETS, registry=registry)
        self.gather_missed = Counter("specd_verify_gather_missed", "sessions of the last forward not back when "
                                     "the next started", ["model"], registry=registry)
        self.gather_missed.labels(self.model)
        self.next_steps_s = Histogram("specd_verify_next_steps_seconds", "seconds between forwards spent on "
                                      "multi-step runs' next steps (the target's own drafting included)", ["model"],
                                      buckets=STEP_BUCKETS, registry=registry)
        depth = Gauge("specd_verify_queue_depth", "verifications waiting for a forward", ["model"],
                      registry=registry)
        depth.labels(model).set_function(queue_depth)
        self.prefill_chunks = Counter("specd_target_prefill_chunks", "prompt chunks prefilled", ["model"],
                                      registry=registry)
        self.prefill_chunks.labels(model)
        self.prefill_shared = Counter("specd_target_prefill_shared_tokens", "prompt positions a session took from "
                                      "another's cache instead of prefilling them", ["model"], registry=registry)
        self.prefill_shared.labels(model)
        per_token = Gauge("specd_target_token_seconds", "seconds between a session's verifications per token "
                          "emitted, moving average (what --latency-budget reads)", ["model"], registry=registry)
        per_token.labels(model).set_function(token_seconds)
        fit = Gauge("specd_target_load_fit", "what the target's forwards cost against its start-up surface: "
                    "term base (a forward of one token a session) and token (each further token), 1 = as measured",
                    ["model", "term"], registry=registry)
        fit.labels(model, "base").set_function(lambda: load_fit()[0])
        fit.labels(model, "token").set_function(lambda: load_fit()[1])
        self.refused = Counter("specd_target_refused_sessions", "sessions refused at once: every KV slot taken, "
                               "or over the latency budget", ["model"], registry=registry)
        self.refused.labels(model)  # a zero series from the start
        self.multi_step = Histogram("specd_target_run_steps", "decoding steps per multi-step run (Verify.steps): "
                                    "target-only decoding without a round trip per token", ["model"],
                                    buckets=TOKEN_BUCKETS, registry=registry)

    def observe_verify(self, num_drafts: int, forward_seconds: float) -> None:
        self.verify_s.labels(self.model, count_label(num_drafts, MAX_LABELLED_WINDOW)).observe(forward_seconds)

    def observe_refused(self) -> None:
        self.refused.labels(self.model).inc()

    def observe_batch(self, batch: Gathered) -> None:
        """One forward: its sessions, their new tokens, how long each waited for it, and how long
        it waited for the last forward's sessions."""
        self.batch_size.labels(self.model).observe(batch.sessions)
        self.last_batch.labels(self.model).set(batch.sessions)
        self.forward_tokens.labels(self.model).observe(batch.tokens)
        for w in batch.waits:
            self.queue_s.labels(self.model).observe(w)
        self.gather_s.labels(self.model).observe(batch.gather_seconds)
        self.gather_missed.labels(self.model).inc(batch.missed)
        self.next_steps_s.labels(self.model).observe(batch.steps_seconds)

    def observe_multi_step(self, steps: int) -> None:
        self.multi_step.labels(self.model).observe(steps)

    def observe_prefill_chunk(self) -> None:
        self.prefill_chunks.labels(self.model).inc()

    def observe_shared_prefill(self, tokens: int) -> None:
        self.prefill_shared.labels(self.model).inc(tokens)
