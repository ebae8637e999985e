"""Speculative sampling through the whole engine follows the target's distribution.

On a tiny model with a 16-token vocabulary the exact target distribution of the first two
generated tokens is computable; many runs of the engine must match it (chi-square), at the
first position and at the second (reached through accepted, recovered and bonus paths), with
temperature and top-k applied. The negative control, the draft's own samples (what "always
accept" would emit), must fail the same test.

The speculative runs are unseeded (rejection sampling; torch's global seed makes them
repeatable). Seeded requests are coupled: test_engine.py checks that their output is the
target alone's for the same seed, and the target alone's seeded draws are tested here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from specd.drafters import HfDrafter
from specd.engine import SpeculativeEngine
from specd.runtime.tiny import loaded, perturbed, tiny_llama
from specd.sampling import logits_to_probs
from specd.types import SamplingParams, SpecParams

V = 16
PROMPT = [3, 7, 1, 12]
RUNS = 2000

pytestmark = pytest.mark.slow  # statistical tests: thousands of samples each


@pytest.fixture(scope="module")
def pair():
    target = loaded(tiny_llama(5, layers=2, vocab_size=V, init_range=0.08), "t16")
    draft = loaded(perturbed(target.model, 0.6, seed=2), "d16")
    target.eos_token_ids = draft.eos_token_ids = frozenset()  # exactly two tokens every run
    return target, draft


def exact_two_token(model, params: SamplingParams) -> np.ndarray:
    """P(t0, t1) [V, V] of the target alone under params."""
    with torch.no_grad():
        p0 = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1], params)
        batch = torch.tensor([PROMPT + [t] for t in range(V)])
        p1 = logits_to_probs(model(batch).logits[:, -1], params)
    return (p0[:, None] * p1).numpy()


def pooled_chisquare(counts: Counter, probs: np.ndarray, runs: int) -> float:
    """Chi-square p-value, pooling cells with expected count < 5 into one."""
    expected = probs.ravel().astype(np.float64) * runs
    observed = np.array([counts.get(i, 0) for i in range(probs.size)], dtype=np.float64)
    if observed[expected == 0].any():
        return 0.0  # a token the target can never produce
    small = expected < 5
    exp = np.append(expected[~small], expected[small].sum())
    obs = np.append(observed[~small], observed[small].sum())
    keep = exp > 0
    exp, obs = exp[keep], obs[keep]
    return chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


def unseeded(engine: SpeculativeEngine, run: int, params: SamplingParams, spec: SpecParams):
    """One rejection-sampling run (no request seed), repeatable through torch's global seed."""
    torch.manual_seed(run)
    return engine.generate(PROMPT, replace(params, seed=None), spec)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=2),
    SamplingParams(temperature=0.7, top_k=6, max_new_tokens=2),
    SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=2),
])
def test_speculative_sampling_matches_the_target(pair, params):
    target, draft = pair
    engine = SpeculativeEngine(target, HfDrafter(draft, target))
    joint = exact_two_token(target.model, params)
    first, second = Counter(), Counter()
    paths = Counter()
    for run in range(RUNS):
        out = unseeded(engine, run, params, SpecParams("constant", policy_params={"k": 2}))
        t0, t1 = out.token_ids
        first[t0] += 1
        second[t0 * V + t1] += 1
        paths[out.stats.accepted_lengths[0]] += 1
    # both paths were exercised: x_1 rejected (recovered token), x_1 accepted (then the bonus token)
    assert paths[0] > 50 and paths[1] > 50
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3


def seeded_alone(model, params: SamplingParams) -> tuple[Counter, Counter]:
    """The first two tokens of RUNS seeded target-alone runs of `model` (the exponential race)."""
    engine = SpeculativeEngine(model)
    first, second = Counter(), Counter()
    for seed in range(RUNS):
        t0, t1 = engine.generate(PROMPT, replace(params, seed=seed), SpecParams("none")).token_ids
        first[t0] += 1
        second[t0 * V + t1] += 1
    return first, second


def test_seeded_target_alone_samples_the_target(pair):
    """Seeded draws (one seed per run) follow the target's distribution: with the test that
    seeded speculative output equals the target alone's (test_engine.py), seeded speculative
    sampling is lossless."""
    target, _ = pair
    params = SamplingParams(temperature=0.7, top_k=6, max_new_tokens=2)
    joint = exact_two_token(target.model, params)
    first, second = seeded_alone(target, params)
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3


def test_negative_control_draft_samples_fail(pair):
    """Emitting the draft's samples unverified (always accept) must be caught by the same test."""
    target, draft = pair
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    joint = exact_two_token(target.model, params)
    first, second = seeded_alone(draft, params)
    assert min(pooled_chisquare(first, joint.sum(1), RUNS), pooled_chisquare(second, joint, RUNS)) < 1e-3


def exact_after_first(model, params: SamplingParams) -> np.ndarray:
    """P(t1, t2) [V, V] of the target alone, t0 marginalised out: the feature drafter can only
    draft once the target has computed features, i.e. from the second generated token on."""
    with torch.no_grad():
        p0 = logits_to_probs(model(torch.tensor([PROMPT])).logits[0, -1], params)
        p1 = logits_to_probs(model(torch.tensor([PROMPT + [a] for a in range(V)])).logits[:, -1], params)
        batch = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p2 = logits_to_probs(model(batch).logits[:, -1], params).reshape(V, V, V)
    return torch.einsum("a,ab,abc->bc", p0, p1, p2).numpy()


@pytest.mark.parametrize("kind", ["early-exit", "feature"])
def test_reduced_vocabulary_drafters_sample_the_target(pair, kind):
    """Drafters that can only propose half the vocabulary (q = 0 elsewhere): the tokens they
    never propose must still come out at the target's rate, through the residual."""
    from specd.drafters import EarlyExitDrafter, FeatureDrafter

    target, _ = pair
    drafter = EarlyExitDrafter(target, 1) if kind == "early-exit" else FeatureDrafter(target)
    drafter.set_vocab(torch.arange(0, V // 2))
    engine = SpeculativeEngine(target, drafter)
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    # The early-exit drafter drafts from the first token; the feature drafter from the second.
    skip = 0 if kind == "early-exit" else 1
    joint = exact_two_token(target.model, params) if skip == 0 else exact_after_first(target.model, params)
    first, second, paths = Counter(), Counter(), Counter()
    for run in range(RUNS):
        out = unseeded(engine, run, SamplingParams(1.0, max_new_tokens=2 + skip),
                       SpecParams("constant", policy_params={"k": 2}))
        t0, t1 = out.token_ids[skip:]
        first[t0] += 1
        second[t0 * V + t1] += 1
        if out.stats.accepted_lengths:
            paths[out.stats.accepted_lengths[0]] += 1
    assert paths[0] > 50 and sum(paths.values()) - paths[0] > 50  # rejections and acceptances
    assert sum(c for t, c in first.items() if t >= V // 2) > 50  # tokens the draft cannot propose
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3


def test_retrieval_point_mass_drafts_sample_the_target(pair):
    """The retrieval drafter proposes point masses (q = 1 on one token): accepted with
    probability p(x), else the residual is p without x. Its datastore proposes the target's two
    most likely tokens after the prompt, so every path occurs: both drafts kept, the second
    refused, the first refused."""
    from specd.drafters import Datastore, RetrievalDrafter

    target, _ = pair
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    joint = exact_two_token(target.model, params)
    a = int(joint.sum(1).argmax())
    b = int(joint[a].argmax())
    engine = SpeculativeEngine(target, RetrievalDrafter(Datastore.from_documents([PROMPT + [a, b]])))
    first, second, paths = Counter(), Counter(), Counter()
    for run in range(RUNS):
        out = unseeded(engine, run, params, SpecParams("constant", policy_params={"k": 2}))
        t0, t1 = out.token_ids
        first[t0] += 1
        second[t0 * V + t1] += 1
        paths[out.stats.accepted_lengths[0]] += 1
    assert paths[0] > 50 and paths[1] + paths[2] > 50
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3


def test_draft_trees_sample_the_target(pair):
    """Several point-mass candidates after the prompt, verified as a tree: the first two tokens
    still follow the target's joint distribution, and paths through side branches occur."""
    from specd.costs import CostCurve
    from specd.drafters import Datastore, RetrievalDrafter

    target, _ = pair
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    joint = exact_two_token(target.model, params)
    order = np.argsort(-joint.sum(1))
    docs = [PROMPT + [int(a), int(joint[a].argmax())] for a in order[:4] for _ in range(4 - list(order).index(a))]
    flat = CostCurve(0.0, list(range(1, 18)), [0.01] * 17, smoothing=0.0)  # frozen: not the machine's timings
    engine = SpeculativeEngine(target, RetrievalDrafter(Datastore.from_documents(docs)), costs=flat)
    first, second = Counter(), Counter()
    branch_paths = 0
    for run in range(RUNS):
        out = unseeded(engine, run, params, SpecParams("constant", policy_params={"k": 2}, branches=3))
        t0, t1 = out.token_ids
        first[t0] += 1
        second[t0 * V + t1] += 1
        branch_paths += out.stats.branch_accepted
    assert branch_paths > 50
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3


def test_hybrid_trees_sample_the_target(pair):
    """A draft model's sampled chain with lookup siblings beside it (the hybrid drafter): the
    chain's node keeps its q rule, the siblings are asked against its residual, and the first
    two tokens still follow the target's joint distribution through both kinds of path."""
    from specd.costs import CostCurve
    from specd.drafters import Datastore, HybridDrafter, RetrievalDrafter

    target, draft = pair
    params = SamplingParams(temperature=1.0, max_new_tokens=2)
    joint = exact_two_token(target.model, params)
    order = np.argsort(-joint.sum(1))
    docs = [PROMPT + [int(a), int(joint[a].argmax())] for a in order[:3]]
    flat = CostCurve(0.0, list(range(1, 18)), [0.01] * 17, smoothing=0.0)  # frozen: not the machine's timings
    hybrid = HybridDrafter(HfDrafter(draft, target), RetrievalDrafter(Datastore.from_documents(docs)))
    engine = SpeculativeEngine(target, hybrid, costs=flat)
    first, second = Counter(), Counter()
    chain_paths = branch_paths = 0
    for run in range(RUNS):
        out = unseeded(engine, run, params, SpecParams("constant", policy_params={"k": 2}))
        t0, t1 = out.token_ids
        first[t0] += 1
        second[t0 * V + t1] += 1
        branch_paths += out.stats.branch_accepted
        chain_paths += any(out.stats.judged_accepted)
    assert branch_paths > 50 and chain_paths > 50
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3


def test_pearl_in_process_samples_the_target(pair):
    """PEARL's rounds (specd.speculation.overlap): drafts verified in chunks while the next
    window is drafted on another thread, kept past a chunk only where they equal the target's
    token. Three tokens a run, so the second is reached through drafts as well as plain steps."""
    target, draft = pair
    engine = SpeculativeEngine(target, HfDrafter(draft, target))
    params = SamplingParams(temperature=1.0, max_new_tokens=3)
    joint = exact_two_token(target.model, params)
    first, second = Counter(), Counter()
    drafted = accepted = 0
    for run in range(RUNS):
        torch.manual_seed(run)
        out = engine.start(PROMPT, params, SpecParams("constant", policy_params={"k": 2}), overlap=True)
        try:
            ids = [t for new in out for t in new]
        finally:
            out.close()
        first[ids[0]] += 1
        second[ids[0] * V + ids[1]] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert 0.1 * drafted < accepted < 0.9 * drafted  # drafts were accepted and rejected
    assert pooled_chisquare(first, joint.sum(1), RUNS) > 1e-3
    assert pooled_chisquare(second, joint, RUNS) > 1e-3
