"""scripts/draft_cost.py replays drafting against the target's own answers: its rounds must be
the ones the engine runs with the same drafter, policy and frozen cost curve, or its timings
would be of some other work."""

from __future__ import annotations

import json

from specd.bench.datasets import load_questions
from specd.costs import CostCurve
from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.models import load_model
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
