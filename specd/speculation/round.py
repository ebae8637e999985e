"""Steps of a draft -> verify round that the in-process engine (specd.engine) and the
services (services.coordinator.loop, services.target) share, written once here."""

from __future__ import annotations

import time
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

import torch

from specd.drafters.base import DraftSession
from specd.errors import InvalidRequest
from specd.grammar import Grammar
from specd.penalties import penalize
from specd.policies.base import Decision, StoppingPolicy
from specd.types import DraftStep, RoundOutcome, SamplingParams


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


@dataclass
class DraftedWindow:
    """One window a drafter proposed under a stopping policy (draft_window)."""

    tokens: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)  # each token's draft distribution (None: a point mass)
    steps: list[DraftStep] = field(default_factory=list)  # what the policy saw for each token
    dropped: DraftStep | None = None  # the token the policy dropped after these (Decision.DROP)
    hit_cap: bool = False
    ran: bool = False  # the drafter ran (the policy did not decline the round)
    seconds: float = 0.0  # spent drafting

    def outcome(self, num_strict: int, after: int, js_distances: tuple[float, ...] = ()) -> RoundOutcome | None:
        """What the policy observes once the window is verified (after: the target's token after
        the accepted drafts); None for a window with nothing to judge."""
        if not self.tokens and self.dropped is None:
            return None
        return RoundOutcome.judged(self.steps, num_strict, self.hit_cap, js_distances, self.dropped, after)


def draft_window(policy: StoppingPolicy, session: DraftSession, seq: list[int], sampling: SamplingParams,
                 generator, cap: int, generated: int, want_hidden: bool = False) -> DraftedWindow:
    """Draft one window after the committed tokens `seq` (the drafts are appended to it), asking
    the policy after each token (docs/engine.md, "The round"); at most `cap` drafts. generated:
    how many of seq's tokens are generated ones (not the prompt)."""
    window = DraftedWindow()
    if cap <= 0:
        return window
    t0 = time.perf_counter()
    policy.begin_round()
    if not policy.should_draft():
        return window
    window.ran = True
    while True:
        d = session.next(seq, sampling, generator, want_hidden)
        if d is None:
            break
        step = d.step(len(window.tokens) + 1, generated + len(window.tokens))
        decision = policy.decide(step)
        if decision is Decision.DROP:
            window.dropped = step
            break
        seq.append(d.token)
        window.tokens.append(d.token)
        window.qs.append(d.q)
        window.steps.append(step)
        if decision is Decision.STOP:
            break
        if len(window.tokens) >= cap:
            window.hit_cap = True
            break
    window.seconds = time.perf_counter() - t0
    costs = policy.resources.costs
    if costs is not None and (n := len(window.tokens) + (window.dropped is not None)):
        costs.observe_draft(window.seconds / n)
    return window


def validate_prompt(prompt: Sequence[int], vocab_size: int, max_context: int) -> None:
    """A prompt the target can continue: non-empty, shorter than its context, ids in its vocab."""
    if not prompt:
        raise InvalidRequest("prompt", "must not be empty")
    if len(prompt) >= max_context:
        raise InvalidRequest("prompt", f"is {len(prompt)} tokens; the model's context is "
                                       f"{max_context} and at least one token must be generated")
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        raise InvalidRequest("prompt", f"token ids must be in [0, {vocab_size})")
