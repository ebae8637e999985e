"""When is the compiled CPU forward slower than the eager one? A library that gathers keys for
SDPA costs more per key of context, every row reading keys up to the batch's longest context,
where the eager forward attends in span groups (KVPool._span_groups); one that attends in place
with the few-row operator reads each row's own. On the embedded target:
decode steps and a mixed batch (windows among decode steps) of sessions prefilled to the given
contexts (docs/engine.md, "Compiled CPU forwards").

Columns: specd's choice (AotRunner.eager_is_faster), always compiled, always eager. Medians of
12 forwards, the three interleaved.

    python scripts/cpu_compiled_spans.py
"""

from __future__ import annotations

import statistics
import time

import torch

from specd.runtime.loading import load_model
from specd.runtime.pool import pooled_extend

CASES = [[60] * 2 + [250] * 6, [50] * 4 + [300] * 4, [500] * 8, [50] * 4 + [1000] * 4, [2000] * 8,
         [200] * 7 + [2000], [50] * 7 + [4500], [2000], [4000]]


def timed(sessions, contexts, widths) -> float:
    t0 = time.perf_counter()
    pooled_extend(sessions, [[5] * w for w in widths], widths)
    seconds = time.perf_counter() - t0
    for s, n in zip(sessions, contexts):
        s.rollback(n)
    return 1e3 * seconds


def main() -> None:
    model = load_model("embedded", device="cpu", dtype="float32")
    pool = model.use_pool(8, 4608, compiled="on")
    runner = pool.runner
    choice = runner.eager_is_faster
    modes = {"specd": choice, "compiled": lambda rows, span: False, "eager": lambda rows, span: True}
    print(f"{torch.get_num_threads()} threads; ms per forward (specd's choice / compiled / eager)")
    for contexts in CASES:
        sessions = [model.session() for _ in contexts]
        for s, n in zip(sessions, contexts):
            for at in range(0, n, 400):
                s.extend(list(range(100, 100 + min(400, n - at))), 1)
        label = " + ".join(f"{n} x{contexts.count(n)}" for n in dict.fromkeys(contexts))
        for widths in ([1] * len(contexts), [1, 4, 1, 5, 1, 1, 3, 1][:len(contexts)] if len(contexts) > 1 else [4]):
            times = {name: [] for name in modes}
            for _ in range(13):
                for name, rule in modes.items():
                    runner.eager_is_faster = rule
                    times[name].append(timed(sessions, contexts, widths))
            runner.eager_is_faster = choice
            ms = {name: statistics.median(t[1:]) for name, t in times.items()}
            print(f"contexts {label}, tokens {widths}: {ms['specd']:.1f} / {ms['compiled']:.1f} / {ms['eager']:.1f}",
                  flush=True)
        for s in sessions:
            s.close()


if __name__ == "__main__":
    with torch.inference_mode():
        main()
