"""A KV-cached forward session over a causal LM, one per request and model.

The session owns a DynamicCache holding keys/values of `length` tokens. `extend` feeds new
tokens and returns logits for the last positions only (transformers' logits_to_keep, so a
long prompt does not pay for a [T, vocab] projection). `rollback` crops the cache back to a
prefix, which is how rejected draft tokens are forgotten.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers import DynamicCache

from specd.tree import DraftTree, tree_mask

# (input_ids [1, T], cache, num_logits, want_hidden[, attention_mask, position_ids])
#   -> (logits [num_logits, V], hidden [num_logits, H] | None)
# The optional pair is a custom additive mask [1, 1, T, cached + T] and positions [1, T] (draft
# trees, specd.tree); only the target's forward is given them.
ForwardFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def hf_forward(model: torch.nn.Module) -> ForwardFn:
    """ForwardFn of a transformers causal LM; hidden = last layer's (final-normed) state."""

    def forward(input_ids, cache, num_logits, want_hidden, attention_mask=None, position_ids=None):
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True, attention_mask=attention_mask,
                    position_ids=position_ids, logits_to_keep=num_logits, output_hidden_states=want_hidden)
        hidden = out.hidden_states[-1][0, -num_logits:] if want_hidden else None
        return out.logits[0, -num_logits:], hidden

    return forward


class KVSession:
    def __init__(self, forward: ForwardFn, device: torch.device, cache=None):
        """cache: an empty cache for `forward` (default a DynamicCache; the lean forward's
        FlatCache, specd/runtime/lean.py)."""
        self._forward = forward
        self.device = device
        self.cache = cache if cache is not None else DynamicCache()
        self.length = 0  # tokens whose keys/values are cached

    @torch.inference_mode()
    def extend(self, ids: Sequence[int], num_logits: int = 1,
               want_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed ids after the cached prefix; logits [num_logits, V] (float32) of the last positions."""
        assert 1 <= num_logits <= len(ids), (num_logits, len(ids))
        input_ids = torch.tensor([list(ids)], dtype=torch.long, device=self.device)
        logits, hidden = self._forward(input_ids, self.cache, num_logits, want_hidden)
        self.length += len(ids)
        return logits.float(), hidden

    @torch.inference_mode()
    def extend_tree(self, pending: Sequence[int], tree: DraftTree, dtype: torch.dtype) -> torch.Tensor:
        """Feed the pending committed tokens and a draft tree's nodes; logits [len(tree) + 1, V]
        after the last pending token and after each node. Cache slots past the pending tokens
        hold the nodes in tree order until `keep_path`."""
        assert pending, "a tree hangs from the last committed token"
        mask, positions = tree_mask(tree, self.length, len(pending), dtype, self.device)
        input_ids = torch.tensor([list(pending) + tree.tokens], dtype=torch.long, device=self.device)
        logits, _ = self._forward(input_ids, self.cache, len(tree) + 1, False, mask, positions)
        self.length += input_ids.shape[1]
        return logits.float()

    @torch.inference_mode()
    def keep_path(self, base: int, nodes: list[int]) -> None:
        """After a tree forward whose nodes start at cache slot `base`: keep the cached keys and
        values of `nodes` (increasing) at base, base + 1, ... and forget everything after them."""
        if nodes != list(range(len(nodes))):  # a prefix of the node order is already in place
            src = torch.tensor(nodes, device=self.device) + base
            for layer in self.cache.layers:
                for name in ("keys", "values"):
                    t = getattr(layer, name)
                    t[:, :, base:base + len(nodes)] = t.index_select(2, src)
        self.rollback(base + len(nodes))

    def rollback(self, length: int) -> None:
        """Forget everything after the first `length` tokens (no-op if fewer are cached)."""
        if length < self.length:
            # A negative argument removes that many tokens in every transformers version.
            self.cache.crop(length - self.length)
            self.length = length

    def nbytes(self) -> int:
        """Bytes held by the cached keys and values (0 once closed)."""
        cache = self.cache
        if cache is None:
            return 0
        if hasattr(cache, "nbytes"):
            return cache.nbytes()
        total = 0
        for layer in list(getattr(cache, "layers", ())):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def close(self) -> None:
        """Free the cache now rather than when the session object is collected."""
        self.cache = None
        self.length = 0
