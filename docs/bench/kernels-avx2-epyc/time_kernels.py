"""One target forward of 1, 2 and 9 new tokens after a 64-token context, per linear-kernel choice
(best of 5), on the embedded model in float32: what docs/design.md's "`auto` picks the few-row
product without timing it" cites. Run from the repository root: python docs/bench/kernels-avx2-epyc/time_kernels.py"""
import time

from specd.models.loading import load_model

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
