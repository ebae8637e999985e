"""The four real service processes (`specd serve target|draft|coordinator|gateway`) on
loopback, driven over HTTP like a user would: greedy answers through gateway -> coordinator
-> draft/target equal the embedded model's own target-only decoding, every process exports
its Prometheus series with consistent values, a draft service killed mid-stream falls back
to the target without changing the answer (and is used again once restarted on the same
port), the openai SDK parses the gateway's stream, and with an early-exit draft eight
concurrent streams share draft forwards and still answer as the target alone. The stack itself
is tests/integration/conftest.py's."""

from __future__ import annotations

import json
import os
import signal
import time

import asyncio

import httpx
import pytest

from specd_bench import load as bench_load
from services.coordinator.metrics import tag_label
from tests.integration.conftest import HTTP_TIMEOUT_S, MAX_TOKENS, MESSAGES, Stack

TAG = "metrics-test"

pytestmark = pytest.mark.embedded


def _chat(stack: Stack, max_tokens: int, **speculative) -> dict:
    body = {"model": "specd", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0}
    if speculative:
        body["speculative"] = speculative
    reply = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _fail_with_logs(stack: Stack, message: str) -> None:
    logs = "\n".join(f"--- {n} ---\n{stack.tail(n, 1500)}" for n in ("coordinator", "draft", "gateway"))
    pytest.fail(f"{message}\n{logs}", pytrace=False)


# -- 1. lossless through the real processes ---------------------------------------------------

def test_greedy_through_the_stack_equals_target_only_decoding(stack, reference):
    n = 32
    want_ids, want_text = reference(n)
    assert want_text.strip()
    for policy in ("heuristic", "constant"):
        for overlap in (True, False):
            doc = _chat(stack, n, policy=policy, overlap=overlap)
            stats, case = doc["spec_stats"], f"policy {policy}, overlap {overlap}"
            if stats["fallback"]:
                _fail_with_logs(stack, f"{case}: fell back to the target alone: {stats['fallback_reason']}")
            assert doc["choices"][0]["message"]["content"] == want_text, case
            assert stats["overlap"] is overlap, case
            assert stats["policy"] == policy, case
            assert stats["drafter"].startswith("ngram"), case
            assert doc["usage"]["completion_tokens"] == len(want_ids) == stats["new_tokens"], case
            assert doc["choices"][0]["finish_reason"] == ("length" if len(want_ids) == n else "stop"), case
            assert 1 <= stats["verifications"] <= len(want_ids), case
            assert 0 <= stats["accepted"] <= stats["drafted"], case
            if doc["choices"][0]["finish_reason"] == "length":  # (an EOS may cut an accepted run short)
                assert stats["verifications"] + stats["accepted"] == len(want_ids), case  # each: accepted + 1

    plain = _chat(stack, n, enabled=False)
    assert plain["choices"][0]["message"]["content"] == want_text
    assert plain["spec_stats"]["policy"] == "none"
    assert plain["spec_stats"]["drafted"] == 0
    assert plain["spec_stats"]["verifications"] == len(want_ids)


# -- 2. every process exports its Prometheus series ---------------------------------------------

def scrape(url: str) -> dict[str, list]:
    """name -> samples of one /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    reply = httpx.get(url, timeout=10)
    assert reply.status_code == 200, url
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def value(samples: dict[str, list], name: str, **labels) -> float:
    assert name in samples, f"{name} is not exported"
    return sum(s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items()))


def test_every_process_exports_consistent_metrics(stack):
    for policy in ("heuristic", "constant"):
        _chat(stack, 24, policy=policy, task_tag=TAG)
    _chat(stack, 8, enabled=False)
    coord, draft = scrape(stack.metrics_url("coordinator")), scrape(stack.metrics_url("draft"))
    target, gateway = scrape(stack.metrics_url("target")), scrape(stack.metrics_url("gateway"))

    for policy in ("heuristic", "constant"):
        drafted = value(coord, "specd_drafted_tokens_total", policy=policy)
        accepted = value(coord, "specd_accepted_tokens_total", policy=policy)
        verifications = value(coord, "specd_verifications_total", policy=policy)
        emitted = value(coord, "specd_emitted_tokens_total", policy=policy)
        assert 0 <= accepted <= drafted, policy
        assert verifications > 0 and emitted <= accepted + verifications, policy  # an EOS may cut a run
        assert value(coord, "specd_accepted_tokens_by_position_total", policy=policy) == accepted, policy
        assert value(coord, "specd_drafted_tokens_by_position_total", policy=policy) == drafted, policy
        assert value(coord, "specd_draft_length_tokens_sum", policy=policy) == drafted, policy
        assert value(coord, "specd_accepted_length_tokens_count", policy=policy) > 0, policy
        assert value(coord, "specd_requests_total", policy=policy, status="ok") >= 1, policy
        assert value(coord, "specd_fallbacks_total", policy=policy) == 0, policy
        assert value(coord, "specd_time_to_first_token_seconds_count", policy=policy) >= 1, policy
        assert value(coord, "specd_target_only_seconds_total", policy=policy) > 0, policy
        assert value(coord, "specd_generation_seconds_total", policy=policy) > 0, policy
    assert value(coord, "specd_verifications_total", policy="none") == value(coord, "specd_emitted_tokens_total",
                                                                             policy="none")
    assert value(coord, "specd_inter_token_latency_seconds_count") > 0
    assert value(coord, "specd_request_duration_seconds_count") >= 3
    assert value(coord, "specd_policy_state", policy="heuristic", task_tag=tag_label(TAG), key="k") >= 1
    assert value(coord, "specd_grpc_requests_total", service="coordinator", method="Generate", code="OK") >= 3

    assert value(draft, "specd_draft_tokens_total") >= value(coord, "specd_drafted_tokens_total")
    assert value(draft, "specd_draft_step_seconds_count") >= value(draft, "specd_draft_tokens_total")
    assert value(draft, "specd_draft_windows_total") > 0
    assert value(target, "specd_verify_seconds_count") >= value(coord, "specd_verifications_total")
    assert 0 < value(target, "specd_target_decode_seconds_per_token") < 10
    assert value(target, "specd_verify_batch_size_count") > 0
    assert value(target, "specd_verify_last_batch_size") >= 1
    for samples, service in ((draft, "draft"), (target, "target"), (coord, "coordinator")):
        assert value(samples, "specd_active_sessions", service=service) == 0, service
        assert value(samples, "process_resident_memory_bytes") > 0, service
    assert value(target, "specd_kv_cache_bytes", service="target") == 0
    assert value(gateway, "specd_gateway_requests_total", route="/v1/chat/completions", status="200") >= 3
    assert value(gateway, "specd_gateway_request_duration_seconds_count", route="/v1/chat/completions") >= 3


# -- 3. the draft service dies mid-stream -----------------------------------------------------

def _stream_killing_draft(stack: Stack, max_tokens: int) -> tuple[str, dict | None, bool]:
    """Stream one greedy answer, SIGKILLing the draft after the first content chunk:
    (text, spec_stats of the final chunk before [DONE], whether [DONE] arrived)."""
    body = {"model": "specd", "messages": MESSAGES, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "speculative": {"policy": "heuristic"}}
    parts, last, done, killed = [], {}, False, False
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S) as reply:
        assert reply.status_code == 200, reply.read().decode()
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                content = choice["delta"].get("content")
                if content:
                    parts.append(content)
                    if not killed:
                        os.kill(stack.draft.pid, signal.SIGKILL)
                        stack.draft.wait(10)
                        killed = True
            last = chunk
    assert killed, "no content chunk arrived"
    return "".join(parts), last.get("spec_stats"), done


def test_draft_killed_mid_stream_falls_back_then_is_used_again(stack, reference):
    n = MAX_TOKENS
    want_ids, want_text = reference(n)
    text, stats, done = _stream_killing_draft(stack, n)
    assert done, "the stream did not end with [DONE]"
    assert stats is not None, "the final chunk carried no spec_stats"
    assert text == want_text
    assert stats["new_tokens"] == len(want_ids)
    if not stats["fallback"]:
        _fail_with_logs(stack, f"the draft was killed mid-stream but spec_stats says no fallback: {stats}")
    assert stats["fallback_reason"], stats
    assert stats["fallback_kind"] == "failed", stats
    assert "draft" in stats["fallback_reason"].lower(), stats["fallback_reason"]

    # While the draft is down, requests are still answered by the target alone.
    down = _chat(stack, 8, policy="heuristic")
    assert down["spec_stats"]["fallback"] is True
    assert down["choices"][0]["message"]["content"] == reference(8)[1]

    # The same port again: a new request speculates again. The coordinator's channel to the
    # draft may still be in its reconnect backoff (at most 2 s) for the first one or two.
    stack.start("draft")
    stack.wait_healthy("draft", timeout_s=60)
    reasons, deadline = [], time.monotonic() + 15
    while True:
        doc = _chat(stack, 16, policy="heuristic")
        stats = doc["spec_stats"]
        if not stats["fallback"]:
            break
        reasons.append(stats["fallback_reason"])
        if time.monotonic() > deadline:
            _fail_with_logs(stack, f"the restarted draft was not used by {len(reasons)} requests: {reasons}")
        time.sleep(0.5)
    assert doc["choices"][0]["message"]["content"] == reference(16)[1]
    assert stats["drafter"].startswith("ngram")
    assert stack.draft.poll() is None


# -- 4. the openai SDK over the real stream ---------------------------------------------------

def test_openai_sdk_streams_with_spec_stats(stack, reference):
    from openai import OpenAI

    n = 24
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="x", timeout=HTTP_TIMEOUT_S, max_retries=0)
    stream = client.chat.completions.create(
        model="specd", messages=MESSAGES, max_tokens=n, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"speculative": {"policy": "heuristic"}})
    chunks = list(stream)
    assert len(chunks) >= 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference(n)[1]

    # spec_stats comes with the chunk carrying finish_reason; usage with a last chunk of no choices.
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert len(finishing) == 1
    assert finishing[0].choices[0].finish_reason in ("length", "stop")
    stats = (finishing[0].model_extra or {}).get("spec_stats")
    assert isinstance(stats, dict), finishing[0]
    assert stats["policy"] == "heuristic"
    assert stats["fallback"] is False, stats["fallback_reason"]
    assert stats["verifications"] >= 1

    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == len(reference(n)[0]) == stats["new_tokens"]
    assert last.usage.total_tokens == last.usage.prompt_tokens + last.usage.completion_tokens


# -- 5. a model drafter under load (last: it restarts the draft) -------------------------------

def _swap_draft(stack, flags: list[str]) -> None:
    stack.stop("draft")
    stack.flags["draft"] = flags
    stack.start("draft")
    stack.wait_healthy("draft", timeout_s=120)


def _draft_batches(stack) -> tuple[float, float]:
    """(sessions summed over draft forwards, forwards) from the draft's /metrics."""
    values = {}
    for line in httpx.get(stack.metrics_url("draft"), timeout=10).text.splitlines():
        for name in ("specd_draft_batch_size_sum", "specd_draft_batch_size_count"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("specd_draft_batch_size_sum", 0.0), values.get("specd_draft_batch_size_count", 0.0)


def test_eight_streams_with_a_model_drafter_share_draft_forwards_and_answer_as_the_target(stack, reference):
    """The early-exit drafter (PEARL on) with 8 concurrent streams: the draft service drafts their
    steps in shared forwards, and every answer equals the target alone's. Last in this file: it
    restarts the draft (twice), which resets the draft's counters that the metrics test above
    compares with the coordinator's."""
    ngram = list(stack.flags["draft"])
    metrics = ngram[ngram.index("--metrics-port"):ngram.index("--metrics-port") + 2]
    _swap_draft(stack, ["--drafter", "early-exit", "--target-model", "embedded", "--threads", "1", *metrics])
    swapped = stack.log_path("draft")  # this draft's log, which a failure below quotes
    try:
        others = ["Name three uses of a queue.", "What is a prime number?", "Write one sentence about rain."]
        prompts = [MESSAGES] + [[{"role": "user", "content": q}] for q in others]
        bodies = [{"messages": prompts[i % len(prompts)]} for i in range(8)]
        doc = asyncio.run(bench_load.run(_load_args(), stack.url, bodies,
                                         ["none", "constant", "cost-aware"]))
        sessions, forwards = _draft_batches(stack)
    finally:
        _swap_draft(stack, ngram)
    for mode in ("none", "constant", "cost-aware"):
        s = doc["summary"]["c8"][mode][0]
        assert s["completed"] == 8 and s["errors"] == 0 and s["fallbacks"] == 0, \
            f"{s}\n--- the early-exit draft's log ---\n{swapped.read_text(errors='replace')[-3000:]}"
    answers = {r["prompt"]: r["text"] for r in doc["requests"]["c8"]["constant"]}
    assert answers[0] == reference(12)[1]
    for mode in ("constant", "cost-aware"):
        assert doc["compare"]["c8"][mode]["identical_to_none"] == "8/8"
    assert forwards > 0 and sessions > forwards  # some draft forwards carried several sessions


def _load_args():
    import argparse

    return argparse.Namespace(model="specd", max_tokens=12, temperature=0.0, top_p=1.0, seed=None, concurrency="8",
                              rates="", repeats=1, slo_ttft_ms=None, slo_tpot_ms=None, timeout=120.0,
                              long_prompt_tokens=0, duration=0.0)


def test_the_hybrid_drafter_with_draft_trees_answers_as_the_target(stack, reference):
    """`specd serve draft --drafter hybrid`: the early-exit chain with retrieval's proposals beside
    it, verified as draft trees by the target service; greedy answers equal the target alone's.
    (Whether a round is worth a tree depends on the measured cost curve; tests/services/
    coordinator/test_trees.py shows trees and side branches kept on a flat one.)"""
    ngram = list(stack.flags["draft"])
    metrics = ngram[ngram.index("--metrics-port"):ngram.index("--metrics-port") + 2]
    _swap_draft(stack, ["--drafter", "hybrid", "--target-model", "embedded", "--threads", "1", *metrics])
    try:
        n = 32
        for policy in ("constant", "cost-aware"):
            doc = _chat(stack, n, policy=policy)
            stats = doc["spec_stats"]
            if stats["fallback"]:
                _fail_with_logs(stack, f"{policy}: fell back to the target alone: {stats['fallback_reason']}")
            assert doc["choices"][0]["message"]["content"] == reference(n)[1], policy
            assert "+" in stats["drafter"] and not stats["overlap"], stats  # trees run sequentially
            assert stats["tree_rounds"] >= stats["branch_accepted"] >= 0
    finally:
        _swap_draft(stack, ngram)
