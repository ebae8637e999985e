"""PEARL in process (specd.speculation.overlap, SpeculativeEngine.start(overlap=True)): the
next window is drafted on a thread of its own while this one is verified; the output stays
the target alone's, a drafter that fails or stalls leaves the target alone, and closing a run
stops its thread. The scenario suite (tests/services/test_drivers.py) runs it as the driver
"engine-pearl"; the sampled distribution is tested in tests/specd/test_engine_sampling.py."""

from __future__ import annotations

import threading
import time

import pytest

from specd.drafters import HfDrafter
from specd.engine import GenerationRun, OverlapRun, SpeculativeEngine
from specd.runtime.tiny import loaded, perturbed, tiny_llama
from specd.speculation import overlap
from specd.types import SamplingParams, SpecParams
from tests.specd.drafters.faults import Faulty

PROMPT = [5, 9, 2, 7, 11, 3]
K4 = SpecParams("constant", policy_params={"k": 4})


@pytest.fixture(scope="module")
def models():
    target = loaded(tiny_llama(3, layers=2, vocab_size=64), "t64")
    target.eos_token_ids = frozenset()
    return target, loaded(perturbed(target.model, 0.0, seed=0), "same"), loaded(perturbed(target.model, 0.3, seed=1),
                                                                               "noisy")


def alone(target, sampling: SamplingParams) -> list[int]:
    return SpeculativeEngine(target).generate(PROMPT, sampling, SpecParams("none")).token_ids


def pearl(engine: SpeculativeEngine, sampling: SamplingParams, spec: SpecParams = K4) -> OverlapRun:
    run = engine.start(PROMPT, sampling, spec, overlap=True)
    assert isinstance(run, OverlapRun)
    try:
        for _ in run:
            pass
    finally:
        run.close()
    return run


def test_the_next_window_drafted_during_verification_is_kept_when_its_first_draft_is_the_bonus(models):
    """A draft equal to the target: every window is accepted, and the window drafted on top of
    it while it was verified starts with the target's bonus token, so it is kept (PEARL's
    post-verify); the output is the target alone's."""
    target, same, _ = models
    sampling = SamplingParams(max_new_tokens=40)
    run = pearl(SpeculativeEngine(target, HfDrafter(same, target)), sampling)
    assert run.result().token_ids == alone(target, sampling)
    stats = run.stats.to_dict()
    assert stats["overlap"] and not stats["fallback"]
    assert stats["accepted"] == stats["drafted"] > 0
    assert stats["continuations_kept"] > 0


def test_rejections_roll_the_drafting_thread_back_and_the_output_stays_the_targets(models):
    target, _, noisy = models
    engine = SpeculativeEngine(target, HfDrafter(noisy, target))
    for sampling in (SamplingParams(max_new_tokens=48), SamplingParams(max_new_tokens=48, temperature=1.0, seed=3)):
        run = pearl(engine, sampling)
        assert run.result().token_ids == alone(target, sampling)
        assert 0 < run.stats.accepted < run.stats.drafted
        assert run.stats.drafted_total >= run.stats.drafted  # drafts a rollback discarded unverified too


def test_a_drafter_that_stalls_leaves_the_target_alone(models, monkeypatch):
    target, _, noisy = models
    monkeypatch.setattr(overlap, "DRAFT_STALL_S", 0.05)
    sampling = SamplingParams(max_new_tokens=12)
    run = pearl(SpeculativeEngine(target, Faulty(HfDrafter(noisy, target), lambda step: time.sleep(0.5))), sampling)
    assert run.result().token_ids == alone(target, sampling)
    assert run.stats.fallback and run.stats.fallback_kind == "stalled"
    assert run.stats.drafted == 0


def test_closing_a_run_mid_request_stops_its_thread_and_frees_both_caches(models):
    target, _, noisy = models
    run = SpeculativeEngine(target, HfDrafter(noisy, target)).start(PROMPT, SamplingParams(max_new_tokens=64), K4,
                                                                    overlap=True)
    rounds = iter(run)
    next(rounds)
    thread = run.driver.thread
    assert thread.is_alive()
    run.close()
    assert not thread.is_alive() and run.driver.thread is None
    assert run.target_kv.cache is None
    assert not [t for t in threading.enumerate() if t.name == "specd-pearl-draft"]
    run.close()  # idempotent


@pytest.mark.parametrize("spec, reference", [
    (SpecParams("none"), None),
    (SpecParams("adasd", relaxed=True), None),
    (SpecParams("oracle"), [1, 2, 3]),
])
def test_rounds_with_nothing_to_overlap_run_sequentially(models, spec, reference):
    target, _, noisy = models
    engine = SpeculativeEngine(target, HfDrafter(noisy, target))
    run = engine.start(PROMPT, SamplingParams(max_new_tokens=4), spec, reference, overlap=True)
    try:
        assert type(run) is GenerationRun
    finally:
        run.close()


def test_log_probabilities_are_the_sequential_runs(models):
    """Each emitted token's log-probability comes from the verifier's judging, cut with the tokens
    at the length; both equal the sequential engine's."""
    target, _, noisy = models
    engine = SpeculativeEngine(target, HfDrafter(noisy, target))
    sampling = SamplingParams(max_new_tokens=30)
    want = engine.generate(PROMPT, sampling, K4, logprobs=2)
    got = engine.generate(PROMPT, sampling, K4, logprobs=2, overlap=True)
    assert got.token_ids == want.token_ids and got.stats.to_dict()["overlap"]
    assert len(got.logprobs) == len(want.logprobs) == 30
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.top_ids == b.top_ids and a.logprob == pytest.approx(b.logprob, abs=1e-4)
