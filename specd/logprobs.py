"""The log-probabilities of emitted tokens (OpenAI's `logprobs`), from the target's own
distribution at each emitted position: its logits at temperature 1, before penalties, a bias or
top-k/top-p (as vLLM reports them by default). A window's accepted drafts and its recovered or
bonus token are emitted at rows 0..n of its verification's logits, the rows that predicted
them, so the values are those of the target alone decoding the same text, whatever drafted it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.errors import InvalidRequest
from specd.types import SpecParams

MAX_TOP_LOGPROBS = 20  # alternatives per token (OpenAI's cap)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One emitted token's log-probability and the `top` most likely tokens at its position."""

    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def check_logprobs(top: int | None, spec: SpecParams) -> None:
    """InvalidRequest naming top_logprobs out of [0, MAX_TOP_LOGPROBS], or branches where
    log-probabilities are asked (they are a chain's: draft trees are not grown for them)."""
    if top is None:
        return
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    if spec.branches:
        raise InvalidRequest("branches", "log-probabilities are returned along one chain, not draft trees; "
                                         "ask for 0 branches")


def emitted_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [R, V] whose row i predicted tokens[i] (R >= len(tokens)) -> one TokenLogprob per
    token, with its `top` alternatives (0: none)."""
    if not tokens:
        return []
    lp = logits[:len(tokens)].float().log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(list(tokens), dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    if not top:
        return [TokenLogprob(c) for c in chosen]
    vals, ids = lp.topk(min(top, lp.shape[-1]), -1)
    return [TokenLogprob(c, tuple(i), tuple(v)) for c, i, v in zip(chosen, ids.tolist(), vals.tolist())]
