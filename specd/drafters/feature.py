"""feature: an EAGLE-style draft head on the target's own features (Li et al. 2024, "EAGLE:
Speculative Sampling Requires Rethinking Feature Uncertainty").

The target's last hidden state f_t (after its final norm; what its LM head reads to predict
x_{t+1}) is far more informative than the token alone. The head reads, at position t,
    x = fc([f_t ; embed(x_{t+1})])          (2H -> H)
runs one decoder layer over the positions so far (its own KV cache), the target's final norm,
and predicts x_{t+2} through the target's LM head (or its rows of a reduced draft vocabulary).
Its output at t is trained to be f_{t+1} too, so while drafting past the verified prefix, where
the target has not computed f yet, the head's own output stands in for it.

The engine hands the session the target's features of every verified position after each
verification (`observe_target`); positions the head processed with stand-in features are
recomputed with the true ones then. The head's weights are its own (fc and the layer, initialised
as a copy of the target's last layer); embeddings, norm and LM head are the target's.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from specd.drafters.base import (
    Drafter,
    DraftSession,
    DraftToken,
    ReducedVocab,
    draft_token,
    fit_vocab,
    read_adapter_meta,
    shallow_decoder,
)
from specd.errors import ModelError
from specd.runtime.loading import LoadedModel


class FeatureHead(nn.Module):
    """The trained part: fc and one decoder layer."""

    def __init__(self, target: LoadedModel):
        super().__init__()
        base = target.model.get_decoder()
        hidden = target.model.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = copy.deepcopy(base.layers[-1])
        self.layer.self_attn.layer_idx = 0  # the only layer of the head's own cache


class FeatureDrafter(Drafter, ReducedVocab):
    kind = "feature"
    learns_online = True
    needs_target_features = True

    def __init__(self, target: LoadedModel, head_path: str | Path | None = None):
        self.target = target
        base = target.model.get_decoder()
        dtype = next(base.parameters()).dtype
        self.head = FeatureHead(target).to(target.device, dtype).eval()
        with torch.no_grad():  # an untrained fc passes the feature through: f_t + embed(x_{t+1})
            h = self.head.fc.weight.shape[0]
            self.head.fc.weight.copy_(torch.cat([torch.eye(h), torch.eye(h)], 1))
        # A one-layer decoder sharing the target's embeddings, rotary and norm (not registered
        # in the head, so the head's state dict holds only what it trains).
        self.decoder = shallow_decoder(base, [self.head.layer])
        self.embed = base.embed_tokens
        self.lm_head = target.model.get_output_embeddings()
        self.set_vocab(None)  # ReducedVocab
        self.head_name: str | None = None
        if head_path is not None:
            self.load(head_path)

    @property
    def name(self) -> str:
        base = f"{self.target.name}:feature"
        return f"{base}+{self.head_name}" if self.head_name else base

    def load(self, path: str | Path) -> None:
        path = Path(path)
        meta = read_adapter_meta(path)
        if meta.get("kind") != self.kind:
            raise ModelError(f"{path} holds a {meta.get('kind', 'unknown')} drafter, not a feature head")
        self.load_trained(path, self.head)
        self.head_name = path.stem

    def save(self, path: str | Path, train: dict | None = None) -> None:
        self.save_trained(Path(path), self.head, {"kind": self.kind}, train)

    def run(self, feats: torch.Tensor, next_ids: torch.Tensor, cache: DynamicCache | None = None,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Head outputs [B, T, H] (stand-ins for f_{t+1}) from features [B, T, H] and the ids of
        the tokens after them [B, T]."""
        x = self.head.fc(torch.cat([feats, self.embed(next_ids).to(feats.dtype)], -1))
        return self.decoder(inputs_embeds=x, past_key_values=cache, use_cache=cache is not None,
                            attention_mask=attention_mask).last_hidden_state

    def unrolled(self, feats: torch.Tensor, next_ids: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Head outputs [B, T, H] at drafting depths 1..depth, for training on the head's own
        stand-ins (EAGLE-3's "training-time test"). Row t of depth d is what a draft session
        computes at position t when positions up to t - d + 1 read the target's features and
        t - d + 2 .. t read the head's own outputs (row t - 1 of depth d - 1): the d-th token
        drafted after a verified prefix. Depth 1 is `run`. Right padding needs no mask: a real
        row never sees a later position."""
        b, t, _ = feats.shape
        cache, outs = DynamicCache(), []
        emb = self.embed(next_ids).to(feats.dtype)
        positions = torch.arange(t, device=feats.device)[None].expand(b, t)
        stand_in = feats
        for d in range(1, depth + 1):
            x = self.head.fc(torch.cat([stand_in, emb], -1))
            mask = unroll_mask(t, d, x.dtype, x.device)
            out = self.decoder(inputs_embeds=x, past_key_values=cache, use_cache=True, attention_mask=mask,
                               position_ids=positions).last_hidden_state
            outs.append(out)
            stand_in = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], 1)  # row t reads row t - 1
        return outs

    @property
    def hidden_size(self) -> int:
        return self.head.fc.weight.shape[0]

    @torch.inference_mode()
    def teacher_forced_logits(self, seq: list[int], n: int) -> torch.Tensor:
        """Logits [n, V] for the last n tokens of seq + one more, each drafted right after a
        verified prefix (the target's features everywhere): one target and one head forward."""
        ids = torch.tensor([seq], dtype=torch.long, device=self.target.device)
        f = self.target.model.get_decoder()(input_ids=ids).last_hidden_state
        out = self.run(f[:, :-1].to(self.head.fc.weight.dtype), ids[:, 1:])[0]  # row t predicts seq[t + 2]
        return self.vocab_logits(out[-n:])

    def open(self, vocab_size: int | None = None) -> FeatureDraftSession:
        return FeatureDraftSession(self, vocab_size or self.target.vocab_size)


def unroll_mask(t: int, depth: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, t, depth * t] for depth `depth` of `FeatureDrafter.unrolled`, whose
    cache holds the keys of depths 1..depth, t columns each. Row i sees depth 1 (true features)
    at positions up to i - depth + 1 and, of each depth d' = 2..depth, only position
    i - depth + d' (its own stand-in chain; d' = depth is row i itself)."""
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    blocks = [j <= i - depth + 1] + [j == i - depth + d for d in range(2, depth + 1)]
    allowed = torch.cat(blocks, 1)
    mask = torch.zeros(t, depth * t, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


class FeatureDraftSession(DraftSession):
    """Head position t reads (feature of t, token t+1) and predicts token t+2. Positions below
    `true_len` were computed from the target's features, later ones from the head's own output
    at the position before (EAGLE's stand-in)."""

    def __init__(self, drafter: FeatureDrafter, vocab_size: int):
        self.d = drafter
        self.vocab_size = vocab_size
        self.feats: torch.Tensor | None = None  # [F, H] the target's features of positions 0..F-1
        self.cache: DynamicCache | None = DynamicCache()
        self.outs: torch.Tensor | None = None  # [P, H] head outputs of the cached positions
        self.length = 0  # head positions cached (P)
        self.true_len = 0  # of which computed from the target's features

    def observe_target(self, start: int, hidden: torch.Tensor) -> None:
        have = 0 if self.feats is None else self.feats.shape[0]
        if start > have:
            raise ModelError(f"target features from position {start} leave a gap after {have}")
        hidden = hidden.detach().to(self.d.target.device, self.d.head.fc.weight.dtype)
        self.feats = hidden if self.feats is None or start == 0 else torch.cat([self.feats[:start], hidden])
        if self.true_len > start:  # computed from features that were just replaced
            self._crop(start)

    @torch.inference_mode()
    def next(self, seq, params, generator, want_hidden) -> DraftToken | None:
        need = len(seq) - 1  # head positions 0..len-2; the last one predicts the token after seq
        if need < 1 or self.feats is None:
            return None
        if self.length > need:
            self._crop(need)
        n_feats = self.feats.shape[0]
        if self.length > self.true_len and n_feats > self.true_len:  # true features replace stand-ins
            self._crop(self.true_len)
        n_true = min(n_feats, need)
        if n_true > self.length:  # catch up with the target's features in one forward
            self._extend(self.feats[self.length:n_true], seq[self.length + 1:n_true + 1])
            self.true_len = self.length
        if self.length == 0:
            return None
        while self.length < need:  # past the verified prefix
            self._extend(self.outs[-1:], seq[self.length + 1:self.length + 2])
        out = self.outs[-1]
        logits = fit_vocab(self.d.vocab_logits(out).float(), self.vocab_size, self.d.target.emitted_vocab)
        return draft_token(logits, params, generator, out if want_hidden else None, len(seq))

    def _extend(self, feats: torch.Tensor, ids: list[int]) -> None:
        ids_t = torch.tensor([ids], dtype=torch.long, device=self.d.target.device)
        out = self.d.run(feats[None], ids_t, self.cache)[0]
        self.outs = out if self.outs is None else torch.cat([self.outs, out])
        self.length += len(ids)

    def _crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length - self.length)
            self.length = length
            self.outs = self.outs[:length]
        self.true_len = min(self.true_len, length)

    def rollback(self, length: int) -> None:
        """Only seq[:length] is still valid: head positions up to length - 2 and features up to
        length - 1."""
        if self.feats is not None and self.feats.shape[0] > length:
            self.feats = self.feats[:length]
        self._crop(max(length - 1, 0))

    def close(self) -> None:
        self.cache, self.feats, self.outs, self.length, self.true_len = None, None, None, 0, 0

    def nbytes(self) -> int:
        total = sum(t.numel() * t.element_size() for t in (self.feats, self.outs) if t is not None)
        for layer in list(getattr(self.cache, "layers", ()) if self.cache is not None else ()):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total
