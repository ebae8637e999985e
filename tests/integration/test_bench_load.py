"""`specd bench-load` against the real four-process stack (its target on the KV pool): greedy
answers of several concurrent streams, with speculation and without, are the target alone's,
and the report carries every load level and mode."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from services import bench_load

from tests.integration.conftest import MESSAGES

pytestmark = pytest.mark.embedded

OTHERS = ["Name three uses of a queue.", "What is a prime number?", "Write one sentence about rain."]


def _args(**kw) -> argparse.Namespace:
    base = dict(model="specd", max_tokens=16, temperature=0.0, seed=None, concurrency="1,4", rates="",
                repeats=1, slo_ttft_ms=None, slo_tpot_ms=None, timeout=120.0, long_prompt_tokens=0, duration=0.0)
    return argparse.Namespace(**{**base, **kw})


def test_concurrent_streams_through_the_stack_answer_as_the_target_alone(stack, reference):
    bodies = [{"messages": MESSAGES}] + [{"messages": [{"role": "user", "content": q}]} for q in OTHERS]
    doc = asyncio.run(bench_load.run(_args(), stack.url, bodies, ["none", "heuristic", "cost-aware"]))
    for level in ("c1", "c4"):
        for mode in ("none", "heuristic", "cost-aware"):
            s = doc["summary"][level][mode][0]
            assert s["completed"] == 4 and s["errors"] == 0 and s["refused"] == 0
            answers = {r["prompt"]: r["text"] for r in doc["requests"][level][mode]}
            assert answers[0] == reference(16)[1]  # the in-process target alone's text
        for mode in ("heuristic", "cost-aware"):
            assert doc["compare"][level][mode]["identical_to_none"] == "4/4"
    report = bench_load.report({**doc, "settings": {"limit": 4, "dataset": "x.jsonl", "max_tokens": 16,
                                                    "temperature": 0.0}, "machine": "m", "server": "s"})
    assert report.count("| c4 |") == 3


def _swap_draft(stack, flags: list[str]) -> None:
    stack.stop("draft")
    stack.flags["draft"] = flags
    stack.start("draft")
    stack.wait_healthy("draft", timeout_s=120)


def _draft_batches(stack) -> tuple[float, float]:
    """(sessions summed over draft forwards, forwards) from the draft's /metrics."""
    import httpx

    values = {}
    for line in httpx.get(stack.metrics_url("draft"), timeout=10).text.splitlines():
        for name in ("specd_draft_batch_size_sum", "specd_draft_batch_size_count"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values.get("specd_draft_batch_size_sum", 0.0), values.get("specd_draft_batch_size_count", 0.0)


def test_eight_streams_with_a_model_drafter_share_draft_forwards_and_answer_as_the_target(stack, reference):
    """The early-exit drafter (PEARL on) with 8 concurrent streams: the draft service drafts their
    steps in shared forwards, and every answer equals the target alone's."""
    ngram = list(stack.flags["draft"])
    metrics = ngram[ngram.index("--metrics-port"):ngram.index("--metrics-port") + 2]
    _swap_draft(stack, ["--drafter", "early-exit", "--target-model", "embedded", "--threads", "1", *metrics])
    try:
        prompts = [MESSAGES] + [[{"role": "user", "content": q}] for q in OTHERS]
        bodies = [{"messages": prompts[i % len(prompts)]} for i in range(8)]
        doc = asyncio.run(bench_load.run(_args(concurrency="8", max_tokens=12), stack.url, bodies,
                                         ["none", "constant", "cost-aware"]))
        sessions, forwards = _draft_batches(stack)
    finally:
        _swap_draft(stack, ngram)
    for mode in ("none", "constant", "cost-aware"):
        s = doc["summary"]["c8"][mode][0]
        assert s["completed"] == 8 and s["errors"] == 0 and s["fallbacks"] == 0, s
    answers = {r["prompt"]: r["text"] for r in doc["requests"]["c8"]["constant"]}
    assert answers[0] == reference(12)[1]
    for mode in ("constant", "cost-aware"):
        assert doc["compare"]["c8"][mode]["identical_to_none"] == "8/8"
    assert forwards > 0 and sessions > forwards  # some draft forwards carried several sessions
