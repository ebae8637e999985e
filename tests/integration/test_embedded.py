"""The real embedded SmolLM2-135M-Instruct: cached loading, and greedy speculative output
identical to transformers' greedy decoding for every policy with the model-free and the
early-exit drafter."""

from __future__ import annotations

import json
import time

import pytest

from specd.drafters import NgramDrafter, build_drafter
from specd.engine import SpeculativeEngine
from specd.policies import POLICIES, AcceptanceHead
from specd.types import SamplingParams, SpecParams

pytestmark = pytest.mark.embedded
N = 64
QUESTIONS = [
    "Compose an engaging travel blog post about a recent trip to Hawaii.",
    "Explain in simple terms how a hash map works, with a short Python example.",
]


@pytest.fixture(scope="module")
def prompts_and_refs(embedded, hf_greedy):
    prompts = [embedded.encode_prompt(q, chat=True) for q in QUESTIONS]
    return [(p, hf_greedy(embedded.model, p, N, eos=2)) for p in prompts]


def test_embedded_model_shape(embedded):
    cfg = embedded.model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, embedded.vocab_size) == (30, 576, 49152)
    assert embedded.eos_token_ids == frozenset([2])


def test_cached_load_is_fast(embedded):
    from specd.runtime import load_model

    t0 = time.perf_counter()
    again = load_model("embedded", device="cpu")
    assert time.perf_counter() - t0 < 15  # dequantizing takes ~20 s; the safetensors cache ~1 s
    assert again.vocab_size == embedded.vocab_size


@pytest.mark.parametrize("drafter_kind, question", [("ngram", 1), ("early-exit", 0)])
def test_every_policy_is_lossless_on_the_embedded_model(embedded, prompts_and_refs, drafter_kind, question):
    """One question per drafter (the suite's time: each policy's run costs seconds here; tiny
    models check every policy on more prompts in tests/specd): the lookup drafter on the code
    answer, where it finds the most to draft, the early-exit drafter on the prose one."""
    from specd.policies import bundled_head_path

    drafter = NgramDrafter() if drafter_kind == "ngram" else build_drafter("early-exit", embedded)
    if drafter_kind == "early-exit":  # the trained adapter specd ships, with its reduced vocabulary
        assert drafter.adapter_name and drafter.layers == 4 and drafter.vocab_ids.numel() == 8192
    head_path = bundled_head_path(drafter.name)
    assert (head_path is not None) == (drafter_kind == "early-exit")  # the head ships in the package
    head = AcceptanceHead.load(head_path) if head_path else None
    engine = SpeculativeEngine(embedded, drafter, specdecpp_head=head)
    for policy in sorted(POLICIES):
        if policy == "specdec++" and head is None:
            continue
        prompt, want = prompts_and_refs[question]
        out = engine.generate(prompt, SamplingParams(max_new_tokens=N), SpecParams(policy), reference=want)
        assert out.token_ids == want, f"{policy}/{drafter_kind}"


def test_cli_on_the_embedded_model(embedded, capsys):
    from specd.cli import main

    assert main(["generate", "What is the capital of France?", "--policy", "svip", "--drafter",
                 "early-exit", "--max-new-tokens", "12", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "Paris" in doc["text"]
    assert doc["stats"]["verifications"] >= 1
