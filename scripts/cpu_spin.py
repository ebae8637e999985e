"""What torch's OpenMP threads (libgomp) cost between forwards, under the spin settings this
process was started with (libgomp reads them when torch loads it; docs/engine.md, "Threads that
do not spin between forwards"): the embedded target's compiled decode step and 4-token window,
one session and 8, with an idle gap after each forward as a served target has; then the CPU time
the process burns during idle gaps after a forward (the threads' spinning).

    GOMP_SPINCOUNT=300000 python scripts/cpu_spin.py   # libgomp's default count
    GOMP_SPINCOUNT=10000 python scripts/cpu_spin.py    # what the `specd` command sets
    OMP_WAIT_POLICY=PASSIVE python scripts/cpu_spin.py # no spinning
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from specd.runtime.loading import load_model
from specd.runtime.pool import pooled_extend

CONTEXT = 200


def main() -> None:
    settings = {k: os.environ[k] for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY") if k in os.environ}
    print(f"{torch.get_num_threads()} threads, {settings or 'libgomp defaults'}")
    model = load_model("embedded", device="cpu", dtype="float32")
    model.use_pool(8, 1024, compiled="on")
    for n in (1, 8):
        sessions = [model.session() for _ in range(n)]
        for s in sessions:
            s.extend(list(range(100, 100 + CONTEXT)), 1)
        for width in (1, 4):
            times = []
            for _ in range(15):
                t0 = time.perf_counter()
                pooled_extend(sessions, [[5] * width] * n, [width] * n)
                times.append(1e3 * (time.perf_counter() - t0))
                for s in sessions:
                    s.rollback(CONTEXT)
                time.sleep(0.02)  # idle, as a served target between forwards
            print(f"{n} session(s) x {width} token(s): {statistics.median(times[1:]):.1f} ms a forward")
        for s in sessions:
            s.close()
    s = model.session()
    s.extend(list(range(100, 100 + CONTEXT)), 1)
    burnt = []
    for _ in range(11):
        s.extend([5], 1)
        s.rollback(CONTEXT)
        c0 = time.process_time()
        time.sleep(0.02)
        burnt.append(1e3 * (time.process_time() - c0))
    print(f"CPU time burnt in a 20 ms idle gap after a forward: {statistics.median(burnt):.1f} ms")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
