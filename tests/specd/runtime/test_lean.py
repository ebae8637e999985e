"""The lean Llama forward computes transformers' logits bit for bit, with its own cache."""

from __future__ import annotations

import copy

import pytest
import torch

from specd.errors import InvalidRequest
from specd.runtime.lean import FlatCache, LeanModel, choose_forward, supports
from specd.runtime.session import KVSession, hf_forward
from specd.runtime.tiny import loaded, tiny_llama
from specd.tree import DraftTree


def _pair(model: torch.nn.Module) -> tuple[KVSession, KVSession]:
    """(transformers' forward, the lean forward) sessions over the same model."""
    lean = LeanModel(model)
    return KVSession(hf_forward(model), torch.device("cpu")), KVSession(lean.forward, torch.device("cpu"),
                                                                       lean.new_cache())


def _same_walk(model: torch.nn.Module, steps: int, seed: int, prefix: int = 20) -> None:
    """Random windows (with logits of several rows and hidden states) and rollbacks fed to both
    forwards: every output equal to the bit."""
    hf, lean = _pair(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (prefix,), generator=gen).tolist()
    for s in (hf, lean):
        s.extend(ids, 1)
    for step in range(steps):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        toks = torch.randint(0, vocab, (n,), generator=gen).tolist()
        k = int(torch.randint(1, n + 1, (1,), generator=gen))
        (la, ha), (lb, hb) = hf.extend(toks, k, want_hidden=True), lean.extend(toks, k, want_hidden=True)
        assert torch.equal(la, lb) and torch.equal(ha, hb), f"step {step}: window of {n}"
        if step % 3 == 0:  # a rejection: forget part of the window
            back = hf.length - int(torch.randint(0, n + 1, (1,), generator=gen))
            hf.rollback(back)
            lean.rollback(back)
    for a, b in zip(hf.cache.layers, lean.cache.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_lean_windows_and_rollbacks_equal_transformers_bit_for_bit(tiny_target):
    assert tiny_target.model.config.num_key_value_heads < tiny_target.model.config.num_attention_heads  # GQA
    _same_walk(tiny_target.model, steps=40, seed=0)


def test_the_cache_grows_past_its_first_capacity_and_keeps_its_contents(tiny_target):
    """300 cached tokens: the buffers double past 256 while the outputs stay transformers'."""
    _same_walk(tiny_target.model, steps=40, seed=1, prefix=300)


def test_lean_draft_tree_forward_and_kept_path_equal_transformers(tiny_target):
    hf, lean = _pair(tiny_target.model)
    for s in (hf, lean):
        s.extend(list(range(3, 30)), 1)
    tree = DraftTree.from_chain([5, 6, 7])
    tree.add([5, 9, 10], 2)
    tree.add([11, 12], 2)
    outs = [s.extend_tree([4], tree, torch.float32) for s in (hf, lean)]
    assert torch.equal(outs[0], outs[1])
    base = hf.length - len(tree)
    for s in (hf, lean):
        s.keep_path(base, [0, 3, 4])
    nxt = [s.extend([13, 14], 2)[0] for s in (hf, lean)]
    assert torch.equal(nxt[0], nxt[1])


def test_the_embedded_model_runs_lean_bit_for_bit(embedded):
    """The real 135M target (9 query heads over 3 KV heads): what the speed claim is about."""
    assert embedded.forward_kind() == "lean"
    _same_walk(embedded.model, steps=8, seed=2, prefix=40)


def test_a_changed_weight_is_fused_again_for_the_next_session(tiny_target):
    wrapped = loaded(copy.deepcopy(tiny_target.model), "changing")
    model = wrapped.model
    before = wrapped.session().extend([3, 4, 5, 6], 2)[0]
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(0.5)
        model.model.layers[1].mlp.up_proj.weight.add_(0.01)
    lean = wrapped.session()
    assert isinstance(lean.cache, FlatCache)
    a = KVSession(hf_forward(model), torch.device("cpu")).extend([3, 4, 5, 6], 2)[0]
    b = lean.extend([3, 4, 5, 6], 2)[0]
    assert torch.equal(a, b) and not torch.equal(a, before)


def test_flat_cache_crop_update_and_size():
    cache = FlatCache(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    kv = torch.arange(2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)
    for layer in range(2):
        keys, values = cache.update(kv, -kv, layer)
        assert keys.shape == (1, 2, 3, 4) and torch.equal(values, -kv)
    assert cache.get_seq_length() == 3 and cache.nbytes() == 2 * 2 * (2 * 256 * 4) * 4
    cache.crop(-1)
    assert cache.get_seq_length() == 2 and torch.equal(cache.layers[1].keys, kv[:, :, :2])
    cache.crop(5)  # longer than cached: nothing changes
    assert cache.get_seq_length() == 2


def test_choose_forward():
    model = tiny_llama(0, layers=1)
    cpu = torch.device("cpu")
    assert choose_forward(model, "auto", cpu) == "lean"
    assert choose_forward(model, "hf", cpu) == "hf"
    assert choose_forward(model.to(torch.bfloat16), "auto", cpu) == "hf"  # not measured bit-exact there
    assert choose_forward(model, "lean", cpu) == "lean"
    with pytest.raises(InvalidRequest, match="forward"):
        choose_forward(model, "fast", cpu)


def test_lean_refuses_a_model_it_does_not_compute_exactly():
    from transformers import MixtralConfig, MixtralForCausalLM

    model = MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=2)).eval()
    assert not supports(model)
    assert choose_forward(model, "auto", torch.device("cpu")) == "hf"
    with pytest.raises(InvalidRequest, match="forward"):
        loaded(model, "biased", forward="lean")


def test_load_model_names_a_bad_forward_before_loading(tmp_path):
    from specd.runtime import load_model

    with pytest.raises(InvalidRequest, match="forward"):
        load_model(str(tmp_path), forward="quick")


def test_sessions_follow_the_requested_forward():
    model = tiny_llama(0, layers=1)
    assert isinstance(loaded(model, "t").session().cache, FlatCache)
    assert not isinstance(loaded(model, "t", forward="hf").session().cache, FlatCache)
