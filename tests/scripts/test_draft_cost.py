"""scripts/draft_cost.py replays drafting against the target's own answers: its rounds must be
the ones the engine runs with the same drafter, policy and frozen cost curve, or its timings
would be of some other work."""

from __future__ import annotations

import json

import pytest

from specd_bench.datasets import load_questions
from specd.costs import CostCurve
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.runtime import load_model
from specd.types import SamplingParams, SpecParams


def test_the_replay_drafts_the_engines_rounds(tmp_path, script, tiny_dirs):
    target_dir = tiny_dirs[0]
    module = script("draft_cost")
    curve_file = tmp_path / "gpu_check.json"  # a GPU's flat curve: long windows
    ts = [1.6, 1.9, 2.0, 2.1, 2.2, 2.2, 2.3, 2.3, 2.6]
    curve_file.write_text(json.dumps({"speculation": {"cost_curve_ms": {"ngram": {"t_draft": 0.014, "t_target_k": ts}}}}))
    out = tmp_path / "draft_cost.json"
    assert module.main(["--target-model", str(target_dir), "--prompts", "3", "--max-new-tokens", "40",
                        "--drafters", "ngram", "--curve", str(curve_file), "--repeats", "1", "--out", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    assert set(cells) == {"greedy ngram/cost-aware", "t1-seeded ngram/cost-aware"}

    target = load_model(str(target_dir), "cpu", "float32")
    prompts = [target.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True)
               for q in load_questions(None, limit=3)]
    for label, sampling in (("greedy", SamplingParams(max_new_tokens=40)),
                            ("t1-seeded", SamplingParams(1.0, seed=0, max_new_tokens=40))):
        curve = CostCurve(0.014e-3, list(range(1, 10)), [t * 1e-3 for t in ts], smoothing=0.0)
        engine = SpeculativeEngine(target, build_drafter("ngram", target), costs=curve)
        stats = [engine.generate(ids, sampling, SpecParams("cost-aware")).stats for ids in prompts]
        got = cells[f"{label} ngram/cost-aware"]
        assert got["drafted"] > 0
        assert (got["rounds"], got["drafted"], got["accepted"]) == (
            sum(s.verifications for s in stats), sum(s.drafted for s in stats), sum(s.accepted for s in stats))


def test_the_oracle_drafts_only_what_the_target_keeps_and_bounds_the_policy_on_the_curve(tmp_path, script, tiny_dirs):
    module = script("draft_cost")
    curve_file = tmp_path / "gpu_check.json"
    ts = [1.6, 1.9, 2.0, 2.1, 2.2, 2.2, 2.3, 2.3, 2.6]
    alone = {"seconds": 1.0, "tokens": 500}  # 2.0 ms a token: 0.4 ms of it beside the 1.6 ms forward
    curve_file.write_text(json.dumps({
        "target_alone": {"graphs": alone},
        "speculation": {"baseline": "graphs", "t1_baseline": None,
                        "cost_curve_ms": {"ngram": {"t_draft": 0.014, "t_target_k": ts}}}}))
    # Answers that repeat the prompt's end, so that prompt lookup has something to find: the
    # replay judges drafts against whatever answers it is given.
    target = load_model(str(tiny_dirs[0]), "cpu", "float32")
    prompts = [target.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True)
               for q in load_questions(None, limit=3)]
    answers = tmp_path / "answers.json"
    answers.write_text(json.dumps({"greedy": [(ids[-12:] + [7, 8]) * 3 for ids in prompts], "t1-seeded": []}))
    out = tmp_path / "draft_cost.json"
    assert module.main(["--target-model", str(tiny_dirs[0]), "--prompts", "3", "--max-new-tokens", "42",
                        "--drafters", "ngram", "--policies", "cost-aware,oracle,constant", "--samplings", "greedy",
                        "--answers", str(answers), "--curve", str(curve_file), "--repeats", "1",
                        "--out", str(out)]) == 0
    cells = json.loads(out.read_text())["cells"]
    oracle, policy, constant = (cells[f"greedy ngram/{p}"] for p in ("oracle", "cost-aware", "constant"))
    assert oracle["drafted"] == oracle["accepted"] > 0
    assert oracle["rounds"] <= min(policy["rounds"], constant["rounds"])
    assert oracle["speedup_on_curve"] >= max(policy["speedup_on_curve"], constant["speedup_on_curve"])
    # the price: each round's curve and host time against one 2.0 ms step per token
    host = 0.4e-3
    assert module.host_times(str(curve_file), module.frozen_curve(str(curve_file), None, None))["greedy"] == \
        pytest.approx(host)
    tokens = oracle["tokens_per_round"] * oracle["rounds"]
    assert oracle["speedup_on_curve"] == pytest.approx(
        tokens * 2.0 / (oracle["rounds"] * oracle["priced_ms_per_round"]), rel=1e-3)
    # a drafted token priced above a whole step: cost-aware stops drafting, the oracle does not
    dear = tmp_path / "dear.json"
    assert module.main(["--target-model", str(tiny_dirs[0]), "--prompts", "3", "--max-new-tokens", "42",
                        "--drafters", "ngram", "--policies", "cost-aware,oracle", "--samplings", "greedy",
                        "--answers", str(answers), "--curve", str(curve_file), "--t-draft-ms", "5",
                        "--repeats", "1", "--out", str(dear)]) == 0
    priced = json.loads(dear.read_text())["cells"]
    assert priced["greedy ngram/cost-aware"]["drafted"] < policy["drafted"] / 2
    assert priced["greedy ngram/oracle"]["drafted"] == oracle["drafted"]
    assert priced["greedy ngram/oracle"]["speedup_on_curve"] < oracle["speedup_on_curve"]


def test_under_a_compute_bound_load_the_replay_never_asks_the_drafter(tmp_path, script, tiny_dirs):
    """--others prices every window in a forward of that many other sessions: on a surface where
    a further token costs what a session's step does, no round asks the drafter (drafter_ran),
    where alone the same replay drafts."""
    module = script("draft_cost")
    profile = tmp_path / "results.json"  # bench-load's target_costs: a session's step and a further token, 4 ms each
    profile.write_text(json.dumps({"target_costs": {
        "verify_s": [0.020 + 0.001 * k for k in range(9)],
        "batch_s": [0.004 * b for b in range(1, 17)], "batch_token_s": [0.004] * 16}}))
    answers = tmp_path / "answers.json"
    target = load_model(str(tiny_dirs[0]), "cpu", "float32")
    prompts = [target.encode_prompt([{"role": "user", "content": q.turns[0]}], chat=True)
               for q in load_questions(None, limit=2)]
    answers.write_text(json.dumps({"greedy": [(ids[-12:] + [7, 8]) * 3 for ids in prompts], "t1-seeded": []}))
    cells = {}
    for others in (0, 15):
        out = tmp_path / f"draft_cost-{others}.json"
        assert module.main(["--target-model", str(tiny_dirs[0]), "--prompts", "2", "--max-new-tokens", "40",
                            "--drafters", "ngram", "--curve", str(profile), "--others", str(others),
                            "--t-draft-ms", "0.02", "--samplings", "greedy", "--answers", str(answers),
                            "--repeats", "1", "--out", str(out)]) == 0
        cells[others] = json.loads(out.read_text())["cells"]["greedy ngram/cost-aware"]
    assert cells[0]["drafter_ran"] > 0 and cells[0]["drafted"] > 0
    assert cells[15]["drafter_ran"] == 0 and cells[15]["speedup_on_curve"] is None
