"""llama.cpp as a bench peer: without the optional extra the two peers are skipped with a one-line
reason (the tests never need llama-cpp-python); with it, only against the embedded GGUF target."""

from __future__ import annotations

import importlib.util

import pytest

from specd_bench import llama_cpp
from specd_bench.configs import BenchSettings, build_configs
from specd_bench.peers import BASELINES, skip_reason
from specd.runtime.tiny import loaded, tiny_llama


@pytest.fixture
def tiny_target():
    return loaded(tiny_llama(0), "tiny")


def test_without_the_extra_the_llama_cpp_peers_are_skipped_in_one_line(monkeypatch, tiny_target):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert set(llama_cpp.LLAMA_PEERS) <= set(BASELINES)
    s = BenchSettings(baselines=("ar", *llama_cpp.LLAMA_PEERS))
    s.validate()
    skips = {p: skip_reason(p, None, tiny_target) for p in llama_cpp.LLAMA_PEERS}
    configs = {c.label: c for c in build_configs(s, {}, skips)}
    for peer in llama_cpp.LLAMA_PEERS:
        assert configs[peer].kind == "peer"
        assert "llama-cpp-python is not installed" in configs[peer].skip and "\n" not in configs[peer].skip


def test_with_the_extra_only_the_embedded_gguf_target_is_a_peer(monkeypatch, tiny_target):
    monkeypatch.setattr(llama_cpp, "available", lambda: True)
    assert "embedded GGUF target only" in llama_cpp.skip_reason(tiny_target)
    assert skip_reason("hf-ar", None, tiny_target) is None  # the transformers peers are unaffected


def test_the_context_fits_the_prompt_and_its_answer_up_to_the_targets():
    """A long prompt gets a context it fits in (the peer is loaded again, larger), never past the
    target's own; a prompt that leaves no room to generate is refused in one clear line."""
    size = llama_cpp.context_size
    assert size(635, 256, 8192) == llama_cpp.CONTEXT  # the summarization prompt fits the default
    assert size(3900, 256, 8192) == 5120  # 4156 tokens: rounded up to CONTEXT_STEP
    assert size(10, 8, 8192, loaded=5120) == 5120  # a loaded larger context is kept
    assert size(8000, 256, 8192) == 8192  # capped at the target's: the run stops at its end, as specd's
    assert size(100, 8, 512) == 512
    with pytest.raises(ValueError, match="the prompt is 512 tokens; the target's context is 512"):
        size(512, 8, 512)
