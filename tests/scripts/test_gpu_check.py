"""The device check (scripts/gpu_check.py) is run once per lent GPU, so its dry run on the CPU
must work end to end: every section on a tiny model, one results file."""

from __future__ import annotations

import json


def test_the_cpu_dry_run_writes_every_section(tmp_path, script):
    module = script("gpu_check")
    out = tmp_path / "check.json"
    rc = module.main(["--device", "cpu", "--model", "tiny", "--drafters", "ngram,early-exit", "--prompts", "2",
                      "--max-new-tokens", "12", "--batch-steps", "6", "--batch-sizes", "1,3", "--slots", "4",
                      "--max-len", "128", "--compiled", "--out", str(out)])
    results = json.loads(out.read_text())
    assert rc == 0 and "errors" not in results
    assert set(results["target_alone_identical"]) == {"hf", "pool-eager", "pool-compiled"}
    assert all(results["target_alone_identical"].values())
    for drafter in ("ngram", "early-exit"):
        entry = results["speculation"][drafter]
        assert entry["greedy"]["identical"] and entry["t1_seeded"]["identical"]
        assert entry["greedy"]["live_t_draft_ms"] > 0 and entry["t1_seeded"]["live_t_draft_ms"] > 0
    assert results["batched"]["eager-3"]["rows_identical"] == 3
    assert results["batched"]["eager-3"]["pool_in_use_after"] == 0
