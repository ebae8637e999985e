"""Steps of a draft -> verify round that every driver shares (the in-process drivers of
specd.speculation, services.coordinator.loop, services.target), written once here."""

from __future__ import annotations

from collections.abc import Container, Sequence

import torch

from specd.errors import InvalidRequest
from specd.grammar import Grammar
from specd.penalties import penalize
from specd.types import SamplingParams


def judged_window(logits: torch.Tensor, q: torch.Tensor | None, drafts: list[int], sampling: SamplingParams,
                  grammar: Grammar | None, prompt: Sequence[int], generated: Sequence[int]):
    """A window as verification judges it: (logits, q, drafts) with the request's penalties and
    bias applied (specd.penalties) and its grammar's masks (specd.grammar), the drafts cut
    before the first one the grammar forbids. prompt, generated: the committed tokens."""
    logits = penalize(logits, sampling, prompt, generated, drafts)
    if grammar is not None:
        logits, kept = grammar.constrain(logits, drafts)
        drafts, logits, q = drafts[:kept], logits[:kept + 1], q[:kept] if q is not None else None
    return logits, q, drafts


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


def validate_prompt(prompt: Sequence[int], vocab_size: int, max_context: int) -> None:
    """A prompt the target can continue: non-empty, shorter than its context, ids in its vocab."""
    if not prompt:
        raise InvalidRequest("prompt", "must not be empty")
    if len(prompt) >= max_context:
        raise InvalidRequest("prompt", f"is {len(prompt)} tokens; the model's context is "
                                       f"{max_context} and at least one token must be generated")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidRequest("prompt", f"token ids must be in [0, {vocab_size})")
