"""One target forward of 1, 2 and 9 new tokens after a 64-token context, per linear-kernel choice
(best of 5), on the embedded model in float32, eager: what docs/engine.md's "The few-row product"
cites for an AVX2-only CPU. out-16-lanes.txt: the few-row product with 16-float vectors (before
2026-11-27); out.txt: with 8; out-after-blocking.txt: with 8 and 3 input rows per block, as it is
now built there. Run from the repository root: python docs/bench/kernels-avx2-epyc/time_kernels.py"""
import time

from specd.runtime.loading import load_model

for kernels in ("auto", "onednn", "torch"):
    model = load_model("embedded", linear_kernels=kernels)
    session = model.session()
    session.extend(list(range(10, 74)), 1)
    for n in (1, 2, 9):
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            session.extend([7] * n, 1)
            times.append(time.perf_counter() - t0)
            session.rollback(64)
        print(f"{kernels} {n} rows: {min(times) * 1e3:.1f} ms", flush=True)
    session.close()
