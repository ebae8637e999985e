"""The transformers peers run with the same pair as ours: the early-exit drafter as an assistant."""

from __future__ import annotations

import pytest
import torch

from specd_bench.peers import PeerRunner, early_exit_assistant
from specd.drafters import EarlyExitDrafter
from specd.runtime.session import KVSession, hf_forward
from specd.types import SamplingParams


def trained_like(target, adapter: str) -> EarlyExitDrafter:
    """An early-exit drafter as a trained adapter file makes it: a non-identity adapter, the
    `layer` kind's extra decoder layer, a reduced draft vocabulary."""
    drafter = EarlyExitDrafter(target, layers=2, adapter=adapter)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        drafter.adapter.up.weight.copy_(torch.randn(drafter.adapter.up.weight.shape, generator=gen) * 0.5)
    drafter.set_vocab(torch.arange(0, target.vocab_size, 2))
    return drafter


@pytest.mark.parametrize("adapter", ["untrained", "mlp", "layer"])
def test_early_exit_assistant_is_the_same_drafter(tiny_target, adapter):
    drafter = (EarlyExitDrafter(tiny_target, layers=2) if adapter == "untrained"
               else trained_like(tiny_target, adapter))
    assistant = early_exit_assistant(drafter)
    ids = [5, 9, 17, 33]
    ours, _ = KVSession(drafter.forward, tiny_target.device).extend(ids, 2)
    theirs, _ = KVSession(hf_forward(assistant.model), tiny_target.device).extend(ids, 2)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("adapter", ["untrained", "layer"])
def test_assisted_peer_with_early_exit_is_lossless(tiny_target, hf_greedy, adapter):
    drafter = (EarlyExitDrafter(tiny_target, layers=2) if adapter == "untrained"
               else trained_like(tiny_target, adapter))
    peers = PeerRunner(tiny_target, early_exit_assistant(drafter))
    prompt = [5, 9, 17, 33, 5, 9, 17]
    want = hf_greedy(tiny_target.model, prompt, 16, eos=2)
    for peer in ("hf-assisted", "hf-heuristic"):
        ids, wall = peers.generate(peer, prompt, SamplingParams(max_new_tokens=16))
        assert ids == want and wall > 0
