"""The oracle bound of a tree drafter (the hybrid): what its side branches keep counts too."""

from __future__ import annotations

import random

import pytest

from specd_bench.oracle import CostCurve, ar_step, at_step_cost, bound, branch_reach, oracle_rounds, tree_rounds
from specd_bench.report import add_oracle_fractions
from specd.drafters import EarlyExitDrafter, HybridDrafter, NgramDrafter

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1]
OUTPUT = [2, 3, 4, 5, 6, 1, 2, 9, 9]  # the cycle goes on for 7 tokens, then leaves it


@pytest.mark.parametrize("agree, reach, rounds, drafted", [
    # no model token right; branches reach 3 at y_0 and 2 at y_4: keep them, draft nothing
    ([0] * 8, [3, 0, 0, 0, 2, 0, 0, 0], [3, 2, 0], [0, 0, 0]),
    # the model's run (3) beats the branch (2): its tokens are drafted and paid for
    ([1, 1, 1, 0, 0, 0], [2, 0, 0, 0, 0, 0], [3, 0, 0], [3, 0, 0]),
    # a tie goes to the free branch
    ([1, 1, 0, 0, 0], [2, 0, 0, 0, 0], [2, 0, 0], [0, 0, 0]),
    # a branch never keeps the last token (room for the verified one)
    ([0, 0, 0], [5, 5, 5], [2], [0]),
])
def test_tree_rounds_keep_the_longer_of_chain_and_branch(agree, reach, rounds, drafted):
    got_rounds, got_drafted = tree_rounds([bool(a) for a in agree], reach, 16)
    assert (got_rounds, got_drafted) == (rounds, drafted)
    assert sum(k + 1 for k in got_rounds) == len(agree)


def test_without_branches_the_tree_oracle_is_the_chain_oracle():
    rng = random.Random(0)
    for _ in range(50):
        agree = [rng.random() < 0.6 for _ in range(rng.randrange(40))]
        window = rng.randrange(1, 9)
        rounds, drafted = tree_rounds(agree, [0] * len(agree), window)
        assert rounds == drafted == oracle_rounds(agree, window)


def test_bound_pays_draft_steps_only_for_drafted_tokens():
    curve = CostCurve(t_draft=0.5, ks=[1, 2, 4], t_target_k=[1.0, 2.0, 4.0])
    chain = bound([0, 2], curve, t_prefill=1.0)
    tree = bound([0, 2], curve, t_prefill=1.0, drafted=[0, 0])  # the 2 tokens came from a branch
    assert chain["time_s"] == pytest.approx(1.0 + 2 * 0.5 + 3.0)
    assert tree["time_s"] == pytest.approx(1.0 + 3.0)
    assert tree["new_tokens"] == chain["new_tokens"] == 4 and tree["drafted"] == 0


def test_ar_step_is_the_target_alones_cost_per_token_after_the_prefill():
    records = [{"new_tokens": 11, "wall_time_s": 2.5}, {"new_tokens": 11, "wall_time_s": 3.5}]
    assert ar_step(records, t_prefill=0.5) == pytest.approx(((2.0 / 10) + (3.0 / 10)) / 2)
    assert ar_step([{"new_tokens": 1, "wall_time_s": 1.0}], t_prefill=0.5) is None
    assert ar_step([], t_prefill=0.5) is None


def test_at_ar_step_the_bound_without_agreement_is_ars_own_time():
    curve = CostCurve(t_draft=0.5, ks=[1, 2, 4], t_target_k=[1.0, 2.0, 4.0])
    records = [{"new_tokens": 6, "wall_time_s": 0.3 + 5 * 1.25}]
    step = ar_step(records, t_prefill=0.3)
    scaled = at_step_cost(curve, step)
    # a window of none: the prefill then five one-token steps at ar's cost, exactly ar's wall time
    assert bound([0] * 6, scaled, t_prefill=0.3)["time_s"] == pytest.approx(records[0]["wall_time_s"])
    # every target cost is scaled alike, the draft's is kept, the measured curve is untouched
    assert bound([0, 2], scaled, t_prefill=1.0)["time_s"] == pytest.approx(1.0 + 2 * 0.5 + 1.25 * 3.0)
    assert curve.t_target(1) == 1.0 and scaled.t_draft == 0.5
    # a curve measured from k = 2 on: t_target(1) is its extrapolation, and still becomes ar's step
    assert at_step_cost(CostCurve(t_draft=0.5, ks=[2, 4], t_target_k=[2.0, 4.0]), 1.25).t_target(1) == \
        pytest.approx(1.25)


def test_fractions_at_ar_step_only_where_every_prompt_has_it():
    configs = [{"label": "hf/constant", "drafter": "hf"}]
    rows = [{"new_tokens": 10, "time_s": 1.0, "time_at_ar_step_s": 2.0},
            {"new_tokens": 10, "time_s": 1.0, "time_at_ar_step_s": 2.0}]
    aggregates = {"hf/constant": {"tokens_per_s": 5.0}}
    oracle = {"drafters": {"hf": {"per_prompt": rows}}}
    add_oracle_fractions(aggregates, configs, oracle)
    assert oracle["drafters"]["hf"]["tokens_per_s"] == pytest.approx(10.0)
    assert oracle["drafters"]["hf"]["tokens_per_s_at_ar_step"] == pytest.approx(5.0)
    assert aggregates["hf/constant"]["oracle_fraction_at_ar_step"] == pytest.approx(1.0)
    # a run from before the field (a part joined by bench-merge): no half-summed bound
    del rows[1]["time_at_ar_step_s"]
    aggregates, oracle = {"hf/constant": {"tokens_per_s": 5.0}}, {"drafters": {"hf": {"per_prompt": rows}}}
    add_oracle_fractions(aggregates, configs, oracle)
    assert "tokens_per_s_at_ar_step" not in oracle["drafters"]["hf"]
    assert "oracle_fraction_at_ar_step" not in aggregates["hf/constant"]


def test_the_report_line_at_ar_step_skips_one_token_answers():
    """A one-token answer has no decoding step (ar_step None, its bound is its prefill): the
    report's mean step is over the prompts that decoded."""
    from specd_bench.report import _oracle_lines

    rows = [{"new_tokens": 11, "time_s": 1.0, "ar_step_s": 0.04, "time_at_ar_step_s": 1.2,
             "verifications": 5, "draft_lengths": []},
            {"new_tokens": 1, "time_s": 0.1, "ar_step_s": None, "time_at_ar_step_s": 0.1,
             "verifications": 1, "draft_lengths": [0]}]
    entry = {"per_prompt": rows, "cost_curve": {"t_draft_s": 0.01, "k": [1, 2], "t_target_s": [0.035, 0.04]}}
    oracle = {"window": 16, "drafters": {"hf": entry}}
    aggregates = {"ar": {"tokens_per_s": 8.0}, "hf/constant": {"tokens_per_s": 9.1}}
    add_oracle_fractions(aggregates, [{"label": "hf/constant", "drafter": "hf"}], oracle)
    assert entry["tokens_per_s_at_ar_step"] == pytest.approx(12 / 1.3)
    lines = "\n".join(_oracle_lines(oracle, aggregates))
    assert "(40.0 ms mean, against the curve's t_target(1) 35.0 ms): 9.2 tok/s, 1.15× ar" in lines
    assert "hf/constant 99%" in lines


def test_branch_reach_is_what_the_hybrids_branches_match(tiny_target):
    hybrid = HybridDrafter(EarlyExitDrafter(tiny_target, 2), NgramDrafter())
    assert hybrid.branch_length == 4
    reach = branch_reach(hybrid, PROMPT, OUTPUT, [False] * len(OUTPUT), 16)
    # at y_s the lookup proposes the cycle's next 4 tokens: right until the output leaves it
    assert reach == [4, 4, 4, 4, 3, 2, 1, 0, 0]


def test_a_branch_that_repeats_the_chain_is_not_offered(tiny_target):
    """As in the engine: a branch equal to the chain's start adds no node, so it reaches nothing
    the chain does not (and another branch may take its place)."""
    hybrid = HybridDrafter(EarlyExitDrafter(tiny_target, 2), NgramDrafter())
    agree = [True] * 4 + [False] * (len(OUTPUT) - 4)  # the model's chain at y_0 is the branch itself
    reach = branch_reach(hybrid, PROMPT, OUTPUT, agree, 16)
    assert reach[0] == 0 and reach[4:] == [3, 2, 1, 0, 0]
    rounds, drafted = tree_rounds(agree, reach, 16)
    assert rounds[0] == 4 and drafted[0] == 4
