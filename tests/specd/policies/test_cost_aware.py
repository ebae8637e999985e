"""The cost-aware policy against hand-made cost curves: long windows where verification is
flat (a GPU), short ones where it is steep (a CPU), no window for a guess it does not believe,
and an acceptance table that learns from verification outcomes and survives the state store."""

from __future__ import annotations

import pytest

from specd.costs import CostCurve
from specd.errors import InvalidRequest
from specd.policies import Decision, PolicyResources, build_policy
from specd.policies.cost_aware import feature_bin
from specd.types import DraftStep, RoundOutcome

C, S, D = Decision.CONTINUE, Decision.STOP, Decision.DROP
KS = list(range(1, 18))
FLAT = CostCurve(0.0005, KS, [0.020 + 0.0002 * (n - 1) for n in KS])  # GPU-like: 20 ms for any window
STEEP = CostCurve(0.002, KS, [0.033 + 0.012 * (n - 1) for n in KS])  # CPU-like: each token adds 36%
# What the embedded pair measured on the 2-core CPU (issue 6): a jump from 1 to 2 tokens, then flatter.
CPU = CostCurve(0.0001, [1, 2, 4, 6, 8, 17], [0.033, 0.045, 0.053, 0.053, 0.062, 0.075])


def policy(costs: CostCurve, state: dict | None = None, **overrides):
    return build_policy("cost-aware", overrides, state, PolicyResources(costs=costs))


def model_step(index: int, prob: float) -> DraftStep:
    return DraftStep(index, index - 1, 7, prob, prob, 0.5)


def ngram_step(index: int, match_len: int, token: int = 7, retrieved: bool = False, votes: int = 0,
               support: float = 1.0) -> DraftStep:
    return DraftStep(index, index - 1, token, 1.0, 1.0, 0.0, None, match_len, retrieved, votes, support)


def window(p, make_step, cap: int = 64) -> tuple[int, Decision]:
    """Draft identical tokens until the policy does not continue: (index, decision)."""
    p.begin_round()
    for i in range(1, cap + 1):
        decision = p.decide(make_step(i))
        if decision is not C:
            return i, decision
    return cap, C


def test_flat_verification_drafts_long_windows_steep_short_ones():
    confident = lambda i: model_step(i, 0.85)  # prior: accepted 85% of the time
    k_flat, _ = window(policy(FLAT), confident)
    assert k_flat >= 10  # the rate E_k / C_k peaks at k = 12 here
    k, decision = window(policy(STEEP), confident)
    assert decision is S and k == 3  # peaks at k = 3
    # The same policy on the same curve drafts shorter for worse tokens.
    k_unsure, _ = window(policy(STEEP), lambda i: model_step(i, 0.65))
    assert k_unsure < k


def test_a_guess_it_does_not_believe_is_not_verified():
    # A first token with a 5% chance: verifying it costs 36% more than a plain step on a CPU.
    assert policy(STEEP).decide(model_step(1, 0.05)) is D
    # On a GPU the same token costs next to nothing to verify, so it is kept.
    assert policy(FLAT).decide(model_step(1, 0.05)) is not D


def test_look_ahead_crosses_the_cpu_jump():
    # On the measured CPU curve verifying 2 tokens costs 36% more than 1, but 5 cost only 60%
    # more. A first n-gram token accepted 30% of the time is not worth 36% on its own, but when
    # the tokens after it, once it is right, are accepted 95% of the time, the window is.
    later = {"n8i2:a": 95.0, "n8i2:r": 5.0, "n8i3:a": 95.0, "n8i3:r": 5.0, "n8i4:a": 95.0, "n8i4:r": 5.0}
    first = {"n8i1:a": 30.0, "n8i1:r": 70.0}
    assert policy(CPU, {**first, **later}).decide(ngram_step(1, 9)) is C
    unsure_later = {key: 30.0 if key.endswith(":a") else 70.0 for key in later}
    assert policy(CPU, {**first, **unsure_later}).decide(ngram_step(1, 9)) is D


def test_ngram_bins_learn_from_outcomes_and_dropped_tokens():
    p = policy(CPU)
    before = p.estimate("n1i1")
    # one-token matches keep failing, in windows and as dropped first tokens
    for _ in range(20):
        p.observe(RoundOutcome(2, 0, (0.0, 0.0), False, (), (ngram_step(1, 1), ngram_step(2, 1))))
        p.observe(RoundOutcome(0, 0, (), False, (), (), ngram_step(1, 1), False))
    assert p.estimate("n1i1") < min(before, 0.1)
    assert p.estimate("n1i2") == before  # never judged: after a rejection nothing is learnt
    assert p.decide(ngram_step(1, 1)) is D
    # long matches keep succeeding
    p.begin_round()
    for _ in range(20):
        p.observe(RoundOutcome(3, 3, (0.0,) * 3, False, (), tuple(ngram_step(i, 8) for i in (1, 2, 3))))
    assert p.estimate("n8i1") > 0.9 and p.decide(ngram_step(1, 8)) is C


def test_retrieved_matches_are_calibrated_apart_from_the_requests_own():
    """A 3-token match in the datastore is not as good as a 3-token repeat of this request's
    own text: their outcomes land in separate bins, and the decisions follow."""
    p = policy(CPU)
    for _ in range(30):
        p.observe(RoundOutcome(2, 0, (0.0, 0.0), False, (), (ngram_step(1, 3, retrieved=True),
                                                              ngram_step(2, 3, retrieved=True))))
        p.observe(RoundOutcome(3, 3, (0.0,) * 3, False, (), tuple(ngram_step(i, 3) for i in (1, 2, 3))))
    assert p.estimate("r3i1") < 0.1 < 0.9 < p.estimate("n3i1")
    assert p.decide(ngram_step(1, 3, retrieved=True)) is D
    p.begin_round()
    assert p.decide(ngram_step(1, 3)) is C


def test_votes_split_a_match_length_bin_and_start_from_its_estimate():
    """Within one match length, a token most occurrences disagree with is a worse bet than one
    many agree on: their outcomes land in separate vote bins, and the decisions follow. A vote
    class never seen starts from the match length's own estimate."""
    p = policy(CPU)
    contested = lambda i: ngram_step(i, 3, retrieved=True, votes=10, support=0.3)
    settled = lambda i: ngram_step(i, 3, retrieved=True, votes=10, support=1.0)
    for _ in range(30):
        p.observe(RoundOutcome(1, 0, (0.0,), False, (), (contested(1),)))
        p.observe(RoundOutcome(3, 3, (0.0,) * 3, False, (), tuple(settled(i) for i in (1, 2, 3))))
    assert p.estimate("r3i1v0") < 0.1 < 0.9 < p.estimate("r3i1v4")
    assert 0.3 < p.estimate("r3i1") < 0.7  # the parent saw both
    assert p.estimate("r3i1v2") == pytest.approx(p.estimate("r3i1"))  # unseen class: the parent's
    assert p.decide(contested(1)) is D
    p.begin_round()
    assert p.decide(settled(1)) is C
    # votes unknown (0): the match length's bin alone
    assert p.estimate("r3i1") == pytest.approx(p.estimate(feature_bin(ngram_step(1, 3, retrieved=True))))


def test_race_noise_splits_the_bins_under_coupled_sampling():
    """Seeded sampling: a token the race noise favours (small E) is a better bet than the same
    match's token the noise is against; the bins learn it and the decisions follow."""
    p = policy(CPU)
    step = lambda i, e: DraftStep(i, i - 1, 7, 1.0, 1.0, 0.0, None, 3, True, 10, 1.0, e)
    assert feature_bin(step(1, 0.05)) == "r3i1v4e0" and feature_bin(step(1, 2.0)) == "r3i1v4e4"
    assert feature_bin(model_step(1, 0.35)) == "q3"  # greedy: no noise class
    for _ in range(30):
        p.observe(RoundOutcome(2, 2, (0.0,) * 2, False, (), (step(1, 0.05), step(2, 0.05))))
        p.observe(RoundOutcome(1, 0, (0.0,), False, (), (step(1, 2.0),)))
    assert p.estimate("r3i1v4e4") < 0.1 < 0.9 < p.estimate("r3i1v4e0")
    assert p.estimate("r3i1v4e2") == pytest.approx(p.estimate("r3i1v4"))  # unseen: the parent's
    assert p.decide(step(1, 2.0)) is D
    p.begin_round()
    assert p.decide(step(1, 0.05)) is C


def test_the_table_is_shared_state_and_forgets_slowly():
    p = policy(STEEP, memory=10.0)
    for _ in range(50):
        p.observe(RoundOutcome(1, 1, (0.5,), False, (), (model_step(1, 0.35),)))
    high = p.estimate("q3")
    assert high > 0.8  # q(x) in [0.3, 0.4) but accepted every time: recalibrated up
    again = policy(STEEP, p.state(), memory=10.0)
    assert again.estimate("q3") == pytest.approx(high)
    for _ in range(50):  # the traffic changes: old outcomes fade (memory 10)
        again.observe(RoundOutcome(1, 0, (0.5,), False, (), (model_step(1, 0.35),)))
    assert again.estimate("q3") < 0.2


def test_needs_the_cost_curve():
    with pytest.raises(InvalidRequest) as err:
        build_policy("cost-aware", {})
    assert err.value.field == "policy" and "cost curve" in err.value.message


def test_cost_curve_follows_observed_forwards():
    curve = CostCurve(0.001, [1, 2, 4], [0.010, 0.020, 0.040])
    for _ in range(200):
        curve.observe_target(2, 0.040)  # the machine got twice as slow
        curve.observe_draft(0.003)
    assert curve.t_target(4) == pytest.approx(0.080, rel=0.01)  # the whole curve, not just n = 2
    assert curve.t_draft == pytest.approx(0.003, rel=0.01)
    assert curve.round_time(3) == pytest.approx(3 * 0.003 + 0.080, rel=0.01)


def test_stops_drafting_when_the_drafter_does_not_earn_its_time_back_but_keeps_looking():
    # An untrained early-exit drafter on a CPU: a draft step costs half a target step and its
    # tokens are almost never right.
    slow_draft = CostCurve(0.016, [1, 2, 4, 6, 8, 17], [0.033, 0.045, 0.053, 0.053, 0.062, 0.075])
    p = policy(slow_draft, explore=8)
    assert p.should_draft()  # no evidence yet
    for _ in range(50):
        p.observe(RoundOutcome(1, 0, (0.5,), False, (), (model_step(1, 0.55),)))
    decisions = [p.should_draft() for _ in range(32)]
    # it explores on the 8th round after it stopped, then 16 rounds later: twice as far apart each
    # time drafting still does not pay
    assert [i for i, d in enumerate(decisions) if d] == [7, 23]
    gaps = []
    for _ in range(2000):
        gaps.append(0)
        while not p.should_draft():
            gaps[-1] += 1
    assert gaps[1:3] == [63, 127] and max(gaps) == 16 * 8 - 1  # at most EXPLORE_BACKOFF x explore
    # the same evidence with a nearly free drafter (n-gram): looking at the first token costs nothing
    q = policy(CPU, p.state(), explore=8)
    assert all(q.should_draft() for _ in range(32))
    # and a drafter that pays for itself keeps drafting
    good = policy(slow_draft, explore=8)
    for _ in range(50):
        good.observe(RoundOutcome(3, 3, (0.5,) * 3, False, (), tuple(model_step(i, 0.95) for i in (1, 2, 3))))
    assert all(good.should_draft() for _ in range(32))


# A target whose batched forward is launch-bound up to 8 sessions (flat) and compute-bound beyond:
# B sessions x 1 token cost BATCH[B-1]; each further token BATCH_TOKEN[B-1].
BATCH = [0.020 + 0.0005 * b if b <= 8 else 0.024 + 0.006 * (b - 8) for b in range(1, 33)]
BATCH_TOKEN = [0.0002 if b <= 8 else 0.006 for b in range(1, 33)]


def loaded_policy(others: tuple[int, int] | None) -> object:
    costs = CostCurve(0.0005, KS, [0.020 + 0.0002 * (n - 1) for n in KS], batch_seconds=list(BATCH),
                      batch_token_seconds=list(BATCH_TOKEN), load_smoothing=1.0)
    if others is not None:
        costs.observe_load(*others)
    return policy(costs)


def test_under_load_windows_follow_the_batch_they_join():
    """The load-aware decision table: a small batch on a flat surface keeps long windows; a large,
    compute-bound batch makes even a likely draft not worth the forward it slows for everyone."""
    confident = lambda i: model_step(i, 0.85)
    alone, _ = window(loaded_policy(None), confident)
    small, _ = window(loaded_policy((3, 3)), confident)
    assert alone >= 10 and small >= 8
    k, decision = window(loaded_policy((31, 31)), confident)
    assert (k, decision) == (1, D)  # 32 sessions: each token costs as much as another session's step


def test_a_round_no_window_could_pay_for_asks_the_drafter_nothing():
    """Under a compute-bound load each further token of the forward costs what another session's
    step does: even a window of sure drafts loses, so the round is plain without a lookup (the
    drafter's time would be spent for a token the policy then drops)."""
    from specd.drafters import build_drafter
    from specd.speculation.proposer import Proposer
    from specd.types import SamplingParams

    calls = []

    def session():  # the n-gram drafter's own session, its lookups counted
        s = build_drafter("ngram", None).open(64)
        lookup = s.next
        s.next = lambda *a, **k: calls.append(1) or lookup(*a, **k)
        return s

    seq = [1, 2, 3, 4, 1, 2, 3]  # "1 2 3" was followed by 4: a match to draft from

    def propose(policy):
        """Whether the round's first draft step ran, and the proposer's events."""
        events = []
        p = Proposer(session(), policy, SamplingParams(), list(seq), max_length=64, lookahead=1, send_q=False,
                     publish=events.append)
        if (ready := p.prepare()) is None:
            return False, events
        window, epoch, after = ready
        p.drafted(window, epoch, after, p.next(after), 0.0)
        return True, events

    busy = loaded_policy((31, 31))
    ran, events = propose(busy)
    assert not ran and not calls
    assert events[0].start == events[0].end and events[0].repeat == 1  # a plain round, the load looked at next round
    for quiet in (loaded_policy((3, 3)), loaded_policy(None)):
        assert propose(quiet)[0]
    assert calls


def test_speculation_comes_back_when_the_load_falls():
    """The load is a moving average of what the verifications report, so windows come back over a
    few rounds once the batch shrinks (and not on one quiet forward)."""
    p = loaded_policy(None)
    p.costs.load_smoothing = 0.5
    confident = lambda i: model_step(i, 0.85)
    for _ in range(6):
        p.costs.observe_load(31, 31)
    assert window(p, confident) == (1, D)
    p.costs.observe_load(0, 0)  # one forward alone: still about 15 others on average
    assert window(p, confident) == (1, D)
    for _ in range(6):
        p.costs.observe_load(0, 0)
    assert window(p, confident)[0] >= 10


def test_an_unloaded_curve_prices_windows_as_before():
    costs = CostCurve(0.002, KS, [0.033 + 0.012 * (n - 1) for n in KS], batch_seconds=list(BATCH),
                      batch_token_seconds=list(BATCH_TOKEN))
    costs.observe_load(0, 0)
    for k in range(8):
        assert costs.loaded_time(k) == costs.round_time(k)
        assert costs.loaded_rate(2.0, k) == 2.0 / costs.round_time(k)


def paying_policy(**overrides):
    """A model drafter whose rounds pay on the cost curve: 3 of 3 drafts accepted."""
    slow_draft = CostCurve(0.016, [1, 2, 4, 6, 8, 17], [0.033, 0.045, 0.053, 0.053, 0.062, 0.075])
    p = policy(slow_draft, explore=8, **overrides)
    for _ in range(20):
        p.observe(RoundOutcome(3, 3, (0.5,) * 3, False, (), tuple(model_step(i, 0.95) for i in (1, 2, 3))))
    return p


def test_measured_pace_overrules_the_cost_curve():
    """The curve prices each process alone; a draft model sharing the target's cores slows every
    round it runs in. When the clock says rounds with the drafter emit tokens more slowly than
    plain rounds, drafting stops, whatever the curve says; when it says they emit faster, it
    goes on."""
    p = paying_policy()
    assert p.drafting_pays() and p.measured_speedup() is None  # the curve alone: it pays
    for _ in range(10):
        p.observe_pace(2, 0.080, drafted=True)  # 25 tokens/s with the drafter
        p.observe_pace(1, 0.033, drafted=False)  # 30 tokens/s without
    assert p.measured_speedup() == pytest.approx(25 / 30.3, rel=0.01)
    assert not p.drafting_pays()
    assert [p.should_draft() for _ in range(8)].count(True) == 1  # exploring only
    q = paying_policy()
    for _ in range(10):
        q.observe_pace(3, 0.080, drafted=True)
        q.observe_pace(1, 0.033, drafted=False)
    assert q.drafting_pays() and all(q.should_draft() for _ in range(6))


def test_while_drafting_pays_a_plain_round_is_timed_now_and_then():
    """Without a recent plain round there is nothing to compare the drafting rounds with, so the
    policy runs one every so often (once the last has faded from the pace), and never for a
    nearly free drafter."""
    p = paying_policy()
    decisions = []
    for _ in range(300):
        d = p.should_draft()
        decisions.append(d)
        p.observe_pace(3, 0.080, drafted=d) if d else p.observe_pace(1, 0.033, drafted=False)
    plain = [i for i, d in enumerate(decisions) if not d]
    assert plain and plain[0] == 7  # the first after `explore` rounds
    assert 2 <= len(plain) <= 5  # then each time the last one has faded (about every 90 rounds)
    free = policy(CPU, p.state(), explore=8)  # an n-gram lookup: looking costs nothing
    assert all(free.should_draft() for _ in range(300))


def test_the_measured_pace_is_shared_state():
    p = paying_policy()
    for _ in range(4):
        p.observe_pace(2, 0.080, drafted=True)
        p.observe_pace(1, 0.033, drafted=False)
    q = policy(p.costs, p.state())
    assert q.measured_speedup() == pytest.approx(p.measured_speedup())


def test_plain_rounds_announce_the_stretch_to_the_next_exploring_round():
    """While drafting does not pay, a draft service may ask once how many rounds will be plain
    (so the coordinator need not wait on it each round): up to the next exploring round, the
    same rounds the policy would have declined one by one."""
    slow_draft = CostCurve(0.016, [1, 2, 4, 6, 8, 17], [0.033, 0.045, 0.053, 0.053, 0.062, 0.075])

    def gated():
        p = policy(slow_draft, explore=8)
        for _ in range(50):
            p.observe(RoundOutcome(1, 0, (0.5,), False, (), (model_step(1, 0.55),)))
        return p

    one_by_one = gated()
    per_round = [one_by_one.should_draft() for _ in range(40)]
    stretched, decisions = gated(), []
    while len(decisions) < 40:
        if stretched.should_draft():
            decisions.append(True)
        else:
            decisions += [False] * stretched.plain_rounds()
    assert decisions[:40] == per_round
    assert [i for i, d in enumerate(per_round) if d] == [7, 23]


# A GPU target through the services: a 2 ms step, an n-gram lookup at next to nothing, and 0.8 ms
# of round trip a round pays beyond the forward (a plain stretch's later rounds skip it).
SERVICES_GPU = CostCurve(0.00001, KS, [0.002 + 0.00005 * (n - 1) for n in KS], overhead=0.0008)


def test_a_lookup_that_costs_a_round_trip_is_timed_like_a_model_drafter():
    """In process an n-gram lookup is nearly free and never second-guessed. Through the services
    each round that asks for one pays a round trip that plain stretches skip, so the policy times
    plain probes too, and stops drafting when the rounds that asked emit tokens more slowly."""
    p = policy(SERVICES_GPU, explore=8)
    decisions = []
    for _ in range(40):
        d = p.should_draft()
        decisions.append(d)
        if d:
            p.observe(RoundOutcome(1, 1, (0.5,), False, (), (ngram_step(1, 3),)))
            p.observe_pace(1, 0.0031, drafted=True)  # no match: a step and the round trip to ask
        else:
            assert p.plain_rounds() == 2  # a probe: its second round times the stretch
            p.observe_pace(1, 0.002, drafted=False)
            break
    assert decisions.index(False) == 7  # the first probe, on the `explore`-th round
    assert p.measured_speedup() < 0.98 and not p.drafting_pays()
    assert [p.should_draft() for _ in range(8)].count(True) == 1  # exploring only
    # the same evidence in process, where a round costs no overhead: it keeps drafting
    q = policy(CostCurve(0.00001, KS, [0.002 + 0.00005 * (n - 1) for n in KS]), p.state(), explore=8)
    assert q.drafting_pays() and all(q.should_draft() for _ in range(300))
    assert q.plain_rounds() == 1
