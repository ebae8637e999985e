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

# (input_ids [1, T], cache, num_logits, want_hidden) -> (logits [num_logits, V], hidden [num_logits, H] | None)
ForwardFn = Callable[[torch.Tensor, DynamicCache, int, bool], tuple[torch.Tensor, torch.Tensor | None]]


def hf_forward(model: torch.nn.Module) -> ForwardFn:
    """ForwardFn of a transformers causal LM; hidden = last layer's (final-normed) state."""

    def forward(input_ids, cache, num_logits, want_hidden):
        out = model(input_ids=input_ids, past_key_values=cache, use_cache=True,
                    logits_to_keep=num_logits, output_hidden_states=want_hidden)
        hidden = out.hidden_states[-1][0, -num_logits:] if want_hidden else None
        return out.logits[0, -num_logits:], hidden

    return forward


class KVSession:
    def __init__(self, forward: ForwardFn, device: torch.device):
        self._forward = forward
        self.device = device
        self.cache: DynamicCache | None = DynamicCache()
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
