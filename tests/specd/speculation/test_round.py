"""The round's shared steps (specd.speculation.round, specd.stats, specd.types, specd.policies), which the
engine and the services both call."""

import pytest

from specd.errors import InvalidRequest
from specd.policies import PolicyResources, check_drafter, check_spec, request_policy
from specd.speculation.round import commit_tokens
from specd.sampling import request_generator
from specd.stats import GenerationStats
from specd.types import DraftStep, RoundOutcome, SamplingParams, SpecParams


def test_commit_cuts_after_eos_and_at_the_length_limit():
    assert commit_tokens([5, 6, 7], 10, {99}, 100) == ([5, 6, 7], None)
    assert commit_tokens([5, 99, 7], 10, {99}, 100) == ([5, 99], "stop")
    assert commit_tokens([5, 6, 7], 10, {99}, 12) == ([5, 6], "length")
    assert commit_tokens([99, 6], 11, {99}, 12) == ([99], "stop")  # EOS first: it is the reason


def test_record_round_counts_drafts_and_the_judged_chain():
    stats = GenerationStats("constant", "ngram")
    stats.record_round(0, 0, 0)  # a plain step
    stats.record_round(4, 3, 2, 1, [0.1, 0.2, 0.3, 0.4])
    assert (stats.verifications, stats.drafted, stats.accepted, stats.relaxed_accepted) == (2, 4, 3, 1)
    assert stats.draft_lengths == [4] and stats.accepted_lengths == [3]
    assert stats.judged_entropies == [0.1, 0.2, 0.3] and stats.judged_accepted == [True, True, False]


def _step(token: int) -> DraftStep:
    return DraftStep(1, 0, token, 0.5, 0.5, 0.7)


def test_round_outcome_judges_a_dropped_token_only_after_a_fully_accepted_chain():
    steps, dropped = [_step(1), _step(2)], _step(3)
    assert RoundOutcome.judged(steps, 2, False, (), dropped, 3).dropped_accepted is True
    assert RoundOutcome.judged(steps, 2, False, (), dropped, 4).dropped_accepted is False
    assert RoundOutcome.judged(steps, 1, False, (), dropped, 3).dropped_accepted is None
    assert RoundOutcome.judged(steps, 2, False, (), dropped, None).dropped_accepted is None
    out = RoundOutcome.judged(steps, 1, True)
    assert (out.num_drafted, out.num_accepted, out.entropies, out.hit_cap) == (2, 1, (0.7, 0.7), True)


def test_request_generator_only_for_unseeded_sampling():
    assert request_generator(SamplingParams()) is None
    assert request_generator(SamplingParams(temperature=1.0, seed=3)) is None
    assert request_generator(SamplingParams(temperature=1.0)) is not None


@pytest.mark.parametrize("spec, sampling, oracle, field", [
    (SpecParams("nope"), SamplingParams(), False, "policy"),
    (SpecParams("svip", policy_params={"h": -1.0}), SamplingParams(), False, "policy_params.h"),
    (SpecParams("constant", max_draft_tokens=300), SamplingParams(), False, "policy_params.max_draft_tokens"),
    (SpecParams("constant", relaxed=True), SamplingParams(), False, "relaxed"),
    (SpecParams("none", relaxed=True), SamplingParams(), False, "relaxed"),
    (SpecParams("oracle"), SamplingParams(), False, "policy"),
    (SpecParams("oracle"), SamplingParams(temperature=1.0), True, "policy"),
])
def test_check_spec_refuses(spec, sampling, oracle, field):
    with pytest.raises(InvalidRequest) as err:
        check_spec(spec, sampling, oracle)
    assert err.value.field == field


def test_check_spec_accepts_and_request_policy_builds():
    check_spec(SpecParams("oracle"), SamplingParams(), oracle=True)
    check_spec(SpecParams("adasd", relaxed=True), SamplingParams())
    with pytest.raises(InvalidRequest, match="ngram has none"):
        check_drafter(SpecParams("adasd", relaxed=True), "ngram", False)
    assert request_policy(SpecParams("none"), None, PolicyResources()) is None
    policy = request_policy(SpecParams("constant", max_draft_tokens=5, policy_params={"k": 3}), None,
                            PolicyResources(), lambda: pytest.fail("constant needs no cost curve"))
    assert policy.params.max_draft_tokens == 5 and policy.params.k == 3
