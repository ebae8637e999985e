"""`specd bench-load` against the real four-process stack (its target on the KV pool): greedy
answers of several concurrent streams, with speculation and without, are the target alone's,
every mode is warmed before any is measured, and the report carries every load level
and mode."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from specd_bench import load as bench_load

from tests.integration.conftest import MESSAGES

pytestmark = pytest.mark.embedded

OTHERS = ["Name three uses of a queue.", "What is a prime number?", "Write one sentence about rain."]


def _args(**kw) -> argparse.Namespace:
    base = dict(model="specd", max_tokens=16, temperature=0.0, top_p=1.0, seed=None, concurrency="1,4", rates="",
                repeats=1, slo_ttft_ms=None, slo_tpot_ms=None, timeout=120.0, long_prompt_tokens=0, duration=0.0)
    return argparse.Namespace(**{**base, **kw})


def test_concurrent_streams_through_the_stack_answer_as_the_target_alone(stack, reference, capsys):
    bodies = [{"messages": MESSAGES}] + [{"messages": [{"role": "user", "content": q}]} for q in OTHERS]
    doc = asyncio.run(bench_load.run(_args(), stack.url, bodies, ["none", "heuristic", "cost-aware"],
                                     target_metrics=stack.metrics_url("target")))
    out = capsys.readouterr().out
    for mode in ("none", "heuristic", "cost-aware"):  # every mode warmed, before any cell is measured
        warm = doc["warm_up"][mode]
        assert warm["status"] == 200 and not warm["error"] and warm["tokens"] > 0
        assert out.index(f"warm-up {mode}: status 200") < out.index("c1 none (repeat 0)")
    for level in ("c1", "c4"):
        for mode in ("none", "heuristic", "cost-aware"):
            s = doc["summary"][level][mode][0]
            assert s["completed"] == 4 and s["errors"] == 0 and s["refused"] == 0
            answers = {r["prompt"]: r["text"] for r in doc["requests"][level][mode]}
            drafted = sum(r["drafted"] for r in doc["requests"][level][mode])
            if mode != "cost-aware":  # which may rightly find, under load, that drafting does not pay
                assert (drafted > 0) is (mode != "none")  # spec_stats reach the records
            assert answers[0] == reference(16)[1]  # the in-process target alone's text
            target = s["target"]  # how the target's forwards went in this cell, from its metrics
            assert target["forwards_per_s"] > 0 and target["forward_ms"] > 0
            assert 1 <= target["sessions_per_forward"] <= int(level[1:])
            assert target["tokens_per_forward"] >= target["sessions_per_forward"]
            assert target["gather_ms"] >= 0 and target["missed_per_forward"] >= 0 and target["next_steps_ms"] >= 0
            if mode == "none":  # target-only answers are multi-step runs after their first step
                assert target["multi_step_share"] > 0.5
            if mode == "heuristic":  # every step verifies drafts
                assert target["multi_step_share"] < 0.5
        for mode in ("heuristic", "cost-aware"):
            assert doc["compare"][level][mode]["identical_to_none"] == "4/4"
    costs = asyncio.run(bench_load.target_costs(stack.address("target")))  # what results.json records
    assert len(costs["verify_s"]) == 17 and len(costs["batch_s"]) == len(costs["batch_token_s"]) >= 2
    assert all(t > 0 for t in costs["verify_s"] + costs["batch_s"])
    report = bench_load.report({**doc, "settings": {"limit": 4, "dataset": "x.jsonl", "max_tokens": 16,
                                                    "temperature": 0.0}, "machine": "m", "server": "s",
                                "target_costs": costs})
    assert report.count("| c4 |") == 6  # the requests' table and the target's forwards
    assert "a 1-token forward of one session" in report and "4 sessions x 1 token" in report
