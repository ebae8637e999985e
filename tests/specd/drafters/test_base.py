"""fit_vocab: a drafter's logits laid out as the target's verification reads them."""

from __future__ import annotations

import torch

from specd.drafters.base import fit_vocab


def test_rows_past_the_emitted_ids_get_no_mass():
    logits = torch.arange(10, dtype=torch.float32)  # the padding rows (7..9) would win the argmax
    out = fit_vocab(logits, 10, emitted=7)
    assert int(out.argmax()) == 6 and out.softmax(-1)[7:].sum() == 0
    assert torch.equal(logits, torch.arange(10, dtype=torch.float32))  # the input is left as it was


def test_cropped_and_padded_to_the_targets_width():
    logits = torch.zeros(6)
    assert fit_vocab(logits, 4).shape == (4,)
    wide = fit_vocab(logits, 8, emitted=5)
    assert wide.shape == (8,) and torch.isinf(wide[5:]).all() and (wide[:5] == 0).all()
    assert fit_vocab(logits, 6) is logits  # nothing to change: no copy
