"""Table-driven tests of the stopping policies (docs/engine.md), built through the registry
exactly as the engine builds them: build_policy(name, overrides, state, resources)."""

from __future__ import annotations

import math

import pytest
import torch

from specd.errors import InvalidRequest
from specd.policies import POLICIES, AcceptanceHead, Decision, PolicyResources, build_policy
from specd.policies.threshold import OnlineThreshold
from specd.types import DraftStep, RoundOutcome

C, S, D = Decision.CONTINUE, Decision.STOP, Decision.DROP


def step(index: int = 1, *, position: int | None = None, token: int = 0, prob: float = 0.5,
         max_prob: float = 0.9, entropy: float = 0.0, hidden: torch.Tensor | None = None) -> DraftStep:
    return DraftStep(index, index - 1 if position is None else position, token, prob, max_prob, entropy,
                     hidden)


def outcome(drafted: int, accepted: int, *, hit_cap: bool = False, entropies: tuple = (),
            js: tuple = ()) -> RoundOutcome:
    return RoundOutcome(drafted, accepted, entropies or (0.0,) * drafted, hit_cap, js)


def stop_index(policy, max_steps: int = 64, **fields) -> int | None:
    """Draft one round of identical steps; the index at which the policy stops (None: never)."""
    policy.begin_round()
    for i in range(1, max_steps + 1):
        if policy.decide(step(i, **fields)) is not C:
            return i
    return None


# ---- registry and parameters ---------------------------------------------------------------------

@pytest.mark.parametrize("name, cap", [
    ("constant", 16), ("heuristic", 16), ("max-confidence", 16), ("svip", 40), ("adaedl", 16),
    ("adasd", 16), ("specdec++", 20), ("oracle", 16)])
def test_registry_defaults(name, cap):
    assert POLICIES[name].name == name
    resources = PolicyResources(reference=(1, 2), specdecpp_head=AcceptanceHead(4, depth=1))
    policy = build_policy(name, {}, None, resources)
    assert policy.params.max_draft_tokens == cap
    policy = build_policy(name, {"max_draft_tokens": 7}, None, resources)
    assert policy.params.max_draft_tokens == 7


def test_unknown_policy():
    with pytest.raises(InvalidRequest) as err:
        build_policy("longest", {})
    assert err.value.field == "policy"
    assert "constant" in err.value.message  # tells the caller what exists


BAD_OVERRIDES = [
    ("constant", {"kk": 3}, "policy_params.kk"),  # unknown name
    ("adasd", {"k": 3}, "policy_params.k"),  # adasd has no hyperparameters besides the cap
    ("constant", {"k": 0}, "policy_params.k"),  # out of range
    ("constant", {"k": 257}, "policy_params.k"),
    ("constant", {"max_draft_tokens": 0}, "policy_params.max_draft_tokens"),
    ("svip", {"h": -0.1}, "policy_params.h"),
    ("max-confidence", {"lam0": 1.5}, "policy_params.lam0"),
    ("adaedl", {"adapt": 2}, "policy_params.adapt"),
    ("constant", {"k": "5"}, "policy_params.k"),  # not a number
    ("adaedl", {"gamma": "0.2"}, "policy_params.gamma"),
    ("constant", {"k": None}, "policy_params.k"),
    ("svip", {"c": [0.1]}, "policy_params.c"),
    ("constant", {"k": True}, "policy_params.k"),  # bool is not a number here
    ("heuristic", {"k0": False}, "policy_params.k0"),
    ("svip", {"h": True}, "policy_params.h"),
    ("constant", {"k": 2.5}, "policy_params.k"),  # float for an int
    ("specdec++", {"min_draft": 1.5}, "policy_params.min_draft"),
    ("svip", {"h": float("nan")}, "policy_params.h"),  # not finite
    ("svip", {"h": float("inf")}, "policy_params.h"),
    ("constant", {"k": float("inf")}, "policy_params.k"),  # not finite, for an int
    ("constant", {"k": float("nan")}, "policy_params.k"),
    ("constant", {"k": 10**400}, "policy_params.k"),  # JSON allows integers of any size
    ("svip", {"h": 10**400}, "policy_params.h"),
]


@pytest.mark.parametrize("name, overrides, field", BAD_OVERRIDES,
                         ids=[f"{n}-{str(o)[:24]}" for n, o, _ in BAD_OVERRIDES])
def test_bad_overrides(name, overrides, field):
    with pytest.raises(InvalidRequest) as err:
        build_policy(name, overrides)
    assert err.value.field == field


@pytest.mark.parametrize("name, overrides, attr, value, typ", [
    ("constant", {"k": 3}, "k", 3, int),
    ("constant", {"k": 5.0}, "k", 5, int),  # an integral float is coerced to int
    ("svip", {"h": 1}, "h", 1.0, float),  # an int for a float is coerced to float
    ("adaedl", {"lam0": 0.5}, "lam0", 0.5, float),
])
def test_good_overrides_are_typed(name, overrides, attr, value, typ):
    params = build_policy(name, overrides).params
    assert getattr(params, attr) == value and type(getattr(params, attr)) is typ


# ---- constant ------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, k", [({}, 5), ({"k": 1}, 1), ({"k": 3}, 3), ({"k": 12}, 12)])
def test_constant_stops_at_k(overrides, k):
    policy = build_policy("constant", overrides)
    assert stop_index(policy, entropy=50.0, max_prob=0.01) == k  # ignores the draft's confidence
    policy.observe(outcome(k, 0))
    policy.observe(outcome(k, k))
    assert stop_index(policy) == k  # and the feedback
    assert policy.state() == {}


# ---- heuristic -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k0, rounds, k_after", [
    (5, [], 5),
    (5, [(5, 5)], 7),  # all accepted: +2
    (5, [(5, 2)], 4),  # a rejection: -1
    (5, [(5, 0)], 4),
    (5, [(5, 5), (7, 7), (9, 3)], 8),
    (2, [(2, 1), (1, 0), (1, 0)], 1),  # never below 1
    (1, [(1, 0)], 1),
    (5, [(0, 0)], 5),  # an empty round says nothing
    (15, [(15, 15), (16, 16, True), (16, 16, True)], 16),  # K does not run away past the cap,
    (15, [(15, 15), (16, 16, True), (16, 16, True), (16, 10)], 15),  # so one rejection shortens it
])
def test_heuristic_schedule(k0, rounds, k_after):
    policy = build_policy("heuristic", {"k0": k0})
    for r in rounds:
        policy.observe(outcome(r[0], r[1], hit_cap=len(r) > 2))
    assert stop_index(policy) == k_after
    assert policy.state() == {"k": float(k_after)}


def test_heuristic_state_round_trips():
    first = build_policy("heuristic", {})
    first.observe(outcome(5, 5))
    first.observe(outcome(7, 7))  # K = 9
    saved = first.state()
    second = build_policy("heuristic", {}, saved)  # the next request, same shared state
    assert stop_index(second) == 9
    second.observe(outcome(9, 1))
    assert build_policy("heuristic", {}, second.state()).state() == {"k": 8.0}


# ---- online threshold (max-confidence, adaedl) ---------------------------------------------------

@pytest.mark.parametrize("rounds, lam, ar", [
    # AR <- 0.5 AR + 0.5 acc/drafted; target = lam + 0.01 if AR < 0.9, lam - 0.01 if it stopped
    # before the cap, else lam; lam <- 0.9 lam + 0.1 target. Start: lam 0.6, AR 0.9.
    ([(5, 1, False)], 0.601, 0.55),  # low acceptance: up
    ([(4, 4, False)], 0.599, 0.95),  # high acceptance, cut short by the threshold: down
    ([(16, 16, True)], 0.600, 0.95),  # high acceptance at the cap: unchanged
    ([(5, 1, True)], 0.601, 0.55),  # low acceptance raises it even at the cap
    ([(10, 9, False)], 0.599, 0.9),  # AR == alpha counts as high
    ([(5, 1, False), (5, 5, False)], 0.602, 0.775),  # smoothed AR still low: up again
    ([(5, 1, False), (5, 5, False), (5, 5, False)], 0.603, 0.8875),
    ([(5, 1, False), (5, 5, False), (5, 5, False), (5, 5, False)], 0.602, 0.94375),
    ([(0, 0, False)], 0.6, 0.9),  # nothing drafted: no update
])
def test_online_threshold_formula(rounds, lam, ar):
    t = OnlineThreshold(0.6, 0.9, beta1=0.5, beta2=0.9, eps=0.01, alpha=0.9)
    for drafted, accepted, cap in rounds:
        t.update(outcome(drafted, accepted, hit_cap=cap))
    assert t.lam == pytest.approx(lam, abs=1e-12)
    assert t.ar == pytest.approx(ar, abs=1e-12)


def test_online_threshold_stays_in_unit_interval():
    high = OnlineThreshold(1.0, 0.9)
    high.update(outcome(5, 0))
    assert high.lam == 1.0
    low = OnlineThreshold(0.0, 0.9)
    low.update(outcome(5, 5))
    assert low.lam == 0.0


# ---- max-confidence ------------------------------------------------------------------------------

@pytest.mark.parametrize("max_prob, decision", [
    (0.0, S), (0.3, S), (0.5999, S), (0.6, C), (0.6001, C), (0.95, C), (1.0, C)])
def test_max_confidence_stops_below_lambda(max_prob, decision):
    policy = build_policy("max-confidence", {})
    assert policy.decide(step(1, max_prob=max_prob, entropy=10.0)) is decision


@pytest.mark.parametrize("name, rounds, lam", [
    ("max-confidence", [(5, 1, False)], 0.601),
    ("max-confidence", [(4, 4, False)], 0.599),
    ("max-confidence", [(16, 16, True)], 0.6),
    ("adaedl", [(5, 1, False)], 0.701),
    ("adaedl", [(4, 4, False)], 0.699),
    ("adaedl", [(16, 16, True)], 0.7),
])
def test_adaptive_policies_update_lambda_and_persist_it(name, rounds, lam):
    policy = build_policy(name, {})
    for drafted, accepted, cap in rounds:
        policy.observe(outcome(drafted, accepted, hit_cap=cap))
    assert policy.state()["lam"] == pytest.approx(lam, abs=1e-12)
    again = build_policy(name, {}, policy.state())
    assert again.state() == pytest.approx(policy.state(), abs=1e-15)
    fixed = build_policy(name, {"adapt": 0})
    for drafted, accepted, cap in rounds:
        fixed.observe(outcome(drafted, accepted, hit_cap=cap))
    assert fixed.state()["lam"] == pytest.approx(0.7 if name == "adaedl" else 0.6, abs=1e-15)


def test_max_confidence_adaptation_changes_decisions():
    policy = build_policy("max-confidence", {})
    borderline = step(1, max_prob=0.6005)
    assert policy.decide(borderline) is C
    policy.observe(outcome(5, 1))  # lam 0.601: the same step now stops
    assert policy.decide(borderline) is S
    resumed = build_policy("max-confidence", {}, policy.state())  # and so does the next request
    assert resumed.decide(borderline) is S
    assert build_policy("max-confidence", {"lam0": 0.5}).decide(borderline) is C


# ---- svip ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, entropy, decision", [
    ({}, 0.0, C), ({}, 0.3, C), ({}, 0.6 - 1e-6, C), ({}, 0.6 + 1e-6, S), ({}, 5.0, S),
    # sqrt(c H) > h  <=>  H > h^2 / c
    ({"c": 1.0, "h": 0.5}, 0.25 - 1e-6, C), ({"c": 1.0, "h": 0.5}, 0.25 + 1e-6, S),
    ({"h": 0.6}, 2.4 - 1e-6, C), ({"h": 0.6}, 2.4 + 1e-6, S),
])
def test_svip_entropy_rule(overrides, entropy, decision):
    policy = build_policy("svip", overrides)
    for index in (1, 3, 30):  # only the entropy matters, not the position in the window
        assert policy.decide(step(index, entropy=entropy, max_prob=0.99)) is decision


# ---- adaedl --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rounds, entropy, decision", [
    # 1 - sqrt(0.2 H) < lam  <=>  H > (1 - lam)^2 / 0.2; lam0 = 0.7 gives H > 0.45
    ([], 0.0, C), ([], 0.45 - 1e-6, C), ([], 0.45 + 1e-6, S), ([], 3.0, S),
    ([(5, 1, False)], 0.4475, S),  # lam 0.701: H > 0.299^2 / 0.2 = 0.447005
    ([(5, 1, False)], 0.4469, C),
    ([(4, 4, False)], 0.4525, C),  # lam 0.699: H > 0.301^2 / 0.2 = 0.453005
    ([(4, 4, False)], 0.4531, S),
])
def test_adaedl_bound_rule_and_adaptation(rounds, entropy, decision):
    policy = build_policy("adaedl", {})
    for drafted, accepted, cap in rounds:
        policy.observe(outcome(drafted, accepted, hit_cap=cap))
    assert policy.decide(step(2, entropy=entropy, max_prob=0.99)) is decision


def test_adaedl_gamma_override():
    policy = build_policy("adaedl", {"gamma": 1.0, "lam0": 0.5})  # H > 0.25
    assert policy.decide(step(1, entropy=0.2499)) is C
    assert policy.decide(step(1, entropy=0.2501)) is S


# ---- adasd ---------------------------------------------------------------------------------------

def test_adasd_never_stops_before_a_rejection():
    policy = build_policy("adasd", {})
    assert stop_index(policy, entropy=100.0) is None
    policy.observe(outcome(4, 4, entropies=(3.0, 4.0, 5.0, 6.0)))  # all accepted: still no evidence
    assert stop_index(policy, entropy=100.0) is None


@pytest.mark.parametrize("rounds, entropy, decision", [
    # first rejected token's entropy: 1.0 -> mean 1.0
    ([(4, 2, (0.1, 0.2, 1.0, 0.3))], 0.99, C),
    ([(4, 2, (0.1, 0.2, 1.0, 0.3))], 1.0, C),
    ([(4, 2, (0.1, 0.2, 1.0, 0.3))], 1.01, S),
    # then 2.0 (rejected at position 0) -> mean 1.5; accepted rounds do not move it
    ([(4, 2, (0.1, 0.2, 1.0, 0.3)), (3, 0, (2.0, 0.1, 0.1)), (2, 2, (9.0, 9.0))], 1.49, C),
    ([(4, 2, (0.1, 0.2, 1.0, 0.3)), (3, 0, (2.0, 0.1, 0.1)), (2, 2, (9.0, 9.0))], 1.51, S),
])
def test_adasd_stops_above_mean_rejected_entropy(rounds, entropy, decision):
    policy = build_policy("adasd", {})
    for drafted, accepted, entropies in rounds:
        policy.observe(outcome(drafted, accepted, entropies=entropies))
    assert policy.decide(step(1, entropy=entropy)) is decision
    resumed = build_policy("adasd", {}, policy.state())  # the running mean is shared state
    assert resumed.decide(step(1, entropy=entropy)) is decision


@pytest.mark.parametrize("rounds, threshold", [
    ([], None),
    ([(3, 3, (0.1, 0.2, 0.3))], None),  # only accepted tokens seen
    ([(2, 0, (0.5, 0.1))], None),  # only a rejected token seen
    ([(3, 1, ())], None),  # strict mode sends no JS distances
    # accepted: 0.1, 0.2, 0.3, 0.1 (mean 0.175); rejected: 0.7 -> midpoint 0.4375
    ([(3, 3, (0.1, 0.2, 0.3)), (3, 1, (0.1, 0.7, 0.9))], 0.4375),
    # accepted 0.2 (mean 0.2); rejected 0.6, 0.8 (mean 0.7) -> 0.45
    ([(2, 1, (0.2, 0.6)), (3, 0, (0.8, 0.0, 0.0))], 0.45),
])
def test_adasd_relaxed_threshold(rounds, threshold):
    policy = build_policy("adasd", {})
    for drafted, accepted, js in rounds:
        policy.observe(outcome(drafted, accepted, js=js))
    got = policy.relaxed_threshold()
    assert got == (None if threshold is None else pytest.approx(threshold, abs=1e-12))
    assert build_policy("adasd", {}, policy.state()).relaxed_threshold() == got


def test_other_policies_have_no_relaxed_threshold():
    for name in ("constant", "heuristic", "max-confidence", "svip", "adaedl"):
        policy = build_policy(name, {})
        policy.observe(outcome(3, 1, js=(0.1, 0.7, 0.9)))
        assert policy.relaxed_threshold() is None


# ---- oracle --------------------------------------------------------------------------------------

@pytest.mark.parametrize("index, position, token, decision", [
    (1, 0, 5, C), (1, 0, 6, D), (2, 1, 7, C), (2, 1, 5, D),
    (1, 3, 11, C),  # the position in the generation counts, not the index in the round
    (1, 3, 9, D),
    (1, 4, 5, D),  # past the end of the reference
])
def test_oracle_drops_first_disagreement(index, position, token, decision):
    policy = build_policy("oracle", {}, None, PolicyResources(reference=(5, 7, 9, 11)))
    assert policy.decide(step(index, position=position, token=token, entropy=9.0, max_prob=0.1)) is decision


def test_oracle_needs_reference():
    with pytest.raises(InvalidRequest) as err:
        build_policy("oracle", {})
    assert err.value.field == "policy"


# ---- specdec++ -----------------------------------------------------------------------------------

def _head(hidden_size: int = 4) -> AcceptanceHead:
    """Zero weights: the residual blocks add 0, and the logit is hidden[0] + out.bias."""
    head = AcceptanceHead(hidden_size, depth=3)
    with torch.no_grad():
        for prm in head.parameters():
            prm.zero_()
        head.out.weight[0, 0] = 1.0
    return head.eval()


def _logit(a: float) -> float:
    return math.log(a / (1 - a))


def _specdecpp(overrides: dict | None = None, bias_accept: float | None = None):
    head = _head()
    if bias_accept is not None:
        with torch.no_grad():
            head.out.bias.fill_(_logit(bias_accept))
    return build_policy("specdec++", overrides or {}, None, PolicyResources(specdecpp_head=head))


def _run(policy, accepts: list[float]) -> int | None:
    """One round whose i-th token the head predicts accepted with probability accepts[i]."""
    policy.begin_round()
    for i, a in enumerate(accepts, start=1):
        hidden = torch.tensor([_logit(a), 0.0, 0.0, 0.0])
        if policy.decide(step(i, hidden=hidden)) is not C:
            return i
    return None


@pytest.mark.parametrize("overrides, accepts, stop", [
    # 1 - prod a: 0.1, 0.28, 0.496, 0.6976, 0.8488 -> first above h = 0.7 at 5
    ({}, [0.9, 0.8, 0.7, 0.6, 0.5, 0.5], 5),
    ({"h": 0.69}, [0.9, 0.8, 0.7, 0.6, 0.5, 0.5], 4),
    ({"h": 0.495}, [0.9, 0.8, 0.7, 0.6, 0.5, 0.5], 3),
    ({"h": 0.497}, [0.9, 0.8, 0.7, 0.6, 0.5, 0.5], 4),
    ({}, [0.5, 0.5, 0.5], 2),  # 0.5 < 0.7, then 0.75 > 0.7
    ({}, [0.1, 0.9, 0.9], 2),  # 0.9 > h at once, but never before min_draft = 2
    ({"min_draft": 4}, [0.1, 0.9, 0.9, 0.9, 0.9], 4),
    ({"min_draft": 1}, [0.1, 0.9], 1),
    ({}, [0.99] * 30, None),  # confident head: keeps drafting (the engine's cap ends the round)
])
def test_specdecpp_stops_when_rejection_probability_exceeds_h(overrides, accepts, stop):
    assert _run(_specdecpp(overrides), accepts) == stop


def test_specdecpp_constant_acceptance_from_bias_and_round_reset():
    # a = 0.8: 1 - 0.8^n > 0.7 <=> n > log 0.3 / log 0.8 = 5.4 -> stops at 6
    policy = _specdecpp(bias_accept=0.8)
    assert stop_index(policy, hidden=torch.zeros(4)) == 6
    assert stop_index(policy, hidden=torch.zeros(4)) == 6  # the product restarts every round
    assert stop_index(_specdecpp({"h": 0.487}, bias_accept=0.8), hidden=torch.zeros(4)) == 3  # 1-0.512
    assert stop_index(_specdecpp({"h": 0.489}, bias_accept=0.8), hidden=torch.zeros(4)) == 4


def test_specdecpp_needs_head_and_hidden():
    with pytest.raises(InvalidRequest) as err:
        build_policy("specdec++", {})
    assert err.value.field == "policy"
    policy = _specdecpp()
    policy.begin_round()
    with pytest.raises(InvalidRequest) as err:
        policy.decide(step(1))
    assert err.value.field == "drafter"


def test_specdecpp_head_saves_and_loads(tmp_path):
    head = _head()
    with torch.no_grad():
        head.out.bias.fill_(_logit(0.8))
    head.save(tmp_path / "head.safetensors")
    loaded = AcceptanceHead.load(tmp_path / "head.safetensors")
    policy = build_policy("specdec++", {}, None, PolicyResources(specdecpp_head=loaded))
    assert stop_index(policy, hidden=torch.zeros(4)) == 6


def test_bundled_head_is_found_by_drafter_name_only():
    from specd.policies import bundled_head_path

    path = bundled_head_path("smollm2-135m-instruct:early-exit-4")
    assert path is not None and path.is_file()
    assert bundled_head_path("smollm2-135m-instruct:early-exit-4+my-adapter") is None
    assert bundled_head_path("ngram-3") is None
