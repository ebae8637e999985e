"""`specd bench` end to end on the tiny random pair: output files and their shape, and one-line
errors naming a bad dataset line or an unknown name. No timing thresholds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


PROMPTS = ["hello there", "count to five", "the cat sat on the mat, the cat"]


@pytest.fixture
def dataset(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "turns": [p, "again"]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


def bench_args(tiny_dirs, dataset, out, *extra):
    target, draft = map(str, tiny_dirs)
    return ["bench", "--dataset", str(dataset), "--target-model", target, "--drafter", "hf",
            "--draft-model", draft, "--max-new-tokens", "8", "--out", str(out), *extra]


def test_bench_smoke(tiny_dirs, dataset, tmp_path, specd_cli):
    out = tmp_path / "out"
    code, stdout, err = specd_cli(bench_args(tiny_dirs, dataset, out, "--policies", "constant,heuristic,svip",
                                       "--baselines", "ar,hf-ar,hf-prompt-lookup,hf-assisted", "--json"))
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert json.loads(stdout) == doc
    assert {"machine", "command", "settings", "configs", "records", "aggregates", "oracle", "contention"} <= set(doc)
    assert {"cpu", "cores", "torch_threads", "device", "dtype", "torch", "transformers", "linear_kernels",
            "forward", "commit", "cpu_flags"} <= set(doc["machine"])
    assert doc["machine"]["forward"] == "lean"
    labels = ["ar", "hf/constant", "hf/heuristic", "hf/svip", "hf-ar", "hf-prompt-lookup", "hf-assisted"]
    assert list(doc["aggregates"]) == labels
    for label in labels:
        records = doc["records"][label]
        assert [r["prompt"] for r in records] == [f"{i}#t1" for i in range(3)]
        assert all({"foreign_share", "foreign_cpu_s"} <= set(r) for r in records)  # specd_bench.contention
    # transformers' own target-alone decoding says the same as specd's lean forward
    assert doc["aggregates"]["hf-ar"]["identical"] is True
    for label in ("hf/constant", "hf/heuristic", "hf/svip"):
        agg = doc["aggregates"][label]
        assert agg["identical"] is True  # greedy speculative output equals the target alone
        assert agg["speedup"]["min"] <= agg["speedup"]["median"] <= agg["speedup"]["max"]
        assert agg["mean_accepted_tokens"] >= 1.0 and agg["oracle_fraction"] > 0
        for r in doc["records"][label]:
            assert r["new_tokens"] == sum(r["accepted_lengths"]) + r["verifications"]
    assert doc["policy_cost_curves"] == {}  # no policy here decides on the cost curve
    bound = doc["oracle"]["drafters"]["hf"]
    assert len(bound["per_prompt"]) == 3 and len(bound["cost_curve"]["t_target_s"]) == 16
    for rec, base in zip(bound["per_prompt"], doc["records"]["ar"]):
        assert rec["new_tokens"] == base["new_tokens"]
        assert rec["verifications"] <= rec["disagreements"] + 1
        assert rec["ar_step_s"] > 0 and rec["time_at_ar_step_s"] > 0  # the bound at ar's own cost
    assert bound["tokens_per_s_at_ar_step"] > 0 and doc["aggregates"]["hf/svip"]["oracle_fraction_at_ar_step"] > 0
    report = (out / "report.md").read_text()
    assert "| hf/svip |" in report and "% of oracle" in report and "Machine contention" in report
    assert "at `ar`'s own cost" in report
    assert doc["contention"]["measured"] == Path("/proc/stat").exists()
    for png in ("speedup.png", "draft_lengths.png", "accepted_lengths.png", "entropy.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_the_curve_cost_aware_decided_on_is_recorded(tiny_dirs, dataset, tmp_path, specd_cli):
    """results.json keeps the policies' cost curve as measured at start-up and as the rounds
    left it (the payoff gate's inputs; docs/benchmarks.md found it settling either way)."""
    out = tmp_path / "out"
    code, _, err = specd_cli(bench_args(tiny_dirs, dataset, out, "--policies", "cost-aware", "--baselines", "ar",
                                        "--limit", "1"))
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    curves = doc["policy_cost_curves"]["hf"]
    for when in ("start", "end"):
        assert curves[when]["t_draft_s"] > 0 and len(curves[when]["t_target_s"]) == len(curves[when]["k"])
    assert curves["start"] != curves["end"]  # the rounds moved it
    assert "- hf: start t_draft" in (out / "report.md").read_text()


@pytest.mark.parametrize("seed", [3, None])
def test_sampled_bench_checks_identity_when_seeded(tiny_dirs, dataset, tmp_path, specd_cli, seed):
    """Seeded sampling is coupled, so a seeded run's output must equal the target alone's, and
    the oracle is defined (measured for n-gram, computed for the model drafter); an unseeded one
    has no reference to equal and no oracle."""
    out = tmp_path / "out"
    extra = ["--seed", str(seed)] if seed is not None else []
    argv = bench_args(tiny_dirs, dataset, out, "--limit", "2", "--temperature", "1.0",
                      "--policies", "constant", "--baselines", "ar", *extra)
    argv[argv.index("--drafter") + 1] = "hf,ngram"
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    agg = doc["aggregates"]["hf/constant"]
    assert agg["identical"] is (True if seed is not None else None)
    assert agg["acceptance_rate"] > 0
    skipped = {c["label"]: c["skipped"] for c in doc["configs"] if c["skipped"]}
    if seed is None:
        assert "--seed" in skipped["ngram/oracle"] and "--seed" in doc["oracle"]["skipped"]
        return
    assert not skipped
    oracle = doc["aggregates"]["ngram/oracle"]
    assert oracle["identical"] is True and oracle["discard_rate"] == 0.0
    bound = doc["oracle"]["drafters"]["hf"]
    for rec, base in zip(bound["per_prompt"], doc["records"]["ar"]):
        assert rec["new_tokens"] == base["new_tokens"] and rec["verifications"] <= rec["disagreements"] + 1
    assert agg["oracle_fraction"] > 0


def test_bench_second_turn_and_skips(tiny_dirs, dataset, tmp_path, specd_cli):
    out = tmp_path / "out"
    target, _ = map(str, tiny_dirs)
    code, _, err = specd_cli(["bench", "--dataset", str(dataset), "--target-model", target, "--limit", "1",
                        "--offset", "1", "--turn", "all", "--policies", "constant,specdec++", "--max-new-tokens", "6",
                        "--baselines", "hf-heuristic", "--trees", "--overlap", "--out", str(out)])
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert [p["key"] for p in doc["prompts"]] == ["1#t1", "1#t2"]  # --offset 1: the second question
    assert doc["settings"]["offset"] == 1
    assert doc["settings"]["dataset"] == str(dataset)
    assert f"2 prompts of `{dataset}` (from question 2 of the set on)" in (out / "report.md").read_text()
    assert doc["prompts"][1]["prompt_tokens"] > doc["prompts"][0]["prompt_tokens"]
    skipped = {c["label"]: c["skipped"] for c in doc["configs"] if c["skipped"]}
    assert set(skipped) == {"ngram/specdec++", "ngram/specdec++/tree", "ngram/specdec++/pearl", "hf-heuristic"}
    assert "draft model" in skipped["hf-heuristic"]
    tree = next(c for c in doc["configs"] if c["label"] == "ngram/constant/tree")
    assert tree["branches"] == 3 and doc["aggregates"]["ngram/constant/tree"]["identical"] is True
    assert all(r["tree_rounds"] == 0 for r in doc["records"]["ngram/constant"])
    pearl = next(c for c in doc["configs"] if c["label"] == "ngram/constant/pearl")
    assert pearl["overlap"] is True and doc["aggregates"]["ngram/constant/pearl"]["identical"] is True
    assert doc["aggregates"]["ngram/oracle"]["identical"] is True
    assert doc["aggregates"]["ngram/oracle"]["discard_rate"] == 0.0


def test_bad_dataset_line_is_named(tiny_dirs, tmp_path, specd_cli):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"turns": ["ok"]}\n{"turns": "not a list"}\n')
    code, _, err = specd_cli(bench_args(tiny_dirs, path, tmp_path / "o"))
    assert code == 2 and f"{path}:2:" in err and "turns" in err and "Traceback" not in err
    path.write_text('{"turns": ["ok"]}\n\n{not json\n')
    code, _, err = specd_cli(bench_args(tiny_dirs, path, tmp_path / "o"))
    assert code == 2 and f"{path}:3: invalid JSON" in err


@pytest.mark.parametrize("value, says", [("-1", "must be >= 0"), ("3", "all skipped by offset 3")])
def test_bad_offset_is_named(tiny_dirs, dataset, tmp_path, specd_cli, value, says):
    code, _, err = specd_cli(bench_args(tiny_dirs, dataset, tmp_path / "o", "--offset", value))
    assert code == 2 and "offset" in err and says in err and "Traceback" not in err


@pytest.mark.parametrize("flag, value, name", [("--policies", "constant,warp", "'warp'"),
                                               ("--baselines", "ar,vllm", "'vllm'"),
                                               ("--drafter", "ngram,magic", "'magic'")])
def test_unknown_names_are_refused(tiny_dirs, dataset, tmp_path, specd_cli, flag, value, name):
    argv = bench_args(tiny_dirs, dataset, tmp_path / "o")
    if flag == "--drafter":
        argv[argv.index("--drafter") + 1] = value
    else:
        argv += [flag, value]
    code, _, err = specd_cli(argv)
    assert code == 2 and name in err and len(err.strip().splitlines()) == 1


def test_hybrid_bound_counts_its_side_branches(tiny_dirs, dataset, tmp_path, specd_cli):
    """A tree drafter's oracle is the chain's and its branches' (specd_bench.oracle.tree_rounds):
    the bound the report divides by, never the chain's alone, which a tree can beat."""
    from specd.drafters import Datastore

    store = tmp_path / "store.safetensors"
    Datastore.from_documents([[5, 6, 7, 8, 9] * 4]).save(store)
    out = tmp_path / "out"
    argv = bench_args(tiny_dirs, dataset, out, "--policies", "constant", "--baselines", "ar", "--limit", "2",
                      "--draft-layers", "1", "--draft-adapter", "none", "--datastore", str(store))
    argv[argv.index("--drafter") + 1] = "hybrid"
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["aggregates"]["hybrid/constant"]["identical"] is True
    bound = doc["oracle"]["drafters"]["hybrid"]
    assert "side branches" in bound["note"] and "side branches" in (out / "report.md").read_text()
    for rec, base in zip(bound["per_prompt"], doc["records"]["ar"]):
        assert rec["new_tokens"] == base["new_tokens"]
        assert rec["drafted"] <= sum(rec["draft_lengths"])  # never more draft steps than kept tokens


def test_bench_runs_the_built_in_set_without_dataset(tiny_dirs, tmp_path, specd_cli):
    """No --dataset: the bundled prompts (specd/data/prompts.jsonl), recorded as "built-in"."""
    out = tmp_path / "out"
    argv = bench_args(tiny_dirs, "unused", out, "--limit", "3", "--policies", "constant", "--baselines", "ar")
    del argv[1:3]  # --dataset PATH
    assert "--dataset" not in argv
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["settings"]["dataset"] == "built-in"
    assert [p["key"] for p in doc["prompts"]] == ["1#t1", "2#t1", "3#t1"]
    assert doc["aggregates"]["hf/constant"]["identical"] is True
    assert "3 prompts of `built-in`" in (out / "report.md").read_text()


@pytest.mark.parametrize("cold", [True, False])
def test_cold_start_runs_each_prompt_from_empty_state(tiny_dirs, tmp_path, specd_cli, cold):
    """--cold-start: each run starts as a fresh `specd generate` (heuristic's K back at k0), so
    the same prompt twice drafts the same windows; without it the second run inherits the K the
    first one left (the negative control)."""
    dataset = tmp_path / "same.jsonl"
    dataset.write_text("".join(json.dumps({"question_id": i, "turns": ["count to five"]}) + "\n" for i in range(2)))
    out = tmp_path / "out"
    extra = ["--cold-start"] if cold else []
    code, _, err = specd_cli(bench_args(tiny_dirs, dataset, out, "--policies", "heuristic", "--baselines", "ar",
                                        "--max-new-tokens", "24", *extra))
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    first, second = (r["draft_lengths"] for r in doc["records"]["hf/heuristic"])
    assert first[0] == 5  # k0
    assert (first == second) is cold
    assert doc["settings"]["cold_start"] is cold
    assert ("every run cold" in (out / "report.md").read_text()) is cold


def short_assistant(tmp_path) -> Path:
    """A transformers model that cannot take a long prompt: GPT-2's learned positions, 64 of
    them (a prompt past them is an IndexError in its position embedding), over the tiny pair's
    vocabulary and tokenizer, so that it can assist the tiny target on short prompts."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from specd.runtime.tiny import save_tiny

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=1, eos_token_id=2, pad_token_id=2)).eval()
    return save_tiny(tmp_path / "short-assistant", model=model)


def test_a_peer_that_cannot_run_a_prompt_is_reported_and_the_run_goes_on(tiny_dirs, tmp_path, specd_cli):
    """A peer that raises on one prompt (assisted generation whose assistant has 64 positions,
    given a prompt of about 100 tokens) gets a record saying why; its row is over the prompts it
    ran and counts the one it could not, and report.md says so. specd's own configurations and
    the other peers run every prompt."""
    dataset = tmp_path / "q.jsonl"
    prompts = ["hello there", "summarize this: " + "the cat sat on the mat. " * 3, "count to five"]
    dataset.write_text("".join(json.dumps({"question_id": i, "turns": [p]}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out"
    argv = bench_args(tiny_dirs, dataset, out, "--policies", "oracle", "--baselines", "ar,hf-ar,hf-assisted")
    argv[argv.index("--drafter") + 1] = "ngram"  # specd drafts without the short model: only the peer uses it
    argv[argv.index("--draft-model") + 1] = str(short_assistant(tmp_path))
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    keys = ["0#t1", "1#t1", "2#t1"]
    assert doc["prompts"][1]["prompt_tokens"] > 64 > doc["prompts"][0]["prompt_tokens"] + 8
    for label in ("ar", "ngram/oracle", "hf-ar"):
        assert [r["prompt"] for r in doc["records"][label]] == keys
        assert not any(r.get("failed") for r in doc["records"][label])
        assert doc["aggregates"][label]["runs"] == 3 and doc["aggregates"][label]["failed_runs"] == 0
    records = doc["records"]["hf-assisted"]
    assert [r["prompt"] for r in records] == keys  # the failed run keeps its place: pairs stay aligned
    failed = records[1]
    assert failed["failed"].startswith("IndexError: index out of range") and "\n" not in failed["failed"]
    assert "new_tokens" not in failed and "tokens_per_s" not in failed
    assert not records[0].get("failed") and not records[2].get("failed")
    agg = doc["aggregates"]["hf-assisted"]
    assert agg["runs"] == 2 and agg["failed_runs"] == 1 and agg["failed_prompts"] == ["1#t1"]
    assert agg["errors"] == {failed["failed"]: 1}
    assert agg["new_tokens"] == records[0]["new_tokens"] + records[2]["new_tokens"]
    assert agg["wall_time_s"] == pytest.approx(records[0]["wall_time_s"] + records[2]["wall_time_s"])
    ar = doc["records"]["ar"]
    assert agg["speedup"]["per_run"] == pytest.approx([records[i]["tokens_per_s"] / ar[i]["tokens_per_s"]
                                                       for i in (0, 2)])
    ar_tps = (ar[0]["new_tokens"] + ar[2]["new_tokens"]) / (ar[0]["wall_time_s"] + ar[2]["wall_time_s"])
    assert agg["speedup"]["ratio_of_sums"] == pytest.approx(agg["tokens_per_s"] / ar_tps)  # against ar on the same 2
    assert agg["identical"] is True  # over the prompts it ran
    report = (out / "report.md").read_text()
    assert "hf-assisted: 1 of 3 prompts failed (1#t1): IndexError: index out of range in self" in report
    assert "| hf-assisted |" in report and "| hf-ar |" in report
    assert "hf-assisted failed on 1#t1: IndexError" in err  # said as it happened, too


def test_specd_itself_failing_a_prompt_is_reported_and_the_run_goes_on(tiny_dirs, tmp_path, specd_cli):
    """specd's own configuration is caught like a peer: the same short model as specd's drafter
    fails the second prompt (an IndexError, not a SpecdError: its traceback is written too), and
    its oracle bound there is listed as not computed; everything else is kept."""
    dataset = tmp_path / "q.jsonl"
    prompts = ["hello there", "summarize this: " + "the cat sat on the mat. " * 3]  # the second in the timed runs
    dataset.write_text("".join(json.dumps({"turns": [p]}) + "\n" for p in prompts))
    out = tmp_path / "out"
    argv = bench_args(tiny_dirs, dataset, out, "--policies", "constant", "--baselines", "ar,hf-ar")
    argv[argv.index("--draft-model") + 1] = str(short_assistant(tmp_path))
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    records = doc["records"]["hf/constant"]
    assert not records[0].get("failed") and records[1]["failed"].startswith("IndexError: index out of range")
    assert "Traceback (most recent call last)" in err and "hf/constant failed on 2#t1: IndexError" in err
    assert not any(r.get("failed") for label in ("ar", "hf-ar") for r in doc["records"][label])
    assert doc["aggregates"]["hf/constant"]["speedup"]["per_run"] == pytest.approx(
        [records[0]["tokens_per_s"] / doc["records"]["ar"][0]["tokens_per_s"]])
    bound = doc["oracle"]["drafters"]["hf"]
    assert [r["prompt"] for r in bound["per_prompt"]] == ["1#t1"]
    assert [f["prompt"] for f in bound["failed_prompts"]] == ["2#t1"]
    assert bound["failed_prompts"][0]["failed"].startswith("IndexError")
    report = (out / "report.md").read_text()
    assert "- hf/constant: 1 of 2 prompts failed (2#t1): IndexError" in report
    assert "**not bounded on 1 prompts** (2#t1): IndexError" in report


def test_a_prompt_past_the_targets_context_fails_alone(tiny_dirs, tmp_path, specd_cli):
    """A prompt longer than the tiny target's context (512 positions; one character a token):
    `ar` and specd's configurations raise on it (the engine refuses it), transformers' generate
    runs it. Each failure is recorded with its error, every ratio is over the prompts both
    sides ran (none on the long one), the oracle bounds the prompts `ar` ran, and the other
    prompts' results are all there."""
    dataset = tmp_path / "q.jsonl"
    prompts = ["hello there", "summarize this: " + "the cat sat on the mat. " * 25, "count to five"]
    dataset.write_text("".join(json.dumps({"question_id": i, "turns": [p]}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "out"
    argv = bench_args(tiny_dirs, dataset, out, "--policies", "constant", "--baselines", "ar,hf-ar")
    argv[argv.index("--drafter") + 1] = "hf,ngram"
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    keys = ["0#t1", "1#t1", "2#t1"]
    assert doc["prompts"][1]["prompt_tokens"] > 512 > doc["prompts"][2]["prompt_tokens"]
    labels = ["ar", "hf/constant", "ngram/constant", "ngram/oracle", "hf-ar"]
    assert list(doc["records"]) == labels
    for label in labels:
        assert [r["prompt"] for r in doc["records"][label]] == keys  # failed runs keep their place
    too_long = doc["records"]["ar"][1]["failed"]
    assert too_long.startswith("InvalidRequest: prompt: is ") and "the model's context is 512" in too_long
    for label in ("hf/constant", "ngram/constant"):
        assert doc["records"][label][1]["failed"] == too_long
    assert doc["records"]["ngram/oracle"][1]["failed"] == "InvalidRequest: oracle: no `ar` output on this prompt to follow"
    assert not doc["records"]["hf-ar"][1].get("failed")  # transformers' generate runs past the positions
    ar = doc["records"]["ar"]
    for label in labels:
        recs, agg = doc["records"][label], doc["aggregates"][label]
        assert not recs[0].get("failed") and not recs[2].get("failed")
        assert agg["failed_runs"] == (label != "hf-ar") and agg["runs"] == 2 + (label == "hf-ar")
        # ratios only where both ran: prompts 0 and 2, for hf-ar too
        assert agg["speedup"]["per_run"] == pytest.approx([recs[i]["tokens_per_s"] / ar[i]["tokens_per_s"]
                                                           for i in (0, 2)])
    for label in ("hf/constant", "ngram/constant", "ngram/oracle", "hf-ar"):
        assert doc["aggregates"][label]["identical"] is True
    assert doc["aggregates"]["hf-ar"]["new_tokens"] == sum(r["new_tokens"] for r in doc["records"]["hf-ar"])
    assert [r["prompt"] for r in doc["oracle"]["drafters"]["hf"]["per_prompt"]] == ["0#t1", "2#t1"]
    assert "failed_prompts" not in doc["oracle"]["drafters"]["hf"]
    report = (out / "report.md").read_text()
    assert "**Failed runs**" in report and "only over the prompts where both it and `ar` ran" in report
    assert f"- ar: 1 of 3 prompts failed (1#t1): {too_long}; no configuration has a speedup there" in report
    assert f"- ngram/constant: 1 of 3 prompts failed (1#t1): {too_long}" in report
    assert "- hf-ar:" not in report and "| hf-ar |" in report
    assert "ar failed on 1#t1: InvalidRequest" in err and "Traceback" not in err  # a SpecdError: one line
    assert "warning: some configurations failed on some prompts (ar: 1 of 3, " in err


def test_a_second_turn_whose_first_answer_cannot_be_generated_fails_alone(tiny_dirs, tmp_path, specd_cli):
    """--turn 2 needs the target's own first answer; where the first turn is past the target's
    context there is no second-turn prompt: every configuration's record there says why."""
    dataset = tmp_path / "q.jsonl"
    turns = [["hello there", "again"], ["the cat sat on the mat. " * 25, "shorter now"]]
    dataset.write_text("".join(json.dumps({"question_id": i, "turns": t}) + "\n" for i, t in enumerate(turns)))
    out = tmp_path / "out"
    argv = bench_args(tiny_dirs, dataset, out, "--policies", "constant", "--baselines", "ar", "--turn", "2")
    argv[argv.index("--drafter") + 1] = "ngram"
    code, _, err = specd_cli(argv)
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["prompts"][1]["prompt_tokens"] is None
    assert doc["prompts"][1]["failed"].startswith("the first turn's answer: InvalidRequest: prompt: is ")
    for label in ("ar", "ngram/constant", "ngram/oracle"):
        records = doc["records"][label]
        assert [r["prompt"] for r in records] == ["0#t2", "1#t2"]
        assert not records[0].get("failed") and records[1]["failed"] == doc["prompts"][1]["failed"]
    assert "- ar: 1 of 2 prompts failed (1#t2): the first turn's answer: InvalidRequest" in (out / "report.md").read_text()
