"""KV sessions: rolling the cache back must leave it exactly as if the dropped tokens had never
been fed."""

from __future__ import annotations

import torch


def test_rollback_then_extend_matches_a_fresh_session(tiny_target):
    prefix, rejected, accepted = [5, 9, 17, 33], [40, 41, 42], [7, 8]
    kv = tiny_target.session()
    kv.extend(prefix + rejected, 1)
    assert kv.length == 7
    kv.rollback(len(prefix))
    assert kv.length == 4 and kv.cache.get_seq_length() == 4
    rolled, _ = kv.extend(accepted, 2)
    fresh, _ = tiny_target.session().extend(prefix + accepted, 2)
    torch.testing.assert_close(rolled, fresh, rtol=1e-5, atol=1e-5)


def test_rollback_past_the_end_is_a_no_op(tiny_target):
    kv = tiny_target.session()
    kv.extend([1, 2, 3], 1)
    kv.rollback(10)
    assert kv.length == 3 and kv.cache.get_seq_length() == 3


def test_extend_returns_only_the_requested_rows_and_hidden(tiny_target):
    kv = tiny_target.session()
    logits, hidden = kv.extend([1, 2, 3, 4, 5], 3, want_hidden=True)
    assert logits.shape == (3, tiny_target.vocab_size) and logits.dtype == torch.float32
    assert hidden.shape == (3, tiny_target.model.config.hidden_size)
    kv.close()
    assert kv.cache is None
