"""Turning logits into the distribution tokens are drawn from (gpt-fast's logits_to_probs).

The same function is applied to the target's p and the draft's q so that lossless
verification compares like with like (Leviathan et al. 2023, Appendix A.5).
"""

from __future__ import annotations

import torch

from specd.types import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (float32)."""
    logits = logits.float()
    if params.greedy:
        # Greedy is the limit T -> 0: a point mass on the argmax.
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose mass reaches top_p.
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # mass before this token already enough
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token id per row of probs [..., V] -> [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """H(q) = -sum q log q in nats, over the last dimension (0 log 0 = 0)."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon distance in base 2, in [0, 1]: sqrt(JSD(p || q))."""
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor) -> torch.Tensor:
        return (a * (a.clamp_min(1e-30).log2() - m.clamp_min(1e-30).log2())).sum(-1)

    return (0.5 * kl(p) + 0.5 * kl(q)).clamp(0.0, 1.0).sqrt()
