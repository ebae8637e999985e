"""Steps of a draft -> verify round that the in-process engine (specd.engine) and the
services (services.coordinator.loop, services.draft.runner) share, written once here."""

from __future__ import annotations

from collections.abc import Container, Sequence


def commit_tokens(new: Sequence[int], committed: int, eos: Container[int],
                  max_length: int) -> tuple[list[int], str | None]:
    """The verified tokens `new` that follow `committed` tokens, cut after the first EOS
    ("stop") or where the sequence reaches max_length ("length"); and that finish reason,
    None while generation goes on. Stop strings are applied to the text afterwards."""
    kept: list[int] = []
    for tok in new:
        kept.append(tok)
        if tok in eos:
            return kept, "stop"
        if committed + len(kept) >= max_length:
            return kept, "length"
    return kept, None
