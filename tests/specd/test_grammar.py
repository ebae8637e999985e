"""Structured output (specd.grammar): under a grammar speculation is lossless (greedy output is
a plain constrained decoding's, seeded output the target alone's), the answer follows the
grammar, and the grammar drafts what it forces itself."""

from __future__ import annotations

import json

import pytest
import torch

from specd.drafters import HfDrafter, NgramDrafter
from specd.engine import SpeculativeEngine
from specd.errors import InvalidRequest
from specd.grammar import Grammar, GrammarSpec
from specd.runtime.tiny import char_tokenizer, loaded, perturbed, tiny_llama
from specd.types import SamplingParams, SpecParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SPECS = {"json_object": GrammarSpec("json_object"), "json_schema": GrammarSpec("json_schema", json.dumps(SCHEMA))}
N = 60


@pytest.fixture(scope="module")
def pair():
    tok = char_tokenizer()
    target = loaded(tiny_llama(0, layers=4, vocab_size=len(tok)), "tiny-chat-target", tok)
    return target, loaded(perturbed(target.model, 0.01, seed=1), "tiny-chat-draft", tok)


def constrained_decoding(target, prompt: list[int], spec: GrammarSpec, n: int) -> list[int]:
    """Greedy decoding masked by the grammar, one token at a time, no cache, no drafts."""
    grammar, ids = Grammar(spec, target.tokenizer, target.emitted_vocab, target.eos_token_ids), list(prompt)
    with torch.no_grad():
        for _ in range(n):
            row = target.model(torch.tensor([ids])).logits[0, -1, :target.emitted_vocab].float()
            token = int(row.masked_fill(~grammar.allowed(), float("-inf")).argmax())
            ids.append(token)
            grammar.commit([token])
            if token in target.eos_token_ids:
                break
    return ids[len(prompt):]


@pytest.mark.parametrize("kind", sorted(SPECS))
@pytest.mark.parametrize("drafter", ["hf", "ngram"])
def test_greedy_speculation_under_a_grammar_is_constrained_decoding(pair, kind, drafter):
    target, draft = pair
    d = HfDrafter(draft, target) if drafter == "hf" else NgramDrafter()
    s = SamplingParams(max_new_tokens=N, grammar=SPECS[kind])
    forced = by_drafter = 0
    for text in ("the cat sat", "Count"):
        prompt = target.encode_prompt(text, chat=False)
        out = SpeculativeEngine(target, d).generate(prompt, s, SpecParams("constant"))
        assert out.token_ids == constrained_decoding(target, prompt, SPECS[kind], N)
        forced += out.stats.grammar_drafted
        by_drafter += out.stats.drafted - out.stats.grammar_drafted
        if out.finish_reason == "stop":  # the grammar let it end: a whole JSON value
            value = json.loads(out.text)
            assert isinstance(value, dict) and (kind == "json_object" or set(value) == {"name", "age"})
    assert forced > 0 and (kind == "json_object" or by_drafter > 0)  # the grammar drafted, and the drafter too


def test_the_grammar_changes_the_answer(pair):
    """Not a test that cannot fail: without it the tiny model writes no JSON."""
    target, _ = pair
    prompt = target.encode_prompt("the cat sat", chat=False)
    free = SpeculativeEngine(target).generate(prompt, SamplingParams(max_new_tokens=N), SpecParams("none"))
    assert not free.text.startswith("{")
    assert constrained_decoding(target, prompt, SPECS["json_schema"], N) != free.token_ids


@pytest.mark.parametrize("kind", sorted(SPECS))
def test_seeded_speculation_under_a_grammar_is_the_target_alones(pair, kind):
    target, draft = pair
    s = SamplingParams(temperature=0.9, seed=2, max_new_tokens=N, grammar=SPECS[kind])
    prompt = target.encode_prompt("the cat sat", chat=False)
    alone = SpeculativeEngine(target).generate(prompt, s, SpecParams("none"))
    assert alone.text.startswith("{")
    for drafter in (HfDrafter(draft, target), NgramDrafter()):
        assert SpeculativeEngine(target, drafter).generate(prompt, s, SpecParams("constant")).token_ids == \
            alone.token_ids


def test_a_draft_the_grammar_forbids_ends_the_window(pair):
    target, _ = pair
    grammar = Grammar(SPECS["json_object"], target.tokenizer, target.emitted_vocab, target.eos_token_ids)
    brace, x = target.tokenizer.encode("{x", add_special_tokens=False)
    logits = torch.zeros(4, target.emitted_vocab)
    masked, kept = grammar.constrain(logits, [brace, x, brace])
    assert kept == 1  # "{" is allowed, then "x" is not
    assert torch.isinf(masked[0]).sum() == target.emitted_vocab - 1 and masked[0, brace] == 0  # only "{" first
    assert not torch.isinf(masked[1, target.tokenizer.encode('"', add_special_tokens=False)[0]])
    assert grammar.allowed()[brace] and not grammar.allowed()[x]  # rolled back to where it was


@pytest.mark.parametrize("spec", [GrammarSpec("yaml"), GrammarSpec("json_schema", "{not json"),
                                  GrammarSpec("json_schema", json.dumps({"type": "objec"}))])
def test_a_bad_grammar_names_response_format(pair, spec):
    with pytest.raises(InvalidRequest) as e:
        SpeculativeEngine(pair[0]).generate([5, 6], SamplingParams(grammar=spec), SpecParams("none"))
    assert e.value.field == "response_format"
