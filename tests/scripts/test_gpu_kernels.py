"""The kernel-level device check (scripts/gpu_kernels.py) runs on a lent GPU once, so its dry run
on the CPU must work end to end and write every section."""

from __future__ import annotations

import json


def test_the_cpu_dry_run_writes_every_section(tmp_path, script):
    module = script("gpu_kernels")
    out = tmp_path / "kernels.json"
    assert module.main(["--device", "cpu", "--steps", "6", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["steps"]) == {"fused-nogemv", "fused"} and "errors" not in results
    assert results["linear"]["o_4"]["rows_err"] < 1e-4  # the batched one-row products compute the product
    for variant in ("fused-nogemv", "fused"):
        assert all(v["identical"] for v in results["pipelined"][variant].values())  # device-fed = read back
