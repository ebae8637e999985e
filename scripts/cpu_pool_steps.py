"""CPU step times of the KV pool's exact path with and without its two batch layouts, on the
embedded target (docs/engine.md, "Packed rows on the CPU" and "Long contexts attend apart"):

- packed: a 9-token window among 7 decode steps (200-token contexts), the projections over the
  real tokens only, against the padded [8, 9] layout;
- grouped: 8 decode steps where one context is 3,600 tokens and seven are 200, attention per
  span group, against one group over the longest span (and the same with a 5-token window on
  the long one).

Medians of 7 forwards, each mode interleaved with its baseline.

    python scripts/cpu_pool_steps.py            # prints one line per shape
"""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import specd.runtime.pool as pool_module
from specd.runtime.loading import load_model
from specd.runtime.pool import pooled_extend


def median_ms(sessions, widths, lengths, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        pooled_extend(sessions, [[5] * w for w in widths], [1] * len(sessions), [False] * len(sessions))
        times.append(time.perf_counter() - t0)
        for s, n in zip(sessions, lengths):
            s.rollback(n)
    return 1e3 * statistics.median(times[1:])


def main() -> None:
    model = load_model("embedded")
    pool = model.use_pool(16, 4608)
    inputs, span_groups = pool.inputs, pool_module.KVPool._span_groups

    def padded(rows, batch, width, span):  # the layout before packing
        return replace(inputs(rows, batch, width, span), packed=None)

    def one_group(self, rows):  # the attention before grouping
        return None

    for contexts, widths, name, off in (
            ([200] * 8, [1] * 7 + [9], "window among decode steps", "padded"),
            ([3600] + [200] * 7, [1] * 8, "one long context, decode steps", "one group"),
            ([3600] + [200] * 7, [5] + [1] * 7, "one long context, a window on it", "one group")):
        sessions = [model.session() for _ in contexts]
        for s, n in zip(sessions, contexts):
            for at in range(0, n, 400):
                s.extend(list(range(100, 100 + min(400, n - at))), 1)
        results = {"on": [], "off": []}
        for _ in range(2):  # interleaved
            results["on"].append(median_ms(sessions, widths, contexts))
            if off == "padded":
                pool.inputs = padded
            else:
                pool_module.KVPool._span_groups = one_group
            try:
                results["off"].append(median_ms(sessions, widths, contexts))
            finally:
                pool.inputs, pool_module.KVPool._span_groups = inputs, span_groups
        print(f"{name}: {off} {statistics.mean(results['off']):.1f} ms -> "
              f"{statistics.mean(results['on']):.1f} ms", flush=True)
        for s in sessions:
            s.close()


if __name__ == "__main__":
    main()
