"""Contention: other processes' CPU time during a timed run, read from /proc/stat, and the
report's flagging of disturbed prompts with the speedups recomputed without them."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from specd_bench.contention import DISTURBED, CpuShare, busy_seconds, disturbed_runs, summarize
from specd_bench.report import _contention_lines

STAT = """cpu  900 10 300 5000 40 1 2 3 0 0
cpu0 100 0 50 2000 20 0 1 0 0 0
cpu1 200 10 100 1500 10 1 1 3 7 0
cpu2 600 0 150 1500 10 0 0 0 0 0
intr 12345 0 0
"""


def test_busy_seconds_counts_every_busy_field_of_our_cpus_only():
    # cpu0: user 100 + system 50 + softirq 1; cpu1: 200 + 10 + 100 + irq 1 + softirq 1 + steal 3
    # (idle, iowait and guest, which is already inside user, are not added)
    assert busy_seconds(STAT, [0, 1], 100.0) == pytest.approx((151 + 315) / 100)
    assert busy_seconds(STAT, [2], 100.0) == pytest.approx(7.5)
    assert busy_seconds(STAT, [], 100.0) == 0.0


needs_proc = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="no /proc/stat (not Linux)")
# It measures the machine's other work: it needs a machine that runs no other test beside it.
pytestmark = pytest.mark.external


@needs_proc
@pytest.mark.alone
def test_a_busy_neighbour_counts_and_our_own_work_does_not():
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.0: pass\n"
    with CpuShare() as theirs:
        subprocess.run([sys.executable, "-c", spin], check=True)
    # about 1 s of a neighbour's CPU time (less its start-up), whatever the number of CPUs
    assert theirs.foreign_s > 0.4
    assert theirs.foreign_share > 0.4 / (2.0 * len(theirs.cpus))  # of a run of about 1 s
    with CpuShare() as ours:
        t = time.perf_counter()
        while time.perf_counter() - t < 1.0:
            pass
    assert ours.foreign_s < 0.4  # our own second of spinning is not foreign


def test_unreadable_stat_measures_nothing(tmp_path):
    with CpuShare(tmp_path / "missing") as share:
        pass
    assert share.record() == {"foreign_cpu_s": None, "foreign_share": None}


def run(prompt, tps, share=0.0, seconds=1.0):
    return {"prompt": prompt, "repeat": 0, "new_tokens": 10 * tps, "wall_time_s": 10.0, "tokens_per_s": tps,
            "foreign_share": share, "foreign_cpu_s": seconds}


def test_a_prompt_is_disturbed_when_any_config_was_and_the_speedups_leave_it_out():
    records = {"ar": [run("a", 10), run("b", 10), run("c", 10, share=0.5)],
               "x/constant": [run("a", 20), run("b", 5, share=0.6), run("c", 15)]}
    assert disturbed_runs(records) == [1, 2]
    c = summarize(records, "ar")
    assert c["measured"] and c["runs"] == 3 and c["max_share"] == 0.6
    assert [d["prompt"] for d in c["disturbed"]] == ["b", "c"]
    assert c["disturbed"][0]["shares"] == {"x/constant": 0.6}
    assert c["undisturbed"]["x/constant"]["median"] == pytest.approx(2.0)
    assert c["undisturbed"]["x/constant"]["ratio_of_sums"] == pytest.approx(2.0)
    lines = "\n".join(_contention_lines(c))
    assert "2 of 3 prompt runs disturbed" in lines and "b, c" in lines and "| x/constant | 2.00× [2.00, 2.00] | 2.00× |" in lines


def test_small_shares_and_short_bursts_are_not_flagged():
    just_below = DISTURBED * 0.99
    records = {"ar": [run("a", 10, share=just_below), run("b", 10, share=0.5, seconds=0.05)],
               "x/constant": [run("a", 20), run("b", 20)]}
    c = summarize(records, "ar")
    assert c["disturbed"] == [] and c["undisturbed"] is None
    assert "none above 10%" in "\n".join(_contention_lines(c))


def test_no_measurements_say_so():
    records = {"ar": [{**run("a", 10), "foreign_share": None, "foreign_cpu_s": None}]}
    assert summarize(records, "ar") == {"measured": False}
    assert "not measured" in "\n".join(_contention_lines({"measured": False}))
