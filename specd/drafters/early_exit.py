"""early-exit: the target's own first k layers, its final norm and LM head (Kangaroo,
Liu et al. 2024; DVI). The weights are shared with the target, so the drafter costs no
memory beyond an adapter and its own KV cache.

An adapter sits between the shallow hidden state and the LM head:
    logits = lm_head(h + up(silu(down(h))))
with `up` zero-initialised, so an untrained adapter is the identity. Untrained, the shallow
model agrees with the target on few tokens; training the adapter is what makes it useful.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from specd.drafters.base import Drafter, ModelDraftSession
from specd.errors import InvalidRequest, ModelError
from specd.models.loading import LoadedModel
from specd.models.session import KVSession


class ResidualAdapter(nn.Module):
    def __init__(self, hidden_size: int, rank: int = 64):
        super().__init__()
        self.down = nn.Linear(hidden_size, rank, bias=False)
        self.up = nn.Linear(rank, hidden_size, bias=False)
        nn.init.zeros_(self.up.weight)  # identity until trained

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.up(nn.functional.silu(self.down(h)))


class EarlyExitDrafter(Drafter):
    kind = "early-exit"

    def __init__(self, target: LoadedModel, layers: int = 4, adapter_path: str | Path | None = None):
        base = target.model.get_decoder()
        total = len(base.layers)
        if not 1 <= layers < total:
            raise InvalidRequest("draft_layers", f"must be in [1, {total - 1}] for this target, got {layers}")
        self.target = target
        self.layers = layers
        self.adapter_name: str | None = None  # set once a trained adapter is loaded
        # A shallow copy of the decoder that shares every module but keeps only k layers;
        # its attention layers keep layer_idx 0..k-1, so it can own a k-layer DynamicCache.
        self.decoder = copy.copy(base)
        self.decoder._modules = dict(base._modules)
        self.decoder.layers = nn.ModuleList(base.layers[:layers])
        self.decoder.config = copy.copy(base.config)
        self.decoder.config.num_hidden_layers = layers
        self.lm_head = target.model.get_output_embeddings()
        hidden = target.model.config.hidden_size
        self.adapter = ResidualAdapter(hidden).to(target.device, next(base.parameters()).dtype).eval()
        if adapter_path is not None:
            self.load_adapter(adapter_path)

    @property
    def name(self) -> str:
        # A trained adapter is a different drafter: its shared policy state and heads are its own.
        base = f"{self.target.name}:early-exit-{self.layers}"
        return f"{base}+{self.adapter_name}" if self.adapter_name else base

    def load_adapter(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise ModelError(f"adapter file not found: {path}")
        try:
            self.adapter.load_state_dict(load_file(str(path), device=str(self.target.device)))
        except RuntimeError as e:
            raise ModelError(f"adapter {path} does not fit this drafter: {e}") from e
        self.adapter_name = path.stem

    def save_adapter(self, path: str | Path) -> None:
        save_file({k: v.contiguous() for k, v in self.adapter.state_dict().items()}, str(path))

    def forward(self, input_ids, cache, num_logits, want_hidden):
        h = self.decoder(input_ids=input_ids, past_key_values=cache, use_cache=True).last_hidden_state
        h = self.adapter(h[0, -num_logits:])
        return self.lm_head(h), (h if want_hidden else None)

    def open(self, vocab_size: int | None = None) -> ModelDraftSession:
        return ModelDraftSession(KVSession(self.forward, self.target.device), vocab_size or self.target.vocab_size)
