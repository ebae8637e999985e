"""Turning logits into the distribution tokens are drawn from (gpt-fast's logits_to_probs),
and the seeded draws.

The same function is applied to the target's p and the draft's q so that lossless
verification compares like with like (Leviathan et al. 2023, Appendix A.5).

Seeded sampling is coupled (Daliri et al. 2024, "Coupling without Communication and
Drafter-Invariant Speculative Decoding"): the token at sequence position j is
argmax_x p_j(x) / E_j(x), with E_j a vector of Exp(1) draws made from (seed, j) alone (the
exponential race, the Gumbel-max trick in another form: the argmax is distributed exactly
as p_j). A draft model draws its token at j from its own q_j with the same E_j, and
verification accepts a draft token iff it is the target's race winner: greedy verification
on the scores p / E. So a seeded request's output is exactly what the target alone samples
with that seed, whatever the drafter, the policy, the window lengths, the overlap or the
service split did, and the same seed always gives the same text. The price: a draft model's
token matches less often than under rejection sampling (the coupling's P(match) is at least
(1 - TV)/(1 + TV) instead of 1 - TV; docs/engine.md gives the measured cost). Point-mass
drafts (ngram, retrieval) lose nothing: x wins the race with probability p_j(x) either way.
Unseeded requests keep rejection sampling.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from specd.types import SamplingParams


def argmax_rows(x: torch.Tensor) -> list[int]:
    """The argmax of each row of x [n, V] as ints (the first of equal maxima, as torch's), read
    from the device once. On the CPU through numpy, whose vectorised argmax over a 49k vocabulary
    row takes a tenth of torch's time (docs/engine.md, "Verification")."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        return x.detach().numpy().argmax(-1).tolist()
    return x.argmax(-1).tolist()


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> probabilities [..., V] after temperature, top-k and top-p (float32)."""
    logits = logits.float()
    if params.greedy:
        # Greedy is the limit T -> 0: a point mass on the argmax.
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    # Shifted first and T kept within float32, so that a tiny temperature gives a point mass,
    # not inf - inf or 0 / 0 = nan.
    temperature = max(params.temperature, torch.finfo(torch.float32).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    return logits.softmax(-1)


TOP_P_LOOKS = (64, 1024)  # how many of the most likely tokens top-p looks at, before sorting the row


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """logits [..., V] with all but the smallest set of most likely tokens whose mass reaches
    top_p set to -inf. The set is looked for among the first 64, then 1,024 by probability
    (torch.topk), and only where it is longer in a sort of the whole row, which costs far more
    (docs/engine.md, "Verification")."""
    probs = logits.softmax(-1)
    vocab = logits.shape[-1]
    for k in (*(k for k in TOP_P_LOOKS if k < vocab), vocab):
        if k < vocab:
            values, order = torch.topk(probs, k, dim=-1)  # most likely first
        else:
            values, order = torch.sort(probs, dim=-1, descending=True)
        before = values.cumsum(-1) - values  # the mass before each
        # every row's set ends among these when their last is out (or of probability 0)
        if k == vocab or bool(((before[..., -1] >= top_p) | (values[..., -1] == 0)).all()):
            break
    keep = before < top_p
    keep[..., 0] = True  # the most likely token always stays (a top_p below float32's range is 0)
    kept = logits.gather(-1, order).masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)


def request_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator | None:
    """An unseeded sampling request's random stream, freshly seeded from torch's global one;
    None for greedy and seeded requests, whose draws are coupled (race_noise)."""
    if params.greedy or params.coupled:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(int(torch.randint(0, 2**62, (1,))))
    return generator


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token id per row of probs [..., V] -> [...] (rows need not sum to 1).

    Inverse-CDF: one uniform per row against the row's cumulative sum, which is kept in float64
    so that no tail token's share rounds away over a long vocabulary. A token of probability 0
    is never drawn. (torch.multinomial draws an Exp(1) per token instead: measured in
    docs/engine.md, "Verification".)"""
    flat = probs.reshape(-1, probs.shape[-1])
    u = torch.rand((flat.shape[0], 1), generator=generator, dtype=torch.float64, device=flat.device)
    return draw(flat, u).reshape(probs.shape[:-1])


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """sample's draw from probs [n, V] with its uniforms u [n, 1] (float64) given: [n]."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    token = torch.searchsorted(cdf, u * total, right=True)  # the first whose cumulative sum exceeds u
    # u can round up to the total: then the last token of positive probability
    last = torch.searchsorted(cdf, total)
    return torch.minimum(token, last).clamp_(max=probs.shape[-1] - 1)[:, 0]


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """H(q) = -sum q log q in nats, over the last dimension (0 log 0 = 0)."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


def js_distance(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Jensen-Shannon distance in base 2, in [0, 1]: sqrt(JSD(p || q))."""
    m = 0.5 * (p + q)

    def kl(a: torch.Tensor) -> torch.Tensor:
        return (a * (a.clamp_min(1e-30).log2() - m.clamp_min(1e-30).log2())).sum(-1)

    return (0.5 * kl(p) + 0.5 * kl(q)).clamp(0.0, 1.0).sqrt()


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """A 64-bit mixer (Steele et al.'s SplitMix64 finaliser): nearby inputs, unrelated outputs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@functools.lru_cache(maxsize=64)  # 64 rows of a 49k vocabulary: 12.6 MB
def race_row(seed: int, position: int, vocab_size: int) -> torch.Tensor:
    """E [V]: a seeded request's Exp(1) draws at one sequence position (read-only)."""
    # Drawn on the CPU so that every device, process and service gets the same numbers; a
    # draft and its verification ask for the same rows, hence the cache.
    generator = torch.Generator().manual_seed(_splitmix64(_splitmix64(seed) ^ position) >> 1)
    return torch.rand(vocab_size, generator=generator).log_().neg_()


def race_noise(seed: int, positions: Sequence[int], vocab_size: int,
               device: torch.device | str = "cpu") -> torch.Tensor:
    """E [len(positions), V]: a seeded request's Exp(1) draws at those sequence positions."""
    rows = [race_row(seed, position, vocab_size) for position in positions]
    return torch.stack(rows).to(device) if rows else torch.empty(0, vocab_size, device=device)


def race_scores(probs: torch.Tensor, seed: int, positions: Sequence[int] | int) -> torch.Tensor:
    """probs [n, V] at sequence positions (a list, or the first of n consecutive ones) -> p / E:
    the token drawn at each position is the argmax (the exponential race), distributed exactly
    as probs."""
    if isinstance(positions, int):
        positions = range(positions, positions + probs.shape[0])
    return probs / race_noise(seed, positions, probs.shape[-1], probs.device)
