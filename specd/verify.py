"""Verification of a draft window against the target (docs/engine.md, "Verification").

Given the target's distributions p over k+1 positions (k draft positions plus the bonus
position) and the draft tokens x_1..x_k with their draft distributions q:

- greedy: accept while x_i == argmax p_i; emit argmax p at the first mismatch (recovered
  token) or argmax p_{k+1} after a full accept (bonus token);
- sampling (Leviathan et al. 2023, Chen et al. 2023): accept x_i with probability
  min(1, p_i(x_i) / q_i(x_i)); on the first rejection sample the recovered token from
  norm(max(p_i - q_i, 0)); after a full accept sample the bonus token from p_{k+1}.
  The emitted tokens are then distributed exactly as p (the target alone);
- seeded sampling (coupled, specd.sampling): greedy verification on the race scores
  p_i / E_i, whose argmax at each position is the token the target alone draws there with
  that seed;
- AdaSD relaxed (lossy, opt-in): additionally accept a rejected x_i when the JS distance
  between p_i and q_i is below a threshold.

A drafter without a distribution (n-gram) passes q = None, i.e. a point mass on x.

verify_windows judges every window of a batched forward at once, with the verdicts
verify_window gives each, read from a GPU in one copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specd.sampling import argmax_rows, draw, js_distance, logits_to_probs, race_scores, sample
from specd.types import SamplingParams


@dataclass(frozen=True, slots=True)
class Verdict:
    num_accepted: int  # leading draft tokens kept (including relaxed acceptances)
    next_token: int  # recovered token (num_accepted < k) or bonus token (== k)
    num_strict: int  # leading draft tokens the lossless rule alone accepts (first strict rejection)
    num_relaxed: int = 0  # tokens accepted only by AdaSD's relaxed rule
    js_distances: tuple[float, ...] = ()  # JS(p_i, q_i) per draft position, relaxed mode only


def _first_false(ok: torch.Tensor) -> int:
    """Index of the first False in a bool vector, or its length when all are True."""
    bad = (~ok).nonzero()
    return int(bad[0, 0]) if bad.numel() else ok.numel()


def verify_greedy(target_logits: torch.Tensor, draft: list[int]) -> Verdict:
    """target_logits [k+1, V], draft [k] -> accepted count and recovered/bonus token."""
    return greedy_verdict(argmax_rows(target_logits), draft)


def greedy_verdict(best: list[int], draft: list[int]) -> Verdict:
    """The greedy verdict from the target's argmax at each of the k+1 positions: one copy to the
    host per window (or per batched forward, services.common.batcher), then plain Python, where
    comparing on the device cost a handful of small kernels and two waits for the device."""
    n = 0
    while n < len(draft) and best[n] == draft[n]:
        n += 1
    return Verdict(n, best[n], n)


def verify_sampling(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor,
                    generator: torch.Generator | None) -> Verdict:
    """p [k+1, V] target probs, q [k, V] draft probs (or None: point mass), draft [k]."""
    k = draft.numel()
    idx = torch.arange(k, device=draft.device)
    p_x = p[idx, draft]  # [k]
    q_x = q[idx, draft] if q is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=generator, device=p.device)
    # Accept x with probability min(1, p(x)/q(x)); written as u * q(x) <= p(x) to avoid 0/0.
    n = _first_false(u * q_x <= p_x)
    if n == k:
        return Verdict(k, int(sample(p[k], generator)), k)
    return Verdict(n, _sample_residual(p[n], q[n] if q is not None else None, int(draft[n]), generator), n)


def _sample_residual(p: torch.Tensor, q: torch.Tensor | None, x: int,
                     generator: torch.Generator | None) -> int:
    """Sample from norm(max(p - q, 0)), the recovered-token distribution."""
    if q is None:
        residual = p.clone()
        residual[x] = 0.0
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    if total <= 0:  # only reachable through float round-off when p == q
        residual, total = p, p.sum()
    return int(sample(residual / total, generator))


def _residual(p: torch.Tensor, q: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """_sample_residual's distribution with no read from the device: norm(max(p - q, 0)) (q
    None: p without x), or p where round-off leaves nothing."""
    if q is None:
        residual = p.index_fill(0, x.reshape(1), 0.0)
    else:
        residual = (p - q).clamp_min(0.0)
    total = residual.sum()
    return torch.where(total > 0, residual / total, p / p.sum())


def verify_relaxed(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, threshold: float | None,
                   greedy: bool, generator: torch.Generator | None, scores: torch.Tensor | None = None) -> Verdict:
    """AdaSD: lossless rule first; a rejected x_i is still accepted when JS(p_i, q_i) < threshold.

    p and q are full distributions here (softmax of the logits at the sampling temperature,
    or at temperature 1 for greedy decoding, where the acceptance rule is argmax equality).
    scores: seeded sampling's race scores [k+1, V], whose argmax is the target's token.
    """
    k = draft.numel()
    js = js_distance(p[:k], q)  # [k]
    idx = torch.arange(k, device=draft.device)
    ranks = p if greedy else scores  # argmax rules: greedy decoding, or the seeded race
    if ranks is not None:
        strict_ok = ranks[:k].argmax(-1) == draft
    else:
        u = torch.rand(k, generator=generator, device=p.device)
        strict_ok = u * q[idx, draft] <= p[idx, draft]
    n_strict = _first_false(strict_ok)
    ok = strict_ok | (js < threshold) if threshold is not None else strict_ok
    n = _first_false(ok)
    js_list = tuple(js.tolist())
    if ranks is not None:
        nxt = int(ranks[n].argmax())
    elif n == k:
        nxt = int(sample(p[k], generator))
    else:
        nxt = _sample_residual(p[n], q[n], int(draft[n]), generator)
    num_relaxed = int((~strict_ok[:n]).sum())
    return Verdict(n, nxt, n_strict, num_relaxed, js_list)


def verify_window(logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, sampling: SamplingParams,
                  generator: torch.Generator | None, relaxed_threshold: float | None = None,
                  relaxed: bool = False, position: int | None = None, best: list[int] | None = None) -> Verdict:
    """One verification: target logits [k+1, V] after the committed tokens and x_1..x_k.

    q [k, V] is the stacked draft distribution (None: point mass, or greedy where it is not
    read); relaxed turns on AdaSD's rule with relaxed_threshold (None: no relaxation yet);
    position: the sequence index of the window's first token (x_1, or the token sampled when
    there is no draft), which seeded sampling's draws are keyed by; best: the logits' argmax
    per row, where the caller has it (a batched forward's, read once for all its sessions).
    """
    if sampling.coupled and position is None:
        raise ValueError("seeded sampling verifies at a sequence position; none was given")
    if sampling.greedy and not (relaxed and draft):
        return greedy_verdict(best if best is not None else argmax_rows(logits), draft)
    x = torch.tensor(draft, dtype=torch.long, device=logits.device)
    if relaxed and draft:
        # p and q as full distributions: at the sampling temperature, or T = 1 for greedy.
        p = logits.softmax(-1) if sampling.greedy else logits_to_probs(logits, sampling)
        scores = race_scores(p, sampling.seed, position) if sampling.coupled else None
        return verify_relaxed(p, q, x, relaxed_threshold, sampling.greedy, generator, scores)
    p = logits_to_probs(logits, sampling)
    if sampling.coupled:
        return verify_greedy(race_scores(p, sampling.seed, position), draft)
    if not draft:
        return Verdict(0, int(sample(p[0], generator)), 0)
    return verify_sampling(p, q, x, generator)


@dataclass(frozen=True)
class Window:
    """One session's window in a batched forward, as verify_windows judges it: its drafts and
    their distributions (None: point masses, or greedy), its sampling, the sequence position of
    its first fed token (seeded sampling's draws are keyed by it), its random stream (unseeded)
    and the ids it emits (the logits' columns past `vocab` are never read; None: all)."""

    drafts: list[int]
    sampling: SamplingParams
    q: torch.Tensor | None = None
    position: int = 0
    generator: torch.Generator | None = None
    vocab: int | None = None


def verify_windows(logits: Sequence[torch.Tensor], windows: Sequence[Window],
                   on_device: bool | None = None) -> list[Verdict]:
    """Every window of a forward (logits[i] [k_i + 1, V] after window i's committed tokens and
    drafts) -> the verdict verify_window gives each (chains, lossless rules: greedy, seeded and
    unseeded; the same draws from each unseeded window's generator, in the same order).

    on_device (default: where the logits are not on the CPU) judges them all on the device and
    reads the accept counts and emitted tokens of all in one copy: greedy and seeded windows on
    one argmax over the rows of all (of the logits, or of the race scores), then each window's
    first mismatch; an unseeded window's first rejection and the distribution its token is drawn
    from (the residual there, or the bonus row) chosen by tensor operations. A CPU has no device
    to wait for, and there each window is judged as verify_window judges it, which costs less."""
    if on_device is None:
        on_device = bool(logits) and logits[0].device.type != "cpu"
    logits = [lg[..., :w.vocab] if w.vocab is not None and lg.shape[-1] > w.vocab else lg
              for lg, w in zip(logits, windows)]
    if not on_device:
        return [verify_window(lg, list(w.drafts), w.q, w.sampling, w.generator, position=w.position)
                for lg, w in zip(logits, windows)]
    if not windows:
        return []
    device = logits[0].device
    ranked, counts, nexts = [], [None] * len(windows), [None] * len(windows)
    for i, (lg, w) in enumerate(zip(logits, windows)):
        if w.sampling.greedy:
            ranked.append((i, lg))
        elif w.sampling.coupled:
            ranked.append((i, race_scores(logits_to_probs(lg, w.sampling), w.sampling.seed, w.position)))
        else:
            counts[i], nexts[i] = _unseeded(logits_to_probs(lg, w.sampling), w, len(w.drafts), device)
    if ranked:
        best = torch.cat([r.argmax(-1) for _, r in ranked])  # [rows of the ranked windows]
        width = max(len(windows[i].drafts) for i, _ in ranked)
        at, index, drafts = 0, [], []
        for i, _ in ranked:
            k = len(windows[i].drafts)
            index.append([at + min(j, k) for j in range(width + 1)])
            drafts.append(windows[i].drafts + [-1] * (width - k))  # -1 never matches
            at += k + 1
        picked = best[torch.tensor(index, device=device)]  # [windows, width + 1], the last row repeated
        match = picked[:, :width] == torch.tensor(drafts, device=device, dtype=picked.dtype)
        n = match.long().cumprod(-1).sum(-1)
        nxt = picked.gather(1, n[:, None])[:, 0]
        for j, (i, _) in enumerate(ranked):
            counts[i], nexts[i] = n[j], nxt[j]
    host = torch.stack([torch.stack(counts), torch.stack(nexts).to(torch.long)]).tolist()
    return [Verdict(n, x, n) for n, x in zip(*host)]


def _unseeded(p: torch.Tensor, w: Window, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """An unseeded window's accept count and token (verify_sampling's rule and draws), as
    tensors on the device."""
    if k == 0:
        u_token = torch.rand((1, 1), generator=w.generator, dtype=torch.float64, device=device)
        return torch.zeros((), dtype=torch.long, device=device), draw(p[:1], u_token)[0]
    x = torch.tensor(w.drafts, dtype=torch.long, device=device)
    idx = torch.arange(k, device=device)
    p_x = p[idx, x]
    q_x = w.q[idx, x] if w.q is not None else torch.ones_like(p_x)
    u = torch.rand(k, generator=w.generator, device=device)
    n = (u * q_x <= p_x).long().cumprod(-1).sum()
    u_token = torch.rand((1, 1), generator=w.generator, dtype=torch.float64, device=device)
    at = n.clamp(max=k - 1)  # the first rejected position (read only when there is one)
    residual = _residual(p.index_select(0, at.reshape(1))[0], w.q.index_select(0, at.reshape(1))[0]
                         if w.q is not None else None, x.index_select(0, at.reshape(1)))
    dist = torch.where(n == k, p[k], residual)
    return n, draw(dist[None], u_token)[0]
