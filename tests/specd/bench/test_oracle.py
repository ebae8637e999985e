"""The oracle bound of a tree drafter (the hybrid): what its side branches keep counts too."""

from __future__ import annotations

import random

import pytest

from specd.bench.oracle import CostCurve, bound, branch_reach, oracle_rounds, tree_rounds
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
