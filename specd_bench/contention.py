"""Was the machine shared while a run was timed?

A benchmark's ratios are only as good as the machine's quiet. Configurations are interleaved per
prompt so that slow drift cancels, but a burst of other work (a test suite, a training run, a
hypervisor's neighbour) lands on one configuration of one prompt and skews it: a pytest run on the
same two cores once made single runs take 2-16x their time (docs/benchmarks.md). So every timed
run also records how much of the CPUs this process may run on went to other processes meanwhile:

    foreign_s     = Δ busy time of those CPUs (/proc/stat: user, nice, system, irq, softirq and
                    steal, i.e. everything but idle and iowait)  −  Δ this process's CPU time
    foreign_share = foreign_s / (wall time x number of those CPUs)

A (prompt, repeat) is *disturbed* when any configuration's run on it had foreign_share above
DISTURBED and at least MIN_FOREIGN_S seconds (/proc/stat counts in ticks of 10 ms, so a short run's
share alone is noisy). The report flags disturbed prompts and repeats every speedup over the
undisturbed ones. Where /proc/stat cannot be read (not Linux) nothing is measured and nothing is
flagged. In a container limited by a CPU quota rather than by affinity, /proc/stat shows the
host's CPUs, so the share is diluted over them and counts other containers' work: a coarse flag
there, not a measure of what the bench lost.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path

from specd_bench.metrics import speedups

DISTURBED = 0.10  # other processes used more than a tenth of our CPUs during a run
MIN_FOREIGN_S = 0.1  # ... and at least this much CPU time (10 ticks)
PROC_STAT = Path("/proc/stat")
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)  # user nice system [idle iowait] irq softirq steal (guest is inside user)


def our_cpus() -> list[int]:
    """The CPUs this process may run on."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def busy_seconds(stat_text: str, cpus: Iterable[int], tick_hz: float) -> float:
    """Busy CPU seconds since boot of `cpus`, from the text of /proc/stat."""
    wanted = {f"cpu{c}" for c in cpus}
    ticks = 0
    for line in stat_text.splitlines():
        name, _, rest = line.partition(" ")
        if name in wanted:
            fields = rest.split()
            ticks += sum(int(fields[i]) for i in _BUSY_FIELDS if i < len(fields))
    return ticks / tick_hz


class CpuShare:
    """Measures other processes' use of our CPUs over a `with` block:

        with CpuShare() as share:
            run()
        share.foreign_s, share.foreign_share   # None where /proc/stat is unreadable
    """

    def __init__(self, stat_path: Path = PROC_STAT):
        self.stat_path = stat_path
        self.cpus = our_cpus()
        self.tick_hz = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self.foreign_s: float | None = None
        self.foreign_share: float | None = None

    def _busy(self) -> float | None:
        try:
            return busy_seconds(self.stat_path.read_text(), self.cpus, self.tick_hz)
        except (OSError, ValueError):
            return None

    def __enter__(self) -> CpuShare:
        self._busy0, self._own0, self._wall0 = self._busy(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy, own, wall = self._busy(), time.process_time() - self._own0, time.perf_counter() - self._wall0
        if busy is None or self._busy0 is None or wall <= 0:
            return
        self.foreign_s = max(0.0, busy - self._busy0 - own)
        self.foreign_share = min(1.0, self.foreign_s / (wall * len(self.cpus)))

    def record(self) -> dict:
        return {"foreign_cpu_s": self.foreign_s, "foreign_share": self.foreign_share}


def is_disturbed(record: dict) -> bool:
    share, seconds = record.get("foreign_share"), record.get("foreign_cpu_s")
    return share is not None and share > DISTURBED and seconds >= MIN_FOREIGN_S


def disturbed_runs(records: dict[str, list[dict]]) -> list[int]:
    """Indices i (the i-th (prompt, repeat), the same in every configuration's list) at which some
    configuration's run was disturbed."""
    lists = list(records.values())
    n = min((len(r) for r in lists), default=0)
    return [i for i in range(n) if any(is_disturbed(r[i]) for r in lists)]


def summarize(records: dict[str, list[dict]], baseline: str) -> dict:
    """results.json's "contention": the shares seen, the disturbed (prompt, repeat)s with the
    configurations that were, and every configuration's speedup over the undisturbed ones."""
    shares = [r["foreign_share"] for recs in records.values() for r in recs if r.get("foreign_share") is not None]
    if not shares:
        return {"measured": False}
    bad = disturbed_runs(records)
    first = records[baseline]
    out = {"measured": True, "threshold": DISTURBED, "min_foreign_s": MIN_FOREIGN_S,
           "mean_share": sum(shares) / len(shares), "max_share": max(shares),
           "runs": len(first), "disturbed": [
               {"prompt": first[i]["prompt"], "repeat": first[i]["repeat"],
                "shares": {label: recs[i]["foreign_share"] for label, recs in records.items() if is_disturbed(recs[i])}}
               for i in bad],
           "undisturbed": None}
    if bad:
        skip = set(bad)
        keep = {label: [r for i, r in enumerate(recs) if i not in skip] for label, recs in records.items()}
        out["undisturbed"] = {}  # stays empty when every run was disturbed
        if keep[baseline]:
            for label, recs in keep.items():
                sp = speedups(recs, keep[baseline])
                del sp["per_run"]
                out["undisturbed"][label] = sp
    return out
