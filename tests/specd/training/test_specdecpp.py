"""Training the SpecDec++ acceptance head: labels, token mixing, the fit, the saved file and
the trained head inside the engine (greedy output must equal the target's)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from specd.drafters import EarlyExitDrafter, HfDrafter, NgramDrafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.runtime import load_model
from specd.runtime.tiny import loaded, perturbed
from specd.policies.specdecpp import AcceptanceHead
from specd.training.specdecpp import (acceptance_labels, auc, build_examples, draft_forward_fn,
                                      generate_targets, mix_tokens, train_head,
                                      train_head_from_prompts)
from specd.types import SamplingParams, SpecParams

PROMPTS = [[1, 5, 6, 7], [1, 9, 10], [1, 40, 41, 42, 43]]


@pytest.fixture(scope="module")
def target(tiny_target):
    """The shared tiny 4-layer Llama (tests/conftest.py)."""
    return tiny_target


@pytest.fixture(scope="module")
def sequences(target):
    generations = generate_targets(target, PROMPTS, 12, 0.0, seed=0)
    assert all(len(g) == 12 for g in generations)
    return [p + g for p, g in zip(PROMPTS, generations)], [len(p) for p in PROMPTS]


def test_labels_are_one_when_the_drafter_is_the_target(target, sequences):
    twin = HfDrafter(loaded(copy.deepcopy(target.model), "twin"), target)
    hidden, soft, hard = build_examples(target, draft_forward_fn(twin), *sequences, seed=0)
    assert hidden.shape == (36, 64) and soft.shape == hard.shape == (36,)
    assert torch.equal(soft, torch.ones(36))
    assert hard.all()


@pytest.mark.parametrize("make_drafter", [
    lambda target: EarlyExitDrafter(target, 2),
    lambda target: HfDrafter(loaded(perturbed(target.model, 0.1, seed=1), "noisy"), target),
], ids=["early-exit", "hf-perturbed"])
def test_labels_of_a_weaker_drafter(target, sequences, make_drafter):
    drafter = make_drafter(target)
    hidden, soft, hard = build_examples(target, draft_forward_fn(drafter), *sequences, seed=0)
    assert hidden.shape == (36, 64)
    assert ((soft >= 0) & (soft <= 1)).all()
    assert soft.mean() < 1 and not hard.all()  # negative control: the drafter does disagree
    again = build_examples(target, draft_forward_fn(drafter), *sequences, seed=0)
    assert torch.equal(again[1], soft)  # seeded


def test_acceptance_labels_math():
    # Row 0: q's argmax 0 has q = 0.5, p = 0.25 -> 0.5; row 1: p(x) >= q(x) -> 1.
    q = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.2, 0.2]]).log()
    p = torch.tensor([[0.25, 0.5, 0.25], [0.7, 0.2, 0.1]]).log()
    soft, hard = acceptance_labels(p, q)
    assert torch.allclose(soft, torch.tensor([0.5, 1.0]))
    assert hard.tolist() == [False, True]


def test_mix_tokens_keeps_the_prompt_and_draws_from_q():
    seq, n = [1, 2, 3, 10, 11, 12, 13], 3
    q = torch.zeros(4, 20)
    q[:, 7] = 1.0  # a point mass: every replacement is 7
    gen = torch.Generator().manual_seed(0)
    assert mix_tokens(seq, n, q, 0.0, gen) == seq
    assert mix_tokens(seq, n, q, 1.0, gen) == [1, 2, 3, 7, 7, 7, 7]
    mixed = [mix_tokens(seq, n, q, 0.5, gen) for _ in range(200)]
    rate = sum(t == 7 for m in mixed for t in m[n:]) / 800
    assert 0.4 < rate < 0.6


def test_mixing_changes_the_contexts(target, sequences):
    forward = draft_forward_fn(EarlyExitDrafter(target, 2))
    plain = build_examples(target, forward, *sequences, mix_rate=0.0)[0]
    mixed = build_examples(target, forward, *sequences, mix_rate=0.5, seed=3)[0]
    assert plain.shape == mixed.shape and not torch.allclose(plain, mixed)


@pytest.mark.parametrize("scores, positive, expected", [
    ([0.1, 0.2, 0.8, 0.9], [False, False, True, True], 1.0),
    ([0.9, 0.8, 0.2, 0.1], [False, False, True, True], 0.0),
    ([0.5, 0.5, 0.5, 0.5], [False, True, False, True], 0.5),
    ([0.1, 0.5, 0.5, 0.9], [False, True, False, True], 0.875),  # one tied pair of four
])
def test_auc(scores, positive, expected):
    assert auc(torch.tensor(scores), torch.tensor(positive)) == pytest.approx(expected)


def test_auc_is_undefined_with_one_class():
    assert math.isnan(auc(torch.tensor([0.1, 0.2]), torch.tensor([True, True])))


def test_draft_forward_fn_refuses_a_drafter_without_hidden_states():
    with pytest.raises(InvalidRequest):
        draft_forward_fn(NgramDrafter())


def test_head_learns_a_separable_problem():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2000, 8, generator=gen)
    hidden[:, 0] += torch.where(hidden[:, 0] > 0, 0.5, -0.5)  # a margin of 1 around x0 = 0
    hard = hidden[:, 0] > 0
    head, report = train_head(hidden, hard.float(), hard, width=32, epochs=8, lr=3e-3, batch_size=64, seed=0)
    assert report["num_val"] == 200 and report["num_train"] == 1800
    assert report["val_accuracy"] > 0.95
    assert abs(report["val_mean_predicted_acceptance"] - report["val_base_rate"]) < 0.1


def test_saved_head_loads_with_identical_outputs(tmp_path):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(64, 16, generator=gen)
    soft = torch.rand(64, generator=gen)
    head, _ = train_head(hidden, soft, soft > 0.5, width=32, epochs=2, seed=0)
    head.save(tmp_path / "head.safetensors")
    again = AcceptanceHead.load(tmp_path / "head.safetensors")
    assert again.config == {"hidden_size": 16, "depth": 3, "width": 32}
    with torch.no_grad():
        assert torch.equal(head(hidden), again(hidden))


def test_train_head_rejects_bad_numbers():
    with pytest.raises(InvalidRequest):
        train_head(torch.zeros(1, 4), torch.zeros(1), torch.zeros(1, dtype=torch.bool))
    with pytest.raises(InvalidRequest):
        train_head(torch.zeros(8, 4), torch.zeros(8), torch.zeros(8, dtype=torch.bool), epochs=0)


@pytest.fixture(scope="module")
def tokenized_target(tiny_dirs):
    return load_model(str(tiny_dirs[0]), device="cpu")


def _write_prompts(path, texts):
    path.write_text("".join(json.dumps({"turns": [t, "second turn"]}) + "\n" for t in texts))
    return path


def test_trained_head_drives_the_engine_losslessly(tokenized_target, tmp_path):
    target = tokenized_target
    drafter = EarlyExitDrafter(target, 2)
    prompts = _write_prompts(tmp_path / "prompts.jsonl", ["Hello there", "Write a poem", "2+2=?", "unused"])
    out = tmp_path / "head.safetensors"
    report = train_head_from_prompts(target, drafter, prompts, limit=3, max_new_tokens=16, temperature=0.0,
                                     epochs=3, out_path=out, seed=0)
    assert out.is_file()
    assert report["num_prompts"] == 3 and report["num_examples"] == report["generated_tokens"] == 48
    assert 0 <= report["val_accuracy"] <= 1

    engine = SpeculativeEngine(target, drafter, specdecpp_head=AcceptanceHead.load(out))
    prompt = target.encode_prompt("Tell me a story", chat=True)
    sampling = SamplingParams(max_new_tokens=20)
    spec = engine.generate(prompt, sampling, SpecParams(policy="specdec++"))
    plain = engine.generate(prompt, sampling, SpecParams(policy="none"))
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted > 0


@pytest.mark.parametrize("content, overrides", [
    (None, {}),  # missing file
    ("", {}),  # empty file
    ('{"question": "no turns"}\n', {}),
    ('{"turns": ["hi"]}\n', {"limit": 0}),
    ('{"turns": ["hi"]}\n', {"max_new_tokens": 0}),
    ('{"turns": ["hi"]}\n', {"temperature": -1.0}),
    ('{"turns": ["hi"]}\n', {"epochs": 0}),
])
def test_train_head_from_prompts_rejects_bad_input(tokenized_target, tmp_path, content, overrides):
    path = tmp_path / "prompts.jsonl"
    if content is not None:
        path.write_text(content)
    args = dict(limit=2, max_new_tokens=4, temperature=0.0, epochs=1, out_path=tmp_path / "h.safetensors")
    args.update(overrides)
    with pytest.raises(InvalidRequest):
        train_head_from_prompts(tokenized_target, EarlyExitDrafter(tokenized_target, 2), path, **args)
    assert not (tmp_path / "h.safetensors").exists()
