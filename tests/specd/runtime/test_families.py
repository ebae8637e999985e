"""Every decoder family the runtime serves (specd.runtime.arch), on tiny random checkpoints built
from transformers' own config classes: the lean forward, the KV pool's exact (CPU) and fused
(GPU) forwards and speculation in process compute what transformers computes for the model.

Compared positions reach past each sliding window (24) and past each scaled rotary table's
original context (32). Rotary scalings that depend on the sequence's length (dynamic, longrope)
are compared with transformers decoding one token at a time, the rule the runtime applies at
every position (specd.runtime.lean)."""

from __future__ import annotations

import pytest
import torch

from specd.drafters import build_drafter
from specd.engine import SpeculativeEngine
from specd.runtime.arch import describe, unsupported
from specd.runtime.lean import LeanModel
from specd.runtime.pool import pooled_extend
from specd.runtime.tiny import FAMILIES, loaded, perturbed, tiny_family
from specd.tree import DraftTree
from specd.types import SamplingParams, SpecParams

TOL = {"atol": 2e-4, "rtol": 1e-4}
LENGTH = 96  # each reference sequence: past every window and original context of the tiny models
PER_POSITION = ("dynamic", "longrope")


def _sequence(seed: int, n: int = LENGTH) -> list[int]:
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def reference_logits(model: torch.nn.Module, family: str, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] after each prefix of ids: one forward over the whole
    sequence, or one token at a time for a length-dependent rotary scaling."""
    x = torch.tensor([ids])
    if not any(kind in family for kind in PER_POSITION):
        return model(input_ids=x).logits[0].float()
    from transformers import DynamicCache

    cache, out = DynamicCache(config=model.config), []
    for p in range(len(ids)):
        out.append(model(input_ids=x[:, p:p + 1], past_key_values=cache, use_cache=True).logits[0])
    return torch.cat(out).float()


@torch.inference_mode()
def greedy_reference(model: torch.nn.Module, family: str, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy generate. Phi-3's generate re-encodes the whole sequence with its long
    rotary factors when the sequence first passes the original context; the runtime keeps each
    position's own factors (docs/deploy.md, "Your own models"), which is transformers' Phi-3
    decoding one token at a time without that reset."""
    if family != "phi3-longrope":
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                              eos_token_id=None)[0, len(prompt):].tolist()
    from transformers import DynamicCache

    cache, ids, out = DynamicCache(config=model.config), list(prompt), []
    x = torch.tensor([ids])
    for _ in range(n):
        token = int(model(input_ids=x, past_key_values=cache, use_cache=True).logits[0, -1].argmax())
        out.append(token)
        x = torch.tensor([[token]])
    return out


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_family(request.param)
    seqs = [_sequence(s) for s in range(3)]
    return request.param, model, seqs, [reference_logits(model, request.param, s) for s in seqs]


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, **TOL)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_every_family_is_described_and_a_sliding_or_capped_one_is_not_plain(family):
    name, model, _, _ = family
    assert unsupported(model) is None
    arch = describe(model)
    if "window" in name or name.startswith("gemma"):
        assert any(w is not None for w in arch.windows) and not arch.plain_attention
    if name == "gemma2":
        assert arch.attn_softcap is not None and arch.final_softcap is not None and arch.sandwich


def test_lean_forward_in_chunks_and_after_rollbacks_equals_transformers(family):
    _, model, seqs, refs = family
    lean = loaded(model, "tiny", forward="lean")
    ids, ref = seqs[0], refs[0]
    s = lean.session()
    for a, b in ((0, 30), (30, 31), (31, 40)):
        _close(s.extend(ids[a:b], b - a)[0], ref[a:b])
    s.extend(_sequence(9, 6), 1)  # a rejected window: rolled back, its keys overwritten
    s.rollback(40)
    _close(s.extend(ids[40:LENGTH], LENGTH - 40)[0], ref[40:])


@pytest.fixture(params=["exact", "fused"])
def pooled(family, request):
    """The family's model in a 4-slot pool, with the CPU's exact forward or the GPU's fused one
    (run here on the CPU)."""
    name, model, seqs, refs = family
    target = loaded(model, name, forward="lean")
    target.use_pool(4, 128)
    target.pool.fused = request.param == "fused"
    yield target, seqs, refs
    target.pool = None


def test_pooled_batches_of_unequal_sessions_with_rollbacks_equal_transformers(pooled):
    """Three sessions of 5, 40 and 70 prefilled tokens (in chunks), then batched windows; a wrong
    window is rolled back and the true tokens follow: every position's logits are transformers'."""
    target, seqs, refs = pooled
    sessions = [target.session() for _ in seqs]
    starts = [5, 40, 70]
    for s, ids, ref, n in zip(sessions, seqs, refs, starts):
        for a in range(0, n, 16):  # chunked prefill
            b = min(a + 16, n)
            _close(s.extend(ids[a:b], b - a)[0], ref[a:b])
    wrong = [_sequence(20 + i, k) for i, k in enumerate((3, 1, 5))]
    pooled_extend(sessions, wrong, [len(w) for w in wrong])
    for s, n in zip(sessions, starts):
        s.rollback(n)
    for width in (1, 4, 7, 2):
        windows = [ids[s.length:s.length + width] for s, ids in zip(sessions, seqs)]
        got = pooled_extend(sessions, windows, [width] * 3)
        for (logits, _), s, ref in zip(got, sessions, refs):
            _close(logits, ref[s.length - width:s.length])
    assert [s.length for s in sessions] == [n + 14 for n in starts]


def test_a_draft_tree_in_the_pool_equals_transformers_on_each_branch(pooled):
    target, seqs, refs = pooled
    ids, ref = seqs[1], refs[1]
    s = target.session()
    base = 50
    s.extend(ids[:base - 1], 1)
    side = [ids[base] + 1 if ids[base] + 1 < 128 else 3, 7]
    tree = DraftTree.from_chain(ids[base:base + 3])
    tree.add(side, 2)  # a side branch beside the chain
    logits = s.extend_tree(ids[base - 1:base], tree, torch.float32)
    _close(logits[:4], ref[base - 1:base + 3])  # after the root, then after each chain node
    side_ref = reference_logits(target.model, target.name, ids[:base] + side)
    _close(logits[4:], side_ref[base:])
    s.keep_path(base, [0, 1])  # two chain nodes kept: the session goes on from ids[:base + 2]
    _close(s.extend(ids[base + 2:base + 6], 4)[0], ref[base + 2:base + 6])


def test_greedy_speculation_in_process_equals_transformers_generate(family):
    """An hf draft of the same family (the target with 1% noise) and n-gram lookups: greedy output
    is transformers' own generate, token for token."""
    name, model, _, _ = family
    prompt = _sequence(5, 12) + _sequence(5, 6)  # a repeat for the lookups to find
    want = greedy_reference(model, name, prompt, 40)
    target = loaded(model, name)
    target.use_pool(4, 128)
    draft = loaded(perturbed(model, 0.01, seed=2), name + "-draft")
    draft.use_pool(4, 128)
    sampling = SamplingParams(max_new_tokens=40)
    for drafter in (build_drafter("hf", target, draft), build_drafter("ngram", target)):
        result = SpeculativeEngine(target, drafter).generate(prompt, sampling, SpecParams("constant"))
        assert result.token_ids == want[:len(result.token_ids)], drafter.name
        assert len(result.token_ids) == 40 or result.token_ids[-1] in target.eos_token_ids
        assert result.stats.drafted > 0


def test_a_model_the_runtime_cannot_serve_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=1, n_head=4)).eval()
    assert "gpt2" in unsupported(model)
    target = loaded(model, "gpt2")  # in process it still generates, on transformers' forward
    assert target.forward_kind() == "hf"
    from specd.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="gpt2") as e:
        target.use_pool(2, 64)
    assert e.value.field == "kv_slots"


def test_the_lean_model_reads_fused_phi3_weights_and_refreshes_them():
    model = tiny_family("phi3")
    lean = LeanModel(model)
    assert len(lean.layers[0].sources) == 2  # one q/k/v linear, one gate/up linear
    with torch.no_grad():
        model.model.layers[0].self_attn.qkv_proj.weight.mul_(0.5)
    lean.new_cache()  # a changed weight is fused again
    ids = torch.tensor([_sequence(1, 20)])
    with torch.inference_mode():
        _close(lean.forward(ids, lean.new_cache(), 20, False)[0].float(), model(input_ids=ids).logits[0])


@pytest.mark.slow
def test_fused_layers_through_torch_compile_equal_transformers():
    """What the GPU's CUDA graphs capture (each fused layer through torch.compile), here on the CPU,
    for the family whose layers differ most from Llama's (Gemma 2: soft caps, four norms a layer,
    windows); the others' fused layers run eagerly above, and compiling one takes a minute."""
    name = "gemma2"
    model = tiny_family(name)
    ids = _sequence(7, 60)
    ref = reference_logits(model, name, ids)
    target = loaded(model, name, forward="lean")
    target.use_pool(2, 128)
    target.pool.fused = True
    target.pool.compile_layers()
    s = target.session()
    _close(s.extend(ids[:40], 40)[0], ref[:40])
    for at in range(40, 60, 5):
        _close(s.extend(ids[at:at + 5], 5)[0], ref[at:at + 5])


@pytest.mark.slow
def test_a_compiled_cpu_forward_of_gemma2_with_biases_equals_transformers(tmp_path):
    """The CPU's ahead-of-time compiled forward (specd.runtime.aot) of the family furthest from
    Llama, with attention biases too: what it reads beside the model's weights (concatenated
    biases, Gemma's norm scales) are constants it names, and its logits are transformers'."""
    from specd.runtime.aot import AotRunner, compile_supported

    if compile_supported() is not None:
        pytest.skip(compile_supported())
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                           attention_bias=True, sliding_window=24, query_pre_attn_scalar=24,
                                           attn_logit_softcapping=20.0, final_logit_softcapping=15.0,
                                           initializer_range=0.3, attn_implementation="eager")).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn(p.shape) * 0.2)
    ids = _sequence(4, 60)
    ref = reference_logits(model, "gemma2", ids)
    target = loaded(model, "gemma2-biased", forward="lean")
    target.use_pool(2, 128, compiled="on", cache_dir=tmp_path)
    runner = target.pool.runner
    assert isinstance(runner, AotRunner)
    s = target.session()
    got = [s.extend(ids[:20], 20)[0]] + [s.extend(ids[at:at + 4], 4)[0] for at in range(20, 60, 4)]
    assert runner.runs >= 10
    _close(torch.cat(got), ref)
