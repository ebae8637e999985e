"""Batched extends: one forward pass over several sessions must give each session exactly what
its own extend would have (logits, and a cache that keeps working afterwards)."""

from __future__ import annotations

import copy

import pytest
import torch

from specd.runtime import batch as batch_mod
from specd.runtime.batch import batched_extend, batched_extend_hidden, build_batch, forward_batch

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 128, (n,), generator=gen).tolist()


def _prefilled(loaded, prefixes):
    sessions = [loaded.session() for _ in prefixes]
    for s, p in zip(sessions, prefixes):
        s.extend(p, 1)
    return sessions


PREFIXES = [_tokens(5, 1), _tokens(17, 2), _tokens(40, 3)]
NEW = [_tokens(1, 4), _tokens(4, 5), _tokens(7, 6)]
NUM_LOGITS = [1, 3, 7]


def test_batched_logits_equal_individual_extends(tiny_target):
    batched = _prefilled(tiny_target, PREFIXES)
    got = batched_extend(tiny_target.model, batched, NEW, NUM_LOGITS)
    ref = _prefilled(tiny_target, PREFIXES)
    for s, r, g, ids, k in zip(batched, ref, got, NEW, NUM_LOGITS):
        want, _ = r.extend(ids, k)
        assert g.shape == (k, tiny_target.vocab_size) and g.dtype == torch.float32
        torch.testing.assert_close(g, want, **TOL)
        assert s.length == r.length and s.cache.get_seq_length() == r.length


def test_batched_hidden_states_equal_individual_extends_where_wanted(tiny_target):
    """What the target service returns to a feature drafter, per session of a batch."""
    batched = _prefilled(tiny_target, PREFIXES)
    got = batched_extend_hidden(tiny_target.model, batched, NEW, NUM_LOGITS, [True, False, True])
    ref = _prefilled(tiny_target, PREFIXES)
    for (g_logits, g_hidden), r, ids, k, want_hidden in zip(got, ref, NEW, NUM_LOGITS, [True, False, True]):
        logits, hidden = r.extend(ids, k, True)
        torch.testing.assert_close(g_logits, logits, **TOL)
        if want_hidden:
            assert g_hidden.shape == (k, tiny_target.model.config.hidden_size)
            torch.testing.assert_close(g_hidden, hidden, **TOL)
        else:
            assert g_hidden is None


def test_sessions_keep_working_after_a_batched_extend(tiny_target):
    batched, ref = _prefilled(tiny_target, PREFIXES), _prefilled(tiny_target, PREFIXES)
    batched_extend(tiny_target.model, batched, NEW, NUM_LOGITS)
    for r, ids, k in zip(ref, NEW, NUM_LOGITS):
        r.extend(ids, k)

    second = [_tokens(6, 7), _tokens(2, 8), _tokens(3, 9)]
    got = batched_extend(tiny_target.model, batched, second, [6, 2, 1])
    for r, g, ids, k in zip(ref, got, second, [6, 2, 1]):
        torch.testing.assert_close(g, r.extend(ids, k)[0], **TOL)

    for s, r in zip(batched, ref):  # verification-style: drop the last 2 tokens, go on alone
        s.rollback(s.length - 2)
        r.rollback(r.length - 2)
        more = _tokens(3, s.length)
        torch.testing.assert_close(s.extend(more, 3)[0], r.extend(more, 3)[0], **TOL)
        assert s.length == r.length == s.cache.get_seq_length()


def test_empty_sessions_can_be_prefilled_in_a_batch(tiny_target):
    batched = [tiny_target.session(), _prefilled(tiny_target, [PREFIXES[1]])[0], tiny_target.session()]
    prompts = [_tokens(9, 10), _tokens(3, 11), _tokens(2, 12)]
    got = batched_extend(tiny_target.model, batched, prompts, [2, 1, 2])
    ref = [tiny_target.session(), _prefilled(tiny_target, [PREFIXES[1]])[0], tiny_target.session()]
    for s, r, g, ids, k in zip(batched, ref, got, prompts, [2, 1, 2]):
        torch.testing.assert_close(g, r.extend(ids, k)[0], **TOL)
        assert s.length == r.length

    fresh = [tiny_target.session() for _ in range(2)]
    got = batched_extend(tiny_target.model, fresh, prompts[:2], [1, 3])
    for g, ids, k in zip(got, prompts[:2], [1, 3]):
        torch.testing.assert_close(g, tiny_target.session().extend(ids, k)[0], **TOL)


def _greedy_alone(loaded, prompt: list[int], n: int) -> list[int]:
    s = loaded.session()
    out = [int(s.extend(prompt, 1)[0][-1].argmax())]
    while len(out) < n:
        out.append(int(s.extend(out[-1:], 1)[0][-1].argmax()))
    return out


def test_batched_greedy_decode_with_rollbacks_matches_decoding_alone(tiny_target):
    """Every step is one batched_extend over all three prompts. On alternating steps a row
    verifies a 3-token draft (the true next token, then 2 wrong ones): it feeds 4 tokens,
    keeps 2 new tokens and rolls the 2 rejected ones back, as speculative decoding does."""
    prompts = [_tokens(6, 20), _tokens(13, 21), _tokens(25, 22)]
    steps = 20
    refs = [_greedy_alone(tiny_target, p, 2 * steps + 3) for p in prompts]
    sessions = [tiny_target.session() for _ in prompts]
    first = batched_extend(tiny_target.model, sessions, prompts, [1, 1, 1])
    outs = [[int(lg[-1].argmax())] for lg in first]

    for step in range(steps):
        feeds, verifying = [], []
        for i, out in enumerate(outs):
            verify = (step + i) % 2 == 0
            wrong = [(refs[i][len(out) + 1] + d) % 128 for d in (1, 2)]
            feeds.append(out[-1:] + [refs[i][len(out)]] + wrong if verify else out[-1:])
            verifying.append(verify)
        logits = batched_extend(tiny_target.model, sessions, feeds, [len(f) for f in feeds])
        for s, out, lg, feed, verify in zip(sessions, outs, logits, feeds, verifying):
            greedy = lg.argmax(-1).tolist()
            if verify:
                assert greedy[0] == feed[1]  # the draft's first token is accepted...
                out += [feed[1], greedy[1]]  # ...the target's token after it is the bonus
                s.rollback(s.length - 2)  # ...and both wrong draft tokens are forgotten
                assert greedy[1] != feed[2]
            else:
                out.append(greedy[0])

    for out, ref, s in zip(outs, refs, sessions):
        assert out == ref[:len(out)] and len(out) > steps
        assert s.length == s.cache.get_seq_length()


def test_a_single_session_takes_the_plain_path(tiny_target, monkeypatch):
    def no_batch(*args, **kwargs):
        raise AssertionError("a single session must not be padded into a batch")

    monkeypatch.setattr(batch_mod, "build_batch", no_batch)
    s = _prefilled(tiny_target, PREFIXES[:1])[0]
    cache = s.cache
    (got,) = batched_extend(tiny_target.model, [s], NEW[2:], [4])
    want, _ = _prefilled(tiny_target, PREFIXES[:1])[0].extend(NEW[2], 4)
    torch.testing.assert_close(got, want, **TOL)
    assert s.cache is cache and s.length == len(PREFIXES[0]) + len(NEW[2])


def test_without_the_attention_mask_shorter_rows_go_wrong(tiny_target):
    """Negative control: the same padded inputs with an all-ones mask let short rows attend to
    the left padding, which the equality checks above must be able to see."""
    refs = []
    for r, ids, k in zip(_prefilled(tiny_target, PREFIXES), NEW, NUM_LOGITS):
        refs.append(r.extend(ids, k)[0])

    def run(mask_padding: bool) -> list[torch.Tensor]:
        b = build_batch(_prefilled(tiny_target, PREFIXES), NEW, NUM_LOGITS)
        if not mask_padding:
            b.attention_mask = torch.ones_like(b.attention_mask)
        logits, _, _ = forward_batch(tiny_target.model, b)
        return [logits[i, st:st + k].float() for i, (st, k) in enumerate(zip(b.logit_starts, NUM_LOGITS))]

    masked, unmasked = run(True), run(False)
    for got, want in zip(masked, refs):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(unmasked[:2], refs[:2]):  # rows with left padding
        assert not torch.allclose(got, want, **TOL)
    torch.testing.assert_close(unmasked[2], refs[2], **TOL)  # the longest row has no padding


def test_lower_precision_models_batch_too(tiny_target):
    """dtype-agnostic: a bfloat16 copy batches, keeps a bfloat16 cache and returns float32
    logits that agree within bfloat16 round-off."""
    bf16 = copy.deepcopy(tiny_target)
    bf16.model = bf16.model.to(torch.bfloat16)
    batched, ref = _prefilled(bf16, PREFIXES), _prefilled(bf16, PREFIXES)
    got = batched_extend(bf16.model, batched, NEW, NUM_LOGITS)
    for s, r, g, ids, k in zip(batched, ref, got, NEW, NUM_LOGITS):
        want, _ = r.extend(ids, k)
        assert g.dtype == torch.float32 and s.cache.layers[0].keys.dtype == torch.bfloat16
        torch.testing.assert_close(g, want, atol=0.1, rtol=0.05)
        assert s.length == r.length


@pytest.mark.parametrize("bad", [{"num_logits": [0, 1, 1]}, {"num_logits": [2, 1, 1]}])
def test_bad_num_logits_are_refused(tiny_target, bad):
    sessions = _prefilled(tiny_target, PREFIXES)
    with pytest.raises(AssertionError):
        batched_extend(tiny_target.model, sessions, NEW, bad["num_logits"])
