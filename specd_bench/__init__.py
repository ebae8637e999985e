"""`specd bench` (docs/benchmarks.md): tokens/s and speedup over target-only decoding measured in
the same run, MAT, acceptance, verification and discard rates, draft-length distributions, the
oracle bound with its measured cost curve, and transformers' own speculative decoders as peers.

Modules: datasets (prompts), configs (settings, rows), runner (the interleaved loop), metrics
(per-run and aggregate arithmetic), oracle (bound, cost curve), peers (transformers),
report (results.json, report.md), plots (PNGs).
"""

from specd_bench.configs import BenchSettings
from specd_bench.runner import run_bench

__all__ = ["BenchSettings", "run_bench"]
