"""`specd bench-merge`: runs over disjoint parts of one prompt set (`--offset`/`--limit`) joined
into one document whose per-prompt records are the parts' own and whose summaries are
recomputed over their union; parts that do not belong together are refused by name."""

from __future__ import annotations

import json

import pytest

from specd_bench.merge import load_part, merge_docs
from specd_bench.metrics import aggregate
from specd.errors import InvalidRequest

PROMPTS = ["hello there", "count to five", "the cat sat on the mat, the cat"]


@pytest.fixture(scope="module")
def parts(tiny_dirs, tmp_path_factory):
    """Two real tiny-pair runs: question 0, then questions 1-2."""
    from specd.cli import main

    root = tmp_path_factory.mktemp("merge")
    dataset = root / "q.jsonl"
    dataset.write_text("".join(json.dumps({"question_id": i, "turns": [p]}) + "\n" for i, p in enumerate(PROMPTS)))
    target, draft = map(str, tiny_dirs)
    out = []
    for name, window in (("a", ["--limit", "1"]), ("b", ["--offset", "1"])):
        code = main(["bench", "--dataset", str(dataset), "--target-model", target, "--drafter", "hf",
                     "--draft-model", draft, "--max-new-tokens", "8", "--policies", "constant",
                     "--baselines", "ar,hf-assisted", *window, "--out", str(root / name)])
        assert code == 0
        out.append(root / name)
    return out


def test_merge_keeps_the_records_and_recomputes_the_summaries(parts, tmp_path, specd_cli):
    a, b = (json.loads((p / "results.json").read_text()) for p in parts)
    code, _, err = specd_cli(["bench-merge", *map(str, parts), "--out", str(tmp_path / "m")])
    assert code == 0, err
    doc = json.loads((tmp_path / "m" / "results.json").read_text())
    assert [p["key"] for p in doc["prompts"]] == ["0#t1", "1#t1", "2#t1"]
    assert doc["settings"]["offset"] == 0 and doc["settings"]["limit"] == 3
    for label in ("ar", "hf/constant", "hf-assisted"):
        assert doc["records"][label] == a["records"][label] + b["records"][label]
        agg = doc["aggregates"][label]
        fractions = {k: agg[k] for k in ("oracle_fraction", "oracle_fraction_at_ar_step") if k in agg}
        assert agg == {**aggregate(doc["records"][label], doc["records"]["ar"]), **fractions}
        assert agg["speedup"]["per_run"] == a["aggregates"][label]["speedup"]["per_run"] + \
            b["aggregates"][label]["speedup"]["per_run"]
        assert agg["new_tokens"] == a["aggregates"][label]["new_tokens"] + b["aggregates"][label]["new_tokens"]
    bound = doc["oracle"]["drafters"]["hf"]
    per_prompt = bound["per_prompt"]
    assert per_prompt == a["oracle"]["drafters"]["hf"]["per_prompt"] + b["oracle"]["drafters"]["hf"]["per_prompt"]
    expected = sum(r["new_tokens"] for r in per_prompt) / sum(r["time_s"] for r in per_prompt)
    assert bound["tokens_per_s"] == pytest.approx(expected)
    assert doc["aggregates"]["hf/constant"]["oracle_fraction"] == pytest.approx(
        doc["aggregates"]["hf/constant"]["tokens_per_s"] / expected)
    # the bound at ar's own cost per token is recomputed over the union too
    at_ar = sum(r["new_tokens"] for r in per_prompt) / sum(r["time_at_ar_step_s"] for r in per_prompt)
    assert bound["tokens_per_s_at_ar_step"] == pytest.approx(at_ar)
    assert doc["aggregates"]["hf/constant"]["oracle_fraction_at_ar_step"] == pytest.approx(
        doc["aggregates"]["hf/constant"]["tokens_per_s"] / at_ar)
    assert doc["contention"]["runs"] == 3
    assert [p["prompts"] for p in doc["parts"]] == [1, 2] and "hf" in doc["parts"][1]["cost_curves"]
    assert [p["policy_cost_curves"] for p in doc["parts"]] == [a["policy_cost_curves"], b["policy_cost_curves"]]
    report = (tmp_path / "m" / "report.md").read_text()
    assert "Joined from 2 runs" in report and "1#t1 to 2#t1 (2 prompts)" in report
    assert {p.name for p in (tmp_path / "m").glob("*.png")} == {"speedup.png", "draft_lengths.png",
                                                               "accepted_lengths.png", "entropy.png"}


def test_overlapping_parts_are_refused(parts):
    with pytest.raises(InvalidRequest, match="prompt 0#t1 is in both") as e:
        merge_docs([load_part(parts[0]), load_part(parts[0])])
    assert e.value.field == "parts"


def test_parts_of_different_runs_are_refused(parts):
    a, b = load_part(parts[0]), load_part(parts[1])
    b["settings"]["max_new_tokens"] = 6
    with pytest.raises(InvalidRequest, match="setting 'max_new_tokens' differs"):
        merge_docs([a, b])
    b = load_part(parts[1])
    b["machine"]["torch_threads"] = 16
    with pytest.raises(InvalidRequest, match="machine 'torch_threads' differs"):
        merge_docs([a, b])
    b = load_part(parts[1])
    b["configs"] = b["configs"][:1]
    with pytest.raises(InvalidRequest, match="configurations differ"):
        merge_docs([a, b])


def test_bad_parts_are_named(parts, tmp_path, specd_cli):
    code, _, err = specd_cli(["bench-merge", str(parts[0]), str(tmp_path), "--out", str(tmp_path / "m")])
    assert code == 2 and f"{tmp_path}: no results.json" in err and "Traceback" not in err
    (tmp_path / "results.json").write_text("{}")
    code, _, err = specd_cli(["bench-merge", str(parts[0]), str(tmp_path), "--out", str(tmp_path / "m")])
    assert code == 2 and "not a `specd bench` results.json" in err
    code, _, err = specd_cli(["bench-merge", str(parts[0]), "--out", str(tmp_path / "m")])
    assert code == 2 and "at least 2 parts" in err
