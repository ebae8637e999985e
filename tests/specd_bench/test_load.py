"""bench-load's arithmetic (percentiles, TPOT and goodput as vLLM's serving benchmark defines them),
and how it warms and orders the modes."""

from __future__ import annotations

import argparse

from specd_bench import load as bench_load


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"slo_ttft_ms": None, "slo_tpot_ms": None, **kw})


def test_percentiles_and_goodput():
    assert bench_load.percentiles([0.1, 0.2, 0.3, 0.4]) == {"p50": 300.0, "p95": 400.0, "p99": 400.0}
    ok = bench_load.Result(0, "none", "c1", 0, 0.0, status=200, ttft=0.1, e2e=1.1, tokens=11)
    slow = bench_load.Result(1, "none", "c1", 0, 0.0, status=200, ttft=0.9, e2e=1.9, tokens=11)
    refused = bench_load.Result(2, "none", "c1", 0, 0.0, status=503, retry_after=True)
    s = bench_load.summarize([ok, slow, refused], 2.0, _args(slo_ttft_ms=500.0, slo_tpot_ms=None))
    assert (s["completed"], s["refused"], s["refused_with_retry_after"], s["errors"]) == (2, 1, 1, 0)
    assert s["output_tok_s"] == 11.0 and s["goodput_rps"] == 0.5
    assert s["tpot_ms"]["p50"] == 100.0


def test_the_long_prompt_is_reported_apart_and_refusals_with_their_latency():
    client = bench_load.Result(0, "none", "c1", 0, 0.0, status=200, ttft=0.2, e2e=1.2, tokens=11)
    long = bench_load.Result(bench_load.LONG_PROMPT, "none", "c1", 0, 0.0, status=200, ttft=3.0, e2e=4.0,
                             tokens=11, long=True, prompt_tokens=3990)
    refused = bench_load.Result(2, "none", "c1", 0, 0.0, status=503, retry_after=True, e2e=0.004)
    s = bench_load.summarize([client, long, refused], 2.0, _args())
    assert (s["completed"], s["output_tokens"], s["ttft_ms"]["p95"]) == (1, 11, 200.0)  # the long one apart
    assert (s["long_ttft_ms"], s["long_prompt_tokens"]) == (3000.0, 3990)
    assert s["refused_ms"]["p95"] == 4.0
    messages = bench_load.long_messages(["What is a cache?", "Why?"], 100)
    assert len(messages[0]["content"]) == 400 and "What is a cache?" in messages[0]["content"]


def test_the_report_states_the_targets_cost_surface():
    costs = {"verify_s": [0.030 + 0.001 * n for n in range(17)], "batch_s": [0.030, 0.033, 0.040, 0.052],
             "batch_token_s": [0.002] * 4}
    line = bench_load._surface_line(costs)
    assert "a 1-token forward of one session 30.0 ms" in line and "a 9-token forward of one session 38.0 ms" in line
    assert "4 sessions x 1 token 52.0 ms (1.73x)" in line and "8 sessions" not in line


def test_the_stack_it_starts_is_planned_as_specd_up_plans_one():
    """bench-load's own stack goes through `specd up`'s plan (it once lacked an argument the
    plan reads, `branches`, and every bench-load without --url failed before starting)."""
    from services.cli import _plan

    args = argparse.Namespace(drafter="retrieval", target_model="embedded", no_overlap=False)
    plan = _plan(bench_load.stack_args(args, 8123))
    assert [name for name, _, _ in plan] == ["target", "draft", "coordinator", "gateway"]
    assert plan[-1][2] == 8123


def test_the_machine_line_names_the_gpus_where_there_are_any(monkeypatch):
    """Numbers measured on a GPU name it: an H200 run's report once named only the host's CPU."""
    import torch

    from specd_bench.load import _machine

    assert "GPU" not in _machine() or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: "NVIDIA H200")
    assert _machine().endswith("CPUs; GPUs: NVIDIA H200")


def test_a_request_says_the_sampling_asked_for_and_nothing_it_was_not():
    messages = [{"role": "user", "content": "Hi"}]
    plain = bench_load.request_body("none", messages, _args(model="m", max_tokens=8, temperature=0.0, seed=None,
                                                          top_p=1.0))
    assert "top_p" not in plain and "seed" not in plain and plain["speculative"] == {"enabled": False}
    nucleus = bench_load.request_body("cost-aware", messages, _args(model="m", max_tokens=8, temperature=0.7,
                                                                    seed=3, top_p=0.95))
    assert (nucleus["temperature"], nucleus["top_p"], nucleus["seed"]) == (0.7, 0.95, 3)
    assert nucleus["speculative"] == {"policy": "cost-aware"}
    doc = {"settings": {"limit": 4, "dataset": "x.jsonl", "max_tokens": 8, "temperature": 0.7, "top_p": 0.95},
           "machine": "m", "server": "s", "summary": {}, "compare": {}, "requests": {}}
    assert bench_load.report(doc).splitlines()[0].endswith("8 tokens, T = 0.7, top-p 0.95")


def test_the_modes_take_turns_abba_so_that_no_mode_always_runs_first():
    assert [bench_load.mode_order(["none", "cost-aware"], r) for r in range(4)] == [
        ["none", "cost-aware"], ["cost-aware", "none"], ["none", "cost-aware"], ["cost-aware", "none"]]
    firsts = [bench_load.mode_order(["none", "cost-aware"], r)[0] for r in range(2)]
    assert sorted(firsts) == ["cost-aware", "none"]  # over two repeats each mode runs first once
    modes = ["none", "heuristic", "cost-aware"]
    pair = [bench_load.mode_order(modes, r) for r in (0, 1)]
    assert pair == [modes, modes[::-1]]
    places = {m: sum(order.index(m) for order in pair) for m in modes}
    assert places == dict.fromkeys(modes, 2)  # each mode's places sum alike: a linear drift cancels
    assert modes == ["none", "heuristic", "cost-aware"]  # the caller's list is left as it was


def test_two_repeats_by_default():
    parser = argparse.ArgumentParser()
    bench_load.add_command(parser.add_subparsers())
    assert parser.parse_args(["bench-load"]).repeats == 2


def test_every_mode_is_warmed_with_its_own_request_before_any_is_measured(monkeypatch, capsys):
    """run() against a stand-in for the server: one short warm-up per mode, carrying that mode's
    speculative setting, then the measured cells in ABBA order."""
    import asyncio

    calls = []

    async def answer(client, url, body, result, t0):
        calls.append((result.level, result.mode, body.get("speculative"), body["max_tokens"]))
        result.status, result.ttft, result.e2e, result.tokens, result.text = 200, 0.01, 0.02, 2, "ok"
        return result

    monkeypatch.setattr(bench_load, "one_request", answer)
    args = argparse.Namespace(model="m", max_tokens=16, temperature=0.0, top_p=1.0, seed=None,
                              concurrency="1", rates="", repeats=2, slo_ttft_ms=None, slo_tpot_ms=None, timeout=5.0,
                              long_prompt_tokens=0, duration=0.0)
    bodies = [{"messages": [{"role": "user", "content": q}]} for q in ("a?", "b?")]
    modes = ["none", "heuristic", "cost-aware"]
    doc = asyncio.run(bench_load.run(args, "http://127.0.0.1:1", bodies, modes))
    warm, measured = calls[:3], calls[3:]
    assert warm == [("warm-up", "none", {"enabled": False}, bench_load.WARM_UP_TOKENS),
                    ("warm-up", "heuristic", {"policy": "heuristic"}, bench_load.WARM_UP_TOKENS),
                    ("warm-up", "cost-aware", {"policy": "cost-aware"}, bench_load.WARM_UP_TOKENS)]
    assert all(level == "c1" and n == 16 for level, _, _, n in measured)
    assert [mode for _, mode, _, _ in measured[::2]] == modes + modes[::-1]  # two prompts a cell
    assert sorted(doc["warm_up"]) == sorted(modes)
    assert all(w["status"] == 200 for w in doc["warm_up"].values())
    assert [len(doc["summary"]["c1"][m]) for m in modes] == [2, 2, 2]
    out = capsys.readouterr().out
    assert [line.split(":")[0] for line in out.splitlines() if line.startswith("warm-up")] == [
        f"warm-up {m}" for m in modes]


def test_a_logprobs_mode_asks_for_them_and_is_compared_with_its_plain_mode():
    args = _args(model="m", max_tokens=8, temperature=0.0, seed=None, top_p=1.0, top_logprobs=5)
    body = bench_load.request_body("cost-aware+logprobs", [{"role": "user", "content": "Hi"}], args)
    assert body["speculative"] == {"policy": "cost-aware"} and (body["logprobs"], body["top_logprobs"]) == (True, 5)
    assert "logprobs" not in bench_load.request_body("cost-aware", [], args)

    def result(prompt, mode, repeat, e2e):
        return bench_load.Result(prompt, mode, "c1", repeat, 0.0, status=200, e2e=e2e, text=f"t{prompt}")

    cells = {"c1": {  # repeat 1 ran slower for every mode: pairs are made within a repeat
        "none": [result(0, "none", 0, 2.0), result(0, "none", 1, 4.0)],
        "cost-aware": [result(0, "cost-aware", 0, 1.0), result(0, "cost-aware", 1, 2.0)],
        "cost-aware+logprobs": [result(0, "cost-aware+logprobs", 0, 1.25), result(0, "cost-aware+logprobs", 1, 2.5)]}}
    cmp = bench_load.compare(cells, greedy=True)["c1"]
    assert cmp["cost-aware"] == {"speedup_median": 2.0, "identical_to_none": "2/2"}
    assert cmp["cost-aware+logprobs"]["speedup_vs_cost-aware"] == 0.8
    doc = {"settings": {"limit": 1, "dataset": "x.jsonl", "max_tokens": 8, "temperature": 0.0},
           "machine": "m", "server": "s", "summary": {}, "compare": {"c1": cmp}, "requests": {}}
    assert "c1 cost-aware+logprobs vs cost-aware: 0.8x" in bench_load.report(doc)


def test_a_request_is_stored_to_the_microsecond_and_its_gaps_to_a_tenth_of_a_millisecond():
    from specd_bench.load import Result, stored

    r = Result(prompt=3, mode="none", level="c8", repeat=1, start=0.0015585800000508243, ttft=0.6151226569999153,
               e2e=6.937562084999968, tokens=2, chunk_gaps=[0.5096626510000988, 0.07632459199999175])
    out = stored(r)
    assert (out["start"], out["ttft"], out["e2e"]) == (0.001559, 0.615123, 6.937562)
    assert out["chunk_gaps"] == [0.5097, 0.0763] and out["prompt"] == 3 and out["tokens"] == 2


def test_results_json_reads_back_as_written_with_a_line_per_request():
    import json

    from specd_bench.load import results_text

    doc = {"summary": {"c1": {"none": 1.5}}, "requests": {"c1": {"none": [{"prompt": 0, "chunk_gaps": [0.1]},
                                                                      {"prompt": 1, "chunk_gaps": []}],
                                                             "cost-aware": []}, "c8": {"none": []}}}
    text = results_text(doc)
    assert json.loads(text) == doc
    assert '   {"prompt": 1, "chunk_gaps": []}' in text.splitlines()
    assert json.loads(results_text({"summary": {}})) == {"summary": {}}


def test_the_targets_start_up_is_read_from_its_log():
    from specd_bench.load import startup_lines

    log = "\n".join([
        "2026-12-03 14:07:35,906 specd.runtime.aot WARNING compiling the CPU forward ahead of time, once per model",
        "2026-12-03 14:09:02,001 services.target.main INFO target embedded (llama) on specd's runtime: KV pool of "
        "16 slots x 4608 positions, 0.53 GiB",
        "2026-12-03 14:09:40,100 services.target.main INFO 269 CUDA graphs captured in 31.5 s",
        "2026-12-03 14:09:41,000 services.target.main INFO target service (embedded) listening on 127.0.0.1:1"])
    assert startup_lines(log) == ["target embedded (llama) on specd's runtime: KV pool of 16 slots x 4608 positions, "
                                  "0.53 GiB", "269 CUDA graphs captured in 31.5 s"]


def test_a_cells_forwards_are_the_difference_of_two_scrapes_and_the_fit_as_it_ends():
    from specd_bench.load import TARGET_SAMPLES, target_stats

    before = dict.fromkeys(TARGET_SAMPLES, 0.0) | {"load_fit_base": 1.0, "load_fit_token": 1.0}
    after = before | {"specd_verify_batch_size_count": 10.0, "specd_verify_batch_size_sum": 40.0,
                      "specd_target_forward_tokens_sum": 60.0, "specd_verify_seconds_sum": 0.5,
                      "specd_verify_seconds_count": 10.0, "specd_target_run_steps_sum": 40.0,
                      "load_fit_base": 0.91, "load_fit_token": 1.2437}
    t = target_stats(before, after, 2.0)
    assert (t["forwards_per_s"], t["sessions_per_forward"], t["tokens_per_forward"], t["forward_ms"]) == (5.0, 4.0,
                                                                                                          6.0, 50.0)
    assert t["fit"] == [0.91, 1.244] and t["multi_step_share"] == 1.0
    older = {k: v for k, v in after.items() if not k.startswith("load_fit")}  # a target without the gauge
    assert target_stats(before, older, 2.0)["fit"] is None
