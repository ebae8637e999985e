"""The draft -> verify loop on tiny models: greedy output identical to the target alone for
every policy x drafter, exact EOS / max_new_tokens / stop-string handling, shared state."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specd.costs import CostCurve
from specd.drafters import (
    Datastore,
    EarlyExitDrafter,
    FeatureDrafter,
    HfDrafter,
    HybridDrafter,
    NgramDrafter,
    RetrievalDrafter,
)
from specd.drafters.base import Drafter, DraftSession, DraftToken
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.runtime.tiny import loaded
from specd.policies import POLICIES, AcceptanceHead
from specd.state import MemoryStateStore
from specd.types import SamplingParams, SpecParams

PROMPTS = [[5, 9, 17, 33, 5, 9, 17], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [77, 3, 77, 3, 77]]
N = 32


def drafters(target, draft, store=None):
    store = store or Datastore.from_documents([])
    return {"hf": HfDrafter(draft, target), "early-exit": EarlyExitDrafter(target, 2), "ngram": NgramDrafter(),
            "feature": FeatureDrafter(target), "retrieval": RetrievalDrafter(store),
            "hybrid": HybridDrafter(HfDrafter(draft, target), RetrievalDrafter(store))}


@pytest.fixture(scope="module")
def tiny_store(tiny_target, hf_greedy):
    """The target's own greedy answers to the test prompts, every 7th token corrupted, and
    their reverse: the retrieval drafter's matches are often right and sometimes wrong."""
    docs = []
    for prompt in PROMPTS:
        answer = hf_greedy(tiny_target.model, prompt, N)
        docs.append([(t + 1) % 100 if i % 7 == 6 else t for i, t in enumerate(prompt + answer)])
        docs.append(answer[::-1])
    return Datastore.from_documents(docs)


@pytest.fixture(scope="module")
def random_head(tiny_target):
    torch.manual_seed(3)
    return AcceptanceHead(tiny_target.model.config.hidden_size, depth=2, width=32).eval()


@pytest.mark.parametrize("drafter_kind", ["hf", "early-exit", "ngram", "retrieval", "feature", "hybrid"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_greedy_equals_target_alone(tiny_target, tiny_draft, tiny_store, hf_greedy, random_head, policy,
                                    drafter_kind):
    drafter = drafters(tiny_target, tiny_draft, tiny_store)[drafter_kind]
    engine = SpeculativeEngine(tiny_target, drafter, specdecpp_head=random_head)
    if policy == "specdec++" and drafter_kind in ("ngram", "retrieval"):
        pytest.skip("specdec++ reads a draft model's hidden state; the n-gram drafters have none")
    for prompt in PROMPTS:
        want = hf_greedy(tiny_target.model, prompt, N)
        out = engine.generate(prompt, SamplingParams(max_new_tokens=N), SpecParams(policy), reference=want)
        assert out.token_ids == want, f"{policy}/{drafter_kind} diverged on {prompt}"
        assert out.finish_reason == "length"
        s = out.stats
        assert s.accepted <= s.drafted and s.new_tokens == N
        assert sum(s.draft_lengths) == s.drafted and sum(s.accepted_lengths) == s.accepted


SEEDED = SamplingParams(temperature=0.8, top_k=40, seed=11, max_new_tokens=N)


@pytest.mark.parametrize("drafter_kind", ["hf", "early-exit", "ngram", "retrieval", "feature", "hybrid"])
@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"oracle"}))
def test_seeded_sampling_equals_target_alone(tiny_target, tiny_draft, tiny_store, random_head, policy,
                                             drafter_kind):
    """With a seed, sampled output is token for token what the target alone samples with it
    (specd.sampling's coupling), whatever the drafter and policy proposed; the lookup drafters
    also through draft trees on a flat cost curve (the hybrid's are on by default)."""
    if policy == "specdec++" and drafter_kind in ("ngram", "retrieval"):
        pytest.skip("specdec++ reads a draft model's hidden state; the n-gram drafters have none")
    drafter = drafters(tiny_target, tiny_draft, tiny_store)[drafter_kind]
    engine = SpeculativeEngine(tiny_target, drafter, specdecpp_head=random_head, costs=flat())
    alone = SpeculativeEngine(tiny_target)
    branches = 2 if drafter_kind in ("ngram", "retrieval") else None
    accepted = 0
    for i, prompt in enumerate(PROMPTS):
        sampling = replace(SEEDED, seed=SEEDED.seed + i)
        want = alone.generate(prompt, sampling, SpecParams("none")).token_ids
        out = engine.generate(prompt, sampling, SpecParams(policy, branches=branches))
        assert out.token_ids == want, f"{policy}/{drafter_kind} diverged on {prompt}"
        accepted += out.stats.accepted
    assert accepted > 0  # drafts were kept: the comparison is not target-alone against itself


def test_speculation_actually_happens(tiny_target, tiny_draft):
    """A test of losslessness is empty if nothing is ever accepted: the noisy draft must be useful."""
    out = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target)).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("constant"))
    assert 0.2 < out.stats.acceptance_rate < 1.0
    assert out.stats.verifications < N


def test_retrieval_drafts_are_accepted_and_rejected(tiny_target, tiny_store):
    """The lossless test above is empty for retrieval unless its drafts are both kept and refused."""
    out = SpeculativeEngine(tiny_target, RetrievalDrafter(tiny_store)).generate(  # it knows this answer
        PROMPTS[1], SamplingParams(max_new_tokens=N), SpecParams("constant"))
    s = out.stats
    assert s.accepted > 0 and s.accepted < s.drafted


def test_judged_tokens_stop_at_the_first_rejection(tiny_target, tiny_draft):
    out = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target)).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("constant"))
    s = out.stats
    rejected_rounds = sum(n < k for k, n in zip(s.draft_lengths, s.accepted_lengths))
    assert s.judged_accepted.count(True) == s.accepted
    assert s.judged_accepted.count(False) == rejected_rounds
    assert len(s.judged_entropies) == len(s.judged_accepted)


def test_oracle_discards_nothing(tiny_target, tiny_draft, hf_greedy):
    want = hf_greedy(tiny_target.model, PROMPTS[0], N)
    out = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target)).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("oracle"), reference=want)
    assert out.stats.accepted == out.stats.drafted
    assert out.stats.mean_accepted_tokens > 1.0


def test_seeded_oracle_discards_nothing_and_matches_the_computed_bound(tiny_target, tiny_draft):
    """Under a seed (coupled sampling) the target's output is fixed, so the oracle is exact: the
    engine's oracle keeps every drafted token, and its rounds are the ones the bench's bound
    computes from the draft's teacher-forced race winners."""
    from specd_bench.oracle import oracle_rounds, teacher_forced_agreement
    from specd.policies.oracle import OraclePolicy

    sampling = SamplingParams(temperature=1.0, seed=11, max_new_tokens=N)
    want = SpeculativeEngine(tiny_target).generate(PROMPTS[0], sampling, SpecParams("none")).token_ids
    drafter = HfDrafter(tiny_draft, tiny_target)
    out = SpeculativeEngine(tiny_target, drafter).generate(PROMPTS[0], sampling, SpecParams("oracle"),
                                                            reference=want)
    assert out.token_ids == want
    assert out.stats.accepted == out.stats.drafted > 0
    agree = teacher_forced_agreement(drafter, PROMPTS[0], want, tiny_target.vocab_size, sampling)
    assert not all(agree)  # the draft's race winner is not the target's everywhere
    rounds = oracle_rounds(agree, OraclePolicy.Params().max_draft_tokens)
    assert sum(rounds) == out.stats.drafted and len(rounds) == out.stats.verifications
    # greedy agreement is another thing: it must not be what the seeded bound used
    assert teacher_forced_agreement(drafter, PROMPTS[0], want, tiny_target.vocab_size) != agree


def test_max_new_tokens_inside_a_window(tiny_target, hf_greedy):
    """With a perfect drafter and K=5, max_new_tokens=7 falls inside the second window."""
    same = HfDrafter(tiny_target, tiny_target)
    want = hf_greedy(tiny_target.model, PROMPTS[1], 7)
    out = SpeculativeEngine(tiny_target, same).generate(
        PROMPTS[1], SamplingParams(max_new_tokens=7), SpecParams("constant", policy_params={"k": 5}))
    assert out.token_ids == want and len(out.token_ids) == 7
    # 5 drafts + bonus = 6 tokens; one token is left, so the last round drafts nothing: no overshoot.
    assert out.stats.draft_lengths == [5] and out.stats.verifications == 2


def test_eos_in_the_middle_of_a_window(tiny_target, hf_greedy):
    free = hf_greedy(tiny_target.model, PROMPTS[0], N)
    eos = free[8]  # make the 9th generated token the end of sequence
    target = loaded(tiny_target.model, "tiny-eos")
    target.eos_token_ids = frozenset([eos])
    want = hf_greedy(tiny_target.model, PROMPTS[0], N, eos=eos)
    assert want[-1] == eos and len(want) <= 9
    out = SpeculativeEngine(target, HfDrafter(target, target)).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("constant", policy_params={"k": 6}))
    assert out.token_ids == want
    assert out.finish_reason == "stop"


def test_stop_string_cuts_text_and_tokens(tiny_dirs):
    from specd.runtime import load_model

    target = load_model(str(tiny_dirs[0]), device="cpu")
    engine = SpeculativeEngine(target, NgramDrafter())
    prompt = target.encode_prompt("hello there", chat=True)
    free = engine.generate(prompt, SamplingParams(max_new_tokens=30), SpecParams("constant"))
    stop = free.text[10:12]
    assert len(stop) == 2
    out = engine.generate(prompt, SamplingParams(max_new_tokens=30, stop=(stop,)), SpecParams("constant"))
    assert out.finish_reason == "stop"
    assert out.text == free.text[:free.text.index(stop)]
    assert out.token_ids == free.token_ids[:len(out.token_ids)]
    assert stop in target.decode(out.token_ids) and stop not in target.decode(out.token_ids[:-1])


def test_adaptive_state_persists_across_requests(tiny_target, tiny_draft):
    store = MemoryStateStore()
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target), store)
    engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=20), SpecParams("max-confidence", task_tag="a"))
    saved = store.load(engine.state_key("max-confidence", "a"))
    assert set(saved) == {"lam", "ar"} and saved["lam"] != 0.6
    assert store.load(engine.state_key("max-confidence", "b")) == {}


def test_relaxed_mode_is_flagged_lossy(tiny_target, tiny_draft):
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target))
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=30), SpecParams("adasd", relaxed=True))
    assert out.stats.lossy and len(out.token_ids) == 30
    strict = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=30), SpecParams("adasd"))
    assert not strict.stats.lossy and strict.stats.relaxed_accepted == 0


@pytest.mark.parametrize("kwargs, field", [
    ({"spec": SpecParams("nope")}, "policy"),
    ({"spec": SpecParams("constant", relaxed=True)}, "relaxed"),
    ({"spec": SpecParams("constant", policy_params={"k": 0})}, "policy_params.k"),
    ({"spec": SpecParams("constant", max_draft_tokens=-1)}, "policy_params.max_draft_tokens"),
    ({"sampling": SamplingParams(temperature=-1)}, "temperature"),
    ({"sampling": SamplingParams(top_p=0)}, "top_p"),
    ({"sampling": SamplingParams(max_new_tokens=0)}, "max_new_tokens"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1] * 600}, "prompt"),
    ({"prompt": [100000]}, "prompt"),
    ({"spec": SpecParams("oracle"), "sampling": SamplingParams(temperature=1.0)}, "policy"),
])
def test_bad_requests_name_the_field(tiny_target, tiny_draft, kwargs, field):
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target))
    with pytest.raises(InvalidRequest) as err:
        engine.generate(kwargs.get("prompt", PROMPTS[0]), kwargs.get("sampling", SamplingParams()),
                        kwargs.get("spec", SpecParams()))
    assert err.value.field == field


def test_policy_needs_a_drafter(tiny_target):
    with pytest.raises(InvalidRequest, match="needs a drafter"):
        SpeculativeEngine(tiny_target).generate(PROMPTS[0], SamplingParams(), SpecParams("svip"))


def test_target_alone_is_plain_decoding(tiny_target, hf_greedy):
    out = SpeculativeEngine(tiny_target).generate(PROMPTS[2], SamplingParams(max_new_tokens=N), SpecParams("none"))
    assert out.token_ids == hf_greedy(tiny_target.model, PROMPTS[2], N)
    assert out.stats.drafted == 0 and out.stats.verifications == N


def test_closing_a_run_frees_its_caches(tiny_target, tiny_draft):
    run = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target)).start(
        PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("constant"))
    next(iter(run))
    assert run.target_kv.length > 0
    run.close()
    assert run.target_kv.cache is None and run.draft_session.kv.cache is None
    assert run.result().stats.finish_reason == "cancelled"


def test_cost_curve_is_measured_only_when_a_policy_needs_it_and_follows_the_rounds(tiny_target, tiny_draft):
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target))
    engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=8), SpecParams("constant"))
    assert engine._costs is None  # nobody asked: no start-up measurement
    # A curve that claims every forward takes 10 s and every draft step 1 s: the rounds this
    # engine runs pull both towards what the tiny models really take (milliseconds).
    slow = CostCurve(1.0, list(range(1, 18)), [10.0] * 17)
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target), costs=slow)
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("cost-aware"))
    assert out.token_ids == SpeculativeEngine(tiny_target).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("none")).token_ids
    assert engine.costs is slow and slow.scale < 0.9 and slow.t_draft < 1.0



def test_every_round_after_the_first_is_timed_for_the_policy(tiny_target, tiny_draft):
    """cost-aware's measured pace: the engine times each round but the first (which prefills) and
    says whether the drafter ran; the pace is saved with the policy's state."""
    curve = CostCurve(0.01, list(range(1, 18)), [0.01] * 17, smoothing=0.0)  # a drafter that costs time
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target), costs=curve)
    out = engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("cost-aware"))
    state = engine.state_store.load(engine.state_key("cost-aware", "default"))
    timed = state["pace:drafted_rounds"] + state["pace:plain_rounds"]
    # decayed sums: a little under one per round timed
    assert 0.75 * (out.stats.verifications - 1) < timed < out.stats.verifications - 1 + 1e-9
    assert state["pace:drafted_rounds"] > 0 and state["pace:drafted_seconds"] > 0
    assert state["pace:drafted_tokens"] + state["pace:plain_tokens"] <= N


def test_requests_that_run_at_once_both_keep_what_they_learned(tiny_target, tiny_draft):
    """Two cost-aware requests start from the same saved state and end one after the other:
    the saved table holds both requests' judged tokens, not just the last one's."""
    curve = CostCurve(0.0001, list(range(1, 18)), [0.01] * 17, smoothing=0.0)
    engine = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target), costs=curve)
    spec, sampling = SpecParams("cost-aware"), SamplingParams(max_new_tokens=N)
    key = engine.state_key("cost-aware", "default")

    def judged(state):  # every bin's (decayed) count of judged tokens, summed over top-level bins
        return sum(v for k, v in state.items() if k[0] == "q" and k.count("e") == 0 and k[-2:] in (":a", ":r"))

    def alone(prompt):
        e = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target), costs=curve)
        e.generate(prompt, sampling, spec)
        return judged(e.state_store.load(key))

    first, second = alone(PROMPTS[0]), alone(PROMPTS[1])
    assert min(first, second) > 2
    a, b = engine.start(PROMPTS[0], sampling, spec), engine.start(PROMPTS[1], sampling, spec)
    for run in (a, b):
        for _ in run:
            pass
    a.close()
    after_a = judged(engine.state_store.load(key))
    assert after_a == pytest.approx(first)
    b.close()
    # Both, less a little decay; last writer wins would keep B's alone.
    assert judged(engine.state_store.load(key)) > max(first, second) + 0.5 * min(first, second)


class VirtualClock:
    """Time for the engine's timers (`time.perf_counter` in specd.engine and the round's drivers) that
    passes only as a test says: what a drafted token and a forward cost on its cost curve, so
    that what cost-aware measures does not depend on how loaded the machine is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class WrongDrafter(Drafter):
    """A deliberately bad drafter that is sure of itself: q(x) = 1 for a token the tiny target
    almost never picks. It takes `seconds` a token on `clock`, as the cost curve says: cost-aware
    also times real rounds, and a drafter that claimed a cost it does not have would be judged on
    its speed."""

    kind = "wrong"
    has_distribution = False

    def __init__(self, seconds: float, clock: VirtualClock):
        self.seconds, self.clock = seconds, clock

    @property
    def name(self) -> str:
        return "wrong"

    def open(self, vocab_size: int | None = None) -> DraftSession:
        seconds, clock = self.seconds, self.clock

        class Session(DraftSession):
            def next(self, seq, params, generator, want_hidden):
                clock.sleep(seconds)
                return DraftToken((seq[-1] * 7 + 3) % 97, None, 1.0, 1.0, 0.0)

            def rollback(self, length: int) -> None:
                pass

        return Session()


# A free drafter on a flat curve: a wrong window of 16 costs what a wrong window of 1 does, so it
# stops drafting once the estimate says a first token is not worth its forward. A drafter that
# costs half a step: its first window shrinks at once. Cost-aware also times the rounds, on a
# virtual clock here where drafts and forwards take what the curve says: on the real one, a
# loaded machine's stalled plain steps made the costly drafter look paying (CI once saw 8
# windows, with the drafter sleeping 20 ms a token: plain steps that stall 25 ms do it).
@pytest.mark.parametrize("t_draft, most_windows", [(0.0, 10), (0.02, 3)])
def test_a_cold_start_with_a_wrong_drafter_shrinks_its_windows_within_the_request(tiny_target, hf_greedy, t_draft,
                                                                                 most_windows, monkeypatch):
    """Issue 31's cold start: empty state, a drafter that is nearly always wrong yet sure of itself
    (so the prior believes it). Within the one request cost-aware learns it: after a few windows
    it drafts none (plain steps) or at most one token, and the output is the target alone's."""
    import specd.engine
    import specd.speculation.driver
    import specd.speculation.pace
    import specd.speculation.proposer

    step = 2 * t_draft or 0.01  # the curve's one-token forward
    curve = CostCurve(t_draft, list(range(1, 18)), [step * (1 + 0.3 * (k > 1)) for k in range(1, 18)], smoothing=0.0)
    clock = VirtualClock()
    monkeypatch.setattr(specd.engine, "time", clock)
    monkeypatch.setattr(specd.speculation.driver, "time", clock)
    monkeypatch.setattr(specd.speculation.proposer, "time", clock)
    monkeypatch.setattr(specd.speculation.pace, "time", clock)
    open_session = tiny_target.session

    def session():  # each forward takes what the curve says
        kv = open_session()
        extend = kv.extend

        def timed(ids, *args, **kwargs):
            clock.sleep(step * (1 + 0.3 * (len(ids) > 1)))
            return extend(ids, *args, **kwargs)

        kv.extend = timed
        return kv

    monkeypatch.setattr(tiny_target, "session", session)
    engine = SpeculativeEngine(tiny_target, WrongDrafter(t_draft, clock), costs=curve)
    out = engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=48), SpecParams("cost-aware"))
    assert out.token_ids == hf_greedy(tiny_target.model, PROMPTS[1], 48)
    assert clock.now > 0  # the engine's rounds ran on the virtual clock
    lengths = out.stats.draft_lengths  # of the rounds that drafted; the others were plain steps
    assert lengths[0] >= 3  # the prior trusted q(x) = 1 at first
    assert len(lengths) <= most_windows
    if t_draft:  # a costly drafter's later windows hold one token at most
        assert max(lengths[2:], default=0) <= 1

# The test curves are frozen (smoothing 0: the rounds' timings do not move them). A curve that
# followed the tiny models' real timings would make the policies' choices depend on the machine's
# load: CI once saw cost-aware learn that the early-exit drafter (about half a target step on the
# tiny model) does not pay, stop drafting after the first prompt and accept nothing.
def flat() -> CostCurve:  # a forward costs the same for any window, drafting is free
    return CostCurve(0.0, list(range(1, 18)), [0.01] * 17, smoothing=0.0)


def steep() -> CostCurve:  # every token costs a full step
    return CostCurve(0.0, list(range(1, 18)), [0.01 * k for k in range(1, 18)], smoothing=0.0)


@pytest.mark.parametrize("policy", sorted(set(POLICIES) - {"oracle", "specdec++"}))
def test_draft_trees_are_lossless_and_their_branches_are_taken(tiny_target, tiny_store, hf_greedy, policy):
    """Where verification is flat the engine adds the drafter's alternatives as a tree; the
    target sometimes takes a side branch, and the output is still the target's own."""
    rounds = taken = 0
    for prompt in PROMPTS:
        engine = SpeculativeEngine(tiny_target, RetrievalDrafter(tiny_store), costs=flat())
        out = engine.generate(prompt, SamplingParams(max_new_tokens=N), SpecParams(policy, branches=4))
        assert out.token_ids == hf_greedy(tiny_target.model, prompt, N)
        s = out.stats
        assert s.accepted <= s.drafted and sum(s.accepted_lengths) == s.accepted
        rounds, taken = rounds + s.tree_rounds, taken + s.branch_accepted
    assert rounds > 0 and taken > 0


def test_hybrid_keeps_tokens_from_the_models_chain_and_the_lookup_branch(tiny_target, tiny_draft, tiny_store,
                                                                        hf_greedy):
    """The hybrid verifies the draft model's chain and retrieval's proposal in one tree: the
    target keeps tokens of both, and the output is its own."""
    rounds = chain = taken = 0
    for prompt in PROMPTS:
        hybrid = HybridDrafter(HfDrafter(tiny_draft, tiny_target), RetrievalDrafter(tiny_store))
        out = SpeculativeEngine(tiny_target, hybrid, costs=flat()).generate(
            prompt, SamplingParams(max_new_tokens=N), SpecParams("constant"))
        assert out.token_ids == hf_greedy(tiny_target.model, prompt, N)
        s = out.stats
        rounds, taken = rounds + s.tree_rounds, taken + s.branch_accepted
        chain += sum(s.judged_accepted)
    assert rounds > 0 and taken > 0 and chain > 0


def test_draft_trees_size_themselves_on_the_cost_curve(tiny_target, tiny_store):
    """Flat verification: alternatives ride along; steep (every token a full step): they do not
    pay for themselves at the prior gain, and rounds stay chains."""
    def tree_rounds(curve):
        engine = SpeculativeEngine(tiny_target, RetrievalDrafter(tiny_store), costs=curve)
        return engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=N), SpecParams("constant", branches=3)).stats
    flat_run, steep_run = tree_rounds(flat()), tree_rounds(steep())
    assert flat_run.tree_rounds > 0 and steep_run.tree_rounds == 0
    assert max(flat_run.draft_lengths) > max(steep_run.draft_lengths)


def test_branches_are_checked(tiny_target, tiny_draft):
    with pytest.raises(InvalidRequest, match="branches"):
        SpeculativeEngine(tiny_target, NgramDrafter()).generate(
            PROMPTS[0], SamplingParams(max_new_tokens=4), SpecParams("constant", branches=-1))
    with pytest.raises(InvalidRequest, match="branches"):  # a model drafter has no alternatives
        SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target)).generate(
            PROMPTS[0], SamplingParams(max_new_tokens=4), SpecParams("constant", branches=2))
    out = SpeculativeEngine(tiny_target, HfDrafter(tiny_draft, tiny_target)).generate(
        PROMPTS[0], SamplingParams(max_new_tokens=4), SpecParams("constant", branches=0))
    assert out.stats.tree_rounds == 0
