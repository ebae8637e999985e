"""The kernel-level device check (scripts/gpu_kernels.py) runs on a lent GPU once, so its dry run
on the CPU must work end to end and write every section."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_kernels.py"


def test_the_cpu_dry_run_writes_every_section(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "kernels.json"
    assert module.main(["--device", "cpu", "--steps", "6", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results["steps"]) == {"fused-nogemv", "fused"} and "errors" not in results
    assert results["linear"]["o_4"]["rows_err"] < 1e-4  # the batched one-row products compute the product
    for variant in ("fused-nogemv", "fused"):
        assert all(v["identical"] for v in results["pipelined"][variant].values())  # device-fed = read back
