"""Penalties and a logit bias, applied to the target's logits before they are judged.

A window's row j is the target's distribution after the committed tokens and the first j
drafts, so it is penalized as if those drafts were already generated: its counts are the
generated tokens' plus those of draft[:j]. The target alone applies the same rule to its one
row. Verification then judges drafts against the very distribution the target alone samples
from, so greedy output is the target alone's with the same penalties, and sampled output
follows it. The draft's q needs no penalty for that: the rules only need the q each draft was
drawn from.

The order is vLLM's: the bias, then the repetition penalty (over prompt and generated tokens),
then the frequency and presence penalties (over generated tokens only), then the sampling
transforms of specd.sampling.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specd.errors import InvalidRequest
from specd.types import SamplingParams


def check_logit_bias(sampling: SamplingParams, vocab_size: int) -> None:
    """InvalidRequest naming logit_bias for a token id the model does not emit."""
    bad = next((t for t, _ in sampling.logit_bias if t >= vocab_size), None)
    if bad is not None:
        raise InvalidRequest("logit_bias", f"token ids must be in [0, {vocab_size}), got {bad}")


def penalize(logits: torch.Tensor, sampling: SamplingParams, prompt: Sequence[int], generated: Sequence[int],
             drafts: Sequence[int]) -> torch.Tensor:
    """logits [R, V] of a window, row j following prompt + generated + drafts[:j] -> the logits
    with sampling's bias and penalties applied (a new tensor; logits itself where nothing
    applies). R - 1 <= len(drafts) rows beyond the first read drafts."""
    penalized = (sampling.repetition_penalty != 1.0, bool(sampling.frequency_penalty or sampling.presence_penalty))
    if not sampling.logit_bias and not any(penalized):  # a grammar alone, say: nothing here
        return logits
    rows, device = logits.shape[0], logits.device
    out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
    if sampling.logit_bias:
        ids = torch.tensor([t for t, _ in sampling.logit_bias], dtype=torch.long, device=device)
        bias = torch.tensor([b for _, b in sampling.logit_bias], dtype=out.dtype, device=device)
        out[:, ids] += bias
    if not any(penalized):
        return out
    drafts = list(drafts[:rows - 1])
    context = list(prompt) if penalized[0] else []
    ids = torch.tensor(context + list(generated) + drafts, dtype=torch.long, device=device)
    if not len(ids):
        return out
    cols, where = torch.unique(ids, return_inverse=True)  # the ids that occur, and each one's column
    n_context, n_generated = len(context), len(generated)
    # counts[j, c]: occurrences of cols[c] among the generated tokens and drafts[:j].
    counts = torch.zeros(rows, len(cols), dtype=out.dtype, device=device)
    counts += torch.zeros(len(cols), dtype=out.dtype, device=device).index_add_(
        0, where[n_context:n_context + n_generated], torch.ones(n_generated, dtype=out.dtype, device=device))
    if drafts:
        step = torch.zeros(rows, len(cols), dtype=out.dtype, device=device)
        step[torch.arange(1, len(drafts) + 1, device=device), where[n_context + n_generated:]] = 1.0
        counts += step.cumsum(0)
    x = out[:, cols]
    if penalized[0]:
        seen = counts > 0
        if n_context:
            in_prompt = torch.zeros(len(cols), dtype=torch.bool, device=device)
            in_prompt[where[:n_context]] = True
            seen |= in_prompt
        r = sampling.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    if sampling.frequency_penalty:
        x = x - sampling.frequency_penalty * counts
    if sampling.presence_penalty:
        x = x - sampling.presence_penalty * (counts > 0).to(x.dtype)
    out[:, cols] = x
    return out
