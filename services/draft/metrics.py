"""Prometheus series of the draft service (exported on its metrics port), labelled by
`drafter` (the drafter's name, e.g. "ngram" or "early-exit-4"):

  specd_draft_step_seconds                histogram: seconds to draft one token (one forward pass
                                          of the draft model; a lookup for ngram)
  specd_draft_batch_size                  histogram: sessions per draft forward (model drafters over
                                          a KV pool draft concurrent sessions' steps together)
  specd_draft_tokens_total{policy}        every token drafted, verified or not (PEARL drafts ahead,
                                          so some are discarded unverified)
  specd_draft_windows_total{policy, reason}
                                          windows ended, by why: policy (the stopping policy said
                                          stop), cap (max_draft_tokens), no_proposal, length
  specd_active_sessions{service="draft"}, specd_kv_cache_bytes{service="draft"}
  specd_dvi_records_total{outcome}        online learning (DVI): judged draft positions logged to
                                          the replay stream, or dropped (Redis slow or down)
  specd_dvi_adapter_version               the online-learned adapter version in use (0: none)
  specd_dvi_adapter_swaps_total           adapters hot-swapped into the drafter

PromQL: draft tokens per second, and the share of windows the policy ended itself
  sum(rate(specd_draft_tokens_total[5m]))
  sum(rate(specd_draft_windows_total{reason="policy"}[5m])) / sum(rate(specd_draft_windows_total[5m]))
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from services.common.metrics import BATCH_BUCKETS, STEP_BUCKETS, active_sessions, kv_cache_bytes


class DraftMetrics:
    def __init__(self, registry: CollectorRegistry, drafter: str, sessions: Callable[[], int] = lambda: 0,
                 kv_bytes: Callable[[], int] = lambda: 0):
        self.registry, self.drafter = registry, drafter
        active_sessions(registry, "draft", sessions)
        kv_cache_bytes(registry, "draft", kv_bytes)
        self.step_s = Histogram("specd_draft_step_seconds", "seconds to draft one token", ["drafter"],
                                buckets=STEP_BUCKETS, registry=registry).labels(drafter)
        self.batch_size = Histogram("specd_draft_batch_size", "sessions per draft forward", ["drafter"],
                                    buckets=BATCH_BUCKETS, registry=registry).labels(drafter)
        self.tokens = Counter("specd_draft_tokens", "tokens drafted, verified or not", ["drafter", "policy"],
                              registry=registry)
        self.windows = Counter("specd_draft_windows", "draft windows ended, by reason",
                               ["drafter", "policy", "reason"], registry=registry)
        records = Counter("specd_dvi_records", "judged draft positions for online learning, by outcome",
                          ["drafter", "outcome"], registry=registry)
        # Exported at 0 from the start (also without --dvi), so the dashboard's panel has series.
        self.dvi_logged, self.dvi_dropped = records.labels(drafter, "logged"), records.labels(drafter, "dropped")
        self.adapter_version = Gauge("specd_dvi_adapter_version", "online-learned adapter version in use",
                                     ["drafter"], registry=registry).labels(drafter)
        self.adapter_swaps = Counter("specd_dvi_adapter_swaps", "adapters hot-swapped into the drafter",
                                     ["drafter"], registry=registry).labels(drafter)
