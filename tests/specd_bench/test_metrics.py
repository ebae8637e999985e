"""Benchmark arithmetic: per-run rates, aggregates, speedup median/spread, oracle rounds and
the cost-curve interpolation, on hand-made numbers."""

from __future__ import annotations

import pytest

from specd_bench.metrics import aggregate, run_record, speedups
from specd_bench.oracle import CostCurve, bound, oracle_rounds
from specd.stats import GenerationStats


def stats(new, drafted, accepted, verifications, wall, draft_lengths=(), accepted_lengths=()):
    s = GenerationStats("constant", "ngram", new_tokens=new, drafted=drafted, accepted=accepted,
                        verifications=verifications, wall_time_s=wall, draft_time_s=0.1 * wall,
                        verify_time_s=0.5 * wall)
    s.draft_lengths, s.accepted_lengths = list(draft_lengths), list(accepted_lengths)
    return s


def test_run_record_rates():
    # 4 verifications (a prefill step + 3 rounds drafting 4, 4, 2), 6 of 10 drafts accepted, 10 tokens
    r = run_record(stats(10, 10, 6, 4, 2.0, [4, 4, 2], [4, 1, 1]), [1, 2], [1, 2])
    assert r["mean_accepted_tokens"] == pytest.approx(6 / 4 + 1)
    assert r["acceptance_rate"] == pytest.approx(0.6)
    assert r["verification_rate"] == pytest.approx(0.4)
    assert r["discard_rate"] == pytest.approx(0.4)
    assert r["mean_draft_length"] == pytest.approx(10 / 3)
    assert r["tokens_per_s"] == pytest.approx(5.0)
    assert r["overhead_time_s"] == pytest.approx(0.8)
    assert r["identical"] is True
    assert run_record(stats(10, 0, 0, 10, 1.0), [1], [2])["identical"] is False


def test_speedup_median_spread_and_ratio_of_sums():
    base = [{"new_tokens": 10, "wall_time_s": 1.0, "tokens_per_s": 10.0},
            {"new_tokens": 10, "wall_time_s": 2.0, "tokens_per_s": 5.0},
            {"new_tokens": 20, "wall_time_s": 1.0, "tokens_per_s": 20.0}]
    runs = [{"new_tokens": 10, "wall_time_s": 0.5, "tokens_per_s": 20.0},  # 2x
            {"new_tokens": 10, "wall_time_s": 2.0, "tokens_per_s": 5.0},  # 1x
            {"new_tokens": 20, "wall_time_s": 0.25, "tokens_per_s": 80.0}]  # 4x
    sp = speedups(runs, base)
    assert (sp["median"], sp["min"], sp["max"]) == (2.0, 1.0, 4.0)
    assert sp["per_run"] == [2.0, 1.0, 4.0]
    assert sp["ratio_of_sums"] == pytest.approx((40 / 2.75) / (40 / 4.0))


def test_aggregate_sums_before_ratios():
    a = run_record(stats(8, 6, 3, 4, 1.0, [3, 3], [1, 2]), [1], [1])
    b = run_record(stats(4, 2, 2, 2, 1.0, [2], [2]), [1], [1])
    agg = aggregate([a, b], [a, b])
    assert agg["mean_accepted_tokens"] == pytest.approx(5 / 6 + 1)
    assert agg["acceptance_rate"] == pytest.approx(5 / 8)
    assert agg["verification_rate"] == pytest.approx(6 / 12)
    assert agg["discard_rate"] == pytest.approx(3 / 12)
    assert agg["mean_draft_length"] == pytest.approx(8 / 3)
    assert agg["draft_length_histogram"] == {"2": 1, "3": 2}
    assert agg["accepted_length_histogram"] == {"1": 1, "2": 2}
    assert agg["identical"] is True and agg["speedup"]["median"] == 1.0


@pytest.mark.parametrize("agree, window, rounds", [
    # y_0..y_7; the draft disagrees at 2 and 5: rounds draft [0,1], recover 2; [3,4], recover 5; [6], end with 7
    ([1, 1, 0, 1, 1, 0, 1, 1], 16, [2, 2, 1]),
    ([1, 1, 0, 1, 1, 0, 1, 1], 1, [1, 0, 1, 0, 1]),  # a window of 1: y_1, y_4, y_7 come as bonus tokens
    ([0, 0, 0], 16, [0, 0, 0]),  # disagreeing everywhere: one token per verification
    ([1] * 6, 16, [5]),  # all agree: draft 5, the 6th comes as the bonus token
    ([], 16, []),
])
def test_oracle_rounds(agree, window, rounds):
    got = oracle_rounds([bool(a) for a in agree], window)
    assert got == rounds
    assert sum(k + 1 for k in got) == len(agree)


def test_oracle_uncapped_verifications_are_disagreements_plus_one():
    agree = [True] * 20
    for i in (3, 7, 8, 15):
        agree[i] = False
    assert len(oracle_rounds(agree, 100)) == 4 + 1


def test_cost_curve_interpolates_and_extrapolates():
    curve = CostCurve(t_draft=0.5, ks=[1, 2, 4], t_target_k=[1.0, 2.0, 4.0])
    assert curve.t_target(3) == pytest.approx(3.0)  # between measured points
    assert curve.t_target(8) == pytest.approx(8.0)  # least-squares line beyond
    assert curve.round_time(2) == pytest.approx(2 * 0.5 + 3.0)
    b = bound([2, 0], curve, t_prefill=1.0)
    assert b["new_tokens"] == 4 and b["verifications"] == 2
    # the first round's verification is the prefill: prefill + its 2 draft steps + round 2 (t_target(1))
    assert b["time_s"] == pytest.approx(1.0 + 2 * 0.5 + 1.0)
    assert b["tokens_per_s"] == pytest.approx(4 / 3)


def test_entropy_bins_split_by_outcome():
    from specd_bench.metrics import ENTROPY_EDGES, entropy_bins

    bins = entropy_bins([0.0, 0.3, 0.3, 7.0], [True, True, False, False])
    assert bins["accepted"][0] == 1 and bins["accepted"][2] == 1 and bins["rejected"][2] == 1
    assert bins["rejected"][-1] == 1 and len(bins["accepted"]) == len(ENTROPY_EDGES) - 1


def test_failed_runs_are_left_out_of_the_figures_and_counted():
    """A peer's failed record (no numbers) keeps its place; the aggregate, the speedups and the
    contention summary are over the runs that completed, against `ar` on those same prompts."""
    from specd_bench.contention import summarize
    from specd_bench.metrics import failed_record

    def run(key, n, wall, share=0.0):
        return {"prompt": key, "repeat": 0, "new_tokens": n, "wall_time_s": wall, "tokens_per_s": n / wall,
                "identical": True, "foreign_share": share, "foreign_cpu_s": share}

    base = [run("0#t1", 10, 1.0), run("1#t1", 10, 2.0), run("2#t1", 20, 1.0, share=0.5)]
    error = failed_record(ValueError("could not broadcast input array\nfrom shape (6045696,) into shape (0,)"))
    assert error == {"failed": "ValueError: could not broadcast input array from shape (6045696,) into shape (0,)"}
    peer = [run("0#t1", 10, 0.5), {"prompt": "1#t1", "repeat": 0, **error, "foreign_share": 0.0,
                                   "foreign_cpu_s": 0.0}, run("2#t1", 20, 0.25)]
    agg = aggregate(peer, base)
    assert (agg["runs"], agg["failed_runs"], agg["failed_prompts"]) == (2, 1, ["1#t1"])
    assert agg["errors"] == {error["failed"]: 1}
    assert agg["new_tokens"] == 30 and agg["wall_time_s"] == pytest.approx(0.75) and agg["identical"] is True
    assert agg["speedup"]["per_run"] == [2.0, 4.0]
    assert agg["speedup"]["ratio_of_sums"] == pytest.approx((30 / 0.75) / (30 / 2.0))  # ar's prompts 0 and 2
    assert aggregate(base, base)["failed_runs"] == 0 and aggregate([peer[1]], [base[1]])["runs"] == 0
    assert len(failed_record(RuntimeError("x" * 500))["failed"]) == 200
    c = summarize({"ar": base, "peer": peer}, "ar")  # prompt 2 disturbed: left out, with the failed one
    assert [d["prompt"] for d in c["disturbed"]] == ["2#t1"]
    assert c["undisturbed"]["peer"]["median"] == 2.0  # prompt 0 alone


def test_a_prompt_the_baseline_failed_has_no_ratio_for_anyone():
    """Where `ar` itself failed a prompt, a configuration that ran it keeps the run in its own
    totals, but no ratio is taken there: speedups pair only runs where both sides completed."""
    from specd_bench.metrics import failed_record

    def run(key, n, wall):
        return {"prompt": key, "repeat": 0, "new_tokens": n, "wall_time_s": wall, "tokens_per_s": n / wall}

    base = [run("0#t1", 10, 1.0), {"prompt": "1#t1", "repeat": 0, **failed_record(ValueError("too long"))},
            run("2#t1", 10, 2.0)]
    other = [run("0#t1", 10, 0.5), run("1#t1", 10, 0.1), run("2#t1", 10, 0.5)]
    agg = aggregate(other, base)
    assert agg["runs"] == 3 and agg["failed_runs"] == 0 and agg["new_tokens"] == 30
    assert agg["speedup"]["per_run"] == [2.0, 4.0]
    assert agg["speedup"]["ratio_of_sums"] == pytest.approx((20 / 1.0) / (20 / 3.0))
    own = aggregate(base, base)
    assert (own["runs"], own["failed_prompts"], own["speedup"]["per_run"]) == (2, ["1#t1"], [1.0, 1.0])
