"""One forward pass for the extends of several KV sessions (batched verification).

Sessions differ in both cached length L_i and number of new tokens n_i, so the batch is padded
on both sides of the "now" boundary:

    row i:  [ pad * (Lmax - L_i) | cached L_i | new n_i | pad * (nmax - n_i) ]

Cached keys/values are LEFT-padded (with zeros) so that every row's new tokens start at the same
column Lmax: the new tokens then form one rectangular [B, nmax] input, and the batch cache is
one ordinary DynamicCache of length Lmax. New ids are RIGHT-padded, so each row's real new
tokens come first and causal attention alone keeps the padded queries out of them. The
explicit 2-D attention mask (0 on both paddings) hides the left-padded keys, and explicit
position_ids continue each row at its own L_i: cached keys already carry their rotary
positions, so only the new tokens need the right ones.

After the pass, each session's cache is grown by its own new keys/values only (columns
Lmax .. Lmax + n_i of the batch cache), through the cache's public `update`, so a session ends
exactly as an individual `KVSession.extend` would have left it and the padded batch cache is
not kept alive by any session.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from specd.runtime.session import KVSession


@dataclass
class PaddedBatch:
    """The model inputs of one batched extend, and where each row's wanted logits lie."""

    input_ids: torch.Tensor  # [B, nmax], right-padded
    attention_mask: torch.Tensor  # [B, Lmax + nmax], 0 on padding
    position_ids: torch.Tensor  # [B, nmax]
    cache: DynamicCache  # Lmax cached positions per row, left-padded
    past_len: int  # Lmax: the column where every row's new tokens start
    logits_to_keep: int  # the last columns whose logits any row needs
    logit_starts: list[int]  # per row: first wanted column among the kept ones


def batched_extend(model: torch.nn.Module, sessions: Sequence[KVSession], ids: Sequence[Sequence[int]],
                   num_logits: Sequence[int]) -> list[torch.Tensor]:
    """As if each sessions[i].extend(ids[i], num_logits[i]) ran alone: float32 logits
    [num_logits[i], V] per session, and each session's cache and length grown the same way."""
    return [logits for logits, _ in batched_extend_hidden(model, sessions, ids, num_logits)]


def batched_extend_hidden(model: torch.nn.Module, sessions: Sequence[KVSession], ids: Sequence[Sequence[int]],
                          num_logits: Sequence[int], want_hidden: Sequence[bool] | None = None
                          ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """batched_extend that also returns, for the sessions that want them, the last hidden
    states [num_logits[i], H] of the same positions (what a feature drafter reads)."""
    want = list(want_hidden) if want_hidden is not None else [False] * len(sessions)
    assert len(sessions) == len(ids) == len(num_logits) == len(want), (len(sessions), len(ids), len(num_logits))
    assert len({id(s) for s in sessions}) == len(sessions), "a session appears twice in one batch"
    for row, k in zip(ids, num_logits):
        assert 1 <= k <= len(row), (k, len(row))
    if len(sessions) == 1:
        return [sessions[0].extend(ids[0], num_logits[0], want[0])]
    batch = build_batch(sessions, ids, num_logits)
    logits, hidden, grown = forward_batch(model, batch, any(want))
    _split_back(sessions, grown, batch.past_len, [len(row) for row in ids])
    return [(logits[i, start:start + k].float(), hidden[i, start:start + k] if want[i] else None)
            for i, (start, k) in enumerate(zip(batch.logit_starts, num_logits))]


def build_batch(sessions: Sequence[KVSession], ids: Sequence[Sequence[int]],
                num_logits: Sequence[int]) -> PaddedBatch:
    """The padded inputs for sessions[i] fed ids[i]; reads the sessions, changes nothing."""
    device = sessions[0].device
    cached = [s.length for s in sessions]
    new = [len(row) for row in ids]
    max_cached, max_new = max(cached), max(new)
    # Row i wants new columns [n_i - k_i, n_i); keeping the last K columns of the nmax covers
    # them all when K reaches back to the earliest such column.
    keep = max(max_new - n + k for n, k in zip(new, num_logits))
    return PaddedBatch(
        input_ids=_right_padded_ids(ids, max_new, device),
        attention_mask=_attention_mask(cached, new, max_cached, max_new, device),
        position_ids=_position_ids(cached, new, max_new, device),
        cache=_left_padded_cache(sessions, max_cached),
        past_len=max_cached,
        logits_to_keep=keep,
        logit_starts=[n - k - (max_new - keep) for n, k in zip(new, num_logits)],
    )


@torch.inference_mode()
def forward_batch(model: torch.nn.Module, batch: PaddedBatch, want_hidden: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor | None, DynamicCache]:
    """Logits [B, logits_to_keep, V] in the model's dtype, the last hidden states of the same
    columns when wanted, and the grown batch cache."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=batch.position_ids, past_key_values=batch.cache, use_cache=True,
                logits_to_keep=batch.logits_to_keep, output_hidden_states=want_hidden)
    hidden = out.hidden_states[-1][:, -batch.logits_to_keep:] if want_hidden else None
    return out.logits, hidden, out.past_key_values


def _right_padded_ids(ids: Sequence[Sequence[int]], max_new: int, device: torch.device) -> torch.Tensor:
    # Padded queries sit after the real ones, so causality keeps them out of real rows; their
    # token is irrelevant but must be a valid embedding index.
    rows = [list(row) + [0] * (max_new - len(row)) for row in ids]
    return torch.tensor(rows, dtype=torch.long, device=device)


def _attention_mask(cached: list[int], new: list[int], max_cached: int, max_new: int,
                    device: torch.device) -> torch.Tensor:
    col = torch.arange(max_cached + max_new, device=device)
    lens = torch.tensor(cached, device=device)[:, None]
    news = torch.tensor(new, device=device)[:, None]
    real_cached = col >= max_cached - lens
    real_new = col < max_cached + news
    return (real_cached & real_new).long()


def _position_ids(cached: list[int], new: list[int], max_new: int, device: torch.device) -> torch.Tensor:
    # Padded queries repeat the row's last real position rather than counting on, so a model
    # with a learned position table never indexes past what the real tokens use.
    step = torch.arange(max_new, device=device)
    last = torch.tensor(new, device=device)[:, None] - 1
    return torch.tensor(cached, device=device)[:, None] + torch.minimum(step, last)


def _left_padded_cache(sessions: Sequence[KVSession], max_cached: int) -> DynamicCache:
    cache = DynamicCache()
    template = next((s.cache for s in sessions if s.length > 0), None)
    if template is None:  # nothing cached anywhere: the batch starts from an empty cache
        return cache
    for layer in range(len(template.layers)):
        pairs = [_layer_kv(s, template, layer) for s in sessions]
        keys = torch.cat([_left_pad(k, max_cached) for k, _ in pairs])
        values = torch.cat([_left_pad(v, max_cached) for _, v in pairs])
        cache.update(keys, values, layer)
    return cache


def _layer_kv(session: KVSession, template: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A session's keys and values of one layer, [1, H, L, D]; an empty session gets L = 0
    (shaped after a session that has a cache, as it has no layers of its own yet)."""
    if session.length == 0:
        ref = template.layers[layer]
        return ref.keys[:1, :, :0], ref.values[:1, :, :0]
    entry = session.cache.layers[layer]
    return entry.keys, entry.values


def _left_pad(kv: torch.Tensor, length: int) -> torch.Tensor:
    # Zeros, not garbage: masked keys get zero weight, and 0 * finite stays 0 in the sum.
    pad = kv.new_zeros(kv.shape[:-2] + (length - kv.shape[-2], kv.shape[-1]))
    return torch.cat([pad, kv], dim=-2)


def _split_back(sessions: Sequence[KVSession], grown: DynamicCache, max_cached: int, new: list[int]) -> None:
    """Append each row's real new keys/values to its own session's cache."""
    for layer, entry in enumerate(grown.layers):
        for i, (session, n) in enumerate(zip(sessions, new)):
            cols = slice(max_cached, max_cached + n)
            # update concatenates into fresh storage, so no session keeps the batch cache alive.
            session.cache.update(entry.keys[i:i + 1, :, cols], entry.values[i:i + 1, :, cols], layer)
    for session, n in zip(sessions, new):
        session.length += n
