"""Drafters: n-gram prompt lookup, the early-exit drafter's shared weights and identity adapter."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specd.drafters import EarlyExitDrafter, NgramDrafter
from specd.drafters.ngram import suffix_matches
from specd.runtime.session import KVSession, hf_forward
from specd.runtime.tiny import loaded, tiny_llama
from specd.sampling import race_row
from specd.types import SamplingParams

GREEDY = SamplingParams()


def test_ngram_proposes_what_followed_the_most_recent_match():
    s = NgramDrafter().open()
    seq = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    d = s.next(seq, GREEDY, None, False)
    # the trailing 3-gram [1, 2, 3] last occurred at index 5, followed by 5, 6, 1, 2, 3
    assert (d.token, d.q, d.prob, d.entropy) == (5, None, 1.0, 0.0)
    seq.append(d.token)
    assert s.next(seq, GREEDY, None, False).token == 6


def test_suffix_matches_finds_every_earlier_end_of_the_longest_suffix():
    """Against brute force, on random texts over a small alphabet (many repeats)."""
    rng = np.random.default_rng(0)
    for _ in range(300):
        seq = rng.integers(0, 4, rng.integers(1, 60))
        ends, length = suffix_matches(seq, 6)
        want, want_len = [], 0
        for m in range(1, 7):
            found = [e for e in range(m - 1, len(seq) - 1) if list(seq[e - m + 1:e + 1]) == list(seq[-m:])]
            if not found:
                break
            want, want_len = found, m
        assert length == want_len and ends.tolist() == want and ends.dtype == np.int64


def test_ngram_falls_back_to_shorter_ngrams_and_to_nothing():
    s = NgramDrafter().open()
    assert s.next([7, 8, 9, 3, 4, 8, 9], GREEDY, None, False).token == 3  # [8, 9] matched
    assert s.next([1, 2, 3, 4], GREEDY, None, False) is None  # no earlier occurrence at all


def test_ngram_forgets_its_proposal_after_a_rollback():
    s = NgramDrafter().open()
    seq = [1, 2, 3, 1, 2]
    assert s.next(seq, GREEDY, None, False).token == 3  # continuation [3, 1, 2]
    s.rollback(5)  # 3 was rejected and 7 emitted instead: [1, 2] no longer follows
    assert s.next(seq + [7], GREEDY, None, False) is None  # without the rollback: a stale 1


def test_ngram_tokens_carry_their_votes():
    s = NgramDrafter().open()
    # [1, 2] occurred three times before: followed by 3 twice (the most recent one included) and
    # by 4 once; then, of the two occurrences that went on with 3, one has 5 next and one 6
    seq = [1, 2, 3, 5, 1, 2, 4, 0, 1, 2, 3, 6, 8, 1, 2]
    d = s.next(seq, GREEDY, None, False)
    assert (d.token, d.match_len, d.votes) == (3, 2, 3) and d.support == pytest.approx(2 / 3)
    d = s.next(seq + [3], GREEDY, None, False)
    assert (d.token, d.votes, d.support) == (6, 2, 0.5)
    d = s.next(seq + [3, 6], GREEDY, None, False)
    assert (d.token, d.votes, d.support) == (8, 1, 1.0)  # the only occurrence still agreeing


def test_coupled_sampling_drafts_the_candidate_its_race_noise_favours():
    """Seeded sampling draws argmax p / E (specd.sampling): among what the match's occurrences go
    on with, the drafter proposes the v with the largest count(v) / E(v), and reports E(x)."""
    seq = [1, 2, 3, 5, 1, 2, 4, 0, 1, 2, 3, 6, 8, 1, 2]  # after [1, 2]: 3 twice, 4 once
    chosen = set()
    for seed in range(30):
        params = SamplingParams(1.0, 0, 1.0, seed, 16)
        d = NgramDrafter().open(50).next(seq, params, None, False)
        e = race_row(seed, len(seq), 50)
        want = 3 if 2 / e[3] > 1 / e[4] else 4
        assert d.token == want and d.noise == pytest.approx(float(e[want]))
        assert d.votes == 3 and d.support == pytest.approx((2 if want == 3 else 1) / 3)
        chosen.add(d.token)
    assert chosen == {3, 4}  # the noise, not the most recent occurrence, decided
    # greedy, or without the target's vocabulary size: no noise, the most recent occurrence
    for params, vocab in ((GREEDY, 50), (SamplingParams(1.0, 0, 1.0, 0, 16), None)):
        d = NgramDrafter().open(vocab).next(seq, params, None, False)
        assert d.token == 3 and d.noise < 0


def test_early_exit_equals_the_truncated_target_until_trained(tiny_target):
    drafter = EarlyExitDrafter(tiny_target, layers=2)
    ids = [5, 9, 17, 33, 5]
    logits, _ = KVSession(drafter.forward, tiny_target.device).extend(ids, 2)
    # reference: a 2-layer model holding the target's own first two layers, norm and head
    shallow = tiny_llama(0, layers=2)
    src = tiny_target.model.state_dict()
    shallow.load_state_dict({k: v for k, v in src.items() if k in shallow.state_dict()})
    ref, _ = KVSession(hf_forward(shallow), tiny_target.device).extend(ids, 2)
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)
    # the drafter shares weights with the target instead of copying them
    assert drafter.lm_head.weight.data_ptr() == tiny_target.model.lm_head.weight.data_ptr()


def test_early_exit_adapter_round_trip(tiny_target, tmp_path):
    drafter = EarlyExitDrafter(tiny_target, layers=2)
    with torch.no_grad():
        drafter.adapter.up.weight.normal_()
    path = tmp_path / "adapter.safetensors"
    drafter.save_adapter(path)
    again = EarlyExitDrafter(tiny_target, layers=2, adapter_path=path)
    # a trained adapter is another drafter: its own shared policy state, no untrained-pair head
    assert drafter.name == "tiny-target:early-exit-2" and again.name == "tiny-target:early-exit-2+adapter"
    ids = torch.tensor([[5, 9, 17]])
    from transformers import DynamicCache

    a, _ = drafter.forward(ids, DynamicCache(), 1, False)
    b, _ = again.forward(ids, DynamicCache(), 1, False)
    torch.testing.assert_close(a, b)


def test_early_exit_sessions_run_lean_and_draft_what_transformers_computes(tiny_target):
    """Draft sessions on a float32 CPU target run the lean forward over the drafter's layers:
    the same logits and hidden states as transformers' forward, to the bit, over windows and
    rollbacks, with the `layer` adapter and a reduced draft vocabulary; and after the adapter
    layer is changed (training), the next session computes with the new weights."""
    from specd.runtime.lean import FlatCache

    drafter = EarlyExitDrafter(tiny_target, layers=2, adapter="layer")
    drafter.set_vocab(torch.arange(0, tiny_target.vocab_size, 3))
    with torch.no_grad():
        drafter.adapter.up.weight.normal_(std=0.05)

    def walk() -> None:
        lean = drafter.open().kv
        assert isinstance(lean.cache, FlatCache)
        hf = KVSession(drafter.forward, tiny_target.device)
        gen = torch.Generator().manual_seed(0)
        for s in (hf, lean):
            s.extend(list(range(3, 23)), 1)
        for step in range(12):
            n = int(torch.randint(1, 6, (1,), generator=gen))
            toks = torch.randint(0, tiny_target.vocab_size, (n,), generator=gen).tolist()
            (la, ha), (lb, hb) = hf.extend(toks, n, want_hidden=True), lean.extend(toks, n, want_hidden=True)
            assert torch.equal(la, lb) and torch.equal(ha, hb), f"step {step}"
            if step % 3 == 0:
                back = hf.length - int(torch.randint(0, n + 1, (1,), generator=gen))
                hf.rollback(back)
                lean.rollback(back)

    walk()
    before = drafter.open().kv.extend([3, 4, 5], 1)[0]
    with torch.no_grad():
        drafter.extra_layer.self_attn.v_proj.weight.mul_(1.5)
        drafter.extra_layer.mlp.gate_proj.weight.add_(0.02)
    assert not torch.equal(drafter.open().kv.extend([3, 4, 5], 1)[0], before)
    walk()
    # a target that runs transformers' forward gets transformers' forward in its drafter too
    hf_target = loaded(tiny_target.model, "hf-target", forward="hf")
    assert not isinstance(EarlyExitDrafter(hf_target, layers=2).open().kv.cache, FlatCache)


def test_suffix_matches_agrees_with_a_brute_force_search_over_many_occurrences():
    """Against a brute-force search, on random texts of small vocabularies: long texts of
    frequent tokens narrow their many occurrences with numpy, short ones in Python."""
    def brute(seq, max_ngram):
        n, best = len(seq), (np.zeros(0, np.int64), 0)
        for length in range(1, max_ngram + 1):
            ends = [e for e in range(length - 1, n - 1) if seq[e - length + 1:e + 1] == seq[n - length:]]
            if not ends:
                break
            best = (np.asarray(ends, np.int64), length)
        return best

    rng = np.random.default_rng(0)
    for trial in range(400):
        seq = rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(2, 600))).tolist()
        k = int(rng.integers(1, 9))
        seq[:k] = seq[-k:]  # a match that starts the text
        got, want = suffix_matches(np.asarray(seq, np.int64), 8), brute(seq, 8)
        assert got[1] == want[1] and got[0].tolist() == want[0].tolist(), trial


@pytest.mark.parametrize("with_datastore", [False, True])
def test_a_lookup_session_drafts_alike_whether_it_copies_the_text_anew_or_only_what_is_new(with_datastore):
    """An n-gram session keeps the request's text as an array across rounds, copying only the
    tokens new since its last lookup and forgetting what a rollback takes back. Rounds of random
    windows, verdicts and commits (and a rewrite, without a rollback, of the last token it copied)
    must draft what a session that copies the whole text at every lookup drafts."""
    from specd.drafters import RetrievalDrafter
    from specd.drafters.datastore import Datastore

    rng = np.random.default_rng(1)
    if with_datastore:
        docs = [rng.integers(0, 6, int(rng.integers(5, 60))).tolist() for _ in range(40)]
        drafter = RetrievalDrafter(Datastore.from_documents(docs))
    else:
        drafter = NgramDrafter()
    params = SamplingParams()
    for trial in range(30):
        kept, anew = drafter.open(), drafter.open()
        seq = rng.integers(0, 6, int(rng.integers(2, 40))).tolist()
        for _ in range(40):
            committed = len(seq)
            window = []
            for _ in range(int(rng.integers(1, 6))):
                anew.synced = 0  # copies the whole text at its next lookup
                got = [s.next(seq + window, params, None, False) for s in (kept, anew)]
                assert (got[0] is None) == (got[1] is None), trial
                if got[0] is None:
                    break
                a, b = ((d.token, d.match_len, d.retrieved, d.votes, d.support) for d in got)
                assert a == b, trial
                window.append(a[0])
            n = int(rng.integers(0, len(window) + 1))
            for s in (kept, anew):
                s.rollback(committed + n)
            seq += window[:n] + [int(rng.integers(0, 6))]
            if rng.random() < 0.05 and kept.synced:  # a rewrite without a rollback, at the end it copied
                seq[kept.synced - 1] = (seq[kept.synced - 1] + 1) % 6
